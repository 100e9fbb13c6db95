"""What one training batch computes (`batch_fns`: automatic or manual optimization), and the optimizer step the
loop takes every `accumulate_grad_batches` batches under automatic optimization: unscale -> on_before_optimizer_step ->
clip -> step -> update (precision.step) -> on_before_zero_grad -> zero_grad -> the step counted -> the scheduler,
which decides by its interval whether to step (a step the GradScaler skipped does not advance it)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from framework.loop.hooks import Hooks
from framework.loop.run import Run
from framework.task.task import StepOutput, as_step_output


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


def batch_fns(
    run: Run, hooks: Hooks, profiler: Any, optimizer_step: OptimizerStep
) -> tuple[Callable[[Any, int, bool], Optional[StepOutput]], Callable[[], None]]:
    """(what one batch computes, what an optimizer step does), bound for this epoch: under automatic optimization,
    autocast forward -> the loss -> backward (gradients synced on the batch an optimizer step follows) and the
    optimizer step; under manual (loop/manual.py), the task's training_step, which steps its optimizers itself,
    and the step counted."""
    precision = run.precision
    # As they are, unless trainer.profiler times them.
    training_step, backward, timed_step = profiler.loop_fns(run.training_step, precision.backward, optimizer_step)
    where, plain = f"{type(run.task).__name__}.training_step", contextlib.nullcontext()
    autocast = precision.autocast if precision.dtype is not None else None
    accumulate = run.limits.accumulate
    no_sync = run.strategy.no_sync(run.model) if accumulate > 1 else None
    before_backward, after_backward = map(hooks.bound, ("on_before_backward", "on_after_backward"))

    def manual(batch: Any, i: int, steps_now: bool) -> Optional[StepOutput]:
        with autocast() if autocast is not None else plain:
            out = training_step(batch, i)
        return as_step_output(out, where, training=False)  # its loss, if it returns one, is logged

    def automatic(batch: Any, i: int, steps_now: bool) -> Optional[StepOutput]:
        with plain if no_sync is None or steps_now else no_sync():  # one all-reduce per optimizer step
            with autocast() if autocast is not None else plain:
                out = training_step(batch, i)
            if type(out) is not StepOutput:  # a loss tensor or a dict with "loss", as in Lightning
                out = as_step_output(out, where, training=True)
            if before_backward is not None:
                before_backward(out.loss)
            backward(out.loss / accumulate if accumulate > 1 else out.loss)
        if after_backward is not None:
            after_backward()
        return out

    if run.task.automatic_optimization:
        return automatic, timed_step
    return manual, optimizer_step.manual
