"""The optimizer step the loop takes every `accumulate_grad_batches` batches: unscale -> on_before_optimizer_step ->
clip -> step -> update (precision.step) -> on_before_zero_grad -> zero_grad -> the step counted -> the scheduler,
which decides by its interval whether to step (a step the GradScaler skipped does not advance it)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from framework.loop.hooks import Hooks
from framework.loop.run import Run


class OptimizerStep:
    """Bound once per fit to everything it touches: called per optimizer step, it reads no config."""

    def __init__(self, run: Run, hooks: Hooks) -> None:
        self.precision, self.optimizers, self.params = run.precision, run.optimizers, run.params
        self.progress, self.scheduler = run.progress, run.scheduler
        self.clip_norm, self.clip_value = run.limits.grad_clip_norm, run.limits.grad_clip_value
        # Automatic optimization's one optimizer (None: several, which the task steps itself)
        self.optimizer = run.optimizers.only if len(run.optimizers) == 1 else None
        self.before_step: Optional[Callable[[], None]] = hooks.bound("on_before_optimizer_step", self.optimizer)
        self.before_zero_grad: Optional[Callable[[], None]] = hooks.bound("on_before_zero_grad", self.optimizer)

    def __call__(self) -> None:
        assert self.optimizer is not None  # (several optimizers: manual optimization, refused otherwise at build)
        stepped = self.precision.step(
            self.optimizer, self.params, self.clip_norm, self.clip_value, before_step=self.before_step
        )
        if self.before_zero_grad is not None:
            self.before_zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.stepped()
        if self.scheduler is not None:
            self.scheduler.after_optimizer_step(self.progress.step, stepped)

    def lrs(self, names: list[str]) -> dict[str, float]:
        """Each group's learning rate now, as `lr/<group>`."""
        return {f"lr/{name}": group["lr"] for name, group in zip(names, self.optimizers.param_groups)}

    def manual(self) -> None:
        """After a training batch under manual optimization: the task stepped its optimizers; one step counted."""
        self.progress.stepped()

    def extras(self, names: list[str], epoch: int, lrs: bool = True) -> dict[str, Any]:
        """What a logging step writes beside the task's values: the epoch, each group's LR (unless `lrs` is false:
        this step has its LR point already), AMP's scale."""
        extras: dict[str, Any] = {"epoch": float(epoch), **(self.lrs(names) if lrs else {})}
        scale = self.precision.scale  # remembered at the last step: get_scale() would sync with the device
        if scale is not None:
            extras["amp/scale"] = scale
            extras["amp/skipped_steps"] = float(self.precision.skipped_steps)
        return extras
