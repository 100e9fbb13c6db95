"""Seeding, deterministic switches and RNG state capture: the only module that touches global RNGs."""
from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every CUDA device included)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels everywhere (cuDNN included); slower, but runs repeat bit for bit on GPU too.

    Does nothing when disabled: torch's defaults are already non-deterministic, and calling
    `use_deterministic_algorithms` imports torch._inductor, which costs almost two seconds of start-up.
    """
    if not enabled:
        return
    # cuBLAS needs a fixed workspace to be deterministic; it must be set before the first CUDA call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def generator(seed: int) -> torch.Generator:
    """A private CPU generator, so data order never depends on (or disturbs) the global RNG."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g
