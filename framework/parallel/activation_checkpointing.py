"""Activation checkpointing (`parallel.activation_checkpointing`): chosen modules keep only their inputs in forward
and run their forward again in backward, trading compute for activation memory.

`full` covers every block (the shard units under fsdp: `parallel.shard_modules`, else the model's children with
parameters, as `parallel.shard_units` finds them); `selective` the modules of the classes
`parallel.activation_checkpointing_modules` names. The recompute is the public `torch.utils.checkpoint.checkpoint`
(non-reentrant, RNG state kept, so dropout draws the same mask again).

Order (as torchtitan's `parallelize`): activation checkpointing, then `torch.compile`, then the DDP/FSDP wrapping.
A checkpointed module's own forward recomputes; FSDP's hooks run around it (a unit's weights are gathered again
for its backward, before the recompute needs them), and compile traces the checkpoint as one region.

A module is checkpointed in place: its class becomes a subclass of its own (`Checkpointed<Name>`) whose forward
runs the original under `checkpoint`, as `fully_shard` makes `FSDP<Name>`. No wrapper module is inserted, so
parameter names, state-dict keys and optimizer groups (matched by name and module class) are what they are
without it: a checkpoint loads with and without activation checkpointing.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from torch import nn
from torch.utils.checkpoint import checkpoint

from framework.core.errors import ConfigError
from framework.parallel.strategy import classes_used, module_classes, shard_units

log = logging.getLogger(__name__)

MODES = ("none", "full", "selective")


class Checkpointed(nn.Module):
    """The base of every `Checkpointed<Name>` class: forward runs the module's own under `checkpoint`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


_CLASSES: dict[type, type] = {}  # a module class -> its checkpointed subclass (one per class, reused)


def checkpoint_module(module: nn.Module) -> None:
    """Make `module` recompute its forward in backward (nothing if it already does)."""
    cls = type(module)
    if issubclass(cls, Checkpointed):
        return
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = type(f"Checkpointed{cls.__name__}", (Checkpointed, cls), {"__module__": cls.__module__})
        _CLASSES[cls] = sub
    module.__class__ = sub


def apply(model: nn.Module, parallel_cfg: Any) -> int:
    """Checkpoint the modules `parallel.activation_checkpointing` chooses in `model`; returns how many."""
    mode = parallel_cfg.get("activation_checkpointing", "none")
    if mode == "none":
        return 0
    targets = chosen_modules(model, mode, parallel_cfg)
    for module in targets:
        checkpoint_module(module)
    log.info(
        "parallel.activation_checkpointing=%s: %d module%s recomputed in backward",
        mode,
        len(targets),
        "" if len(targets) == 1 else "s",
    )
    return len(targets)


def chosen_modules(model: nn.Module, mode: str, parallel_cfg: Any) -> list[nn.Module]:
    """The outermost modules of those `mode` names: one inside another recomputed would be recomputed twice."""
    if mode == "full":
        shard_types: Optional[tuple[type, ...]] = None
        strategy = parallel_cfg.get("strategy")
        if getattr(strategy, "value", strategy) == "fsdp":  # its shard units
            shard_types = module_classes(parallel_cfg.get("shard_modules"), "parallel.shard_modules")
        units = shard_units(model, shard_types)
        return _outermost(model, units) if units else [model]  # shard_modules: [] makes the root the one unit
    types = module_classes(parallel_cfg.activation_checkpointing_modules, "parallel.activation_checkpointing_modules")
    assert types is not None  # config.validate requires the list with `selective`
    chosen = _outermost(model, [m for m in model.modules() if isinstance(m, types)])
    if not chosen:
        raise ConfigError(
            f"parallel.activation_checkpointing_modules={[t.__qualname__ for t in types]}: the model has no "
            f"module of these classes; expected some of the classes it uses ({classes_used(model)})"
        )
    return chosen


def _outermost(model: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    wanted, found = {id(m) for m in modules}, []

    def walk(module: nn.Module) -> None:
        if id(module) in wanted:
            found.append(module)
            return
        for child in module.children():
            walk(child)

    walk(model)
    return found
