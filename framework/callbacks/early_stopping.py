"""Lightning's EarlyStopping: stop when a monitored metric stops improving (`monitor`, `mode`, `patience`,
`min_delta`), every rank at the same step."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Optional

from framework.callbacks.base import Callback, Trainer

if TYPE_CHECKING:
    from framework.task.task import Task

log = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience` validations in a row, or as
    soon as it passes `stopping_threshold`, or when it is not finite (`check_finite`). Lightning's arguments."""

    def __init__(
        self,
        monitor: str = "val/loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        stopping_threshold: Optional[float] = None,
        check_finite: bool = True,
        verbose: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: expected 'min' or 'max'")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"patience={patience!r}: expected a whole number >= 1")
        if not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ValueError(f"min_delta={min_delta!r}: expected a number >= 0")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.stopping_threshold, self.check_finite, self.verbose = stopping_threshold, check_finite, verbose
        self.wait_count = 0
        self.best_score: Optional[float] = None
        self.best_step = -1
        self.stopped = ""  # why it stopped the run: kept, so a resumed run stops again (see on_fit_start)
        self.by_patience = False

    def _better(self, value: float, than: float) -> bool:
        return value < than - self.min_delta if self.mode == "min" else value > than + self.min_delta

    def on_validation_end(self, trainer: "Trainer", task: "Task", metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:  # the trainer checked the name at start: a task that changed its metrics
            raise RuntimeError(
                f"EarlyStopping: monitor {self.monitor!r} is not among this validation's metrics ({', '.join(metrics)})"
            )
        value = metrics[self.monitor]
        reason, self.stopped = None, ""
        if self.check_finite and not math.isfinite(value):
            reason = f"{self.monitor} = {value} is not finite"
        elif self.stopping_threshold is not None and (
            value <= self.stopping_threshold if self.mode == "min" else value >= self.stopping_threshold
        ):
            reason = f"{self.monitor} = {value:.6g} reached stopping_threshold {self.stopping_threshold}"
        elif self.best_score is None or self._better(value, self.best_score):
            self.best_score, self.best_step, self.wait_count = value, trainer.global_step, 0
            return
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                reason = (
                    f"{self.monitor} did not improve by more than {self.min_delta:g} for {self.patience} "
                    f"validation{'s' if self.patience > 1 else ''} (best {self.best_score:.6g} at step "
                    f"{self.best_step})"
                )
        if reason is not None:
            self.stopped, self.by_patience = f"early stopping: {reason}", self.wait_count >= self.patience
            trainer.request_stop(self.stopped)

    def on_fit_start(self, trainer: "Trainer", task: "Task") -> None:
        # A resumed run that this callback stopped stops again, unless its patience was raised on resume.
        if self.stopped and not (self.by_patience and self.wait_count < self.patience):
            trainer.request_stop(self.stopped)

    def state_dict(self) -> dict[str, Any]:
        # JSON has no infinity: "no best yet" is the step -1.
        return {
            "wait_count": self.wait_count,
            "best_score": self.best_score if self.best_score is not None else 0.0,
            "best_step": self.best_step,
            "stopped": self.stopped,
            "by_patience": self.by_patience,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count, self.best_step = int(state["wait_count"]), int(state["best_step"])
        self.best_score = float(state["best_score"]) if self.best_step >= 0 else None
        self.stopped, self.by_patience = str(state["stopped"]), bool(state["by_patience"])
