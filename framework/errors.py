"""The one exception type for user mistakes: the entry point prints its message alone and exits non-zero."""


class UserError(Exception):
    """Something the user can fix (a config value, a missing file, a diverging run); never a bug of ours."""


class ConfigError(UserError):
    """A config value is wrong: the message names the key, the value and what was expected."""


class Interrupted(UserError):
    """The run stopped on a signal after saving `last`; the app exits with 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
