"""The one exception type for user mistakes: the entry point prints its message alone and exits non-zero. And the
one place a hook of the user's code is called (`hook_caller`), where an exception it raises becomes one of them."""

import os
from typing import Any, Callable

# Set by framework.app.cli when it asks Hydra to raise (HYDRA_FULL_ERROR=1) only to report errors in our own form.
FORCED_FULL_ERROR = "FRAMEWORK_FORCED_HYDRA_FULL_ERROR"


def full_error() -> bool:
    """Did the user ask for tracebacks (HYDRA_FULL_ERROR=1)?"""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" and os.environ.get(FORCED_FULL_ERROR) != "1"


class UserError(Exception):
    """Something the user can fix (a config value, a missing file, a diverging run); never a bug of ours."""


class ConfigError(UserError):
    """A config value is wrong: the message names the key, the value and what was expected."""


class TrainingFailed(UserError):
    """A user's mistake found once this attempt had trained (a loss gone NaN, data files gone mid-epoch): the run
    failed, and is recorded so (summary.json `failed`); its line says which command goes on once it is fixed. The
    mistake is kept as `__cause__`."""


class HookError(UserError):
    """A hook of the user's code (a callback's, or one of the task's Lightning hooks) raised: the message names
    `Class.hook` and the exception, which is kept as `__cause__` (its traceback goes to run.log, not the console)."""


def hook_caller(hook: str, found: list[tuple[str, Callable[..., Any]]]) -> Callable[..., None]:
    """One callable running each `(owner, fn)` of `found` in order, `owner` the class an error names: how every hook
    of the user's code is called (callbacks, the task's Lightning hooks, its checkpoint hooks). An exception a hook
    raises becomes a HookError, `Owner.hook raised Type: message`, the exception its cause; a framework error it
    raises deliberately (a UserError: a stop on a signal, a refusal) and KeyboardInterrupt pass through as they
    are. The try costs nothing until a hook raises, so per-step hooks are called through it too."""

    def every(*args: Any) -> None:
        for owner, fn in found:
            try:
                fn(*args)
            except UserError:
                raise
            except Exception as err:
                raise HookError(f"{owner}.{hook} raised {error_line(err)}") from err

    return every


class Interrupted(UserError):
    """The run stopped on a signal after saving `last`; the app exits with 128 + the signal number."""

    def __init__(self, signum: int, message: str, previous_handler: object = None) -> None:
        super().__init__(message)
        self.signum = signum
        self.previous_handler = previous_handler  # the signal's handler before the run's (submitit's, say)


def os_error_line(err: OSError) -> str:
    """An OSError as a user reads it (a full disk, a folder that cannot be written): the file, what went wrong,
    what would fix it."""
    where = f"{err.filename}: " if err.filename else ""
    return f"{where}{err.strerror or err}; expected a file system with free space and write permission there"


def error_line(err: BaseException) -> str:
    """`Type: message` in one line, for messages that report an exception; for an error a DataLoader worker
    re-raised, whose first line only says so, the worker's own last line."""
    text = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if len(text) > 1 and "Original Traceback" in str(err):
        return text[-1]
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
