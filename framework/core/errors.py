"""The one exception type for user mistakes: the entry point prints its message alone and exits non-zero."""

import os

# Set by framework.app.cli when it asks Hydra to raise (HYDRA_FULL_ERROR=1) only to report errors in our own form.
FORCED_FULL_ERROR = "FRAMEWORK_FORCED_HYDRA_FULL_ERROR"


def full_error() -> bool:
    """Did the user ask for tracebacks (HYDRA_FULL_ERROR=1)?"""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" and os.environ.get(FORCED_FULL_ERROR) != "1"


class UserError(Exception):
    """Something the user can fix (a config value, a missing file, a diverging run); never a bug of ours."""


class ConfigError(UserError):
    """A config value is wrong: the message names the key, the value and what was expected."""


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
