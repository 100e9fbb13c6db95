"""Callbacks: behaviour added to the loop by config, with Lightning's hook names.

A callback is a `Callback` subclass built by `_target_` from the `callbacks` config group, a dict of nodes:

    callbacks:
      early_stopping: {_target_: framework.callbacks.early_stopping.EarlyStopping, monitor: val/loss, patience: 3}

`callbacks.NAME=null` turns one off, `+callbacks.mine={_target_: ...}` (or a yaml file in conf/callbacks/) adds
one. Every hook gets the trainer and the task first, as in Lightning. A hook a callback does not override is
never called (`CallbackList` keeps, per hook, only the callbacks that implement it), so an unused hook costs
nothing per step.

State: `state_dict()`/`load_state_dict()` as in Lightning; it is saved in the pickle-free checkpoint under
the callback's config name (tensors and plain values only), and restored on resume before training goes on.

What a callback may do with the trainer: read `global_step`, `current_epoch`, `callback_metrics`,
`is_global_zero`, `run_dir`, `max_steps`, `max_epochs`; ask it to stop with `trainer.request_stop(reason)`
(the loop stops at the next optimizer-step boundary, every rank at the same one, saves `last`, then validates,
tests and writes the summary naming the reason); log a scalar with `trainer.log(name, value)` (a tensor stays
on the device until the next logging step: no host sync).

An exception a hook raises ends the run with one line naming `Class.hook` (a HookError, framework/core/errors.py's
`hook_caller`; its traceback goes to run.log); a UserError raised on purpose is reported as it is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Union

import torch

from framework.core.errors import hook_caller

if TYPE_CHECKING:
    from framework.task.task import Task

log = logging.getLogger(__name__)


# Every hook, in the order a run calls them. Per-step hooks are in STEP_HOOKS.
HOOKS = (
    "setup",
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_test_start",
    "on_test_end",
    "on_train_end",
    "on_fit_end",
    "on_exception",
)
STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_train_batch_end",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)


class Trainer(Protocol):
    """What a callback's `trainer` is (framework/loop/view.py builds it): Lightning's names for where the run is and
    what it holds, and the two ways to act on it."""

    @property
    def global_step(self) -> int: ...
    @property
    def current_epoch(self) -> int: ...
    @property
    def callback_metrics(self) -> dict[str, float]: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def module(self) -> torch.nn.Module: ...
    @property
    def loggers(self) -> list[Any]: ...

    max_epochs: int
    max_steps: int
    log_every_n_steps: int
    param_group_names: list[str]
    run_dir: Path
    optimizer: torch.optim.Optimizer
    datamodule: Any
    logger: Any

    def request_stop(self, reason: str) -> None: ...
    def log(self, name: str, value: Union[float, torch.Tensor]) -> None: ...


class Callback:
    """Override the hooks you need; the others cost nothing."""

    def setup(self, trainer: "Trainer", task: "Task") -> None:
        """Once, when the trainer has built everything, before a resume's state is loaded into it."""

    def on_fit_start(self, trainer: "Trainer", task: "Task") -> None:
        """Once, before the first step (after a resume's state is restored)."""

    def on_train_start(self, trainer: "Trainer", task: "Task") -> None:
        """Once, after on_fit_start, before the first (possibly resumed) training epoch."""

    def on_train_epoch_start(self, trainer: "Trainer", task: "Task") -> None:
        """Before each (possibly resumed) training epoch."""

    def on_train_batch_start(self, trainer: "Trainer", task: "Task", batch: Any, batch_idx: int) -> None:
        """Before each batch's training_step (each micro-batch when accumulating)."""

    def on_before_backward(self, trainer: "Trainer", task: "Task", loss: Any) -> None:
        """Before each batch's backward, with the loss backward is called on."""

    def on_after_backward(self, trainer: "Trainer", task: "Task") -> None:
        """After each batch's backward, before the optimizer step (gradients still scaled under fp16)."""

    def on_train_batch_end(self, trainer: "Trainer", task: "Task", outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each batch's backward (each micro-batch when accumulating), and after the optimizer step when
        that batch completed one. `outputs` is the task's StepOutput."""

    def on_before_optimizer_step(self, trainer: "Trainer", task: "Task", optimizer: torch.optim.Optimizer) -> None:
        """Before each optimizer step, with the true (unscaled, unclipped) gradients."""

    def on_before_zero_grad(self, trainer: "Trainer", task: "Task", optimizer: torch.optim.Optimizer) -> None:
        """Right after each optimizer step, before the gradients are cleared (Lightning clears them later, before
        the next backward: the gradients are the same either way)."""

    def on_train_epoch_end(self, trainer: "Trainer", task: "Task") -> None:
        """After each completed training epoch and its validation, with the epoch's means in callback_metrics
        (Lightning 2's order); current_epoch is still this epoch's."""

    def on_validation_start(self, trainer: "Trainer", task: "Task") -> None:
        """Before each validation (by epoch or by step)."""

    def on_validation_end(self, trainer: "Trainer", task: "Task", metrics: dict[str, float]) -> None:
        """After each validation, with its metrics (reduced over every rank: the same on each)."""

    def on_test_start(self, trainer: "Trainer", task: "Task") -> None:
        """Before the test split is evaluated."""

    def on_test_end(self, trainer: "Trainer", task: "Task", metrics: dict[str, float]) -> None:
        """After the test split is evaluated, with its metrics."""

    def on_train_end(self, trainer: "Trainer", task: "Task") -> None:
        """Once, after the last training step and the final validation, before the test."""

    def on_fit_end(self, trainer: "Trainer", task: "Task") -> None:
        """Once, after training, validation and test (not when the run fails or is stopped by a signal)."""

    def on_exception(self, trainer: "Trainer", task: "Task", exception: BaseException) -> None:
        """When the run ends by an error or a signal; `last` is already saved for a signal."""

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs: tensors and plain values (saved without pickle)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""


def _overrides(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook) is not getattr(Callback, hook)


class CallbackList:
    """The run's callbacks by config name, and per hook the bound methods of those that implement it. `first`
    (the task's own Lightning hooks, framework/callbacks/task_hooks.py) runs before them and has no state.

    Each hook's implementations are called through one `hook_caller`, made once: a callback's exception is a
    HookError naming its class and the hook."""

    def __init__(self, callbacks: dict[str, Callback], first: Optional[Callback] = None) -> None:
        self.callbacks = dict(callbacks)
        every = ([first] if first is not None else []) + list(self.callbacks.values())
        self.hooks: dict[str, list[tuple[str, Callable[..., None]]]] = {
            hook: [(type(cb).__name__, getattr(cb, hook)) for cb in every if _overrides(cb, hook)] for hook in HOOKS
        }
        self._callers = {hook: hook_caller(hook, found) if found else None for hook, found in self.hooks.items()}

    def __iter__(self) -> Iterator[tuple[str, Callback]]:
        return iter(self.callbacks.items())

    def call(self, hook: str, *args: Any) -> None:
        caller = self._callers[hook]
        if caller is not None:
            caller(*args)

    def bound(self, hook: str) -> Optional[Callable[..., None]]:
        """One callable running every implementation of a per-step hook, or None when there is none (the loop
        then skips the call altogether)."""
        return self._callers[hook]

    def state_dict(self) -> dict[str, Any]:
        return {name: cb.state_dict() for name, cb in self.callbacks.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, cb in self.callbacks.items():
            if name in state:
                cb.load_state_dict(state[name])


# ---------------------------------------------------------------------------------------------- built-ins
