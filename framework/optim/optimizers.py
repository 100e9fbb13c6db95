"""The run's optimizers, from the `optimizer` group: one (`optimizer._target_`, today's shape) that trains every
trainable parameter of the task, or several named ones, each owning the task submodules it names:

    optimizer:
      generator:     {_target_: torch.optim.Adam, lr: 2.0e-4, betas: [0.5, 0.999], owns: [generator]}
      discriminator: {_target_: torch.optim.Adam, lr: 2.0e-4, betas: [0.5, 0.999], owns: [discriminator]}

Every trainable parameter is owned by exactly one optimizer, or the run is refused before its first step in one
line naming what is left over (or owned twice). Each optimizer may have its own `param_groups` rules
(framework/optim/groups.py) and its own `scheduler` node (a `scheduler` group's config), which
`Task.lr_schedulers()` returns. `Task.optimizers()` returns them in config order, as Lightning's does.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Union, cast

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.config.instantiate import without
from framework.core.errors import ConfigError
from framework.optim.groups import Named, build_optimizer, named_in

# A named optimizer's own keys, beside its optimizer's options.
OWN_KEYS = ("owns", "scheduler")


class Optimizers:
    """The optimizers by name, in config order. `single`: the config gave one optimizer (`optimizer._target_`),
    whose state a checkpoint holds as it always has; several are saved by name."""

    def __init__(self, named: dict[str, torch.optim.Optimizer], single: bool, frozen: list[str]) -> None:
        self.named, self.single, self.frozen = named, single, frozen
        self.schedulers: dict[str, Any] = {}  # a named optimizer's own `scheduler` (framework/optim/schedulers.py)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.named.values())

    def __len__(self) -> int:
        return len(self.named)

    @property
    def only(self) -> torch.optim.Optimizer:
        """The one optimizer of a run that has one (automatic optimization steps it)."""
        if len(self.named) != 1:
            raise ValueError(f"{len(self.named)} optimizers, expected one")
        return next(iter(self.named.values()))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's groups, in order (named `<optimizer>/<group>` when there are several)."""
        return [group for optimizer in self.named.values() for group in optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        if self.single:
            return self.only.state_dict()
        states: dict[str, Any] = {name: opt.state_dict() for name, opt in self.named.items()}
        for name, scheduler in self.schedulers.items():
            states[f"{name}/scheduler"] = scheduler.state_dict()
        return states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.single:
            self.only.load_state_dict(state)
            return
        for name, optimizer in self.named.items():
            optimizer.load_state_dict(state[name])
        for name, scheduler in self.schedulers.items():
            if f"{name}/scheduler" in state:
                scheduler.load_state_dict(state[f"{name}/scheduler"])


def as_optimizers(optimizer: Union[torch.optim.Optimizer, Optimizers]) -> Optimizers:
    """A run's optimizers as they are, or one torch optimizer as a run's one."""
    if isinstance(optimizer, Optimizers):
        return optimizer
    return Optimizers({"optimizer": optimizer}, single=True, frozen=[])


def trainable(task: nn.Module) -> list[Named]:
    """Every trainable parameter of the task, by its path in the task, with its owning module."""
    return [n for n in named_in(task) if n.param.requires_grad]


def in_model(path: str, model_attr: str) -> bool:
    """Is the task's parameter or submodule `path` its model's? Every one is where the task is its own model
    (`model_attr` "": it built several nets itself, as a LightningModule does)."""
    return not model_attr or path == model_attr or path.startswith(model_attr + ".")


def outside_model(task: nn.Module, model_attr: str) -> list[str]:
    """The task's trainable parameters that are not its model's (a second net, a learnable temperature)."""
    return [name for name, p in task.named_parameters() if p.requires_grad and not in_model(name, model_attr)]


def build_optimizers(node: DictConfig, task: nn.Module, model_attr: str, model: nn.Module) -> Optimizers:
    """The `optimizer` group's optimizers over the task's parameters. One optimizer: the model's parameters by their
    names in the model (as `param_groups` rules name them), the task's others by their path in the task."""
    if node.get("_target_") is not None:
        extra = [n for n in trainable(task) if not in_model(n.name, model_attr)]
        optimizer, off = build_optimizer(node, named_in(model) + extra, "optimizer")
        return Optimizers({"optimizer": optimizer}, single=True, frozen=off)
    names = [str(k) for k in cast(Iterable[Any], node)]
    if not names or not all(isinstance(node[k], DictConfig) and node[k].get("_target_") for k in names):
        raise ConfigError(
            f"optimizer: {OmegaConf.to_yaml(node).strip() or '{}'!r} is neither an optimizer (optimizer._target_) nor "
            "named optimizers; expected optimizer._target_, or optimizer.<name>._target_ with optimizer.<name>.owns"
        )
    everything = {n.name: n for n in trainable(task)}
    owner_of: dict[str, str] = {}
    named: dict[str, torch.optim.Optimizer] = {}
    frozen: list[str] = []
    for name in names:
        sub = node[name]
        owned = _owned(task, sub.get("owns"), f"optimizer.{name}.owns")
        for param in owned:
            if param in owner_of:
                raise ConfigError(
                    f"optimizer.{name}.owns: {param} is owned by optimizer.{owner_of[param]} too; expected each "
                    "parameter owned by one optimizer"
                )
            owner_of[param] = name
        options = without(sub, OWN_KEYS)
        params = [everything[p] for p in owned if p in everything]
        optimizer, off = build_optimizer(options, params, f"optimizer.{name}", group_prefix=f"{name}/")
        named[name], frozen = optimizer, frozen + off
    left = [p for p in everything if p not in owner_of]
    if left:
        shown = ", ".join(left[:6]) + (f", ... ({len(left)} in all)" if len(left) > 6 else "")
        raise ConfigError(
            f"optimizer: no optimizer owns {shown}; expected every trainable parameter owned by one of "
            f"{', '.join(f'optimizer.{n}' for n in names)} (add its submodule to an `owns` list, or set its "
            "requires_grad to False)"
        )
    return Optimizers(named, single=False, frozen=frozen)


def _owned(task: nn.Module, owns: Any, key: str) -> list[str]:
    """The parameter paths (in the task) of the submodules or parameters `owns` names."""
    if owns is None or isinstance(owns, str) or not len(owns):
        raise ConfigError(f"{key}={owns!r}: expected a list of the task's submodules (or parameters) it trains")
    found: list[str] = []
    for entry in owns:
        path = str(entry)
        try:
            target = task.get_submodule(path)
        except AttributeError:
            target = None
        if isinstance(target, nn.Module):
            found += [f"{path}.{n}" for n, p in target.named_parameters()]
            continue
        params = dict(task.named_parameters())
        if path in params:
            found.append(path)
            continue
        children = ", ".join(n for n, c in task.named_children() if any(True for _ in c.parameters()))
        raise ConfigError(
            f"{key}: {path!r} is neither a submodule nor a parameter of the task; expected one of its submodules "
            f"({children or 'it has none'}) or a parameter's name"
        )
    return found


def build_named_schedulers(
    node: DictConfig, optimizers: Optimizers, build_scheduler: Any, **lengths: Any
) -> Optional[dict[str, Any]]:
    """Each named optimizer's own `scheduler` node, built over that optimizer."""
    if optimizers.single:
        return None
    for name in optimizers.named:
        sub = node[name].get("scheduler")
        if sub is not None:
            scheduler = build_scheduler(sub, optimizers.named[name], **lengths)
            if scheduler is not None:
                optimizers.schedulers[name] = scheduler
    return optimizers.schedulers
