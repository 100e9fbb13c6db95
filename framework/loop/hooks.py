"""Lightning's hooks as the loop reaches them: every callback that implements one (the task's own hooks first,
framework/callbacks/task_hooks.py), called with the run's view and the task, and what the task may log there."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from framework.callbacks.base import CallbackList
from framework.loop.view import RunView
from framework.observe.metric_logger import MetricLogger
from framework.task.task import Task


class Hooks:
    def __init__(self, callbacks: CallbackList, view: RunView, task: Task, metric_logger: MetricLogger) -> None:
        self.callbacks, self.view, self.task, self.metric_logger = callbacks, view, task, metric_logger

    def call(self, hook: str, *args: Any) -> None:
        self.callbacks.call(hook, self.view, self.task, *args)

    def quiet(self, hook: str, *args: Any) -> None:
        """A hook Lightning allows no self.log in (on_fit_start/_end, on_train_end, on_validation_end, on_test_end)."""
        with self.metric_logger.no_logging(hook):
            self.call(hook, *args)

    def epoch(self, hook: str) -> None:
        """A training hook outside any step: what the task logs in it is an epoch value, as in Lightning."""
        with self.metric_logger.epoch_hook():
            self.call(hook)

    def bound(self, hook: str, *leading: Any) -> Optional[Callable[..., None]]:
        """A per-step hook as one callable taking the hook's own arguments, or None where nothing implements it (the
        loop then skips the call altogether). `leading`: arguments after the view and the task (the optimizer)."""
        fn = self.callbacks.bound(hook)
        return functools.partial(fn, self.view, self.task, *leading) if fn is not None else None
