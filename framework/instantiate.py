"""Build objects from config nodes by `_target_`, with errors that name the config key and the target.

Hydra's `instantiate` does the building; before calling it we check, for every node in the tree, that the
target imports and that each key is an argument the target accepts, so a typo such as
`+optimizer.momentm=0.9` is reported as that key rather than as a TypeError deep inside a constructor.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import hydra.utils
from hydra.errors import InstantiationException
from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.errors import ConfigError

_RESERVED = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


def locate(target: str, key: str) -> Any:
    """Import a dotted path, or raise a ConfigError naming `key`."""
    try:
        return hydra.utils.get_object(target)
    except Exception as err:  # ImportError, AttributeError, ValueError from Hydra's locator
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{key}._target_={target!r} cannot be imported ({reason}); "
                          "expected a dotted path to a class or function, e.g. torch.nn.Linear") from None


def _parameters(obj: Any) -> dict[str, inspect.Parameter] | None:
    """The named parameters `obj` accepts, or None when it takes **kwargs or has no inspectable signature."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {name: p for name, p in params.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def check(node: Any, key: str, provided: Iterable[str] = (), partial: bool = False) -> None:
    """Check every `_target_` in the tree under `node`: importable, and every key an accepted argument."""
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            check(item, f"{key}[{i}]")
        return
    if not isinstance(node, DictConfig):
        return
    for name in node:
        if name not in _RESERVED:
            check(node._get_node(name), f"{key}.{name}")
    target = node.get("_target_")
    if target is None:
        return
    params = _parameters(locate(target, key))
    if params is None:
        return
    given = {str(name) for name in node if name not in _RESERVED} | set(provided)
    for name in sorted(given - set(params)):
        value = OmegaConf.select(node, name) if name in node else None
        raise ConfigError(f"{key}.{name}={value!r}: {target} has no argument '{name}'; "
                          f"expected one of: {', '.join(params) or '(none)'}")
    if partial or node.get("_partial_", False):
        return
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and name not in given:
            raise ConfigError(f"{key}: {target} needs the argument '{name}'; add it with +{key}.{name}=VALUE")


def build(node: DictConfig, key: str, *, partial: bool = False, provided: Iterable[str] = ()) -> Any:
    """Instantiate `node` (found at config key `key`). With `partial`, return a callable still waiting for
    the arguments named in `provided` (used for objects that need runtime values, e.g. model parameters)."""
    check(node, key, provided=provided, partial=partial)
    try:
        return hydra.utils.instantiate(node, _partial_=partial, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ConfigError(f"{key}: building {node.get('_target_')} failed: {_first_line(cause)}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
