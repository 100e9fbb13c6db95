"""A value as an error line names it: a tensor by its dtype and shape, a batch by its parts, a list as the command
line writes it."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch


def describe(value: Any) -> str:
    """A batch, an output or a loss in a few words for messages: `shape (64, 1, 8, 8) float32`, `a tuple of
    (shape (64,) int64, a list of 64 str)`."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} {dtype_name(value.dtype)}"
    if isinstance(value, (tuple, list)):
        if len(value) <= 4 and not all(isinstance(item, (str, int, float)) for item in value):
            return f"a {type(value).__name__} of ({', '.join(describe(item) for item in value)})"
        kinds = sorted({type(item).__name__ for item in value})
        return f"a {type(value).__name__} of {len(value)} {'/'.join(kinds)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(map(str, value))}"
    return "None" if value is None else f"a {type(value).__name__}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_override(values: Sequence[int]) -> str:
    """A list as typed on the command line (no spaces to quote)."""
    return f"[{','.join(map(str, values))}]"


def type_name(obj: Any) -> str:
    """A loss or metric by name: its class, or its function (also under functools.partial)."""
    function = getattr(obj, "func", obj)
    return getattr(function, "__name__", None) or type(obj).__name__
