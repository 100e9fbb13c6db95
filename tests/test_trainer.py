"""The training loop's behaviour, in-process on the default digits experiment (tiny runs)."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_scalars

from framework.loop.trainer import Trainer
from framework.loop.view import RunView
from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput

pytestmark = pytest.mark.unit

PLAIN_SGD = ("optimizer.momentum=0.0", "optimizer.weight_decay=0.0")


def make_trainer(compose, run_dir: Path, *overrides: str) -> Trainer:
    cfg = compose("logger.progress_bar=false", *overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, run_dir)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    model = trainer.run.strategy.unwrap(trainer.run.task.model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_accumulating_two_half_batches_equals_one_full_batch(compose, tmp_path):
    common = ("trainer.max_steps=5", "data.shuffle=false", "trainer.test=false", *PLAIN_SGD)
    half = make_trainer(compose, tmp_path / "a", *common, "data.batch_size=32", "trainer.accumulate_grad_batches=2")
    full = make_trainer(compose, tmp_path / "b", *common, "data.batch_size=64")
    half.fit(), full.fit()
    assert half.run.progress.step == full.run.progress.step == 5
    for name, value in weights(full).items():
        torch.testing.assert_close(weights(half)[name], value, rtol=1e-5, atol=1e-6)


def test_grad_clip_norm_bounds_each_update(compose, tmp_path):
    trainer = make_trainer(compose, tmp_path, "trainer.max_steps=1", "trainer.grad_clip_norm=0.001",
                           "optimizer.lr=1.0", "trainer.test=false", *PLAIN_SGD)
    before = weights(trainer)
    trainer.fit()
    after = weights(trainer)
    update = torch.cat([(after[k] - before[k]).flatten() for k in before])
    assert 0 < update.norm() <= 0.001 * 1.0001


def test_grad_clip_value_bounds_each_element(compose, tmp_path):
    trainer = make_trainer(compose, tmp_path, "trainer.max_steps=1", "trainer.grad_clip_value=0.0001",
                           "optimizer.lr=1.0", "trainer.test=false", *PLAIN_SGD)
    before = weights(trainer)
    trainer.fit()
    after = weights(trainer)
    update = torch.cat([(after[k] - before[k]).flatten() for k in before])
    assert update.abs().max() <= 0.0001 * 1.0001 and update.abs().max() > 0


def test_limit_train_batches_as_count_and_as_fraction(compose, tmp_path):
    # digits: 1257 training images / 64 per batch = 20 batches per epoch
    count = make_trainer(compose, tmp_path / "a", "trainer.max_epochs=2", "trainer.limit_train_batches=3",
                         "trainer.test=false")
    count.fit()
    assert (count.run.progress.step, count.run.progress.epoch) == (6, 2)
    fraction = make_trainer(compose, tmp_path / "b", "trainer.max_epochs=1", "trainer.limit_train_batches=0.5",
                            "trainer.test=false")
    fraction.fit()
    assert fraction.run.progress.step == 10


def test_max_steps_decides_the_length_and_may_stop_mid_epoch(compose, tmp_path):
    trainer = make_trainer(compose, tmp_path, "trainer.max_steps=25", "trainer.max_epochs=1", "trainer.test=false")
    summary = trainer.fit()
    assert summary["step"] == 25 and summary["epoch"] == 1  # one whole epoch of 20 batches, then 5 more
    assert "val/acc" in summary  # the final weights are always validated


def test_fast_dev_run_runs_one_batch_of_each_and_writes_no_events(compose, tmp_path):
    trainer = make_trainer(compose, tmp_path, "trainer.fast_dev_run=true")
    summary = trainer.fit()
    assert summary["step"] == 1 and "val/acc" in summary and "test/acc" in summary
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 1


def test_every_log_step_writes_loss_lr_and_epoch(compose, tmp_path):
    make_trainer(compose, tmp_path, "trainer.max_steps=6", "trainer.log_every_n_steps=2",
                 "trainer.test=false").fit()
    scalars = read_scalars(tmp_path)
    assert [step for step, _ in scalars["train/loss"]] == [2, 4, 6]
    assert [value for _, value in scalars["lr/default"]] == pytest.approx([0.1, 0.1, 0.1])
    assert [step for step, _ in scalars["val/acc"]] == [6]


@pytest.mark.parametrize("length, every, steps", [
    ("trainer.max_epochs=2", 1, [1, 2, 3, 4, 5, 6]),
    ("trainer.max_epochs=2", 2, [2, 3, 4, 6]),
    ("trainer.max_epochs=2", 4, [3, 4, 6]),  # the run ends at an epoch's end that is no logging step
    ("trainer.max_epochs=2", 7, [3, 6]),  # no logging step at all: a point at each epoch's end
    ("trainer.max_steps=5", 4, [3, 4, 5]),  # ends mid-epoch: the steps since step 4 are flushed at 5
])
def test_each_lr_point_is_written_once_whatever_log_every_n_steps(compose, tmp_path, length, every, steps):
    """An LR point at every logging step and at each epoch's end, and one at the run's end (where the steps since the
    last logging step are flushed): one per step in metrics.csv and in TensorBoard's files, never two."""
    make_trainer(compose, tmp_path, "logger=[tensorboard,csv]", length, "trainer.limit_train_batches=3",
                 f"trainer.log_every_n_steps={every}", "trainer.test=false").fit()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [int(row["step"]) for row in csv.DictReader(f) if row["name"] == "lr/default"]
    assert rows == [step for step, _ in read_scalars(tmp_path)["lr/default"]] == steps


def test_same_seed_same_weights_and_other_seed_other_weights(compose, tmp_path):
    runs = [make_trainer(compose, tmp_path / str(i), "trainer.max_steps=5", "trainer.test=false", f"seed={seed}")
            for i, seed in enumerate((1, 1, 2))]
    for trainer in runs:
        trainer.fit()
    a, b, c = (weights(t) for t in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


class RecordingTask(ClassificationTask):
    """Remembers the mode and grad switch seen by each kind of step."""

    seen: dict[str, set[tuple[bool, bool]]] = {}

    def _note(self, kind: str) -> None:
        if isinstance(self.trainer, RunView):  # not the pre-flight check's throw-away copy (eval mode, no grad)
            RecordingTask.seen.setdefault(kind, set()).add((self.training, torch.is_grad_enabled()))

    def training_step(self, batch: Any) -> StepOutput:
        self._note("train")
        return super().training_step(batch)

    def validation_step(self, batch: Any) -> StepOutput:
        self._note("val")
        return super().validation_step(batch)

    def test_step(self, batch: Any) -> StepOutput:
        self._note("test")
        return super().test_step(batch)


def test_training_in_train_mode_and_evaluation_in_eval_mode_without_grad(compose, tmp_path):
    RecordingTask.seen.clear()
    make_trainer(compose, tmp_path, "trainer.max_epochs=2", "trainer.limit_train_batches=2",
                 "task._target_=test_trainer.RecordingTask").fit()
    assert RecordingTask.seen == {"train": {(True, True)}, "val": {(False, False)}, "test": {(False, False)}}


def test_deterministic_mode_trains(compose, tmp_path):
    summary = make_trainer(compose, tmp_path, "trainer.deterministic=true", "trainer.max_steps=3",
                           "trainer.test=false").fit()
    assert summary["step"] == 3
    torch.use_deterministic_algorithms(False)


def test_each_model_preset_trains_on_digits(compose, tmp_path):
    for model in ("mlp", "cnn", "resnet18"):
        summary = make_trainer(compose, tmp_path / model, f"model={model}", "trainer.max_steps=2",
                               "trainer.test=false", "trainer.limit_val_batches=1").fit()
        assert summary["step"] == 2 and summary["val/loss"] > 0


def test_a_finished_run_frees_everything_it_built(compose, tmp_path):
    """train() returns with the trainer, model, optimizer and data freed, not left to a later full collection
    (the trainer and its task reference each other). Under DDP the model holds the gloo process group, whose
    C++ threads, destroyed during interpreter shutdown instead, could abort a finished worker with SIGABRT."""
    import gc

    from framework.app.stage import run_stage

    def alive() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is Trainer)  # isinstance would wake dead weak proxies

    before = alive()
    run_stage(compose("logger.progress_bar=false", "trainer.max_steps=2", "checkpoint=none", "trainer.test=false"),
          tmp_path / "run")
    assert alive() <= before


def test_a_training_step_enters_only_the_loop_the_task_precision_the_stop_and_the_loss_record(compose, tmp_path):
    """One step, top to bottom, is read in loop/trainer.py and its optimizer step (loop/step.py), with the task's step
    (task/task.py), parallel/precision.py, the ranks' stop agreement (loop/stop.py), the loop's position (Progress in
    checkpoint/state.py) and the metric logger's record of the batch's size and loss: nothing else of the framework's machinery runs between two optimizer steps that
    neither log, validate nor save. The run's own components (its model, its data, its metrics) are the user's
    choice and are not counted."""
    import sys

    framework_dir = str(Path(__file__).resolve().parent.parent / "framework") + "/"
    components = ("zoo/", "data/", "task/metrics.py", "task/classification.py")
    steps: list[set[str]] = [set()]

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(framework_dir):
            return
        name = frame.f_code.co_filename[len(framework_dir):]
        if name == "loop/step.py" and frame.f_code.co_name == "__call__":
            steps.append(set())
        if not name.startswith(components):
            steps[-1].add(name)

    trainer = make_trainer(compose, tmp_path, "trainer.max_steps=12", "trainer.log_every_n_steps=1000",
                           "trainer.test=false", "callbacks=none", "checkpoint=none", "trainer.limit_train_batches=20")
    sys.setprofile(profile)
    try:
        trainer.fit()
    finally:
        sys.setprofile(None)
    assert len(steps) == 13, len(steps)  # before the first step, 12 steps (the last one runs on to the end)
    middle = set().union(*steps[3:11])  # whole steps, from one optimizer step into the next
    allowed = {"loop/trainer.py", "loop/step.py", "checkpoint/state.py", "observe/metric_logger.py",
               "observe/logged.py", "task/task.py", "parallel/precision.py", "parallel/strategy.py", "loop/stop.py"}
    assert middle <= allowed, middle
    assert {"loop/trainer.py", "loop/step.py", "task/task.py", "parallel/precision.py"} <= middle, middle
