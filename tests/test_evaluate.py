"""framework/loop/evaluate.py built directly on a tiny in-memory DataModule: one evaluation pass's means are exact over
batches of uneven sizes, overfit_batches validates on the training batches it trains on, the limits count batches,
and the idle step a sharded rank runs leaves no trace."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import evaluator_for, read_scalars, tiny_data
from torch import nn

from framework.task.task import StepOutput, Task

pytestmark = pytest.mark.unit


class Probe(Task):
    """A validation step whose loss is its batch's mean input and whose metric `square` its mean square; it logs
    the mean with self.log and records every batch it sees (their inputs)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(1, 1))
        self.seen: list[list[float]] = []
        self.modes: list[tuple[bool, bool]] = []  # (training, grad enabled) in each step

    def training_step(self, batch: Any) -> torch.Tensor:
        return self.model(batch[0]).mean()

    def validation_step(self, batch: Any) -> StepOutput:
        x, _ = batch
        self.seen.append(x.flatten().tolist())
        self.modes.append((self.training, torch.is_grad_enabled()))
        self.log("val/logged", x.mean())
        return StepOutput(x.mean(), {"square": (x ** 2).mean()})

    def epoch_metrics(self, split: str) -> dict[str, torch.Tensor]:
        return {"batches": torch.tensor(float(len(self.seen)))}  # computed after the last batch


def test_means_are_exact_over_batches_of_uneven_sizes_and_written_at_the_step_given(tmp_path):
    task = Probe()
    metrics = evaluator_for(task, tiny_data(), run_dir=tmp_path).run("val", 30)
    assert [len(b) for b in task.seen] == [4, 4, 2]
    # The mean over the 10 samples, 4.5 (not 5.17, the mean of the three batch means 1.5, 5.5 and 8.5).
    assert metrics == {"val/loss": 4.5, "val/square": 28.5, "val/logged": 4.5, "val/batches": 3.0}
    task.logger.flush()
    assert read_scalars(tmp_path)["val/loss"] == [(30, 4.5)]


def test_the_pass_runs_in_eval_mode_without_grad_and_leaves_the_task_training():
    task = Probe()
    evaluator_for(task, tiny_data()).run("val", 0)
    assert set(task.modes) == {(False, False)}
    assert task.training and torch.is_grad_enabled()


def test_a_test_runs_the_test_split_and_names_its_metrics_test():
    task = Probe()
    metrics = evaluator_for(task, tiny_data()).run("test", 0)
    assert task.seen[0] == [50.0, 51.0, 52.0, 53.0]  # the test split, in order
    assert metrics["test/loss"] == 54.5 and metrics["test/logged"] == 54.5  # self.log's val/ name as test/
    assert not any(name.startswith("val/") for name in metrics)


def test_limit_val_batches_counts_batches_as_an_int_and_a_fraction():
    for limit, batches in ((2, 2), (0.5, 1)):
        task = Probe()
        metrics = evaluator_for(task, tiny_data(), val_batches=limit).run("val", 0)
        assert len(task.seen) == batches
        assert metrics["val/loss"] == pytest.approx(sum(map(sum, task.seen)) / sum(map(len, task.seen)))


def test_overfit_batches_validates_on_the_first_training_batches_of_epoch_0():
    task, datamodule = Probe(), tiny_data()
    first_two = [batch[0].flatten().tolist() for batch in list(datamodule.batches("train", 0))[:2]]
    run = evaluator_for(task, datamodule, overfit=2)
    run.run("val", 0)
    run.run("val", 1)
    assert task.seen == first_two + first_two  # the same batches every time, none of the val split
    assert all(value >= 100 for batch in task.seen for value in batch)
    assert run.overfit_batches() is run.overfit_batches()  # kept, not drawn again


def test_the_idle_step_runs_on_no_samples_and_logs_nothing(tmp_path):
    task = Probe()
    run = evaluator_for(task, tiny_data(), run_dir=tmp_path)
    with run.metric_logger.evaluation("val") as logged:
        run.idle_step(run.step_fns["validation_step"], None)  # this rank's shard had no batch at all
        run.idle_step(run.step_fns["validation_step"], next(iter(run.data.batches("val"))))
    assert task.seen == [[], []]
    assert logged.entries == {} and run.metric_logger.metrics == {}
