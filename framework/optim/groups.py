"""The optimizer, with declarative parameter groups, from `optimizer.*`.

`optimizer.param_groups` is an ordered list of rules; each parameter goes to the first rule it matches
(by name glob, by the type of the module that owns it, or by `ndim`), unmatched ones to the group `default`,
frozen ones nowhere. A rule's other keys override optimizer options, or scale the base value (`lr_mult`,
`decay_mult`). The result is checkable: a table at start and `param_groups.json` in the run directory.
"""

from __future__ import annotations

import fnmatch
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union, cast

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from framework.config.instantiate import build, locate, without
from framework.core.errors import ConfigError

log = logging.getLogger(__name__)


# Every normalization layer with learnable weights; `modules: [framework.optim.NORM_LAYERS]` in a rule.
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
MATCHERS = ("params", "modules", "ndim")
MULTIPLIERS = {"lr_mult": "lr", "decay_mult": "weight_decay"}


class HasGroups(Protocol):
    """An optimizer, or the run's several (framework/optim/optimizers.py): what the group tables read."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


# ---------------------------------------------------------------------------------------------- groups
@dataclass
class Rule:
    name: str
    patterns: list[str] = field(default_factory=list)
    module_types: tuple[type, ...] = ()
    ndims: list[int] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    multipliers: dict[str, float] = field(default_factory=dict)

    def matches(self, name: str, param: nn.Parameter, owner: nn.Module) -> bool:
        """Any of the rule's matchers (a name glob, the owning module's type, the tensor's ndim)."""
        return (
            any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
            or (bool(self.module_types) and isinstance(owner, self.module_types))
            or param.ndim in self.ndims
        )


@dataclass
class Named:
    """A trainable parameter, by the name rules match it with, with the module that directly holds it."""

    name: str
    param: nn.Parameter
    owner: nn.Module


@dataclass
class Group:
    name: str
    options: dict[str, Any]
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]


def _module_types(value: Any, key: str) -> tuple[type, ...]:
    types: list[type] = []
    for i, path in enumerate(_as_list(value)):
        obj = locate(str(path), f"{key}[{i}]") if isinstance(path, str) else path
        found = obj if isinstance(obj, tuple) else (obj,)
        if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in found):
            raise ConfigError(f"{key}[{i}]={path!r}: expected an nn.Module class such as torch.nn.LayerNorm")
        types.extend(found)
    return tuple(types)


def parse_rules(rules: Any, optimizer_options: set[str], at: str = "optimizer") -> list[Rule]:
    """Check and convert `optimizer.param_groups`; errors name the rule's index and the key."""
    if rules is None:
        return []
    if not isinstance(rules, (list, ListConfig)):
        raise ConfigError(f"{at}.param_groups={rules!r}: expected a list of rules")
    parsed, seen = [], set()
    for i, raw in enumerate(rules):
        key = f"{at}.param_groups[{i}]"
        if not isinstance(raw, (dict, DictConfig)):
            raise ConfigError(f"{key}={raw!r}: expected a mapping with a name, a matcher and overrides")
        raw = (
            cast(dict[str, Any], OmegaConf.to_container(raw, resolve=True))
            if isinstance(raw, DictConfig)
            else dict(raw)
        )
        name = raw.pop("name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}.name={name!r}: expected a non-empty group name")
        if name in seen or name == "default":
            raise ConfigError(f"{key}.name={name!r}: expected a unique name other than 'default'")
        seen.add(name)
        rule = Rule(name)
        rule.patterns = [str(p) for p in _as_list(raw.pop("params", None))]
        rule.module_types = _module_types(raw.pop("modules", None), f"{key}.modules")
        rule.ndims = _as_list(raw.pop("ndim", None))
        if not all(isinstance(n, int) for n in rule.ndims):
            raise ConfigError(f"{key}.ndim={rule.ndims!r}: expected an integer or a list of integers")
        if not (rule.patterns or rule.module_types or rule.ndims):
            raise ConfigError(f"{key}: rule '{name}' has no matcher; expected at least one of {', '.join(MATCHERS)}")
        for option, value in raw.items():
            if option in MULTIPLIERS:
                if MULTIPLIERS[option] in raw:
                    raise ConfigError(f"{key}.{option}: give either {option} or {MULTIPLIERS[option]}, not both")
                if not isinstance(value, (int, float)) or value < 0:
                    raise ConfigError(f"{key}.{option}={value!r}: expected a non-negative number")
                rule.multipliers[MULTIPLIERS[option]] = float(value)
            elif option in optimizer_options:
                rule.options[option] = tuple(value) if isinstance(value, list) else value
            else:
                raise ConfigError(
                    f"{key}.{option}={value!r}: not a matcher ({', '.join(MATCHERS)}), a "
                    f"multiplier (lr_mult, decay_mult) or an option of the optimizer "
                    f"({', '.join(sorted(optimizer_options))})"
                )
        parsed.append(rule)
    return parsed


def resolve_groups(params: list[Named], rules: list[Rule], base: dict[str, Any]) -> tuple[list[Group], list[str]]:
    """Assign every trainable parameter to the first matching rule's group; returns (groups, frozen names)."""
    groups = []
    for rule in rules:
        options = dict(rule.options)
        for option, mult in rule.multipliers.items():
            options[option] = base.get(option, 0.0) * mult
        groups.append(Group(rule.name, options))
    default = Group("default", {})
    frozen = []
    for named in params:
        name, param = named.name, named.param
        if not param.requires_grad:
            frozen.append(name)
            continue
        target = next((g for g, r in zip(groups, rules) if r.matches(name, param, named.owner)), default)
        target.names.append(name)
        target.params.append(param)
    for group in groups:
        if not group.params:
            log.warning("optimizer.param_groups: rule '%s' matches no trainable parameter", group.name)
    return [g for g in (*groups, default) if g.params], frozen


def named_in(module: nn.Module, prefix: str = "") -> list[Named]:
    """A module's parameters (trainable or not) by `prefix` + their name in it, with their owning modules."""
    owners = {
        f"{path}.{name}" if path else name: owner
        for path, owner in module.named_modules()
        for name, _ in owner.named_parameters(recurse=False)
    }
    return [Named(prefix + name, p, owners[name]) for name, p in module.named_parameters()]


def build_optimizer(
    node: DictConfig, params: Union[nn.Module, list[Named]], key: str = "optimizer", group_prefix: str = ""
) -> tuple[torch.optim.Optimizer, list[str]]:
    """Any `torch.optim` optimizer by `_target_` (the node at `key`), over `params` (a module's, or those given),
    in the groups of its `param_groups` rules, each named `group_prefix + <rule name>`. Returns the optimizer and
    the names of the frozen parameters it leaves out."""
    params = named_in(params) if isinstance(params, nn.Module) else params
    options = without(node, ("param_groups",))
    factory = build(options, key, partial=True, provided=("params",))
    signature = inspect.signature(locate(node._target_, key)).parameters
    rules = parse_rules(node.get("param_groups"), set(signature) - {"params", "self"}, key)
    base = {name: p.default for name, p in signature.items() if p.default is not inspect.Parameter.empty}
    configured = cast(dict[str, Any], OmegaConf.to_container(options, resolve=True))
    base.update({k: v for k, v in configured.items() if not k.startswith("_")})
    groups, frozen = resolve_groups(params, rules, base)
    if not groups:
        what = "model" if key == "optimizer" else f"{key}.owns"
        raise ConfigError(f"{what}: it has no trainable parameters (every requires_grad is False)")
    optimizer = factory(
        [{"params": g.params, "name": group_prefix + g.name, "param_names": g.names, **g.options} for g in groups]
    )
    return optimizer, frozen


# Per-parameter state that torch's optimizers keep in the parameter's own shape (SGD, Adam(W), RMSprop,
# Adagrad, Adadelta, ASGD, Rprop, NAdam, RAdam, Adamax): a saved one of another shape is not this model's.
PARAM_SHAPED_STATE = {
    "momentum_buffer",
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "square_avg",
    "acc_delta",
    "sum",
    "grad_avg",
    "ax",
    "prev",
    "step_size",
    "exp_inf",
}


def check_optimizer_state(saved: dict[str, Any], optimizer: torch.optim.Optimizer, where: str) -> Optional[str]:
    """What is wrong with a saved optimizer state's per-parameter tensors for `optimizer`'s parameters (a fresh
    optimizer has none to compare with), or None."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in (saved.get("state") or {}).items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entry, dict):
            return f"{where}/state/{index}: no parameter {index} in this run's {len(params)}"
        for name, value in entry.items():
            if (
                name in PARAM_SHAPED_STATE
                and isinstance(value, torch.Tensor)
                and value.dim() > 0
                and value.shape != params[index].shape
            ):
                return (
                    f"{where}/state/{index}/{name}: the checkpoint holds shape {tuple(value.shape)}, expected "
                    f"{tuple(params[index].shape)} as the parameter it is for"
                )
    return None


def changed_options(saved: dict[str, Any], current: DictConfig) -> set[str]:
    """The optimizer options this config sets differently from the run's saved one (`{"*"}`: the parameter
    group rules changed, so every option may have)."""
    now = cast(dict[str, Any], OmegaConf.to_container(current, resolve=True))
    if now.get("param_groups") != saved.get("param_groups"):
        return {"*"}
    return {k for k in set(now) | set(saved) if k not in ("_target_", "param_groups") and now.get(k) != saved.get(k)}


def apply_changed_options(
    optimizer: torch.optim.Optimizer, configured: list[dict[str, Any]], changed: set[str]
) -> dict[int, float]:
    """After a restore, make the options the config changed take effect: the restored optimizer state would
    otherwise win. `configured` are the groups as this config built them. A new `lr` rescales what the
    schedule has reached (and what it scales from), so the run goes on along the same curve at the new base.
    Returns each rebased group's new base lr, for the scheduler (`Scheduler.rebase`). The groups' `lr` is what the
    next step uses; the scheduler's `get_last_lr()` reports the lrs it last computed itself until its next step, as
    after any change torch's documentation leaves to the user."""
    lr_keys = ("lr", "initial_lr", "max_lr", "min_lr")
    rebased: dict[int, float] = {}
    for i, (group, fresh) in enumerate(zip(optimizer.param_groups, configured)):
        keys = set(fresh) - {"params", "param_names", "name", "initial_lr"} if "*" in changed else changed
        for key in keys & set(fresh):
            if key != "lr":
                group[key] = fresh[key]
                continue
            new_base = fresh.get("initial_lr", fresh["lr"])
            old_base = group.get("initial_lr", group["lr"])
            ratio = new_base / old_base if old_base else None
            for name in lr_keys:
                if name in group:
                    group[name] = group[name] * ratio if ratio is not None else new_base
            if "initial_lr" in group:
                group["initial_lr"] = new_base
            rebased[i] = new_base
    return rebased


def group_names(optimizer: HasGroups) -> list[str]:
    return [group.get("name", f"group{i}") for i, group in enumerate(optimizer.param_groups)]


def describe_groups(optimizer: HasGroups) -> list[dict[str, Any]]:
    """The resolved groups as written to `param_groups.json`: name, lr, weight_decay, every option, params."""
    described = []
    for group in optimizer.param_groups:
        options = {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in group.items()
            if k not in ("params", "param_names", "name", "initial_lr") and _is_plain(v)
        }
        options["lr"] = group.get("initial_lr", group["lr"])  # as configured, before any schedule
        described.append(
            {
                "name": group["name"],
                "lr": options.pop("lr"),
                "weight_decay": options.pop("weight_decay", None),
                **options,
                "params": list(group["param_names"]),
            }
        )
    return described


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, tuple, list))


def format_groups(optimizer: HasGroups, frozen: list[str]) -> str:
    """The table printed at start: group, tensors, elements, lr, weight_decay, first few names."""
    rows = [("group", "tensors", "elements", "lr", "weight_decay", "parameters")]
    for group in optimizer.param_groups:
        names = group["param_names"]
        shown = ", ".join(names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
        rows.append(
            (
                group["name"],
                str(len(group["params"])),
                f"{sum(p.numel() for p in group['params']):,}",
                f"{group.get('initial_lr', group['lr']):.4g}",
                f"{group.get('weight_decay', 0):.4g}",
                shown,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    if frozen:
        lines.append(
            f"frozen (not optimized): {len(frozen)} tensors: {', '.join(frozen[:5])}"
            + (", ..." if len(frozen) > 5 else "")
        )
    return "\n".join(lines)
