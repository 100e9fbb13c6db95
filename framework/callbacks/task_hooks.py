"""A task's Lightning hooks: each one a task defines is called where Lightning calls it, or refused at start.

The hooks run through the callbacks' machinery: `task_callback(task)` is a `Callback` whose methods call the
task's own, built with only the hooks the task overrides, so a hook nobody defines costs nothing per step.
The task's hooks run before the configured callbacks'. What a task logs in `on_validation_epoch_end` (part of the
validation) or `on_train_epoch_end` (an epoch value) is there for early stopping and checkpoints; as in Lightning,
`on_validation_end` is for side effects, not `self.log`. The trainer calls the evaluation's epoch hooks
(`on_validation_epoch_start`/`_end`, `on_test_epoch_start`/`_end`) itself, between the batches and the
computation of what was logged, and `on_save_checkpoint`/`on_load_checkpoint` go through the task's registered
state (framework/checkpoint/state.py).

A Lightning hook whose job a config group does here is refused with one line naming what replaces it; a name
the framework neither calls nor knows is the task's own business and is left alone.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from framework.callbacks.base import Callback
from framework.core.errors import ConfigError, hook_caller

# LightningModule methods the loop does not call, and what does their job here.
REPLACED = {
    "configure_optimizers": "the optimizer and scheduler config groups (optimizer=..., scheduler=..., "
    "optimizer.param_groups for per-group options; several: optimizer.<name>.owns, docs/optimization.md)",
    "configure_callbacks": "the callbacks config group (+callbacks.NAME={_target_: ...})",
    "configure_gradient_clipping": "trainer.grad_clip_norm or trainer.grad_clip_value",
    "configure_model": "the model config group (parallel=fsdp shards it)",
    "configure_sharded_model": "the model config group (parallel=fsdp shards it)",
    "prepare_data": "the data config group (a framework.data.module.DataModule)",
    "train_dataloader": "the data config group (data.train)",
    "val_dataloader": "the data config group (data.val)",
    "test_dataloader": "the data config group (data.test)",
    "predict_dataloader": "python run.py predict with +data.predict=<a dataset node> (or the test split)",
    "transfer_batch_to_device": "none: the loop moves every tensor of a batch to the device",
    "on_before_batch_transfer": "data.collate_fn (or the dataset's transform)",
    "on_after_batch_transfer": "data.collate_fn (or the dataset's transform)",
    "optimizer_step": "none: the loop steps the optimizer; a callback's on_before_optimizer_step sees each step",
    "optimizer_zero_grad": "none: the loop clears the gradients; on_before_zero_grad sees each step",
    "lr_scheduler_step": "the scheduler config group (scheduler.interval, frequency, monitor)",
    "backward": "none: the loop calls backward (precision= picks the loss scaling)",
    "training_step_end": "return the loss from training_step (Lightning 2 removed training_step_end)",
    "validation_step_end": "self.log in validation_step (Lightning 2 removed validation_step_end)",
    "test_step_end": "self.log in test_step (Lightning 2 removed test_step_end)",
    "training_epoch_end": "on_train_epoch_end (Lightning 2 renamed training_epoch_end)",
    "validation_epoch_end": "on_validation_epoch_end (Lightning 2 renamed validation_epoch_end)",
    "test_epoch_end": "on_test_epoch_end (Lightning 2 renamed test_epoch_end)",
}

# Callback hook -> the task's hook it calls, and how the callback's arguments become the task's.
_CALLED: dict[str, tuple[str, Callable[..., tuple]]] = {
    "on_fit_start": ("on_fit_start", lambda: ()),
    "on_train_start": ("on_train_start", lambda: ()),
    "on_train_epoch_start": ("on_train_epoch_start", lambda: ()),
    "on_train_batch_start": ("on_train_batch_start", lambda batch, batch_idx: (batch, batch_idx)),
    "on_before_backward": ("on_before_backward", lambda loss: (loss,)),
    "on_after_backward": ("on_after_backward", lambda: ()),
    "on_before_optimizer_step": ("on_before_optimizer_step", lambda optimizer: (optimizer,)),
    "on_before_zero_grad": ("on_before_zero_grad", lambda optimizer: (optimizer,)),
    "on_train_batch_end": ("on_train_batch_end", lambda outputs, batch, batch_idx: (outputs, batch, batch_idx)),
    "on_train_epoch_end": ("on_train_epoch_end", lambda: ()),
    "on_validation_start": ("on_validation_start", lambda: ()),
    "on_validation_end": ("on_validation_end", lambda metrics: ()),
    "on_test_start": ("on_test_start", lambda: ()),
    "on_test_end": ("on_test_end", lambda metrics: ()),
    "on_train_end": ("on_train_end", lambda: ()),
    "on_fit_end": ("on_fit_end", lambda: ()),
    "on_exception": ("on_exception", lambda exception: (exception,)),
}
# Called by the trainer itself: setup("fit") once the task is built, before the model is placed, compiled or wrapped
# (as Lightning does, so parameters made there are trained); evaluation's epoch hooks; checkpoint hooks.
_OTHERS = (
    "setup",
    "teardown",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
)
CALLED = tuple(sorted({name for name, _ in _CALLED.values()} | set(_OTHERS)))


def defines(task: Any, name: str) -> bool:
    """Whether the task's class (not framework.task.task.Task) defines `name`."""
    from framework.task.task import Task

    return callable(getattr(type(task), name, None)) and getattr(type(task), name) is not getattr(Task, name, None)


def refuse_replaced(task: Any) -> None:
    """One line for the first Lightning hook the task defines whose job a config group does here."""
    for name, instead in REPLACED.items():
        if defines(task, name):
            raise ConfigError(
                f"task: {type(task).__name__}.{name} is Lightning's, and this framework does not call "
                f"it; expected it removed, and instead {instead}"
            )


def task_callback(task: Any) -> Optional[Callback]:
    """A Callback calling each Lightning hook the task defines, or None when it defines none. Its class has the
    task's class name: an error in `on_train_epoch_end` names `MyTask.on_train_epoch_end`."""
    methods: dict[str, Callable[..., None]] = {}
    for hook, (name, convert) in _CALLED.items():
        if defines(task, name):
            methods[hook] = _caller(name, convert)
    if not methods:
        return None
    return type(type(task).__name__, (Callback,), methods)()


def _caller(name: str, convert: Callable[..., tuple]) -> Callable[..., None]:
    def call(self: Callback, trainer: Any, task: Any, *args: Any) -> None:
        getattr(task, name)(*convert(*args))

    call.__name__ = name
    return call


def call_if_defined(task: Any, name: str, *args: Any) -> None:
    """A hook the trainer calls itself (setup, an evaluation's epoch hooks, teardown), when the task defines it; an
    exception it raises is a HookError naming `MyTask.name` (framework/core/errors.py's `hook_caller`)."""
    hook = bound_if_defined(task, name)
    if hook is not None:
        hook(*args)


def bound_if_defined(task: Any, name: str) -> Optional[Callable[..., None]]:
    """The task's hook `name` as one callable (an evaluation's per-batch hooks: bound once per evaluation), its
    exceptions HookErrors; None when the task does not define it."""
    if not defines(task, name):
        return None
    return hook_caller(name, [(type(task).__name__, getattr(task, name))])
