"""Where a run executes: one device (`single`), nn.DataParallel (`dp`), or one process per device (`ddp`).

A strategy only places and wraps: it picks the device, wraps the model for training, unwraps it for
everything saved or logged, reduces tensors across processes and says which rank does I/O.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from framework.errors import ConfigError

log = logging.getLogger(__name__)


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={requested!r}: no CUDA device is visible; expected 'auto' or 'cpu'")
    return device


class Strategy:
    """One process, one device."""

    name = "single"
    rank = 0
    world_size = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module, for saving and logging: never a `module.` prefix in anything written."""
        while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        return getattr(model, "_orig_mod", model)  # torch.compile's wrapper

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def teardown(self) -> None:
        pass


class DataParallelStrategy(Strategy):
    """nn.DataParallel over every visible GPU (the model and batches live on cuda:0)."""

    name = "dp"

    def wrap(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model)


def build_strategy(parallel_cfg, device: str) -> Strategy:
    chosen = pick_device(device)
    if parallel_cfg.strategy == "dp":
        if chosen.type == "cuda" and torch.cuda.device_count() >= 2:
            return DataParallelStrategy(torch.device("cuda", 0))
        log.info("parallel=dp needs at least two GPUs; %d visible, so running as single",
                 torch.cuda.device_count())
    if parallel_cfg.strategy == "ddp":
        raise ConfigError("parallel=ddp: not available yet in this version; expected parallel=single or dp")
    return Strategy(chosen)
