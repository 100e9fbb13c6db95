"""Build objects from config nodes by `_target_`, with errors that name the config key and the target.

Hydra's `instantiate` does the building; before calling it we check, for every node in the tree, that the
target imports and that each key is an argument the target accepts, so a typo such as
`+optimizer.momentm=0.9` is reported as that key rather than as a TypeError deep inside a constructor.
A constructor that raises (a dataset whose files are missing, a learning rate of -1) is reported as the
config key of the node that failed, with the values it was given.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import re
import types
import typing
from typing import Any, Callable, Container, Iterable, cast

import hydra.utils
from hydra.errors import InstantiationException
from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.core.errors import ConfigError, UserError, error_line

_RESERVED = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
FULL_ERROR_HINT = "(HYDRA_FULL_ERROR=1 shows the traceback)"
_HYDRA_UTILS_LOG = logging.getLogger("hydra.utils")


def _silent(record: logging.LogRecord) -> bool:
    return False


def import_object(path: str) -> Any:
    """The object a dotted path names, found as `instantiate` finds a `_target_` (Hydra's `get_object`).

    Raises what Hydra's locator raises (ImportError or ValueError; its cause says what is missing). Hydra also
    logs that error, over several lines, before raising it: the caller reports it in one line of its own, so
    that record is not let through (a filter on Hydra's logger for the duration of the call)."""
    _HYDRA_UTILS_LOG.addFilter(_silent)
    try:
        return hydra.utils.get_object(path)
    finally:
        _HYDRA_UTILS_LOG.removeFilter(_silent)


def locate(target: Any, key: str) -> Any:
    """Import a dotted path, or raise a ConfigError naming `key`."""
    if not isinstance(target, str):
        raise ConfigError(
            f"{key}._target_={target!r}: expected a dotted path to a class or function, e.g. torch.nn.Linear"
        )
    try:
        return import_object(target)
    except Exception as err:  # ImportError or ValueError from Hydra's locator; the cause says what is missing
        raise ConfigError(
            f"{key}._target_={target!r} cannot be imported: {error_line(err.__cause__ or err)}; "
            "expected a dotted path to a class or function, e.g. torch.nn.Linear"
        ) from None


def _parameters(obj: Any) -> dict[str, inspect.Parameter] | None:
    """The named parameters `obj` accepts, or None when it takes **kwargs or has no inspectable signature.

    Annotations are evaluated where they can be (modules with `from __future__ import annotations` keep them
    as strings), so that `_check_type` can read them.
    """
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    try:
        signature = inspect.signature(obj, eval_str=True)
    except Exception:  # an annotation naming something not importable at run time: leave them as strings
        pass
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {
        name: p
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def check(node: Any, key: str, provided: Iterable[str] = ()) -> None:
    """Check every `_target_` in the tree under `node`: importable, every key an accepted argument of a plain
    type the target declares, and every required argument set.

    `provided` names the arguments the framework passes itself at call time (e.g. `params` for an optimizer);
    they are not expected in the config, and the target must accept them.
    """
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            check(item, f"{key}[{i}]")
        return
    if not isinstance(node, DictConfig):
        return
    for name in cast(Iterable[int | str], node):  # YAML keys: names, or a number such as `1:`
        if name not in _RESERVED and not (OmegaConf.is_missing(node, name) or OmegaConf.is_interpolation(node, name)):
            check(node[name], f"{key}.{name}")
    target = node.get("_target_")
    if target is None:
        return
    obj = locate(target, key)
    params = _parameters(obj)
    if params is None:
        return
    provided = set(provided)
    unaccepted = sorted(provided - set(params))
    if unaccepted:
        name = unaccepted[0]
        raise ConfigError(
            f"{key}._target_={target!r}: it takes no argument '{name}', which the framework "
            f"passes; expected a class or function with a '{name}' argument"
        )
    partial = node.get("_partial_", False) or "_args_" in node  # the user's own partial, or positional arguments
    missing = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty and name not in node and name not in provided
    ]
    tensors = [name for name in missing if _is_data(params[name])]
    if tensors and not partial and not inspect.isclass(obj):
        raise ConfigError(_function_of_data(node, key, target, obj, tensors))
    _check_given(node, key, target, params, provided)
    if partial or not missing:
        return
    name = missing[0]
    later = ""
    if not inspect.isclass(obj) and params[name].annotation is inspect.Parameter.empty:  # data or config? say both
        later = (
            f", or, if {target} is called later with its '{name}' (a loss or a metric), {_partial_override(node, key)}"
        )
    raise ConfigError(
        f"{key}.{name} is not set: {target} needs the argument '{name}'; "
        f"expected it in the config, e.g. +{key}.{name}=VALUE{later}"
    )


def _check_given(
    node: DictConfig, key: str, target: str, params: dict[str, inspect.Parameter], provided: set[str]
) -> None:
    """Every key the config gives is an argument of the target, of a type it takes, and a number where one is."""
    settable = [name for name in params if name not in provided]
    given = [str(name) for name in node if name not in _RESERVED]
    unknown = sorted(set(given) - set(params))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, settable, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(
            f"{key}.{name}={_raw(node, name)!r}: {target} has no argument '{name}'; "
            f"{hint}expected one of: {', '.join(settable) or '(none)'}"
        )
    for name in given:
        _check_type(node, name, params[name], f"{key}.{name}", target)
        value = node[name]
        if isinstance(value, float) and math.isnan(value):  # no argument means "not a number"
            raise ConfigError(f"{key}.{name}=nan: not a number; expected a number for {target}'s '{name}'")


def _is_data(param: inspect.Parameter) -> bool:
    """An argument a function is called with at run time (a tensor), not one a config would set."""
    annotation = param.annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return re.search(r"\bTensor\b", text) is not None


def _partial_override(node: DictConfig, key: str) -> str:
    return f"{'' if '_partial_' in node else '+'}{key}._partial_=true"


def _function_of_data(node: DictConfig, key: str, target: str, function: Any, missing: list[str]) -> str:
    """`task.loss._target_=torch.nn.functional.nll_loss`: a function of the batch where an object is built."""
    module_class = _module_class(function)
    instead = (
        f"a module class such as {module_class}"
        if module_class is not None
        else "a class whose objects are called with them (e.g. torch.nn.CrossEntropyLoss for a loss)"
    )
    return (
        f"{key}._target_={target!r} is a function of ({', '.join(missing)}), which are tensors given when it is "
        f"called, not config values; expected {_partial_override(node, key)} to call it with them later, "
        f"or {instead}"
    )


def _module_class(function: Any) -> str | None:
    """The torch.nn class doing what a torch.nn.functional function does (nll_loss -> torch.nn.NLLLoss)."""
    if getattr(function, "__module__", None) != "torch.nn.functional":
        return None
    import torch.nn

    wanted = function.__name__.replace("_", "").lower()
    for name in dir(torch.nn):
        if name.lower() in (wanted, wanted + "loss") and inspect.isclass(getattr(torch.nn, name)):
            return f"torch.nn.{name}"
    return None


# Plain annotations we check values against, and the config values each accepts (bool is not a number here).
_ACCEPTS: dict[type, tuple[type, ...]] = {int: (int,), float: (int, float), bool: (bool,)}
_DESCRIBE = {int: "a whole number", float: "a number", bool: "true or false"}


def _check_type(node: DictConfig, name: str, param: inspect.Parameter, key: str, target: str) -> None:
    """`task.loss.label_smoothing=abc` would otherwise fail at the first training step, far from its key."""
    expected = _plain_type(param.annotation)
    if expected is None:
        return
    value = node[name]
    if value is None or (isinstance(value, _ACCEPTS[expected]) and (expected is bool) == isinstance(value, bool)):
        return
    default = param.default
    example = f", e.g. {key}={_override_text(default)}" if isinstance(default, expected) else ""
    raise ConfigError(
        f"{key}={_raw(node, name)!r}: {target} takes '{name}' as {expected.__name__}; "
        f"expected {_DESCRIBE[expected]}{example}"
    )


def _override_text(value: Any) -> str:
    """A value as it is written on the command line (Hydra spells booleans true/false)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _plain_type(annotation: Any) -> type | None:
    """int, float or bool for an annotation that is one of them, optionally Optional; None for anything else."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        others = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        annotation = others[0] if len(others) == 1 else None
    return annotation if annotation in _ACCEPTS else None


def without(node: DictConfig, keys: Container[str]) -> DictConfig:
    """`node` but its `keys`, its interpolations resolved where it sits in the config: a copy detached from its root
    (OmegaConf.masked_copy's) cannot resolve `${task.lr}`."""
    resolved = cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))
    return OmegaConf.create({k: v for k, v in resolved.items() if k not in keys})


def build(node: DictConfig, key: str, *, partial: bool = False, provided: Iterable[str] = ()) -> Any:
    """Instantiate `node` (found at config key `key`). With `partial`, return a callable still waiting for
    the arguments named in `provided` (used for objects that need runtime values, e.g. model parameters)."""
    check(node, key, provided=provided)
    try:
        obj = hydra.utils.instantiate(node, _partial_=partial, _convert_="all")
    except InstantiationException as err:
        if isinstance(err.__cause__, UserError):  # a constructor of ours already said what is wrong
            raise err.__cause__ from None
        raise _failure(node, key, err) from err
    return _reporting_failures(obj, node, key) if partial else obj


def _reporting_failures(factory: Callable[..., Any], node: DictConfig, key: str) -> Callable[..., Any]:
    """Wrap a partial so that the constructor raising at call time is reported like a failed `instantiate`
    (Hydra wraps errors of eager construction, but a partial's call is ours)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return factory(*args, **kwargs)
        except UserError:
            raise
        except Exception as err:
            raise ConfigError(_failure_message(node, key, node.get("_target_"), err)) from err

    return call


def _failure(node: DictConfig, key: str, err: InstantiationException) -> ConfigError:
    """The node that failed may be nested (e.g. `data.train.dataset`): Hydra names it as `full_key: ...`."""
    match = re.search(r"^full_key: (.+)$", str(err), flags=re.MULTILINE)
    failed_key = match.group(1) if match else key
    if not failed_key.startswith(key):  # `node` had no parent (e.g. a masked copy): the key is relative
        failed_key = f"{key}.{failed_key}"
    relative = failed_key[len(key) :].lstrip(".")
    failed = OmegaConf.select(node, relative) if relative else node
    if not isinstance(failed, DictConfig):
        failed = node
    return ConfigError(_failure_message(failed, failed_key, failed.get("_target_"), err.__cause__ or err))


def _failure_message(node: DictConfig, key: str, target: Any, err: BaseException) -> str:
    """`KEY: TARGET(arg=value, ...) raised Error: message`, with the node's plain values (not nested objects)."""
    names = cast(Iterable[str], node)  # a target's argument names
    args = ", ".join(f"{name}={node[name]!r}" for name in names if name not in _RESERVED and _is_plain(node[name]))
    return f"{key}: {target}({args}) raised {error_line(err)}; expected values it accepts {FULL_ERROR_HINT}"


def _is_plain(value: Any) -> bool:
    """A scalar, None, or a list of scalars: short enough to show in a one-line message."""
    if isinstance(value, ListConfig):
        return all(not OmegaConf.is_config(item) for item in value)
    return not isinstance(value, DictConfig)


def _raw(node: DictConfig, name: str) -> Any:
    """`node.name` as the user wrote it (an interpolation stays `${...}`, a missing value `???`), for messages."""
    return cast(dict, OmegaConf.to_container(node, resolve=False))[name]
