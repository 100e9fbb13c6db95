"""`best/<name>`: the best value a validation metric's series reached over the run, by the metric's direction.

A direction is never guessed from a name. It is read from a declared source, and a metric with none gets no
`best/*` at all:
- a monitor's mode: `checkpoint.monitor` with `checkpoint.mode`, a callback's `monitor` with its `mode` (early
  stopping), `scheduler.monitor` with its scheduler's `mode` (ReduceLROnPlateau);
- a torchmetrics `Metric`'s `higher_is_better`, where the task logs the Metric itself (`self.log(name, metric)`)
  or returns it from `epoch_metrics`;
- the task's word: `self.log(name, value, best="min")` (or `"max"`), or `Task.metric_modes()` for the metrics
  its steps return (`StepOutput.metrics`) and `epoch_metrics` computes;
- the loss the framework averages from what `validation_step` returns: `val/loss`, lower is better.
Two sources that disagree are one line naming both, before training where both are known then.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

from framework.core.errors import ConfigError

MODES = {"min": "lower is better", "max": "higher is better"}


class Best:
    """The declared direction of each metric (by its logged name), and `best/*` kept in `metrics` (the run's
    metrics: saved with every checkpoint, so a resumed run goes on from the best before it)."""

    def __init__(self, metrics: dict[str, float]) -> None:
        self.metrics = metrics
        self._modes: dict[str, tuple[str, str]] = {}  # name -> (mode, the source that declared it)

    def mode(self, name: str) -> Optional[str]:
        """The direction declared for `name` ("min" or "max"), or None where nothing declared one."""
        known = self._modes.get(name)
        return known[0] if known is not None else None

    def declare(self, name: str, mode: str, source: str) -> None:
        """`source` (in words, as the user wrote it) says `name` is better when lower ("min") or higher ("max")."""
        known = self._modes.get(name)
        if known is None:
            self._modes[name] = (mode, source)
        elif known[0] != mode:
            raise ConfigError(
                f"{name}: {known[1]} says {MODES[known[0]]} ({known[0]}), but {source} says {MODES[mode]} "
                f"({mode}); expected one direction for {name}: change one of them"
            )

    def declare_logged(self, name: str, value: Any, best: Optional[str]) -> None:
        """What `self.log(name, value, best=...)` declares: `best`, and a logged Metric's `higher_is_better`."""
        if best is not None:
            if best not in MODES:
                raise ConfigError(
                    f"task: self.log({name!r}, ..., best={best!r}): expected best='min' (lower is better), "
                    "best='max' (higher is better) or best=None (no best/* unless another source declares it)"
                )
            self.declare(name, best, f"self.log({name!r}, ..., best={best!r})")
        self.declare_metric(name, value)

    def declare_metric(self, name: str, metric: Any) -> None:
        """A torchmetrics Metric's own `higher_is_better` (None, as MeanMetric's, declares nothing)."""
        higher = getattr(metric, "higher_is_better", None)
        if isinstance(higher, bool):
            source = f"{type(metric).__name__}.higher_is_better={higher}"
            self.declare(name, "max" if higher else "min", source)

    def declare_task(self, task: Any, split: str, sets: Sequence[str] = ("",)) -> None:
        """`task.metric_modes()`: the directions of the metrics its steps return and `epoch_metrics` computes, in each
        of the split's `sets` (by name, "" for the default set: `<split>/<name>`, else `<split>/<name>/<set>`)."""
        where = f"{type(task).__name__}.metric_modes()"
        for name, mode in task.metric_modes().items():
            if mode not in MODES:
                raise ConfigError(
                    f"task: {where} gives {name!r}: {mode!r}; expected 'min' (lower is better) or 'max' "
                    "(higher is better)"
                )
            for set_name in sets or ("",):
                self.declare(f"{split}/{name}" + (f"/{set_name}" if set_name else ""), mode, f"{where}[{name!r}]")

    def declare_loss(self, name: str, step: str) -> None:
        """The loss the framework averages from what `step` returns: lower is better, as a loss is."""
        self.declare(name, "min", f"the loss {step} returns")

    def record(self, val: Mapping[str, float]) -> None:
        """`best/<name>` for each metric of a validation with a declared direction (a NaN is no best). One without
        has none: a best/* a checkpoint of an older version guessed is dropped."""
        for name, value in val.items():
            key, mode = f"best/{name}", self.mode(name)
            if mode is None:
                self.metrics.pop(key, None)
            elif not math.isnan(value):
                held = self.metrics.get(key, math.nan)
                better = min if mode == "min" else max
                self.metrics[key] = value if math.isnan(held) else better(held, value)
