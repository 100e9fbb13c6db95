"""`best/<metric>` (framework/observe/best.py): the best value of a validation metric's series over the run, kept only
where the metric's direction is declared (a monitor's mode, a torchmetrics Metric's `higher_is_better`, the task's
`best=` or `metric_modes`, the framework's own loss), never guessed from its name; two sources that disagree are one
error line naming both.

The runs are the command line's, in this process (framework.app.api), on the digits data; the tasks below are a
user's own, which `task._target_=test_best.X` imports. Each best is compared with the TensorBoard series it is the
best of."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import one_error_line, output, read_scalars, run_cli
from torch import nn
from torch.nn import functional as F
from torchmetrics import MeanAbsoluteError

from framework.core.errors import ConfigError
from framework.observe.best import Best
from framework.task.task import Task

pytestmark = pytest.mark.e2e

HERE = Path(__file__).stem
# 4 validations, no callback or checkpoint monitoring anything unless a test adds one; the classification task's
# own keys removed for the tasks below.
RUN = ("trainer.max_epochs=4", "callbacks=none", "checkpoint=none", "trainer.test=false")
OWN_TASK = ("~task.loss", "~task.metrics")


class Regression(Task):
    """The digits' label read as a number: `val/mae` of the predicted class, a plain tensor (no direction)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def predicted(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return self.model(x).argmax(dim=1).float(), y.float()

    def validation_step(self, batch: Any) -> None:
        prediction, target = self.predicted(batch)
        self.log("val/mae", (prediction - target).abs().mean())


class MetricRegression(Regression):
    """`val/mae` as torchmetrics' MeanAbsoluteError (higher_is_better=False), logged as the Metric."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.mae = MeanAbsoluteError()

    def validation_step(self, batch: Any) -> None:
        self.mae(*self.predicted(batch))
        self.log("val/mae", self.mae)


class DeclaredRegression(Regression):
    def validation_step(self, batch: Any) -> None:
        prediction, target = self.predicted(batch)
        self.log("val/mae", (prediction - target).abs().mean(), best="min")


class ConflictingRegression(MetricRegression):
    def validation_step(self, batch: Any) -> None:
        self.mae(*self.predicted(batch))
        self.log("val/mae", self.mae, best="max")


class TypoRegression(Regression):
    def validation_step(self, batch: Any) -> None:
        prediction, target = self.predicted(batch)
        self.log("val/mae", (prediction - target).abs().mean(), best="lower")


class EpochMetricRegression(Regression):
    """`val/mae` returned from epoch_metrics as the Metric itself: the framework computes it and takes its
    direction."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.mae = MeanAbsoluteError()

    def validation_step(self, batch: Any) -> None:
        self.mae.update(*self.predicted(batch))

    def epoch_metrics(self, split: str) -> dict[str, Any]:
        return {"mae": self.mae}


def fit(run_dir: Path, *overrides: str) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    proc = run_cli(run_dir, *RUN, *overrides)
    assert proc.returncode == 0, output(proc)
    return json.loads((run_dir / "summary.json").read_text()), read_scalars(run_dir)


def values(series: dict[str, list[tuple[int, float]]], name: str) -> list[float]:
    points = [v for _, v in series[name]]
    assert len(points) == 4 and len(set(points)) > 1, points  # one per validation, not constant: min != max
    return points


def test_a_metric_of_unknown_direction_gets_no_best_in_the_summary_nor_in_tensorboard(tmp_path):
    summary, series = fit(tmp_path / "run", f"task._target_={HERE}.Regression", *OWN_TASK)
    values(series, "val/mae")  # (a name with no "loss" in it was taken as higher-is-better: its worst epoch)
    assert not [k for k in summary if k.startswith("best/")]
    assert not [k for k in series if k.startswith("best/")]


@pytest.mark.parametrize("task", ["MetricRegression", "DeclaredRegression", "EpochMetricRegression"])
def test_a_torchmetrics_metric_or_the_tasks_best_keyword_gives_the_minimum_of_the_series(tmp_path, task):
    summary, series = fit(tmp_path / "run", f"task._target_={HERE}.{task}", *OWN_TASK)
    lowest = min(values(series, "val/mae"))
    assert summary["best/val/mae"] == pytest.approx(lowest, rel=1e-6)
    assert series["best/val/mae"][-1][1] == pytest.approx(lowest, rel=1e-6)


@pytest.mark.parametrize("mode", ["min", "max"])
def test_the_checkpoint_monitors_mode_gives_the_monitored_metric_its_direction(tmp_path, mode):
    summary, series = fit(tmp_path / "run", f"task._target_={HERE}.Regression", *OWN_TASK, "checkpoint=default",
                          "checkpoint.monitor=val/mae", f"checkpoint.mode={mode}")
    best = (min if mode == "min" else max)(values(series, "val/mae"))
    assert summary["best/val/mae"] == pytest.approx(best, rel=1e-6)


def test_the_classification_tasks_accuracy_and_the_frameworks_loss_have_a_best_with_no_monitor(tmp_path):
    summary, series = fit(tmp_path / "run")
    assert summary["best/val/acc"] == pytest.approx(max(values(series, "val/acc")), rel=1e-6)
    assert summary["best/val/loss"] == pytest.approx(min(values(series, "val/loss")), rel=1e-6)


def test_a_direction_two_sources_disagree_on_is_one_error_line_naming_both(tmp_path):
    proc = run_cli(tmp_path / "run", *RUN, f"task._target_={HERE}.ConflictingRegression", *OWN_TASK)
    line = one_error_line(proc)
    assert "val/mae" in line and "MeanAbsoluteError.higher_is_better=False" in line, line
    assert "self.log('val/mae', ..., best='max')" in line, line
    assert not (tmp_path / "run").exists() or "train/loss" not in read_scalars(tmp_path / "run")  # before training


@pytest.mark.parametrize("overrides, sources", [
    (("checkpoint=default", "checkpoint.monitor=val/acc", "checkpoint.mode=min"),
     ("checkpoint.monitor='val/acc' with checkpoint.mode=min", "ClassificationTask.metric_modes()['acc']")),
    (("checkpoint=default", "checkpoint.monitor=val/loss", "checkpoint.mode=max"),
     ("checkpoint.monitor='val/loss' with checkpoint.mode=max", "the loss validation_step returns")),
    (("callbacks=early_stopping", "callbacks.early_stopping.mode=max"),
     ("callbacks.early_stopping.monitor='val/loss' with callbacks.early_stopping.mode=max",
      "the loss validation_step returns")),
], ids=["monitor-vs-task", "monitor-vs-loss", "early-stopping-vs-loss"])
def test_a_monitor_whose_mode_contradicts_the_metrics_direction_is_refused_before_training(tmp_path, overrides,
                                                                                           sources):
    line = one_error_line(run_cli(tmp_path / "run", *RUN, *overrides))
    assert all(source in line for source in sources), line


def test_a_best_keyword_other_than_min_or_max_is_one_error_line(tmp_path):
    line = one_error_line(run_cli(tmp_path / "run", *RUN, f"task._target_={HERE}.TypoRegression", *OWN_TASK))
    assert "best='lower'" in line and "best='min'" in line, line


# ---------------------------------------------------------------------------------------------- the part itself
@pytest.mark.unit
def test_best_follows_the_declared_direction_skips_nan_and_drops_an_undeclared_best():
    metrics: dict[str, float] = {"best/val/mae": 0.1}  # e.g. what an older version guessed, in a checkpoint
    best = Best(metrics)
    best.declare("val/loss", "min", "the loss validation_step returns")
    best.declare("val/acc", "max", "checkpoint.monitor='val/acc' with checkpoint.mode=max")
    best.declare("val/acc", "max", "ClassificationTask.metric_modes()['acc']")  # agreeing: fine
    for val in ({"val/loss": 0.5, "val/acc": 0.7, "val/mae": 3.0}, {"val/loss": math.nan, "val/acc": 0.6},
                {"val/loss": 0.4, "val/acc": 0.9}, {"val/loss": 0.45, "val/acc": 0.8}):
        best.record(val)
    assert metrics == {"best/val/loss": 0.4, "best/val/acc": 0.9}
    with pytest.raises(ConfigError, match=r"val/acc: checkpoint.monitor='val/acc' with checkpoint.mode=max says "
                                          r"higher is better \(max\), but self.log\('val/acc', \.\.\., "
                                          r"best='min'\) says lower is better \(min\)"):
        best.declare_logged("val/acc", torch.tensor(1.0), "min")
