"""The Task contract as a Lightning user meets it (framework/task/task.py, task_hooks.py, task_log.py and the trainer's
side of them): step signatures, what training_step may return, self.log's values and keywords, the hooks and their
order, the pre-flight check's (absent) trace, monitors on logged metrics, what callbacks see, min_epochs/min_steps,
overfit_batches, detect_anomaly and test_ckpt.

Tasks here are LightningModules ported the way lightning-hydra-template's are (`net` given by config, steps with
`batch_idx`, `self.log`), on the digits data. Runs are tiny and in-process unless the behaviour is the command
line's (one `Error:` line, exit 1, no run directory left), which runs through the Python API as `run.py` would
(`task._target_=test_task_contract.X` imports: this directory is on the path), or as `run.py` where its console is
what a test reads. Tests marked xfail(strict=True) pin a place where the
framework departs from Lightning's contract; each says how.
"""
from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import one_error_line, output, read_scalars, run_cli
from torch import nn
from torch.nn import functional as F

from framework.callbacks.base import Callback
from framework.checkpoint import open_checkpoint
from framework.core.errors import ConfigError
from framework.loop.trainer import Trainer
from framework.callbacks import task_hooks
from framework.task.task import StepOutput, Task

pytestmark = pytest.mark.unit

TESTS = str(Path(__file__).parent)
HERE = Path(__file__).stem

# 3 training batches of 64 per epoch, 2 epochs; validation and test on 2 batches of 64; no callbacks, no
# checkpoint (a test that needs them adds them); the classification task's own keys removed (these tasks take `net`).
TINY = ("logger.progress_bar=false", "callbacks=none", "checkpoint=none", "trainer.max_epochs=2",
        "trainer.limit_train_batches=3", "data.eval_batch_size=64", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "~task.loss", "~task.metrics")
ONE_EPOCH = ("logger.progress_bar=false", "callbacks=none", "checkpoint=none", "trainer.max_epochs=1",
             "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
             "~task.loss", "~task.metrics")
EARLY_STOPPING = "+callbacks.early_stopping._target_=framework.callbacks.early_stopping.EarlyStopping"


def fit(compose, run_dir: Path, task: type, *overrides: str, resume_from: Any = None) -> tuple[Trainer, dict]:
    """Train `task` in-process on TINY plus `overrides`; the trainer (its task holds what it recorded) and summary."""
    trainer = build(compose, run_dir, task, *overrides, resume_from=resume_from)
    return trainer, trainer.fit()


def build(compose, run_dir: Path, task: type, *overrides: str, resume_from: Any = None) -> Trainer:
    cfg = compose(*TINY, *overrides)  # composed once for every task these overrides go with (conftest caches it)
    cfg.task._target_ = f"{HERE}.{task.__name__}"  # what `task._target_=...` on the command line sets
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, run_dir, resume_from=resume_from)


def cli(run_dir: Path, task: type, *overrides: str, process: bool = False):
    """`python run.py` on one tiny epoch of `task`, as a user runs it: through the API in this process (which imports
    this module already), or in a process of its own with `process` (what Python's warnings print on its console)."""
    return run_cli(run_dir, *ONE_EPOCH, f"task._target_={HERE}.{task.__name__}", *overrides,
                   env={"PYTHONPATH": TESTS}, fast=False, process=process)


def assert_refused(proc, run_dir: Path, *needles: str) -> str:
    """Exit 1 with one `Error:` line holding every needle, no traceback, and no run directory left behind."""
    out = output(proc)
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 1, out
    assert len(errors) == 1 and "Traceback" not in out, out
    for needle in needles:
        assert needle in errors[0], out
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    return errors[0]


def series(run_dir: Path, name: str) -> list[tuple[int, float]]:
    return read_scalars(run_dir).get(name, [])


def weighted_mean(values: list[float], weights: list[float]) -> float:
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


# ---------------------------------------------------------------------------------------------- the tasks
class Lit(Task):
    """A LightningModule as a newcomer ports it: the model given as `net`, cross-entropy, (batch, batch_idx)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss_of(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss_of(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.loss_of(batch))


def fingerprint(batch: Any) -> tuple[int, ...]:
    """A batch by its labels (64 digits: distinct for distinct batches of a shuffled epoch)."""
    return tuple(batch[1].tolist())


class Seen(Lit):
    """Records the batch_idx (None where the step does not take one) of every step the real loop runs."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.seen: dict[str, list] = {"train": [], "val": [], "test": []}
        self.batches: list[tuple[int, int, tuple[int, ...]]] = []  # (epoch, batch_idx, fingerprint) of training

    def note(self, stage: str, batch: Any, batch_idx: Any) -> None:
        self.seen[stage].append(batch_idx)
        if stage == "train" and batch_idx is not None:
            self.batches.append((self.current_epoch, batch_idx, fingerprint(batch)))


class BatchOnly(Seen):
    def training_step(self, batch):  # type: ignore[override]
        self.note("train", batch, None)
        return self.loss_of(batch)

    def validation_step(self, batch):  # type: ignore[override]
        self.note("val", batch, None)
        self.log("val/loss", self.loss_of(batch))

    def test_step(self, batch):  # type: ignore[override]
        self.note("test", batch, None)
        self.log("test/loss", self.loss_of(batch))


class WithBatchIdx(Seen):
    def training_step(self, batch, batch_idx):
        self.note("train", batch, batch_idx)
        return self.loss_of(batch)

    def validation_step(self, batch, batch_idx):
        self.note("val", batch, batch_idx)
        self.log("val/loss", self.loss_of(batch))

    def test_step(self, batch, batch_idx):
        self.note("test", batch, batch_idx)
        self.log("test/loss", self.loss_of(batch))


class WithDataloaderIdx(Seen):
    def training_step(self, batch, batch_idx, dataloader_idx=0):
        self.note("train", batch, batch_idx)
        return self.loss_of(batch)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.note("val", batch, batch_idx)
        self.log("val/loss", self.loss_of(batch))

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.note("test", batch, batch_idx)
        self.log("test/loss", self.loss_of(batch))


class StarArgs(Seen):
    def training_step(self, *args):
        self.note("train", args[0], args[1])
        return self.loss_of(args[0])

    def validation_step(self, *args):
        self.note("val", args[0], args[1])
        self.log("val/loss", self.loss_of(args[0]))

    def test_step(self, *args):
        self.note("test", args[0], args[1])
        self.log("test/loss", self.loss_of(args[0]))


class OptimizerIdx(Lit):
    """Lightning 1.x's training_step with several optimizers: three required arguments."""

    def training_step(self, batch, batch_idx, optimizer_idx):  # type: ignore[override]
        return self.loss_of(batch)


class ThreeArgValidation(Lit):
    def validation_step(self, batch, batch_idx, dataloader_idx):  # type: ignore[override]
        self.log("val/loss", self.loss_of(batch))


class ThreeArgTest(Lit):
    def test_step(self, batch, batch_idx, dataloader_idx):  # type: ignore[override]
        self.log("test/loss", self.loss_of(batch))


class Returns(Lit):
    """training_step returns what `returns` names."""

    def __init__(self, net: nn.Module, returns: str = "tensor") -> None:
        super().__init__(net)
        self.returns = returns
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        made = {
            "tensor": lambda: loss,
            "step_output": lambda: StepOutput(loss),
            "dict": lambda: {"loss": loss, "logits": logits.detach(), "n": len(y)},
            "shape_1": lambda: loss.reshape(1),
            "none": lambda: None,
            "string": lambda: "loss",
            "per_sample": lambda: F.cross_entropy(logits, y, reduction="none"),
            "int_tensor": lambda: (logits.argmax(1) == y).sum(),
            "dict_without_loss": lambda: {"los": loss},
            "float": lambda: float(loss),
            "none_at_batch_1": lambda: None if batch_idx == 1 else loss,
        }
        return made[self.returns]()


class LogsOnly(Lit):
    """validation_step returns nothing and logs val/ce, val_acc and val/acc; test_step is the default (validation's)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        acc = (logits.argmax(1) == y).float().mean()
        self.log("val/ce", F.cross_entropy(logits, y))
        self.log("val/acc", acc)
        self.log("val_acc", acc)


class LogsEveryKind(Lit):
    """Logs every kind of value self.log takes, with its keywords, in validation; records each batch's numbers."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        from torchmetrics import MaxMetric, MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        self.mean_loss, self.max_loss = MeanMetric(), MaxMetric()
        self.acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.record: list[tuple[float, int, int, int]] = []  # (loss, batch size, correct, batch_idx)

    def on_validation_epoch_start(self) -> None:
        self.record = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.record.append((float(loss), len(y), int((logits.argmax(1) == y).sum()), batch_idx))
        self.mean_loss.update(loss)
        self.max_loss.update(loss)
        self.acc.update(logits, y)
        self.log("val/float", float(loss))
        self.log("val/int", batch_idx + 1)
        self.log("val/tensor_0d", loss)
        self.log("val/tensor_1el", loss.reshape(1))
        self.log("val/int_tensor", torch.tensor(batch_idx + 1))
        self.log("val/mean_metric", self.mean_loss)
        self.log("val/max_metric", self.max_loss)
        self.log("val/acc_metric", self.acc)
        self.log("val/sum", loss, reduce_fx="sum")
        self.log("val/max", loss, reduce_fx="max")
        self.log("val/min", loss, reduce_fx="min")
        self.log("val/torch_max", loss, reduce_fx=torch.max)
        self.log("val/weighted", loss, batch_size=batch_idx + 1)
        self.log("val/hidden", loss, logger=False)
        self.log("val/synced", loss, sync_dist=True, rank_zero_only=True, sync_dist_group=None,
                 add_dataloader_idx=False, enable_graph=False, prog_bar=True)
        self.log_dict({"val/dict_a": loss, "val/dict_b": 2.0})


class TrainLogs(Lit):
    """Logs one value per training batch with each on_step/on_epoch/reduce_fx combination; records it."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.record: list[tuple[int, int, int, float]] = []  # (epoch, step it becomes, batch_idx, value)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        v = x.mean() * 10 + batch_idx
        self.record.append((self.current_epoch, self.global_step + 1, batch_idx, float(v)))
        self.log("step_only", v)
        self.log("epoch_only", v, on_step=False, on_epoch=True)
        self.log("both", v, on_step=True, on_epoch=True)
        self.log("sum", v, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("max", v, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("min", v, on_step=False, on_epoch=True, reduce_fx="min")
        self.log("torch_max", v, on_step=False, on_epoch=True, reduce_fx=torch.max)
        self.log("weighted", v, on_step=False, on_epoch=True, batch_size=batch_idx + 1)
        self.log("hidden", v, on_step=False, on_epoch=True, logger=False)
        self.log("hidden_step", v, logger=False)
        self.log("synced", v, on_step=False, on_epoch=True, sync_dist=True, rank_zero_only=True)
        return self.loss_of(batch)

    def on_train_epoch_end(self) -> None:
        self.log("from_epoch_hook", float(len(self.record)))  # an epoch value by default there, as in Lightning


class BarTask(TrainLogs):
    """TrainLogs, and one epoch value asked for the progress bar."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("shown", 7.0, on_step=False, on_epoch=True, prog_bar=True)
        return loss


class HiddenBoth(Lit):
    def training_step(self, batch, batch_idx):
        loss = self.loss_of(batch)
        self.log("hidden_both", loss, on_step=True, on_epoch=True, logger=False)
        return loss


class BadValue(Lit):
    """Logs `value` (what `kind` names) in the step `where` names."""

    def __init__(self, net: nn.Module, kind: str = "string", where: str = "validation") -> None:
        super().__init__(net)
        self.kind, self.where, self.train_steps = kind, where, 0

    def bad(self) -> Any:
        return {"string": "high", "multi_element": torch.ones(3), "bool": True, "none": None}[self.kind]

    def training_step(self, batch, batch_idx):
        self.train_steps += 1
        if self.where == "training":
            self.log("train/bad", self.bad())
        return self.loss_of(batch)

    def validation_step(self, batch, batch_idx):
        if self.where == "validation":
            self.log("val/bad", self.bad())
        self.log("val/loss", self.loss_of(batch))


class MetricPerValidation(Lit):
    """A MaxMetric and a MeanMetric logged in validation_step; the n-th validation feeds them 100 - 10 n + batch_idx,
    so a metric not reset after the first validation shows it in the second."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        from torchmetrics import MaxMetric, MeanMetric

        self.peak, self.mean = MaxMetric(), MeanMetric()
        self.validations = 0
        self.in_hook: list[tuple[float, float]] = []

    def validation_step(self, batch, batch_idx):
        value = torch.tensor(100.0 - 10 * self.validations + batch_idx)
        self.peak.update(value)
        self.mean.update(value)
        self.log("val/peak", self.peak)
        self.log("val/mean", self.mean)

    def on_validation_epoch_end(self) -> None:
        self.in_hook.append((float(self.peak.compute()), float(self.mean.compute())))
        self.validations += 1


class StepMetric(Lit):
    """A MeanMetric logged from training_step with Lightning's defaults there (on_step only); fed 10 * epoch +
    batch_idx."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        from torchmetrics import MeanMetric

        self.running = MeanMetric()

    def training_step(self, batch, batch_idx):
        self.running(torch.tensor(10.0 * self.current_epoch + batch_idx))
        self.log("train/running", self.running)
        return self.loss_of(batch)


class HookRecorder(Lit):
    """Records every Lightning hook the framework calls (generated from task_hooks.CALLED) and every step."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.calls: list[str] = []
        self.batch_end_outputs: list[Any] = []

    def training_step(self, batch, batch_idx):
        self.calls.append("training_step")
        return self.loss_of(batch)

    def validation_step(self, batch, batch_idx):
        self.calls.append("validation_step")
        self.log("val/loss", self.loss_of(batch))

    def test_step(self, batch, batch_idx):
        self.calls.append("test_step")
        self.log("test/loss", self.loss_of(batch))


def _recording_hook(name: str) -> Any:
    def hook(self: HookRecorder, *args: Any) -> None:
        self.calls.append(f"{name}({args[0]})" if name in ("setup", "teardown") else name)
        if name == "on_train_batch_end":
            self.batch_end_outputs.append(args[0])
        if name == "on_exception":
            self.exception = args[0]
    hook.__name__ = name
    return hook


for _name in task_hooks.CALLED:
    if _name not in ("on_save_checkpoint", "on_load_checkpoint"):
        setattr(HookRecorder, _name, _recording_hook(_name))


class FailsAtBatch1(HookRecorder):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("boom at batch 1")
        return super().training_step(batch, batch_idx)


def _refused_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a refused hook was called")


# One task per Lightning method the framework refuses (a config group does its job), generated from REPLACED.
REPLACED_TASKS = {name: type(f"Defines_{name}", (Lit,), {name: _refused_hook}) for name in task_hooks.REPLACED}
globals().update({cls.__name__: cls for cls in REPLACED_TASKS.values()})

# Lightning hooks a port may define that the loop neither calls nor refuses.
UNCALLED_LIGHTNING_HOOKS = ("on_validation_batch_start", "on_validation_batch_end", "on_test_batch_start",
                            "on_test_batch_end", "on_before_backward")


def _noting_hook(name: str) -> Any:
    def hook(self: Any, *args: Any, **kwargs: Any) -> None:
        self.noted.append(name)
    hook.__name__ = name
    return hook


class NotesHooks(Lit):
    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.noted: list[str] = []


UNCALLED_TASKS = {name: type(f"Defines_{name}", (NotesHooks,), {name: _noting_hook(name)})
                  for name in (*UNCALLED_LIGHTNING_HOOKS, "on_my_thing")}
globals().update({cls.__name__: cls for cls in UNCALLED_TASKS.values()})


class Keeper(Lit):
    """Puts its own keys in the checkpoint (on_save_checkpoint) and records what on_load_checkpoint gets back."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.steps_done = 0
        self.loaded: Any = None
        self.events: list[str] = []

    def training_step(self, batch, batch_idx):
        self.steps_done += 1
        self.events.append("training_step")
        return self.loss_of(batch)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["steps_done"] = self.steps_done
        checkpoint["note"] = "kept"
        checkpoint["scores"] = [0.5, 0.25]
        checkpoint["table"] = torch.arange(3.0) * self.steps_done

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.loaded = checkpoint
        self.steps_done = checkpoint["steps_done"]
        self.events.append("on_load_checkpoint")


class Counting(Lit):
    """Counts every step, keeps a MaxMetric of every batch it sees and a buffer counter, and notes each validation
    batch: the pre-flight check must leave none of it."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        from torchmetrics import MaxMetric

        self.counts = {"train": 0, "val": 0, "test": 0}
        self.seen_max = MaxMetric()
        self.register_buffer("train_batches", torch.zeros((), dtype=torch.long))
        self.val_seen: list[tuple[int, int]] = []  # (global_step: 0 in the check, batch_idx)

    def training_step(self, batch, batch_idx):
        self.counts["train"] += 1
        self.seen_max.update(batch[0].sum())
        self.train_batches += 1
        return self.loss_of(batch)

    def validation_step(self, batch, batch_idx):
        self.counts["val"] += 1
        self.seen_max.update(batch[0].sum())
        self.val_seen.append((self.global_step, batch_idx))
        self.log("val/loss", self.loss_of(batch))

    def test_step(self, batch, batch_idx):
        self.counts["test"] += 1
        self.log("test/loss", self.loss_of(batch))


class HoldsLock(Counting):
    """Counting, holding what deepcopy cannot copy (a lock, as a task writing predictions from a thread would)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.lock = threading.Lock()


class Scored(Lit):
    """val/score = 1 / n at the n-th validation (best at the first, worse every time after), logged by
    validation_step and counted by its epoch-end hook; val/ce is the real loss. test_step is the default:
    test/score, test/ce."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.validations = 0
        self.train_steps = 0

    def training_step(self, batch, batch_idx):
        self.train_steps += 1
        return self.loss_of(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/ce", self.loss_of(batch))
        self.log("val/score", 1.0 / (self.validations + 1))

    def on_validation_epoch_end(self) -> None:
        self.validations += 1


class ScoredInStep(Lit):
    """val/score from validation_step alone, and no epoch-end hook that could log a monitor (validations are
    counted as they start)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.validations = 0
        self.train_steps = 0

    def training_step(self, batch, batch_idx):
        self.train_steps += 1
        return self.loss_of(batch)

    def on_validation_start(self) -> None:
        self.validations += 1

    def validation_step(self, batch, batch_idx):
        self.log("val/ce", self.loss_of(batch))
        self.log("val/score", 1.0 / max(self.validations, 1))


class ScoredAtEpochEnd(Scored):
    """val/score logged in on_validation_epoch_end (the template's val/acc_best), not in validation_step."""

    def validation_step(self, batch, batch_idx):
        self.log("val/ce", self.loss_of(batch))

    def on_validation_epoch_end(self) -> None:
        self.log("val/score", 1.0 / (self.validations + 1))
        self.validations += 1


class Constant(Lit):
    def validation_step(self, batch, batch_idx):
        self.log("val/const", 1.0)


class TrainMetrics(Lit):
    """Logs its own train metric (Lightning's on_epoch) and records each batch's loss and accuracy."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.record: list[tuple[int, float, float]] = []  # (epoch, loss, acc)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(1) == y).float().mean()
        self.record.append((self.current_epoch, loss.item(), acc.item()))
        self.log("train/acc", acc, on_step=False, on_epoch=True)
        return loss

    def epoch_means(self) -> list[tuple[float, float]]:
        """(loss, acc) of each epoch, averaged over its batches (all of 64 samples)."""
        epochs = sorted({e for e, _, _ in self.record})
        rows = [[(loss, acc) for e, loss, acc in self.record if e == epoch] for epoch in epochs]
        return [(sum(l for l, _ in r) / len(r), sum(a for _, a in r) / len(r)) for r in rows]


class MetricSpy(Callback):
    """Records trainer.callback_metrics at each on_train_epoch_end and on_validation_end."""

    def __init__(self) -> None:
        self.at_epoch_end: list[dict[str, float]] = []
        self.at_validation_end: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        self.at_epoch_end.append(dict(trainer.callback_metrics))

    def on_validation_end(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        self.at_validation_end.append(dict(trainer.callback_metrics))


class Overfit(Lit):
    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.train_seen: list[tuple[int, tuple[int, ...]]] = []
        self.val_seen: list[tuple[int, tuple[int, ...]]] = []

    def training_step(self, batch, batch_idx):
        self.train_seen.append((self.global_step // 2, fingerprint(batch)))  # 2 batches, 2 steps per epoch
        return self.loss_of(batch)

    def validation_step(self, batch, batch_idx):
        self.val_seen.append((self.global_step // 2, fingerprint(batch)))
        self.log("val/loss", self.loss_of(batch))


class NanInBackward(Lit):
    """A finite loss whose backward makes a NaN: d sqrt(z)/dz at z = 0 is inf, times the 0 that made z."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y) + torch.sqrt((logits * 0).sum())


class EpochWatcher(Lit):
    """Records current_epoch where a Lightning port reads it, and what on_train_epoch_end sees of validation."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.epochs: list[tuple[str, int]] = []
        self.validations = 0
        self.val_seen_at_train_epoch_end: list[Any] = []

    def training_step(self, batch, batch_idx):
        self.epochs.append(("training_step", self.current_epoch))
        return self.loss_of(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/n", float(self.validations + 1))

    def on_validation_epoch_end(self) -> None:
        self.epochs.append(("on_validation_epoch_end", self.current_epoch))
        self.validations += 1

    def on_train_epoch_end(self) -> None:
        self.epochs.append(("on_train_epoch_end", self.current_epoch))
        self.val_seen_at_train_epoch_end.append(self.trainer.callback_metrics.get("val/n"))


class BatchEndReadsLoss(Lit):
    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.losses: list[float] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))  # Lightning passes training_step's output as a dict


class LogsImages(Lit):
    """Writes to TensorBoard through self.logger.experiment in validation_step, as lightning-hydra-template users
    log images (rank 0 with TensorBoard on: a logger exists)."""

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        if batch_idx == 0:
            self.logger.experiment.add_image("val/first", x[0], self.global_step)
        self.log("val/loss", self.loss_of(batch))


class UsesDevice(Lit):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        weights = torch.ones(10, device=self.device)
        self.log("val/loss", F.cross_entropy(self(x), y, weight=weights))


class LogsInValidationEnd(Lit):
    def on_validation_end(self) -> None:
        self.log("val/late", 1.0)


class TrainingOnly(Task):
    """A task with training_step alone (a GAN's shape): it logs a training metric of its own."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/g_loss", loss)
        return loss


class TrainingAndTest(TrainingOnly):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/ce", F.cross_entropy(self.net(x), y))


# ---------------------------------------------------------------------------------------------- 1. signatures
@pytest.mark.parametrize("task", [BatchOnly, WithBatchIdx, WithDataloaderIdx, StarArgs], ids=lambda t: t.__name__)
def test_every_lightning_step_signature_trains_and_gets_the_index_within_the_epoch(compose, tmp_path, task):
    trainer, summary = fit(compose, tmp_path, task)
    seen = trainer.run.task.seen
    assert summary["status"] == "ok" and summary["step"] == 6
    if task is BatchOnly:  # called with the batch alone, once per real batch (the pre-flight check left no count)
        assert seen == {"train": [None] * 6, "val": [None] * 4, "test": [None] * 2}
    else:
        assert seen == {"train": [0, 1, 2, 0, 1, 2], "val": [0, 1, 0, 1], "test": [0, 1]}


def test_batch_idx_continues_within_the_epoch_after_a_mid_epoch_resume(compose, tmp_path):
    keep_last = ("checkpoint.save_last=true", "trainer.test=false")
    whole, _ = fit(compose, tmp_path / "whole", WithBatchIdx, *keep_last)
    first, _ = fit(compose, tmp_path / "first", WithBatchIdx, *keep_last, "trainer.max_steps=4")
    assert first.run.task.batches == whole.run.task.batches[:4]  # epoch 0's three batches, then epoch 1's first
    resumed, summary = fit(compose, tmp_path / "resumed", WithBatchIdx, *keep_last,
                           resume_from=open_checkpoint(tmp_path / "first" / "checkpoints" / "last"))
    assert summary["step"] == 6
    # Epoch 1's batches 1 and 2, as the uninterrupted run trained them: same index, same samples.
    assert [b[:2] for b in resumed.run.task.batches] == [(1, 1), (1, 2)]
    assert resumed.run.task.batches == whole.run.task.batches[4:]


@pytest.mark.e2e
def test_a_training_step_requiring_three_arguments_is_one_error_line(tmp_path):
    run_dir = tmp_path / "run"
    assert_refused(cli(run_dir, OptimizerIdx), run_dir, "OptimizerIdx.training_step(batch, batch_idx, optimizer_idx)",
                   "training_step(self, batch) or training_step(self, batch, batch_idx)")


@pytest.mark.parametrize("task,step", [(ThreeArgValidation, "validation_step"), (ThreeArgTest, "test_step")])
def test_an_evaluation_step_requiring_three_arguments_is_refused_at_start(compose, tmp_path, task, step):
    with pytest.raises(ConfigError) as err:
        build(compose, tmp_path, task)
    assert f"{task.__name__}.{step}(batch, batch_idx, dataloader_idx)" in str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- 2. returns
def test_a_loss_tensor_a_dict_with_loss_and_a_step_output_train_to_identical_weights(compose, tmp_path):
    final = {}
    for kind in ("tensor", "step_output", "dict", "shape_1"):
        trainer, summary = fit(compose, tmp_path / kind, Returns, f"+task.returns={kind}", "trainer.test=false")
        assert summary["step"] == 6 and trainer.run.task.steps == 6
        final[kind] = {k: v.clone() for k, v in trainer.run.module.state_dict().items()}
    reference = final.pop("tensor")
    before = build(compose, tmp_path / "untrained", Returns).run.module.state_dict()
    assert not all(torch.equal(before[k], reference[k]) for k in reference)  # it trained
    for kind, weights in final.items():
        different = [k for k in reference if not torch.equal(weights[k], reference[k])]
        assert not different, f"{kind}: {different}"


@pytest.mark.e2e
@pytest.mark.parametrize("kind,says", [("none", "returned None"), ("int_tensor", "gave a loss of shape () int64")])
def test_a_training_step_returning_no_usable_loss_is_one_error_line_and_leaves_no_run(tmp_path, kind, says):
    run_dir = tmp_path / "run"
    assert_refused(cli(run_dir, Returns, f"+task.returns={kind}"), run_dir, "task: Returns.training_step", says)


@pytest.mark.parametrize("kind,says", [("none", "returned None"), ("string", "returned a str"),
                                       ("int_tensor", "gave a loss of shape () int64"),
                                       ("per_sample", "gave a loss of shape (64,) float32"),
                                       ("dict_without_loss", "returned a dict with keys los"),
                                       ("float", "returned a float")])
def test_every_unusable_return_is_one_line_naming_the_step_before_training(compose, tmp_path, kind, says):
    trainer = build(compose, tmp_path, Returns, f"+task.returns={kind}")
    with pytest.raises(ConfigError) as err:
        trainer.fit()
    assert "Returns.training_step" in str(err.value) and says in str(err.value) and "\n" not in str(err.value)
    assert trainer.run.task.steps == 0  # refused by the pre-flight check, on its copy: no real step ran


def test_a_training_step_returning_none_later_in_the_epoch_is_one_error_naming_it(compose, tmp_path):
    trainer = build(compose, tmp_path, Returns, "+task.returns=none_at_batch_1")
    with pytest.raises(ConfigError, match=r"Returns\.training_step returned None") as err:
        trainer.fit()
    assert "\n" not in str(err.value) and trainer.run.task.steps == 2


# ---------------------------------------------------------------------------------------------- 3. logged only
def test_validation_metrics_come_from_self_log_alone_and_the_summary_is_tensorboards_last_point(compose, tmp_path):
    fit(compose, tmp_path, LogsOnly)
    summary = json.loads((tmp_path / "summary.json").read_text())
    scalars = read_scalars(tmp_path)
    logged = {"val/ce", "val/acc", "val_acc"}
    assert {k for k in summary if k.startswith(("val/", "val_"))} == logged  # no val/loss: the step returned nothing
    for name in logged:
        assert [step for step, _ in scalars[name]] == [3, 6], name  # one point per validation, none from the test
        assert summary[name] == pytest.approx(scalars[name][-1][1], rel=1e-6), name


def test_a_default_test_step_logs_its_val_names_as_test_names_and_leaves_val_alone(compose, tmp_path):
    trainer, summary = fit(compose, tmp_path, LogsOnly)
    scalars = read_scalars(tmp_path)
    assert {k for k in summary if k.startswith(("test/", "test_"))} == {"test/ce", "test/acc", "test_acc"}
    for name in ("test/ce", "test/acc", "test_acc"):
        assert summary[name] == pytest.approx(scalars[name][-1][1], rel=1e-6)
    # The test's value is the test split's, the summary's val/ce the last validation's: they differ.
    model = trainer.run.module.eval()
    with torch.no_grad():
        batches = list(itertools.islice(trainer.run.data.batches("test"), 2))
        test_ce = sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in batches) / 128
    assert summary["test/ce"] == pytest.approx(test_ce, rel=1e-5)
    assert summary["val/ce"] != pytest.approx(summary["test/ce"], rel=1e-4)
    assert summary["val/ce"] == pytest.approx(scalars["val/ce"][-1][1], rel=1e-6)


# ---------------------------------------------------------------------------------------------- 4. self.log
def test_every_value_kind_and_reduction_self_log_takes_in_validation_is_computed_as_by_hand(compose, tmp_path):
    # All 270 validation samples: batches of 64, 64, 64, 64 and 14, so that weighting by batch size matters.
    trainer, summary = fit(compose, tmp_path, LogsEveryKind, "trainer.limit_val_batches=1.0", "trainer.test=false")
    record = trainer.run.task.record
    assert [n for _, n, _, _ in record] == [64, 64, 64, 64, 14]
    losses, sizes = [r[0] for r in record], [r[1] for r in record]
    by_size = weighted_mean(losses, sizes)
    expected = {
        "val/float": by_size, "val/tensor_0d": by_size, "val/tensor_1el": by_size, "val/synced": by_size,
        "val/hidden": by_size, "val/dict_a": by_size, "val/dict_b": 2.0,
        "val/int": weighted_mean([i + 1 for *_, i in record], sizes),
        "val/int_tensor": weighted_mean([i + 1 for *_, i in record], sizes),
        "val/mean_metric": sum(losses) / len(losses),  # MeanMetric: one update per batch, weight 1
        "val/max_metric": max(losses),
        "val/acc_metric": sum(c for _, _, c, _ in record) / sum(sizes),
        "val/sum": sum(losses), "val/max": max(losses), "val/min": min(losses), "val/torch_max": max(losses),
        "val/weighted": weighted_mean(losses, [i + 1 for *_, i in record]),
    }
    for name, value in expected.items():
        assert summary[name] == pytest.approx(value, rel=1e-5), name
    scalars = read_scalars(tmp_path)
    for name in expected:
        if name == "val/hidden":
            assert name not in scalars  # logger=False: in the summary, not in TensorBoard
        else:
            assert summary[name] == pytest.approx(scalars[name][-1][1], rel=1e-6), name
    assert json.loads((tmp_path / "summary.json").read_text())["val/hidden"] == pytest.approx(by_size, rel=1e-5)


def test_training_logs_follow_on_step_on_epoch_and_reduce_fx(compose, tmp_path):
    trainer, summary = fit(compose, tmp_path, TrainLogs, "trainer.log_every_n_steps=2", "trainer.test=false")
    record = trainer.run.task.record
    scalars = read_scalars(tmp_path)
    by_step = {step: v for _, step, _, v in record}
    epochs = [[v for e, _, _, v in record if e == epoch] for epoch in (0, 1)]
    weights = [[i + 1 for e, _, i, _ in record if e == epoch] for epoch in (0, 1)]

    def points(name: str) -> list[tuple[int, float]]:
        return [(step, pytest.approx(v, rel=1e-5)) for step, v in scalars.get(name, [])]

    at_logging_steps = [(s, pytest.approx(by_step[s], rel=1e-5)) for s in (2, 4, 6)]
    assert points("step_only") == at_logging_steps  # on_step (the default in training_step): logging steps only
    assert "step_only_epoch" not in scalars
    assert points("both") == at_logging_steps and points("both_epoch") == [(3, pytest.approx(sum(epochs[0]) / 3, rel=1e-5)),
                                                                           (6, pytest.approx(sum(epochs[1]) / 3, rel=1e-5))]
    reduced = {"epoch_only": lambda e: sum(e) / len(e), "sum": sum, "max": max, "min": min, "torch_max": max,
               "synced": lambda e: sum(e) / len(e)}
    for name, reduce in reduced.items():
        assert [s for s, _ in scalars[name]] == [3, 6], name  # on_epoch only: once per epoch, at its last step
        assert points(name) == [(3, pytest.approx(reduce(epochs[0]), rel=1e-5)),
                                (6, pytest.approx(reduce(epochs[1]), rel=1e-5))], name
    assert points("weighted") == [(3, pytest.approx(weighted_mean(epochs[0], weights[0]), rel=1e-5)),
                                  (6, pytest.approx(weighted_mean(epochs[1], weights[1]), rel=1e-5))]
    assert points("from_epoch_hook") == [(3, 3.0), (6, 6.0)]  # self.log in on_train_epoch_end: an epoch value
    assert "hidden" not in scalars and "hidden_step" not in scalars  # logger=False
    assert summary["hidden"] == pytest.approx(sum(epochs[1]) / 3, rel=1e-5)
    assert summary["hidden_step"] == pytest.approx(by_step[6], rel=1e-5)
    assert summary["epoch_only"] == pytest.approx(sum(epochs[1]) / 3, rel=1e-5)
    assert "train/loss" in scalars  # the trainer's own loss curve is still there


def test_logger_false_keeps_both_the_step_and_the_epoch_value_out_of_tensorboard(compose, tmp_path):
    _, summary = fit(compose, tmp_path, HiddenBoth, "trainer.max_epochs=1", "trainer.log_every_n_steps=1", "trainer.test=false")
    assert "hidden_both" in summary and "hidden_both_epoch" in summary
    scalars = read_scalars(tmp_path)
    assert "hidden_both" not in scalars
    assert "hidden_both_epoch" not in scalars


@pytest.mark.parametrize("where", ["training", "validation"])
@pytest.mark.parametrize("kind,says", [("string", "<str>"), ("multi_element", "<tensor of shape (3,)>"),
                                       ("bool", "<bool>"), ("none", "<NoneType>")])
def test_a_value_self_log_cannot_take_is_one_line_before_training(compose, tmp_path, where, kind, says):
    # A python bool is refused, not logged as 0/1: `self.log(name, True)` is more likely a mistake than a metric.
    trainer = build(compose, tmp_path, BadValue, f"+task.kind={kind}", f"+task.where={where}")
    with pytest.raises(ConfigError) as err:
        trainer.fit()
    name = "train/bad" if where == "training" else "val/bad"
    assert f"self.log({name!r}, {says})" in str(err.value) and "\n" not in str(err.value)
    assert trainer.run.task.train_steps == 0  # refused by the pre-flight check: no step trained


def test_a_metric_logged_in_validation_is_computed_per_validation_and_reset_after_its_epoch_end_hook(compose,
                                                                                                      tmp_path):
    trainer, summary = fit(compose, tmp_path, MetricPerValidation)
    scalars = read_scalars(tmp_path)
    # 1st validation: 100, 101; 2nd: 90, 91 (a metric kept from the 1st would say 101 and 95.5); the test (no
    # epoch-end hook there): 80, 81.
    assert [v for _, v in scalars["val/peak"]] == [101.0, 91.0]
    assert [v for _, v in scalars["val/mean"]] == [100.5, 90.5]
    assert trainer.run.task.in_hook == [(101.0, 100.5), (91.0, 90.5)]  # the hook sees the epoch's state, not reset yet
    assert (summary["val/peak"], summary["test/peak"], summary["test/mean"]) == (91.0, 81.0, 80.5)


def test_a_metric_logged_on_step_in_training_starts_each_epoch_afresh(compose, tmp_path):
    fit(compose, tmp_path, StepMetric, "trainer.log_every_n_steps=1", "trainer.test=false")
    values = dict(read_scalars(tmp_path)["train/running"])
    # Reset at each epoch's end as Lightning resets every logged Metric: epoch 1's first value is its own update
    # (10), not mean(0, 1, 2, 10) = 3.25. Within an epoch, the value over the epoch so far (Lightning would log
    # the batch's forward value: 1 at step 2, not 0.5).
    assert values == {1: 0.0, 2: 0.5, 3: 1.0, 4: 10.0, 5: 10.5, 6: 11.0}


def test_prog_bar_true_shows_the_value_on_each_epoch_line(compose, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="framework")
    fit(compose, tmp_path, BarTask, "logger.progress_bar=true", "trainer.test=false")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert len(lines) == 2 and all("shown 7" in line for line in lines), lines
    assert all("epoch_only" not in line for line in lines), lines


# ---------------------------------------------------------------------------------------------- 5. hooks
def test_every_hook_a_task_defines_is_called_once_where_the_loop_is(compose, tmp_path):
    trainer, _ = fit(compose, tmp_path, HookRecorder, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                     "trainer.limit_test_batches=1")
    batch = ["on_train_batch_start", "training_step", "on_before_backward", "on_after_backward",
             "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end"]
    # Lightning 2's order: the epoch's validation, then on_train_epoch_end.
    epoch = ["on_train_epoch_start", *batch * 2, "on_validation_start", "on_validation_epoch_start",
             "on_validation_batch_start", "validation_step", "on_validation_batch_end", "on_validation_epoch_end",
             "on_validation_end", "on_train_epoch_end"]
    expected = ["setup(fit)", "on_fit_start", "on_train_start", *epoch * 2, "on_train_end", "on_test_start",
                "on_test_epoch_start", "on_test_batch_start", "test_step", "on_test_batch_end", "on_test_epoch_end",
                "on_test_end", "on_fit_end", "teardown(fit)"]
    assert trainer.run.task.calls == expected
    called = {c.split("(")[0] for c in trainer.run.task.calls} - {"training_step", "validation_step", "test_step"}
    assert called == set(task_hooks.CALLED) - {"on_exception", "on_save_checkpoint", "on_load_checkpoint"}


def test_on_exception_gets_the_error_that_ends_the_run_and_teardown_still_runs(compose, tmp_path):
    trainer = build(compose, tmp_path, FailsAtBatch1)
    with pytest.raises(RuntimeError, match="boom at batch 1"):
        trainer.fit()
    calls = trainer.run.task.calls
    assert calls[-2:] == ["on_exception", "teardown(fit)"]
    assert str(trainer.run.task.exception) == "boom at batch 1"
    assert "on_fit_end" not in calls and "on_train_end" not in calls


def test_on_train_epoch_end_comes_after_the_epochs_validation_as_in_lightning(compose, tmp_path):
    trainer, _ = fit(compose, tmp_path, EpochWatcher, "trainer.test=false")
    assert trainer.run.task.val_seen_at_train_epoch_end == [1.0, 2.0]


def test_current_epoch_in_epoch_end_hooks_is_the_epoch_that_is_ending(compose, tmp_path):
    trainer, _ = fit(compose, tmp_path, EpochWatcher, "trainer.max_epochs=1", "trainer.test=false")
    assert sorted(set(trainer.run.task.epochs)) == [("on_train_epoch_end", 0), ("on_validation_epoch_end", 0),
                                                ("training_step", 0)]


def test_on_train_batch_end_gets_the_loss_as_outputs_loss(compose, tmp_path):
    trainer, _ = fit(compose, tmp_path, BatchEndReadsLoss, "trainer.max_epochs=1", "trainer.test=false")
    assert len(trainer.run.task.losses) == 3 and all(math.isfinite(loss) for loss in trainer.run.task.losses)


@pytest.mark.parametrize("name", sorted(task_hooks.REPLACED))
def test_a_lightning_method_a_config_group_replaces_is_refused_at_start_naming_what_does_its_job(compose, tmp_path,
                                                                                                 name):
    with pytest.raises(ConfigError) as err:
        build(compose, tmp_path, REPLACED_TASKS[name])
    message = str(err.value)
    assert f"Defines_{name}.{name}" in message and task_hooks.REPLACED[name] in message and "\n" not in message


@pytest.mark.e2e
def test_configure_optimizers_is_one_error_line_and_leaves_no_run(tmp_path):
    run_dir = tmp_path / "run"
    assert_refused(cli(run_dir, REPLACED_TASKS["configure_optimizers"]), run_dir,
                   "Defines_configure_optimizers.configure_optimizers", "optimizer and scheduler config groups")


def test_a_method_name_the_framework_does_not_know_is_left_alone(compose, tmp_path):
    trainer, summary = fit(compose, tmp_path, UNCALLED_TASKS["on_my_thing"])
    assert summary["status"] == "ok" and trainer.run.task.noted == []


@pytest.mark.parametrize("name", UNCALLED_LIGHTNING_HOOKS)
def test_a_lightning_hook_is_either_called_or_refused(compose, tmp_path, name):
    try:
        trainer, _ = fit(compose, tmp_path, UNCALLED_TASKS[name], "trainer.max_epochs=1")
    except ConfigError as err:
        assert name in str(err)
        return
    assert name in trainer.run.task.noted


def test_what_on_save_checkpoint_adds_on_load_checkpoint_gets_back_on_resume(compose, tmp_path):
    keep_last = ("checkpoint.save_last=true", "trainer.test=false")
    first, _ = fit(compose, tmp_path / "first", Keeper, *keep_last, "trainer.max_epochs=1")
    assert first.run.task.steps_done == 3 and first.run.task.loaded is None
    resumed, summary = fit(compose, tmp_path / "resumed", Keeper, *keep_last,
                           resume_from=open_checkpoint(tmp_path / "first" / "checkpoints" / "last"))
    loaded = resumed.run.task.loaded
    assert set(loaded) == {"steps_done", "note", "scores", "table"}
    assert (loaded["steps_done"], loaded["note"], list(loaded["scores"])) == (3, "kept", [0.5, 0.25])
    assert torch.equal(torch.as_tensor(loaded["table"]), torch.arange(3.0) * 3)
    assert resumed.run.task.events[0] == "on_load_checkpoint"  # before the first resumed step
    assert resumed.run.task.steps_done == 6 and summary["step"] == 6


# ---------------------------------------------------------------------------------------------- 6. pre-flight
def test_the_pre_flight_check_leaves_no_trace_in_the_tasks_counts_metrics_buffers_or_lists(compose, tmp_path):
    trainer, _ = fit(compose, tmp_path, Counting)
    task = trainer.run.task
    assert task.counts == {"train": 6, "val": 4, "test": 2}  # 2 epochs x 3, 2 validations x 2, 1 test x 2
    assert int(task.train_batches) == 6
    assert task.seen_max.update_count == 10  # every training and validation batch of the real loop, no more
    assert task.val_seen == [(3, 0), (3, 1), (6, 0), (6, 1)]  # after each epoch's 3 steps; never at step 0


@pytest.mark.xfail(strict=True, reason="a task deepcopy cannot copy is checked in place (preflight.check_first_batches "
                   "falls back to the task itself with a warning, and puts its metrics and buffers back): its plain "
                   "attributes (counters) still see the check's training and validation batch")
def test_the_pre_flight_check_leaves_no_trace_in_a_task_that_cannot_be_copied(compose, tmp_path):
    trainer, _ = fit(compose, tmp_path, HoldsLock, "trainer.test=false")
    assert trainer.run.task.counts == {"train": 6, "val": 4, "test": 0}
    assert trainer.run.task.seen_max.update_count == 10


# ---------------------------------------------------------------------------------------------- 7. monitors
MONITORS = ("checkpoint.monitor=val/score", "checkpoint.mode=max", "checkpoint.save_top_k=1",
            EARLY_STOPPING, "+callbacks.early_stopping.monitor=val/score", "+callbacks.early_stopping.mode=max",
            "+callbacks.early_stopping.patience=1",
            "scheduler=plateau", "scheduler.monitor=val/score", "scheduler.mode=max", "scheduler.patience=0",
            "trainer.max_epochs=3")


@pytest.mark.parametrize("task", [ScoredInStep, ScoredAtEpochEnd], ids=["validation_step", "on_validation_epoch_end"])
def test_checkpoint_early_stopping_and_plateau_monitor_a_metric_the_task_logs(compose, tmp_path, task):
    trainer, summary = fit(compose, tmp_path, task, *MONITORS)
    # val/score: 1 at step 3 (the best), 1/2 at step 6: early stopping (patience 1) stops there, before epoch 3.
    assert (summary["step"], summary["epoch"]) == (6, 2) and "val/score" in summary["stopped"]
    assert open_checkpoint(Path(summary["best_checkpoint"])).step == 3
    assert summary["tested"] == "best (step 3)"
    # ReduceLROnPlateau (patience 0) cut the LR once, at the second validation, by its factor 0.1.
    assert [group["lr"] for group in trainer.run.optimizers.param_groups] == pytest.approx([0.01, 0.01])


TYPO_MONITORS = {
    "checkpoint.monitor": ("checkpoint.monitor=val/scroe", "checkpoint.save_top_k=1"),
    "callbacks.early_stopping.monitor": (EARLY_STOPPING, "+callbacks.early_stopping.monitor=val/scroe"),
    "scheduler.monitor": ("scheduler=plateau", "scheduler.monitor=val/scroe"),
}


@pytest.mark.parametrize("key", TYPO_MONITORS)
def test_a_monitor_no_metric_can_have_is_refused_before_training(compose, tmp_path, key):
    trainer = build(compose, tmp_path, ScoredInStep, *TYPO_MONITORS[key])
    with pytest.raises(ConfigError) as err:
        trainer.fit()
    assert str(err.value) == f"{key}='val/scroe': no such metric; expected one of val/ce, val/score"
    assert trainer.run.task.train_steps == 0


@pytest.mark.parametrize("key", TYPO_MONITORS)
def test_a_monitor_an_epoch_end_hook_might_log_is_refused_at_the_first_validation_listing_its_metrics(compose,
                                                                                                    tmp_path, key):
    trainer = build(compose, tmp_path, ScoredAtEpochEnd, *TYPO_MONITORS[key])
    with pytest.raises(ConfigError) as err:
        trainer.fit()
    assert str(err.value) == (f"{key}='val/scroe': no such metric in the first validation; expected one of "
                              "val/ce, val/score")
    assert trainer.run.task.train_steps == 3  # one epoch: the first validation decided


@pytest.mark.e2e
def test_a_typo_monitor_is_one_error_line_and_leaves_no_run(tmp_path):
    run_dir = tmp_path / "run"
    assert_refused(cli(run_dir, ScoredInStep, *TYPO_MONITORS["checkpoint.monitor"]), run_dir,
                   "checkpoint.monitor='val/scroe'", "val/score")


def test_self_log_in_on_validation_end_is_refused_or_a_validation_metric(compose, tmp_path):
    try:
        fit(compose, tmp_path, LogsInValidationEnd, "trainer.log_every_n_steps=1")
    except ConfigError as err:
        assert "on_validation_end" in str(err)
        return
    assert [step for step, _ in series(tmp_path, "val/late")] in ([], [3, 6])


# ---------------------------------------------------------------------------------------------- 8. callbacks
def spy_of(trainer: Trainer) -> MetricSpy:
    spy = dict(trainer.run.callbacks)["spy"]
    assert isinstance(spy, MetricSpy)
    return spy


def test_a_callbacks_on_validation_end_sees_the_epochs_train_means_and_its_validation(compose, tmp_path):
    trainer, _ = fit(compose, tmp_path, TrainMetrics, f"+callbacks.spy._target_={HERE}.MetricSpy",
                     "trainer.test=false")
    means = trainer.run.task.epoch_means()
    seen = spy_of(trainer).at_validation_end
    assert len(seen) == 2
    for metrics, (loss, acc) in zip(seen, means):
        assert metrics["train/acc"] == pytest.approx(acc, rel=1e-5)
        assert metrics["train/loss_epoch"] == pytest.approx(loss, rel=1e-5)
        assert "val/loss" in metrics


def test_a_callbacks_on_train_epoch_end_sees_train_loss_and_the_tasks_train_metrics_of_that_epoch(compose,
                                                                                                 tmp_path):
    trainer, _ = fit(compose, tmp_path, TrainMetrics, f"+callbacks.spy._target_={HERE}.MetricSpy",
                     "trainer.test=false")
    means = trainer.run.task.epoch_means()
    seen = spy_of(trainer).at_epoch_end
    assert len(seen) == 2
    for metrics, (loss, acc) in zip(seen, means):  # this epoch's means, not the last one's
        assert metrics["train/loss_epoch"] == pytest.approx(loss, rel=1e-5)
        assert metrics["train/acc"] == pytest.approx(acc, rel=1e-5)


# ---------------------------------------------------------------------------------------------- 9. trainer keys
STOP_ON_CONSTANT = (EARLY_STOPPING, "+callbacks.early_stopping.monitor=val/const",
                    "+callbacks.early_stopping.patience=1", "trainer.max_epochs=3", "trainer.test=false")


@pytest.mark.parametrize("held,stops_after", [((), 2), (("trainer.min_epochs=3",), 3), (("trainer.min_steps=7",), 3)],
                         ids=["none", "min_epochs=3", "min_steps=7"])
def test_min_epochs_and_min_steps_hold_early_stopping_back(compose, tmp_path, held, stops_after):
    # val/const never improves: patience 1 asks to stop at the second validation, and again at each after it.
    _, summary = fit(compose, tmp_path, Constant, *STOP_ON_CONSTANT, *held)
    assert summary["epoch"] == stops_after and summary["step"] == 3 * stops_after
    assert "val/const did not improve" in summary["stopped"]  # stopped by it, not by max_epochs


def test_overfit_batches_trains_and_validates_on_the_same_first_batches_every_epoch(compose, tmp_path):
    trainer, summary = fit(compose, tmp_path, Overfit, "trainer.overfit_batches=2", "trainer.limit_train_batches=1.0",
                           "trainer.limit_val_batches=1.0", "trainer.max_epochs=3", "trainer.test=false")
    task = trainer.run.task
    first_two = [fingerprint(b) for b in itertools.islice(trainer.run.data.batches("train", 0), 2)]
    assert first_two[0] != first_two[1] and summary["step"] == 6
    assert task.train_seen == [(e, f) for e in range(3) for f in first_two]
    assert task.val_seen == [(e, f) for e in range(1, 4) for f in first_two]  # after each epoch, on those batches


@pytest.mark.e2e
def test_detect_anomaly_names_the_backward_op_that_made_a_nan_in_one_error_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli(run_dir, NanInBackward, "trainer.detect_anomaly=true", process=True)  # torch warns the traceback
    out = output(proc)
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1, out
    assert "trainer.detect_anomaly" in errors[0] and "MulBackward0" in errors[0] and "step 1" in errors[0], out
    assert "Traceback (most recent call last)" not in out, out
    assert "in training_step" in out  # anomaly mode's traceback of the forward that made it: the user's line


def evaluate_test(trainer: Trainer, weights: dict[str, torch.Tensor]) -> float:
    """Mean cross-entropy of `weights` over the run's two test batches, by hand."""
    model = copy.deepcopy(trainer.run.module)
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        batches = list(itertools.islice(trainer.run.data.batches("test"), 2))
        return sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in batches) / 128


@pytest.mark.parametrize("choice", ["best", "last"])
def test_test_ckpt_tests_the_best_or_the_final_weights(compose, tmp_path, choice):
    trainer, summary = fit(compose, tmp_path, Scored, "checkpoint.monitor=val/score", "checkpoint.mode=max",
                           "checkpoint.save_top_k=1", "checkpoint.save_last=true", f"trainer.test_ckpt={choice}")
    best = open_checkpoint(tmp_path / "checkpoints" / "best")
    last = open_checkpoint(tmp_path / "checkpoints" / "last")
    assert (best.step, last.step) == (3, 6)  # val/score is best at the first validation
    on_best, on_last = evaluate_test(trainer, best.model_state()), evaluate_test(trainer, last.model_state())
    assert on_best != pytest.approx(on_last, rel=1e-4)
    assert summary["tested"] == ("best (step 3)" if choice == "best" else "last")
    assert summary["test/ce"] == pytest.approx(on_best if choice == "best" else on_last, rel=1e-5)
    assert summary["test/score"] == pytest.approx(1 / 3)  # the default test_step is validation_step: 2 validations before


# ---------------------------------------------------------------------------------------------- what ports use
def test_a_validation_step_writing_to_self_logger_experiment_passes_the_pre_flight_check(compose, tmp_path):
    _, summary = fit(compose, tmp_path, LogsImages, "trainer.max_epochs=1", "trainer.test=false")
    assert summary["status"] == "ok"


def test_a_task_reads_self_device_as_in_lightning(compose, tmp_path):
    _, summary = fit(compose, tmp_path, UsesDevice, "trainer.max_epochs=1", "trainer.test=false")
    assert summary["status"] == "ok"


# ---------------------------------------------------------------------------------------------- no validation_step
# As in Lightning: a task that defines no validation_step is not validated at all (its training_step is not run on
# the val split), and not tested unless it defines test_step. Through the command line's path (in this process), so
# that the pre-flight check, the summary and the stages are the user's.
NO_VAL = ("callbacks=none", "checkpoint=none", "trainer.max_epochs=2", "trainer.limit_train_batches=3",
          "trainer.log_every_n_steps=1", "~task.loss", "~task.metrics")


@pytest.mark.e2e
@pytest.mark.parametrize("task", [TrainingOnly, TrainingAndTest], ids=lambda t: t.__name__)
def test_a_task_without_validation_step_is_never_validated_and_its_training_series_holds_training_points_only(
        tmp_path, task):
    proc = run_cli(tmp_path, *NO_VAL, f"task._target_={HERE}.{task.__name__}")
    assert proc.returncode == 0, output(proc)
    summary = json.loads((tmp_path / "summary.json").read_text())
    scalars = read_scalars(tmp_path)
    # One point per logging step (every step), none from a validation or a test running training_step.
    assert [step for step, _ in scalars["train/g_loss"]] == [1, 2, 3, 4, 5, 6]
    assert not [k for k in [*summary, *scalars] if k.startswith(("val/", "best/"))]
    tested = {k for k in summary if k.startswith("test/")}
    assert tested == ({"test/ce"} if task is TrainingAndTest else set())  # a test_step of its own: tested


@pytest.mark.e2e
@pytest.mark.parametrize("overrides, key", [
    (("checkpoint.monitor=val/loss", "checkpoint.save_top_k=1"), "checkpoint.monitor='val/loss'"),
    ((EARLY_STOPPING,), "callbacks.early_stopping.monitor='val/loss'"),
    (("scheduler=plateau",), "scheduler.monitor='val/loss'"),
], ids=["checkpoint", "early_stopping", "scheduler"])
def test_a_monitor_on_a_task_without_validation_step_is_one_error_line_naming_the_key(tmp_path, overrides, key):
    line = one_error_line(run_cli(tmp_path / "run", *NO_VAL, f"task._target_={HERE}.TrainingOnly", *overrides))
    assert key in line and "TrainingOnly defines no validation_step" in line, line


@pytest.mark.e2e
def test_validate_or_test_of_a_task_without_the_step_is_one_error_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *NO_VAL, f"task._target_={HERE}.TrainingOnly", "checkpoint.save_last=true")
    assert proc.returncode == 0, output(proc)
    for stage, says in (("validate", "TrainingOnly defines no validation_step"),
                        ("test", "TrainingOnly defines no test_step (nor validation_step")):
        line = one_error_line(run_cli(tmp_path / stage, stage, f"ckpt={run_dir}", fast=False))
        assert says in line and "nothing to " + stage in line, line


@pytest.mark.e2e
@pytest.mark.parametrize("extra, says", [
    ("+data.val_sets.held={_target_: framework.zoo.datasets.digits, split: test}",
     "data.val_sets.held: the task TrainingOnly defines no validation_step, so this set is never evaluated; expected "
     "a validation_step in TrainingOnly, or no data.val_sets"),
    ("+data.test_sets.held={_target_: framework.zoo.datasets.digits, split: test}",
     "data.test_sets.held: the task TrainingOnly defines no test_step or validation_step, so this set is never "
     "evaluated"),
], ids=["val_sets", "test_sets"])
def test_sets_named_for_a_split_the_task_never_evaluates_are_one_error_line(tmp_path, extra, says):
    """The default data.val of a task without validation_step is skipped, as Lightning skips it; a set the user
    named beside it would be skipped as silently, so it is refused."""
    line = one_error_line(run_cli(tmp_path / "run", *NO_VAL, f"task._target_={HERE}.TrainingOnly", extra))
    assert says in line, line
    assert not (tmp_path / "run").exists()
