"""An exception in a hook of the user's code (a callback's, the task's Lightning hooks) is a HookError naming
`Class.hook`, the exception its cause; a stop, a framework error and Ctrl-C raised in a hook pass through as they
are (framework/core/errors.py `hook_caller`, framework/callbacks/base.py, framework/callbacks/task_hooks.py)."""
from __future__ import annotations

from typing import Any

import pytest

from framework.callbacks.base import Callback, CallbackList
from framework.callbacks.task_hooks import call_if_defined
from framework.core.errors import HookError, Interrupted, UserError
from framework.task.classification import ClassificationTask

pytestmark = pytest.mark.unit


class BrokenValidationEnd(ClassificationTask):
    def on_validation_epoch_end(self) -> None:
        raise ZeroDivisionError("division by zero")


# ---------------------------------------------------------------------------------------------- the seam
class Stops(Callback):
    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        raise Interrupted(15, "stopped by SIGTERM")


class Refuses(Callback):
    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        raise UserError("monitor: expected val/acc")


class CtrlC(Callback):
    def on_before_zero_grad(self, trainer: Any, task: Any, optimizer: Any) -> None:
        raise KeyboardInterrupt


class Fine(Callback):
    def on_before_zero_grad(self, trainer: Any, task: Any, optimizer: Any) -> None: ...


class Breaks(Callback):
    def on_before_zero_grad(self, trainer: Any, task: Any, optimizer: Any) -> None:
        raise IndexError("list index out of range")


@pytest.mark.unit
def test_a_hooks_exception_becomes_a_hook_error_naming_its_class_with_the_exception_as_cause():
    hooks = CallbackList({"fine": Fine(), "breaks": Breaks()})
    with pytest.raises(HookError, match=r"^Breaks\.on_before_zero_grad raised IndexError: list index") as raised:
        hooks.bound("on_before_zero_grad")(None, None, None)  # the per-step caller the loop holds
    assert isinstance(raised.value.__cause__, IndexError)
    with pytest.raises(HookError, match=r"^BrokenValidationEnd\.on_validation_epoch_end raised ZeroDivision"):
        call_if_defined(BrokenValidationEnd.__new__(BrokenValidationEnd), "on_validation_epoch_end")


@pytest.mark.unit
@pytest.mark.parametrize(("callback", "hook", "passes"), [
    (Stops(), "on_train_epoch_end", Interrupted),
    (Refuses(), "on_train_epoch_end", UserError),
    (CtrlC(), "on_before_zero_grad", KeyboardInterrupt),
])
def test_a_stop_a_framework_error_and_ctrl_c_raised_in_a_hook_pass_through_unchanged(callback, hook, passes):
    hooks = CallbackList({"cb": callback})
    with pytest.raises(passes) as raised:
        hooks.call(hook, None, None, *([None] if hook == "on_before_zero_grad" else []))
    assert type(raised.value) is passes
