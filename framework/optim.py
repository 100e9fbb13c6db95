"""Optimizer and learning-rate scheduler, built from `optimizer.*` and `scheduler.*` by `_target_`."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.errors import ConfigError
from framework.instantiate import build

log = logging.getLogger(__name__)

# Keys of `scheduler.*` that belong to the trainer, not to the torch scheduler's constructor.
SCHEDULER_KEYS = ("interval", "frequency", "monitor")


def _without(node: DictConfig, keys: tuple[str, ...]) -> DictConfig:
    return OmegaConf.masked_copy(node, [k for k in node if k not in keys])


def build_optimizer(node: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    """Any `torch.optim` optimizer by `_target_`; every trainable parameter in one group named `default`."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("model: it has no trainable parameters (every requires_grad is False)")
    factory = build(node, "optimizer", partial=True, provided=("params",))
    return factory([{"params": params, "name": "default"}])


def group_names(optimizer: torch.optim.Optimizer) -> list[str]:
    return [group.get("name", f"group{i}") for i, group in enumerate(optimizer.param_groups)]


@dataclass
class Scheduler:
    """A torch LR scheduler plus when the trainer steps it."""

    scheduler: Any
    interval: str  # "step" (after every optimizer step) or "epoch"
    frequency: int
    monitor: Optional[str]  # metric passed to step() (ReduceLROnPlateau); None for the others

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def build_scheduler(node: DictConfig, optimizer: torch.optim.Optimizer) -> Optional[Scheduler]:
    """`scheduler._target_: null` means a constant learning rate."""
    if node.get("_target_") is None:
        return None
    interval = node.get("interval", "step")
    if interval not in ("step", "epoch"):
        raise ConfigError(f"scheduler.interval={interval!r}: expected 'step' or 'epoch'")
    frequency = node.get("frequency", 1)
    if not isinstance(frequency, int) or frequency < 1:
        raise ConfigError(f"scheduler.frequency={frequency!r}: expected an integer >= 1")
    factory = build(_without(node, SCHEDULER_KEYS), "scheduler", partial=True, provided=("optimizer",))
    return Scheduler(factory(optimizer), interval, frequency, node.get("monitor"))
