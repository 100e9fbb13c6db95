"""The learning-rate scheduler from `scheduler.*`: any torch scheduler by `_target_`, stepped by `interval` (`step` or
`epoch`) every `frequency`, or on a validation metric (`monitor`, for ReduceLROnPlateau); its length filled in from
the run's; the LR plan it makes, for the setup report and TensorBoard."""

from __future__ import annotations

import copy
import functools
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import torch
from omegaconf import DictConfig, ListConfig

from framework.config.instantiate import build, without
from framework.core.errors import ConfigError
from framework.optim.groups import group_names

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- schedulers
# Keys of `scheduler.*` that belong to the trainer, not to the torch scheduler's constructor.
SCHEDULER_KEYS = ("interval", "frequency", "monitor")
# Constructor arguments that mean "the length of the run": given as null in the config, they are filled in.
LENGTH_ARGS = ("T_max", "total_steps", "total_iters")


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """Linear warmup from 0 over `warmup_steps`, then cosine from each group's lr down to `min_lr` at
    `total_steps` (the schedule of transformers' `get_cosine_schedule_with_warmup`, with a floor)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        self.warmup_steps, self.total_steps, self.min_lr = warmup_steps, total_steps, min_lr
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float | torch.Tensor]:
        step = self.last_epoch
        if step < self.warmup_steps:
            return [base * step / self.warmup_steps for base in self.base_lrs]
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return [self.min_lr + (base - self.min_lr) * cosine for base in self.base_lrs]


@dataclass
class Scheduler:
    """A torch LR scheduler plus when the trainer steps it."""

    scheduler: Any
    interval: str  # "step" (after every optimizer step) or "epoch"
    frequency: int
    monitor: Optional[str]  # metric passed to step() (ReduceLROnPlateau); None for the others
    factory: Callable[..., Any]  # rebuilds the same schedule on another optimizer (for the LR plan)
    length: int  # scheduler steps over the whole run

    @property
    def mode(self) -> Optional[str]:
        """A monitoring scheduler's direction (ReduceLROnPlateau's `mode`: "min" or "max"), else None."""
        mode = getattr(self.scheduler, "mode", None) if self.monitor is not None else None
        return mode if mode in ("min", "max") else None

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def rebase(self, group: int, base_lr: float) -> None:
        """A resume's new `lr` for a group (optim.groups.apply_changed_options): what the schedule scales from."""
        if hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs[group] = base_lr

    # The three moments the loop tells it of; it alone decides whether to step (it is the scheduler's one owner).
    def after_optimizer_step(self, step: int, stepped: bool) -> None:
        """A step scheduler follows the optimizer, and does not advance for a step the GradScaler skipped."""
        if stepped and self.interval == "step" and self.monitor is None and step % self.frequency == 0:
            self.scheduler.step()

    def after_epoch(self, completed_epochs: int) -> None:
        """An unmonitored epoch scheduler: every `frequency` completed epochs."""
        if self.interval == "epoch" and self.monitor is None and completed_epochs % self.frequency == 0:
            self.scheduler.step()

    def after_validation(self, validations: int, metrics: dict[str, float]) -> None:
        """A monitored scheduler (ReduceLROnPlateau): every `frequency` validations, with its metric."""
        if self.monitor is not None and validations % self.frequency == 0:
            self.scheduler.step(metrics[self.monitor])


def run_length(interval: str, frequency: int, max_steps: int, max_epochs: int, steps_per_epoch: int) -> int:
    """How many times the scheduler steps over the run, from the trainer's settings."""
    if interval == "step":
        steps = max_steps if max_steps > 0 else max_epochs * steps_per_epoch
        return steps // frequency
    epochs = max_epochs if max_steps <= 0 else max_steps // steps_per_epoch
    return epochs // frequency


def build_scheduler(
    node: DictConfig, optimizer: torch.optim.Optimizer, *, max_steps: int, max_epochs: int, steps_per_epoch: int
) -> Optional[Scheduler]:
    """`scheduler._target_: null` means a constant learning rate."""
    if node.get("_target_") is None:
        return None
    interval = node.get("interval", "step")
    if interval not in ("step", "epoch"):
        raise ConfigError(f"scheduler.interval={interval!r}: expected 'step' or 'epoch'")
    frequency = node.get("frequency", 1)
    if not isinstance(frequency, int) or frequency < 1:
        raise ConfigError(f"scheduler.frequency={frequency!r}: expected an integer >= 1")
    factory = build(
        without(node, SCHEDULER_KEYS),
        "scheduler",
        partial=True,
        provided=("optimizer",),
    )
    length = run_length(interval, frequency, max_steps, max_epochs, steps_per_epoch)
    filled: dict[str, Any] = {arg: length for arg in LENGTH_ARGS if arg in node and node[arg] is None}
    if "max_lr" in node and node.max_lr is None:  # OneCycleLR: peak at each group's own lr
        filled["max_lr"] = [group["lr"] for group in optimizer.param_groups]
    _warn_if_senseless(node, interval, length)
    make = functools.partial(factory, **filled)
    return Scheduler(make(optimizer), interval, frequency, node.get("monitor"), make, length)


def _warn_if_senseless(node: DictConfig, interval: str, length: int) -> None:
    unit = "optimizer steps" if interval == "step" else "epochs"
    if length < 1:
        log.warning(
            "scheduler: interval=%s, but the run has no whole %s to schedule over (length 0); "
            "the learning rate will not change as planned",
            interval,
            unit,
        )
        return
    warmup = node.get("warmup_steps")
    if warmup is not None and warmup >= length:
        log.warning(
            "scheduler.warmup_steps=%s is not shorter than the run (%d %s): the warmup never ends", warmup, length, unit
        )
    step_size = node.get("step_size")
    milestones = node.get("milestones")
    first_milestone = min(milestones) if isinstance(milestones, ListConfig) and len(milestones) else None
    if (isinstance(step_size, int) and step_size >= length) or (
        isinstance(first_milestone, int) and first_milestone >= length
    ):
        log.warning(
            "scheduler: the first decay comes after the run ends (%d %s): the learning rate never changes", length, unit
        )


def lr_plan(
    scheduler: Scheduler, optimizer: torch.optim.Optimizer, steps_per_epoch: int, max_points: int = 1000
) -> dict[str, list[tuple[int, float]]]:
    """The planned LR of each group over the run, x in optimizer steps, computed on a throw-away optimizer
    with the same groups so the real one is untouched. Empty for metric-driven schedulers."""
    if scheduler.monitor is not None:
        return {}
    # Start from each group's configured lr: constructing the real scheduler may already have changed it.
    dummy_groups = [
        {k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "initial_lr")}
        | {"params": [torch.zeros(1, requires_grad=True)], "lr": g.get("initial_lr", g["lr"])}
        for g in optimizer.param_groups
    ]
    # The concrete class (SGD, AdamW, ...) takes the groups alone; the base Optimizer would also need `defaults`.
    optimizer_class = cast(Callable[..., torch.optim.Optimizer], type(optimizer))
    dummy = optimizer_class(dummy_groups)
    sched = scheduler.factory(dummy)
    names = group_names(dummy)
    unit = scheduler.frequency * (1 if scheduler.interval == "step" else steps_per_epoch)
    every = max(1, scheduler.length // max_points)
    plan: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stepping a scheduler with no optimizer step is the point here
        for i in range(scheduler.length + 1):
            if i % every == 0 or i == scheduler.length:
                for name, group in zip(names, dummy.param_groups):
                    plan[name].append((i * unit, group["lr"]))
            if i < scheduler.length:
                try:
                    sched.step()
                except Exception as err:  # noqa: BLE001  (a value the class accepts but cannot step with)
                    raise ConfigError(
                        f"scheduler: {type(sched).__name__} fails at its step {i + 1} of this run "
                        f"({type(err).__name__}: {err}); expected values it can step with "
                        "(e.g. step_size >= 1)"
                    ) from None
    return plan
