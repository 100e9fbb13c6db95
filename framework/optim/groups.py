"""Optimizer with declarative parameter groups, and the learning-rate scheduler, from `optimizer.*` / `scheduler.*`.

`optimizer.param_groups` is an ordered list of rules; each parameter goes to the first rule it matches
(by name glob, by the type of the module that owns it, or by `ndim`), unmatched ones to the group `default`,
frozen ones nowhere. A rule's other keys override optimizer options, or scale the base value (`lr_mult`,
`decay_mult`). The result is checkable: a table at start and `param_groups.json` in the run directory.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import inspect
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, cast

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from framework.config.instantiate import build, locate
from framework.core.errors import ConfigError

log = logging.getLogger(__name__)

# Every normalization layer with learnable weights; `modules: [framework.optim.groups.NORM_LAYERS]` in a rule.
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
MATCHERS = ("params", "modules", "ndim")
MULTIPLIERS = {"lr_mult": "lr", "decay_mult": "weight_decay"}


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


def parse_rules(rules: Any, optimizer_options: set[str]) -> list[Rule]:
    """Check and convert `optimizer.param_groups`; errors name the rule's index and the key."""
    if rules is None:
        return []
    if not isinstance(rules, (list, ListConfig)):
        raise ConfigError(f"optimizer.param_groups={rules!r}: expected a list of rules")
    parsed, seen = [], set()
    for i, raw in enumerate(rules):
        key = f"optimizer.param_groups[{i}]"
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


def _owners(model: nn.Module) -> dict[str, nn.Module]:
    """Each parameter's name (as in `named_parameters()`) -> the module that directly holds it."""
    return {
        f"{prefix}.{name}" if prefix else name: module
        for prefix, module in model.named_modules()
        for name, _ in module.named_parameters(recurse=False)
    }


def resolve_groups(model: nn.Module, rules: list[Rule], base: dict[str, Any]) -> tuple[list[Group], list[str]]:
    """Assign every trainable parameter to the first matching rule's group; returns (groups, frozen names)."""
    owners = _owners(model)
    groups = []
    for rule in rules:
        options = dict(rule.options)
        for option, mult in rule.multipliers.items():
            options[option] = base.get(option, 0.0) * mult
        groups.append(Group(rule.name, options))
    default = Group("default", {})
    frozen = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            frozen.append(name)
            continue
        target = next((g for g, r in zip(groups, rules) if r.matches(name, param, owners[name])), default)
        target.names.append(name)
        target.params.append(param)
    for group in groups:
        if not group.params:
            log.warning("optimizer.param_groups: rule '%s' matches no trainable parameter", group.name)
    return [g for g in (*groups, default) if g.params], frozen


def build_optimizer(node: DictConfig, model: nn.Module) -> tuple[torch.optim.Optimizer, list[str]]:
    """Any `torch.optim` optimizer by `_target_`, over the groups of `optimizer.param_groups`.

    Returns the optimizer and the names of the frozen parameters it leaves out.
    """
    keys = cast(Iterable[str], node)  # config keys are strings
    options = OmegaConf.masked_copy(node, [k for k in keys if k != "param_groups"])
    factory = build(options, "optimizer", partial=True, provided=("params",))
    signature = inspect.signature(locate(node._target_, "optimizer")).parameters
    rules = parse_rules(node.get("param_groups"), set(signature) - {"params", "self"})
    base = {name: p.default for name, p in signature.items() if p.default is not inspect.Parameter.empty}
    configured = cast(dict[str, Any], OmegaConf.to_container(options, resolve=True))
    base.update({k: v for k, v in configured.items() if not k.startswith("_")})
    groups, frozen = resolve_groups(model, rules, base)
    if not groups:
        raise ConfigError("model: it has no trainable parameters (every requires_grad is False)")
    optimizer = factory([{"params": g.params, "name": g.name, "param_names": g.names, **g.options} for g in groups])
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
    optimizer: torch.optim.Optimizer,
    scheduler: Optional["Scheduler"],
    configured: list[dict[str, Any]],
    changed: set[str],
) -> None:
    """After a restore, make the options the config changed take effect: the restored optimizer state would
    otherwise win. `configured` are the groups as this config built them. A new `lr` rescales what the
    schedule has reached (and what it scales from), so the run goes on along the same curve at the new base.
    The groups' `lr` is what the next step uses; the scheduler's `get_last_lr()` reports the lrs it last computed
    itself until its next step, as after any change torch's documentation leaves to the user."""
    lr_keys = ("lr", "initial_lr", "max_lr", "min_lr")
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
            if scheduler is not None and hasattr(scheduler.scheduler, "base_lrs"):
                scheduler.scheduler.base_lrs[i] = new_base


def group_names(optimizer: torch.optim.Optimizer) -> list[str]:
    return [group.get("name", f"group{i}") for i, group in enumerate(optimizer.param_groups)]


def describe_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
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


def format_groups(optimizer: torch.optim.Optimizer, frozen: list[str]) -> str:
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


# ---------------------------------------------------------------------------------------------- schedulers
# Keys of `scheduler.*` that belong to the trainer, not to the torch scheduler's constructor.
SCHEDULER_KEYS = ("interval", "frequency", "monitor")
# Constructor arguments that mean "the length of the run": given as null in the config, they are filled in.
LENGTH_ARGS = ("T_max", "total_steps", "total_iters")


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """Linear warmup from 0 over `warmup_steps`, then cosine from each group's lr down to `min_lr` at
    `total_steps` (the schedule of transformers' `get_cosine_schedule_with_warmup`, with a floor)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        self.warmup_steps, self.total_steps, self.min_lr = warmup_steps, total_steps, min_lr
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float | torch.Tensor]:
        step = self.last_epoch
        if step < self.warmup_steps:
            return [base * step / self.warmup_steps for base in self.base_lrs]
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return [self.min_lr + (base - self.min_lr) * cosine for base in self.base_lrs]


@dataclass
class Scheduler:
    """A torch LR scheduler plus when the trainer steps it."""

    scheduler: Any
    interval: str  # "step" (after every optimizer step) or "epoch"
    frequency: int
    monitor: Optional[str]  # metric passed to step() (ReduceLROnPlateau); None for the others
    factory: Callable[..., Any]  # rebuilds the same schedule on another optimizer (for the LR plan)
    length: int  # scheduler steps over the whole run

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    # The three moments the loop tells it of; it alone decides whether to step (it is the scheduler's one owner).
    def after_optimizer_step(self, step: int, stepped: bool) -> None:
        """A step scheduler follows the optimizer, and does not advance for a step the GradScaler skipped."""
        if stepped and self.interval == "step" and self.monitor is None and step % self.frequency == 0:
            self.scheduler.step()

    def after_epoch(self, completed_epochs: int) -> None:
        """An unmonitored epoch scheduler: every `frequency` completed epochs."""
        if self.interval == "epoch" and self.monitor is None and completed_epochs % self.frequency == 0:
            self.scheduler.step()

    def after_validation(self, validations: int, metrics: dict[str, float]) -> None:
        """A monitored scheduler (ReduceLROnPlateau): every `frequency` validations, with its metric."""
        if self.monitor is not None and validations % self.frequency == 0:
            self.scheduler.step(metrics[self.monitor])


def run_length(interval: str, frequency: int, max_steps: int, max_epochs: int, steps_per_epoch: int) -> int:
    """How many times the scheduler steps over the run, from the trainer's settings."""
    if interval == "step":
        steps = max_steps if max_steps > 0 else max_epochs * steps_per_epoch
        return steps // frequency
    epochs = max_epochs if max_steps <= 0 else max_steps // steps_per_epoch
    return epochs // frequency


def build_scheduler(
    node: DictConfig, optimizer: torch.optim.Optimizer, *, max_steps: int, max_epochs: int, steps_per_epoch: int
) -> Optional[Scheduler]:
    """`scheduler._target_: null` means a constant learning rate."""
    if node.get("_target_") is None:
        return None
    interval = node.get("interval", "step")
    if interval not in ("step", "epoch"):
        raise ConfigError(f"scheduler.interval={interval!r}: expected 'step' or 'epoch'")
    frequency = node.get("frequency", 1)
    if not isinstance(frequency, int) or frequency < 1:
        raise ConfigError(f"scheduler.frequency={frequency!r}: expected an integer >= 1")
    factory = build(
        OmegaConf.masked_copy(node, [k for k in cast(Iterable[str], node) if k not in SCHEDULER_KEYS]),
        "scheduler",
        partial=True,
        provided=("optimizer",),
    )
    length = run_length(interval, frequency, max_steps, max_epochs, steps_per_epoch)
    filled: dict[str, Any] = {arg: length for arg in LENGTH_ARGS if arg in node and node[arg] is None}
    if "max_lr" in node and node.max_lr is None:  # OneCycleLR: peak at each group's own lr
        filled["max_lr"] = [group["lr"] for group in optimizer.param_groups]
    _warn_if_senseless(node, interval, length)
    make = functools.partial(factory, **filled)
    return Scheduler(make(optimizer), interval, frequency, node.get("monitor"), make, length)


def _warn_if_senseless(node: DictConfig, interval: str, length: int) -> None:
    unit = "optimizer steps" if interval == "step" else "epochs"
    if length < 1:
        log.warning(
            "scheduler: interval=%s, but the run has no whole %s to schedule over (length 0); "
            "the learning rate will not change as planned",
            interval,
            unit,
        )
        return
    warmup = node.get("warmup_steps")
    if warmup is not None and warmup >= length:
        log.warning(
            "scheduler.warmup_steps=%s is not shorter than the run (%d %s): the warmup never ends", warmup, length, unit
        )
    step_size = node.get("step_size")
    milestones = node.get("milestones")
    first_milestone = min(milestones) if isinstance(milestones, ListConfig) and len(milestones) else None
    if (isinstance(step_size, int) and step_size >= length) or (
        isinstance(first_milestone, int) and first_milestone >= length
    ):
        log.warning(
            "scheduler: the first decay comes after the run ends (%d %s): the learning rate never changes", length, unit
        )


def lr_plan(
    scheduler: Scheduler, optimizer: torch.optim.Optimizer, steps_per_epoch: int, max_points: int = 1000
) -> dict[str, list[tuple[int, float]]]:
    """The planned LR of each group over the run, x in optimizer steps, computed on a throw-away optimizer
    with the same groups so the real one is untouched. Empty for metric-driven schedulers."""
    if scheduler.monitor is not None:
        return {}
    # Start from each group's configured lr: constructing the real scheduler may already have changed it.
    dummy_groups = [
        {k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "initial_lr")}
        | {"params": [torch.zeros(1, requires_grad=True)], "lr": g.get("initial_lr", g["lr"])}
        for g in optimizer.param_groups
    ]
    # The concrete class (SGD, AdamW, ...) takes the groups alone; the base Optimizer would also need `defaults`.
    optimizer_class = cast(Callable[..., torch.optim.Optimizer], type(optimizer))
    dummy = optimizer_class(dummy_groups)
    sched = scheduler.factory(dummy)
    names = group_names(dummy)
    unit = scheduler.frequency * (1 if scheduler.interval == "step" else steps_per_epoch)
    every = max(1, scheduler.length // max_points)
    plan: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stepping a scheduler with no optimizer step is the point here
        for i in range(scheduler.length + 1):
            if i % every == 0 or i == scheduler.length:
                for name, group in zip(names, dummy.param_groups):
                    plan[name].append((i * unit, group["lr"]))
            if i < scheduler.length:
                try:
                    sched.step()
                except Exception as err:  # noqa: BLE001  (a value the class accepts but cannot step with)
                    raise ConfigError(
                        f"scheduler: {type(sched).__name__} fails at its step {i + 1} of this run "
                        f"({type(err).__name__}: {err}); expected values it can step with "
                        "(e.g. step_size >= 1)"
                    ) from None
    return plan
