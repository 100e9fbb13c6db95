"""The one exception type for user mistakes: the entry point prints its message alone and exits non-zero."""


class UserError(Exception):
    """Something the user can fix (a config value, a missing file, a diverging run); never a bug of ours."""


class ConfigError(UserError):
    """A config value is wrong: the message names the key, the value and what was expected."""
