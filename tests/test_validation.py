"""Values are checked once, at the edge: a bad value a new user might type ends the run with one `Error: ...`
line naming the key, the value and what was expected, and a non-zero exit; no traceback.

Ranges of the framework's own groups and of the DataModule's counts are checked by `validate` before
anything is built; data of the wrong kind, and a model, loss or metric that does not fit the data, at the
first batch (`Task.check_batch`, called once by the trainer before training). The datasets, model and loss
below are the user's own code in those tests: the subprocess imports them as `test_validation.<name>`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import one_error_line, output, run_cli
from torch import nn
from torch.utils.data import Dataset

from framework.task.task import StepOutput, Task

pytestmark = pytest.mark.e2e

TINY = ("trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.test=false")


# ---------------------------------------------------------------- a user's own code, wrong in one way each
class Samples(Dataset):
    """Digits-shaped samples (1x8x8 float32 images, labels 0..9); subclasses get one thing wrong. Takes the
    digits preset's keys (split, val_fraction, ...) so that only `_target_` needs overriding."""

    def __init__(self, size: int = 100, **_digits_options: Any) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Any:
        return torch.full((1, 8, 8), i / self.size), i % 10


class Triples(Samples):
    def __getitem__(self, i: int) -> Any:
        x, y = super().__getitem__(i)
        return x, y, i


class TextLabels(Samples):
    def __getitem__(self, i: int) -> Any:
        return super().__getitem__(i)[0], "seven"


class Float64Inputs(Samples):
    def __getitem__(self, i: int) -> Any:
        return np.zeros((1, 8, 8)), i % 10


class FloatLabels(Samples):
    def __getitem__(self, i: int) -> Any:
        x, y = super().__getitem__(i)
        return x, float(y)


class Objects(Samples):
    def __getitem__(self, i: int) -> Any:
        return object(), i % 10


class Broken(Samples):
    def __getitem__(self, i: int) -> Any:
        raise KeyError(f"image {i} is missing")


class TwoOutputs(nn.Module):
    """Returns (logits, features), as some published models do."""

    def __init__(self, input_shape: list[int], num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(int(np.prod(input_shape)), num_classes)

    def forward(self, x: torch.Tensor) -> Any:
        return self.fc(x.flatten(1)), x


class DictTask(Task):
    """A task of its own that expects dict batches ({"image": ..., "label": ...})."""

    def training_step(self, batch: Any) -> StepOutput:
        return StepOutput(nn.functional.cross_entropy(self.model(batch["image"]), batch["label"]))


def plain_loss(output, target):  # unannotated: the config cannot tell it takes data
    return nn.functional.cross_entropy(output, target)


# ---------------------------------------------------------------- helpers
def fail(run_dir: Path, *overrides: str) -> str:
    """Run with `overrides` (in this process: `test_validation.Triples` imports from this module); assert a user
    error's form (conftest.one_error_line) and return its line."""
    return one_error_line(run_cli(run_dir, *TINY, *overrides))


def case(*overrides: str, says: tuple[str, ...], id: str) -> Any:
    return pytest.param(overrides, says, id=id)


# ---------------------------------------------------------------- refused by validate, before any build
RANGES = [
    case("trainer.max_epochs=0", says=("trainer.max_epochs=0: expected >= 1",), id="max_epochs-0"),
    case("trainer.max_epochs=-2", "trainer.max_steps=5", says=("trainer.max_epochs=-2", "-1 or 0 with"),
         id="max_epochs-negative-with-max_steps"),
    case("trainer.max_steps=0", says=("trainer.max_steps=0: expected -1 (no limit) or >= 1",), id="max_steps-0"),
    case("trainer.val_every_n_epochs=0", says=("trainer.val_every_n_epochs=0: expected >= 1",), id="val_every-0"),
    case("trainer.log_every_n_steps=-1", says=("trainer.log_every_n_steps=-1: expected >= 1",), id="log_every-neg"),
    case("trainer.accumulate_grad_batches=0", says=("trainer.accumulate_grad_batches=0: expected >= 1",),
         id="accumulate-0"),
    case("trainer.grad_clip_norm=0", says=("trainer.grad_clip_norm=0.0", "a finite number > 0"), id="clip_norm-0"),
    case("trainer.grad_clip_norm=inf", says=("trainer.grad_clip_norm=inf", "a finite number > 0"), id="clip-inf"),
    case("trainer.grad_clip_value=nan", says=("trainer.grad_clip_value=nan", "a finite number > 0"), id="clip-nan"),
    case("trainer.grad_clip_value=-1", says=("trainer.grad_clip_value=-1.0", "a finite number > 0"),
         id="clip_value-neg"),
    case("trainer.limit_train_batches=0", says=("trainer.limit_train_batches=0", "a whole number of batches >= 1"),
         id="limit-0"),
    case("trainer.limit_val_batches=-0.5", says=("trainer.limit_val_batches=-0.5", "a fraction in (0, 1]"),
         id="limit-negative-fraction"),
    case("trainer.limit_test_batches=nan", says=("trainer.limit_test_batches=nan", "a fraction in (0, 1]"),
         id="limit-nan"),
    case("trainer.device=tpu", says=("trainer.device='tpu'", "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
         id="device-unknown"),
    case("trainer.device=cuda:x", says=("trainer.device='cuda:x'", "'cuda:N'"), id="device-bad-index"),
    case("checkpoint.every_n_steps=-1", says=("checkpoint.every_n_steps=-1: expected >= 0",), id="every_n_steps-neg"),
    case("checkpoint.every_n_epochs=-3", says=("checkpoint.every_n_epochs=-3: expected >= 0",), id="every_n_epochs"),
    case("checkpoint.keep_last=-2", says=("checkpoint.keep_last=-2", "-1 to keep them all"), id="keep_last-neg"),
    case("checkpoint.save_top_k=-5", says=("checkpoint.save_top_k=-5", "-1 to keep them all"), id="top_k-neg"),
    case("checkpoint.save_top_k=2", "checkpoint.monitor=null", says=("checkpoint.save_top_k=2", "checkpoint.monitor="),
         id="top_k-without-monitor"),
    case("checkpoint.monitor=val_acc", says=("checkpoint.monitor='val_acc'", "'val/<name>'"), id="monitor-not-val"),
    case("data.val=null", says=("checkpoint.save_top_k=1", "data.val=null"), id="top_k-without-val-split"),
    case("parallel=ddp", "parallel.devices=0", says=("parallel.devices=0", "a number of processes >= 1"),
         id="ddp-devices-0"),
    case("parallel=ddp", "parallel.devices=-1", says=("parallel.devices=-1",), id="ddp-devices-neg"),
    case("parallel.devices=2", says=("parallel.devices=2", "null with parallel=single"), id="devices-without-ddp"),
    case("parallel=dp", "parallel.devices=2", says=("parallel.devices=2", "null with parallel=dp"),
         id="devices-with-dp"),
    case("parallel=ddp", "parallel.timeout_s=0", says=("parallel.timeout_s=0", "seconds in 1.."), id="timeout-0"),
    case("parallel=ddp", "parallel.backend=foo", says=("parallel.backend='foo'", "gloo, nccl"), id="backend-unknown"),
    case("parallel.backend=gloo", says=("parallel.backend='gloo'", "null with parallel=single"),
         id="backend-without-ddp"),
    case("parallel=ddp", "trainer.device=cuda:0", says=("trainer.device='cuda:0'", "'auto' with parallel=ddp"),
         id="ddp-fixed-gpu"),
    case("parallel.static_graph=true", says=("parallel.static_graph=true: expected false with parallel=single",),
         id="ddp-option-without-ddp"),
    case("seed=-1", says=("seed=-1: expected a whole number in 0..4294967295",), id="seed-negative"),
    case("seed=18446744073709551616", says=("seed=18446744073709551616", "0..4294967295"), id="seed-huge"),
    case("data.batch_size=0", says=("data.batch_size=0: expected a whole number >= 1",), id="batch_size-0"),
    case("data.batch_size=-64", says=("data.batch_size=-64",), id="batch_size-neg"),
    case("data.batch_size=abc", says=("data.batch_size='abc'", "a whole number"), id="batch_size-text"),
    case("data.batch_size=1.5", says=("data.batch_size=1.5", "a whole number"), id="batch_size-float"),
    case("data.eval_batch_size=0", says=("data.eval_batch_size=0: expected null or a whole number >= 1",),
         id="eval_batch_size-0"),
    case("data.num_workers=-1", says=("data.num_workers=-1: expected a whole number >= 0",), id="num_workers-neg"),
    case("data.prefetch_factor=0", says=("data.prefetch_factor=0", "null or a whole number >= 1"), id="prefetch-0"),
    case("data.num_classes=0", says=("data.num_classes=0", ">= 1"), id="num_classes-0"),
    case("data.input_shape=[1,0,8]", says=("data.input_shape=[1, 0, 8]", "sizes >= 1"), id="input_shape-0"),
    case("data=fake", "data.train=null", says=("data.train=None", "every run trains on data.train"),
         id="no-train-split"),
]


@pytest.mark.parametrize("overrides, says", RANGES)
def test_value_out_of_range_is_refused_before_anything_is_built(tmp_path: Path, overrides: tuple[str, ...],
                                                                 says: tuple[str, ...]) -> None:
    line = fail(tmp_path, *overrides)
    for fragment in says:
        assert fragment in line, line
    assert not (tmp_path / "checkpoints").exists() and not list(tmp_path.glob("events.out.tfevents.*"))


def test_hardware_a_setting_names_must_be_there(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        line = fail(tmp_path, f"trainer.device=cuda:{torch.cuda.device_count()}")
        assert "CUDA device" in line and "visible" in line, line
    else:
        line = fail(tmp_path, "trainer.device=cuda")
        assert "trainer.device='cuda': no CUDA device is visible; expected 'auto' or 'cpu'" in line, line
        line = fail(tmp_path, "parallel=ddp", "parallel.backend=nccl")
        assert "parallel.backend='nccl': nccl needs CUDA" in line, line


@pytest.mark.unit
def test_values_at_the_edges_of_their_ranges_are_accepted(compose) -> None:
    from framework.config.validate import validate

    for overrides in (("trainer.max_epochs=-1", "trainer.max_steps=10"),
                      ("trainer.max_epochs=0", "trainer.max_steps=1"), ("seed=0",), ("seed=4294967295",),
                      ("checkpoint.save_top_k=0", "checkpoint.monitor=test/acc"),
                      ("checkpoint.save_top_k=-1", "checkpoint.keep_last=-1"), ("checkpoint=none", "data.val=null"),
                      ("trainer.limit_train_batches=1",), ("trainer.limit_train_batches=0.01",),
                      ("data.eval_batch_size=null", "data.batch_size=1"),
                      ("data.num_workers=0", "data.prefetch_factor=2", "data.persistent_workers=true"),
                      ("parallel=ddp", "parallel.devices=1", "parallel.backend=gloo", "parallel.timeout_s=1"),
                      ("trainer.device=cpu",), ("trainer.grad_clip_norm=1e-8", "trainer.grad_clip_value=1e8")):
        validate(compose(*overrides))


# ---------------------------------------------------------------- refused at the first batch, before training
FIRST_BATCH = [
    case("data.num_classes=5", says=("data.num_classes=5", "output of shape (64, 5)", "labels of shape (64,) int64",
                                     "values 0..9", "CrossEntropyLoss", "expected data.num_classes >= 10"),
         id="labels-beyond-num_classes"),
    case("model.num_classes=4", says=("model: output of shape (64, 4)", "values 0..9", "expected 10 scores"),
         id="model-too-few-outputs"),
    case("data.input_shape=[1,4,4]", says=("data.input_shape=[1, 4, 4]", "shape (64, 1, 8, 8)",
                                           "expected data.input_shape=[1,8,8]"), id="data-input_shape"),
    case("model.input_shape=[3,8,8]", says=("model: forward on the first train batch", "(64, 1, 8, 8) float32",
                                            "mat1 and mat2 shapes cannot be multiplied"), id="model-input_shape"),
    case("model=cnn", "model.input_shape=[3,8,8]", says=("model: forward", "to have 3 channels"), id="cnn-channels"),
    case("data.train._target_=test_validation.Triples", says=("data.train: its first batch is a list of (",
                                                              "expected (inputs, labels) pairs"), id="triples"),
    case("data.train._target_=test_validation.TextLabels", says=("data.train", "a tuple of 64 str",
                                                                 "a tensor of inputs and one of labels"),
         id="text-labels"),
    case("data.train._target_=test_validation.Float64Inputs", says=("data.train: inputs of shape (64, 1, 8, 8) float64",
                                                                    "weights are float32"), id="float64-inputs"),
    case("data.train._target_=test_validation.FloatLabels", says=("data.train: labels of shape (64,) float64",
                                                                  "int64"), id="float-labels"),
    case("data.train._target_=test_validation.Objects", says=("data.train: making its first batch raised TypeError",
                                                              "ToTensor"), id="uncollatable-samples"),
    case("data.train._target_=test_validation.Broken", "data.num_workers=1",
         says=("data.train: making its first batch raised KeyError: 'image", "missing"), id="dataset-raises-in-worker"),
    case("data.val._target_=test_validation.Triples", says=("data.val: its first batch",), id="val-split-checked"),
    case("data.test=framework.zoo.datasets.digits", says=("data.test='framework.zoo.datasets.digits'", "_target_"),
         id="dataset-without-_target_"),
    case("model._target_=test_validation.TwoOutputs", "~model.hidden", "~model.dropout",
         says=("model: returned a tuple of (shape (64, 10) float32", "expected a tensor of scores"), id="tuple-output"),
    case("task._target_=test_validation.DictTask", "~task.loss", "~task.metrics", "checkpoint.save_top_k=0",
         "callbacks=none",  # (no validation_step: a monitor of the default config would be refused first)
         says=("task: DictTask.training_step on the first train batch (a tuple of (shape (64, 1, 8, 8) float32",
               "raised TypeError"), id="own-task-fails"),
    case("+task.loss.reduction=none", says=("task.loss: CrossEntropyLoss returned shape (64,) float32",
                                            "one number"), id="loss-not-reduced"),
    case("task.metrics.acc.top_k=20", says=("task.metrics.acc: Accuracy", "selected index k out of range"),
         id="metric-fails"),
    case("checkpoint.monitor=val/accuracy", says=("checkpoint.monitor='val/accuracy': no such metric",
                                                  "val/loss, val/acc"), id="checkpoint-monitor-unknown"),
    case("scheduler=plateau", "scheduler.monitor=val/los", says=("scheduler.monitor='val/los': no such metric",),
         id="scheduler-monitor-unknown"),
    case("data.num_classes=5", "trainer.dry_run=true", says=("data.num_classes=5",), id="dry-run-too"),
]


@pytest.mark.parametrize("overrides, says", FIRST_BATCH)
def test_data_or_model_that_does_not_fit_is_named_at_the_first_batch(tmp_path: Path, overrides: tuple[str, ...],
                                                                     says: tuple[str, ...]) -> None:
    line = fail(tmp_path, *overrides)
    for fragment in says:
        assert fragment in line, line
    assert not list(tmp_path.glob("checkpoints/*"))


@pytest.mark.parametrize("overrides", [pytest.param(("model.dropout=0.5",), marks=pytest.mark.unit),
                                       ("model=cnn", "model.channels=[4,4]", "data.num_workers=1")])  # workers: e2e
def test_first_batch_check_changes_nothing_training_sees(compose, tmp_path: Path, monkeypatch,
                                                         overrides: tuple[str, ...]) -> None:
    """A run ends with the same weights (BatchNorm statistics included) with the check as without it: the
    check draws no random number (dropout, worker seeds), updates no statistic and leaves the model wrapped
    and in train mode."""
    import framework.loop.trainer
    from framework.loop.trainer import Trainer

    def train(run_dir: Path) -> dict[str, torch.Tensor]:
        trainer = Trainer(compose("logger.progress_bar=false", "trainer.max_steps=5", "trainer.test=false",
                                  *overrides), run_dir)
        trainer.fit()
        return trainer.run.strategy.unwrap(trainer.run.task.model).state_dict()

    checked = train(tmp_path / "checked")
    monkeypatch.setattr(framework.loop.trainer, "check_first_batches", lambda *args: [])  # the loop's check, skipped
    unchecked = train(tmp_path / "unchecked")
    assert all(torch.equal(value, unchecked[name]) for name, value in checked.items())


# ---------------------------------------------------------------- a function where an object is built
def test_function_of_tensors_as_target_advises_partial_or_the_module_class(tmp_path: Path) -> None:
    line = fail(tmp_path, "task.loss._target_=torch.nn.functional.nll_loss")
    assert line == ("Error: task.loss._target_='torch.nn.functional.nll_loss' is a function of (input, target), "
                    "which are tensors given when it is called, not config values; expected "
                    "+task.loss._partial_=true to call it with them later, or a module class such as "
                    "torch.nn.NLLLoss"), line


def test_the_partial_advice_works(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, *TINY, "task.loss._target_=torch.nn.functional.cross_entropy",
                   "+task.loss._partial_=true")
    assert proc.returncode == 0, output(proc)


def test_unannotated_function_target_gets_both_advices(tmp_path: Path) -> None:
    line = fail(tmp_path, "task.loss._target_=test_validation.plain_loss", "~task.loss.label_smoothing")
    assert "task.loss.output is not set: test_validation.plain_loss needs the argument 'output'" in line, line
    assert "+task.loss.output=VALUE" in line and "+task.loss._partial_=true" in line, line


def test_function_building_an_object_keeps_the_plain_advice(tmp_path: Path) -> None:
    # framework.zoo.datasets.digits is a function that builds a dataset: its missing `split` is a config value.
    line = fail(tmp_path, "~data.train.split")
    assert line == ("Error: data.train.split is not set: framework.zoo.datasets.digits needs the argument 'split'; "
                    "expected it in the config, e.g. +data.train.split=VALUE"), line


def test_nan_for_any_constructor_argument_is_refused(tmp_path: Path) -> None:
    line = fail(tmp_path, "optimizer.lr=nan")
    assert "optimizer.lr=nan: not a number; expected a number for torch.optim.SGD's 'lr'" in line, line
