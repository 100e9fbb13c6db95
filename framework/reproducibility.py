"""Seeding, deterministic switches and RNG state capture: the only module that touches global RNGs."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every CUDA device included)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels everywhere (cuDNN included); slower, but runs repeat bit for bit on GPU too.

    Disabled, it only undoes what an earlier run in this process (a multirun job before this one) switched on:
    torch's defaults are already non-deterministic, and calling `use_deterministic_algorithms` imports
    torch._inductor, which costs almost two seconds of start-up.
    """
    if not enabled:
        if torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(False)
            torch.backends.cudnn.deterministic = False
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


def rng_state() -> dict[str, Any]:
    """Every global RNG state of this process, as tensors and plain values (checkpointable without pickle)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]},
            "has_gauss": numpy["has_gauss"],
            "gauss": numpy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
