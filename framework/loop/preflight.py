"""The check before training: the first train and val batch through the task once, before anything is logged or
trained, so that data of the wrong kind, or a model, loss, step output, metric or monitor that does not fit it,
is one line naming its key (Task.check_batch) instead of a traceback from the first step.

It runs on a throw-away copy of the task sharing the plain module (the task's metrics, buffers and logs never
see it: unlike Lightning's sanity check, a MaxMetric kept for a best-so-far cannot see a training batch), in eval
mode, without grad, and with the RNG state put back, so training starts exactly as it would without it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from framework.callbacks import task_hooks
from framework.checkpoint.state import TaskState
from framework.core import reproducibility
from framework.core.errors import ConfigError
from framework.loop.evaluate import Evaluator, move_to
from framework.observe.best import Best
from framework.observe.logged import as_tensor, stage_name
from framework.task.task import STEPS, StepOutput, Task, step_function, swapped, throwaway_copy

log = logging.getLogger(__name__)


class _Anything:
    """Takes any call and does nothing: the check's TensorBoard writer (a step that logs an image works)."""

    def __getattr__(self, _name: str) -> Any:
        return lambda *args, **kwargs: None


class _QuietLogger:
    experiment = _Anything()


class _NoStep:
    """An optimizer as the check's manual step gets it: nothing is zeroed or stepped."""

    param_groups: list[dict[str, Any]] = []

    def step(self, closure: Any = None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class NoSteps:
    """Manual optimization's calls during the check (under no_grad): none back-propagates, toggles or steps, as many
    optimizers and schedules as the run's."""

    def __init__(self, optimizers: int, schedules: int) -> None:
        self._optimizers = [_NoStep() for _ in range(optimizers)]
        self._schedules = [_NoStep() for _ in range(schedules)]

    def optimizers(self) -> Any:
        return self._optimizers[0] if len(self._optimizers) == 1 else list(self._optimizers)

    def lr_schedulers(self, schedule: Any = None) -> Any:
        if not self._schedules:
            return None
        return self._schedules[0] if len(self._schedules) == 1 else list(self._schedules)

    def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def toggle(self, optimizer: Any) -> None:
        pass

    def untoggle(self, optimizer: Any) -> None:
        pass

    def clip(self, optimizer: Any, clip_val: Any, algorithm: Any) -> None:
        pass


class CheckHandle:
    """What the task's `trainer` is during the check: its logs are names only, kept to check the monitors
    against, and the directions they declare (`best`: the run's, where a direction that disagrees with another
    is refused before training); its logger writes nothing."""

    logger = _QuietLogger()
    global_step = 0
    current_epoch = 0

    scheduler = None

    def __init__(self, is_global_zero: bool, best: Best, optimizers: int = 1, schedules: int = 0) -> None:
        self.stage, self.is_global_zero, self.best = "train", is_global_zero, best
        self.set_suffix = ""  # "/<set>" while a batch of a set other than the default one is checked
        self.callback_metrics: dict[str, float] = {}
        self.names: list[str] = []
        self.task_optimizers = NoSteps(optimizers, schedules)  # a manual step's forward runs; nothing is stepped

    def checking(self, stage: str, set_name: str = "") -> None:
        """What the next batches are: `stage`'s, of its set `set_name` ("" the default one)."""
        self.stage, self.set_suffix = stage, f"/{set_name}" if set_name else ""

    def log_from_task(
        self, name: str, value: Any, best: Optional[str] = None, add_dataloader_idx: bool = True, **_options: Any
    ) -> None:
        as_tensor(name, value)  # a value of the wrong kind is refused here, before training
        name = stage_name(name, self.stage) + (self.set_suffix if add_dataloader_idx else "")
        self.best.declare_logged(name, value, best)
        if self.stage == "val":
            self.names.append(name)


def check_first_batches(
    task: Task,
    model_attr: str,
    evaluator: Evaluator,
    monitors: dict[str, str],
    splits: tuple[str, ...] = ("train", "val"),
) -> list[str]:
    """Run the check on the first batch of each of `splits` (a test stage checks its own); returns the validation
    metric names the first val batch showed (for TensorBoard's layout). A monitor naming none of them is refused
    now when nothing else could log it (the task has no
    on_validation_epoch_end); otherwise the first validation round decides."""
    strategy, rng = evaluator.strategy, reproducibility.rng_state()
    plain = strategy.unwrap(evaluator.model)
    run = task.trainer  # the run's view (its optimizers and schedules, for a manual step's count of them)
    schedules = run.task_optimizers.lr_schedulers(run.scheduler) if run is not None else None
    counts = (len(run.optimizers), len(schedules) if isinstance(schedules, list) else int(schedules is not None))
    handle = CheckHandle(strategy.is_rank_zero, evaluator.metric_logger.best, *(counts if run is not None else (1, 0)))
    with swapped(task, model_attr, plain):
        try:
            shadow = throwaway_copy(task, plain, handle)
        except Exception as err:  # noqa: BLE001  (a task holding a lock or a file: checked in place)
            if strategy.is_rank_zero:
                log.warning(
                    "The task cannot be copied for the check of its first batches (%s: %s): it is checked in "
                    "place; its metrics and buffers are put back after, its other attributes may keep a trace",
                    type(err).__name__,
                    err,
                )
            kept = TaskState(task, model_attr, strategy)
            saved = kept.local(hooks=False)
            try:
                with swapped(task, "trainer", handle):
                    return _check(task, task, handle, evaluator, monitors, splits)
            finally:
                kept.load_state_dict({"rank0": saved}, hooks=False)
                task.train()
                reproducibility.set_rng_state(rng)
        try:
            return _check(task, shadow, handle, evaluator, monitors, splits)
        finally:
            task.train()
            reproducibility.set_rng_state(rng)


def _check(
    task: Task,
    shadow: Task,
    handle: CheckHandle,
    evaluator: Evaluator,
    monitors: dict[str, str],
    splits: tuple[str, ...],
) -> list[str]:
    """The first batch of each set of each split through `shadow` (the task's throw-away copy, or the task itself)."""
    data = evaluator.data
    shadow.eval()
    names: list[str] = []
    for split in splits:
        handle.checking(split)
        sets = data.sets(split) if split != "train" else {"train": ""}
        shown = 0  # sets whose first batch this rank has: with all of them, the names are all there are
        for index, (key, set_name) in enumerate(sets.items()):
            handle.checking(split, set_name)
            out, seen = _check_set(shadow, evaluator, split, key, index if len(sets) > 1 else None)
            shown += seen
            if split == "val":
                names += [*_val_names(out, handle), *_epoch_names(shadow, handle)]
        handle.checking(split)
        if split == "val":
            if shown == len(sets):
                _check_monitors(task, monitors, names, list(sets.values()))
    return list(dict.fromkeys(names))


def _check_set(
    shadow: Task, evaluator: Evaluator, split: str, key: str, index: Optional[int]
) -> tuple[Optional[StepOutput], bool]:
    """The first batch of one set (`key`: its split in the DataModule; `index`: its dataloader_idx, or None) through
    the step of `split`: its output, and whether this rank had a batch."""
    data = evaluator.data
    batch = data.first_batch(key) if data.has(key) else None
    if batch is None:
        if data.has(key) and evaluator.strategy.collective_forward:  # this rank's shard is empty
            step = step_function(shadow, STEPS[split])
            evaluator.idle_step(step if index is None else lambda b, i: step(b, i, index), None)  # type: ignore[call-arg]
        return None, False
    index_given = {} if index is None else {"dataloader_idx": index}  # (a check_batch of a task's own may take none)
    with torch.no_grad(), evaluator.precision.autocast():
        out = shadow.check_batch(
            move_to(batch, evaluator.device),
            split,
            input_shape=data.input_shape,
            num_classes=data.num_classes,
            **index_given,
        )
    return out, True


def _val_names(out: Optional[StepOutput], handle: CheckHandle) -> list[str]:
    """The names a set's first val batch shows (its loss declared lower-is-better, unless the task logs it)."""
    loss = f"val/loss{handle.set_suffix}"
    if out is not None and loss not in handle.names:  # (a val/loss the task logs is its own)
        handle.best.declare_loss(loss, "validation_step")
    return [
        *([loss] if out is not None else []),
        *(f"val/{n}{handle.set_suffix}" for n in (out.metrics if out else {})),
        *handle.names,
    ]


def _epoch_names(shadow: Task, handle: CheckHandle) -> list[str]:
    """What `epoch_metrics` computes after a set's batches; the directions its Metrics declare."""
    epoch = shadow.epoch_metrics("val")  # (on a rank with no batch too: synchronised over the ranks, as theirs)
    for name, value in epoch.items():
        handle.best.declare_metric(f"val/{name}{handle.set_suffix}", value)
    return [f"val/{name}{handle.set_suffix}" for name in epoch]


def _check_monitors(task: Task, monitors: dict[str, str], names: list[str], sets: list[str]) -> None:
    if task_hooks.defines(task, "on_validation_epoch_end"):  # (Lightning allows no self.log in on_validation_end)
        return
    for key, monitor in monitors.items():
        if monitor not in names:
            raise ConfigError(f"{key}={monitor!r}: no such metric; expected one of {shown_names(names, sets)}")


def shown_names(names: list[str], sets: list[str]) -> str:
    """The metric names a monitor may name, and where the split has several sets, their names (docs/logging.md)."""
    shown = ", ".join(dict.fromkeys(names))
    if len(sets) > 1:
        named = ", ".join(f"/{name}" for name in sets if name)
        shown += f" (the default set's names have no suffix; the other sets' end in {named})"
    return shown
