"""Validation and test within fit: the Evaluator's pass (framework/loop/evaluate.py) between Lightning's hooks, the
monitors checked against the first round's metrics, `best/*` recorded (framework/observe/best.py), the scheduler
that monitors a metric told, and the test of the weights `trainer.test_ckpt` names."""

from __future__ import annotations

from typing import Any

from framework.core.errors import ConfigError
from framework.loop.hooks import Hooks
from framework.loop.preflight import shown_names
from framework.loop.restore import load_test_weights
from framework.loop.run import Run, monitors


class Validation:
    def __init__(self, run: Run, hooks: Hooks, profiler: Any) -> None:
        self.run, self.hooks, self.profiler = run, hooks, profiler
        self.checked = False  # the monitors were checked against a validation round's metrics
        self.tested = ""  # which weights the test used: best (step N) or last

    def validate(self) -> dict[str, float]:
        run, p = self.run, self.run.progress
        self.hooks.call("on_validation_start")
        with self.profiler.phase("evaluation"):
            metrics = run.evaluator.run("val", p.step)
        if not self.checked:
            check_monitors_logged(monitors(run), metrics, list(run.data.sets("val").values()))
            self.checked = True
        run.metric_logger.best.record(metrics)
        p.validated()
        self.hooks.quiet("on_validation_end", metrics)
        return metrics

    def round(self) -> dict[str, float]:
        """A validation during training (by epoch or by step), then the scheduler that monitors its metric."""
        val = self.validate()
        if self.run.scheduler is not None:
            self.run.scheduler.after_validation(self.run.progress.validations, val)
        return val

    def test(self) -> None:
        run = self.run
        self.tested = load_test_weights(run.cfg, run.checkpoints, run.strategy, run.module)
        self.hooks.call("on_test_start")
        with self.profiler.phase("evaluation"):
            metrics = run.evaluator.run("test", run.progress.step)
        self.hooks.quiet("on_test_end", metrics)


def check_monitors_logged(watched: dict[str, str], metrics: dict[str, float], sets: list[str]) -> None:
    """The first validation round shows every metric there is (what the steps and the epoch-end hook logged, in
    every set): a monitor naming none of them is one line, before anything acts on it."""
    for key, monitor in watched.items():
        if monitor not in metrics:
            raise ConfigError(
                f"{key}={monitor!r}: no such metric in the first validation; expected one of "
                f"{shown_names(list(metrics), sets)}"
            )
