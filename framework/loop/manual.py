"""What a task's `optimizers()`, `lr_schedulers()`, `manual_backward`, `toggle_optimizer`/`untoggle_optimizer` and
`clip_gradients` reach: Lightning's manual optimization, over the run's optimizers and precision.

With `automatic_optimization = False` the task's `training_step` zeroes, back-propagates (`self.manual_backward`,
which scales the loss under fp16's GradScaler) and steps its optimizers itself. Each optimizer it gets from
`self.optimizers()` steps through the precision (the GradScaler's `step` and `update` under fp16), and the loop
counts one step per training batch, however many optimizers that batch stepped (Lightning counts each
`optimizer.step()`); `trainer.max_steps`, the logging and checkpoint cadences count in batches. The task steps its
schedulers itself (`self.lr_schedulers()`), as in Lightning. Lightning's hooks come where its own manual
optimization calls them: `on_before_backward` and `on_after_backward` around `manual_backward`, and
`on_before_optimizer_step` in `step`, after the closure, on unscaled gradients.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch

from framework.core.errors import UserError
from framework.optim.optimizers import Optimizers
from framework.parallel.precision import Precision


class StepsThroughPrecision:
    """One optimizer as `self.optimizers()` returns it (Lightning's LightningOptimizer): `step` unscales, steps and
    updates the GradScaler under fp16; everything else is the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        self.optimizer, self._precision = optimizer, precision
        self._unscaled = False  # clip_gradients unscaled this step's gradients already
        self._before_step: Optional[Callable[[torch.optim.Optimizer], None]] = None

    def with_hook(self, before_step: Optional[Callable[[torch.optim.Optimizer], None]]) -> None:
        """`on_before_optimizer_step` (its callbacks' and the task's), given the optimizer, before each step."""
        self._before_step = before_step

    def step(self, closure: Any = None) -> None:
        if closure is not None:  # Lightning's closure: the step's forward and backward, run before it steps
            closure()
        # Nothing to clip here (clip_gradients clips), so the precision reads no parameters: none listed per step.
        # The hook runs on true gradients (unscaled under fp16), as Lightning's does.
        hook = self._before_step
        before = functools.partial(hook, self.optimizer) if hook is not None else None
        self._precision.step(self.optimizer, (), None, None, before_step=before, unscaled=self._unscaled)
        self._unscaled = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale(self) -> None:
        """This step's gradients as true ones (once per step): what clipping must see under fp16."""
        if not self._unscaled:
            self._precision.unscale(self.optimizer)
            self._unscaled = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()


class TaskOptimizers:
    """The run's optimizers and schedulers as the task reaches them, and the manual-optimization calls."""

    def __init__(self, optimizers: Optimizers, precision: Precision) -> None:
        self._precision = precision
        self._wrapped = [StepsThroughPrecision(opt, precision) for opt in optimizers]
        self._schedulers = list(optimizers.schedulers.values())
        # What toggle froze, by id (a tensor's __hash__ is a Python call), with its requires_grad to restore.
        self._toggled: dict[int, tuple[torch.nn.Parameter, bool]] = {}
        self._before_backward: Optional[Callable[[torch.Tensor], None]] = None
        self._after_backward: Optional[Callable[[], None]] = None

    def with_hooks(
        self,
        before_backward: Optional[Callable[[torch.Tensor], None]],
        after_backward: Optional[Callable[[], None]],
        before_step: Optional[Callable[[torch.optim.Optimizer], None]],
    ) -> None:
        """Lightning's hooks around a manual step (each None where nothing implements it): the loop's, bound once."""
        self._before_backward, self._after_backward = before_backward, after_backward
        for wrapped in self._wrapped:
            wrapped.with_hook(before_step)

    def optimizers(self) -> Union[StepsThroughPrecision, list[StepsThroughPrecision]]:
        """One optimizer, or the list of several in config order (Lightning's `self.optimizers()`)."""
        return self._wrapped[0] if len(self._wrapped) == 1 else list(self._wrapped)

    def lr_schedulers(self, schedule: Any = None) -> Any:
        """The named optimizers' own torch schedulers (one, a list, or None); `schedule`: a single optimizer's
        (`scheduler` group), whose torch scheduler this returns."""
        found = [s.scheduler for s in self._schedulers] or ([schedule.scheduler] if schedule is not None else [])
        if not found:
            return None
        return found[0] if len(found) == 1 else found

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """`loss.backward()`, scaled under fp16, between on_before_backward and on_after_backward (Lightning's
        manual_backward)."""
        if self._before_backward is not None:
            self._before_backward(loss)
        self._precision.backward(loss, *args, **kwargs)
        if self._after_backward is not None:
            self._after_backward()

    def _find(self, optimizer: Any) -> StepsThroughPrecision:
        for wrapped in self._wrapped:
            if optimizer is wrapped or optimizer is wrapped.optimizer:
                return wrapped
        raise UserError("task: an optimizer that is not one of this run's (self.optimizers()) was given")

    def toggle(self, optimizer: Any) -> None:
        """Only `optimizer`'s parameters require gradients until `untoggle` (Lightning's toggle_optimizer)."""
        # The groups are read at each call, not cached: add_param_group (unfreezing a backbone) may change them.
        wrapped, toggled = self._find(optimizer), self._toggled
        mine = {id(p) for group in wrapped.param_groups for p in group["params"]}
        for other in self._wrapped:
            if other is wrapped:
                continue
            for group in other.param_groups:
                for param in group["params"]:
                    key = id(param)
                    if key not in mine and key not in toggled:
                        toggled[key] = (param, param.requires_grad)
                        param.requires_grad_(False)

    def untoggle(self, optimizer: Any) -> None:
        self._find(optimizer)
        for param, requires_grad in self._toggled.values():
            param.requires_grad_(requires_grad)
        self._toggled.clear()

    def clip(self, optimizer: Any, clip_val: Optional[float], algorithm: Optional[str]) -> None:
        """Lightning's clip_gradients: by norm (default) or by value, on true gradients (unscaled under fp16)."""
        if clip_val is None:
            return
        wrapped = self._find(optimizer)
        wrapped.unscale()
        params = [p for group in wrapped.param_groups for p in group["params"]]
        if algorithm in (None, "norm"):
            torch.nn.utils.clip_grad_norm_(params, clip_val)
        elif algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, clip_val)
        else:
            raise UserError(f"task: clip_gradients(gradient_clip_algorithm={algorithm!r}); expected 'norm' or 'value'")
