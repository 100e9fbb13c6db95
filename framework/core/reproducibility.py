"""Seeding, deterministic switches and RNG state capture: the only module that touches global RNGs."""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

log = logging.getLogger(__name__)


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


def worker_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of a rank's data-loader generator in `epoch`, from which its workers seed python, numpy and torch:
    each rank its own, so ranks do not draw the same augmentations; rank 0's is `seed + epoch`, as before ranks
    counted. torch's CPU generator keeps a seed's low 32 bits only, so ranks are set apart there, by multiples of
    2**32 / golden ratio: thousands of ranks stay millions of epochs apart."""
    return seed + epoch + rank * 0x9E3779B9


def rng_state(device: Optional[torch.device] = None) -> dict[str, Any]:
    """Every global RNG state of this process, as tensors and plain values (checkpointable without pickle).

    Of CUDA's, only the state of this process's own device (`device`, default the current one): a rank draws
    from no other, and a checkpoint holding one state per visible GPU could not resume where fewer are visible."""
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
        state["cuda"] = torch.cuda.get_rng_state(cuda_index(device))
    return state


def cuda_index(device: Optional[torch.device] = None) -> int:
    """The index of the CUDA device whose RNG a process on `device` uses: its own, else the current one."""
    if device is not None and device.type == "cuda" and device.index is not None:
        return device.index
    return torch.cuda.current_device()


def cuda_state_for(saved: Union[torch.Tensor, Sequence[torch.Tensor]], index: int) -> torch.Tensor:
    """The CUDA RNG state to restore on device `index`: the one a checkpoint holds, or, from an older checkpoint
    holding one per visible GPU, that device's, else the first (a machine with fewer GPUs, another world size)."""
    if isinstance(saved, torch.Tensor):
        return saved
    if index < len(saved):
        log.debug("resume: the checkpoint holds %d CUDA RNG states; restoring device %d's", len(saved), index)
        return saved[index]
    log.debug(
        "resume: the checkpoint holds %d CUDA RNG states, none for device %d; restoring the first",
        len(saved),
        index,
    )
    return saved[0]


def set_rng_state(state: dict[str, Any], device: Optional[torch.device] = None) -> None:
    """Restore what `rng_state` captured; the CUDA state goes to `device` (default the current one)."""
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
        index = cuda_index(device)
        torch.cuda.set_rng_state(cuda_state_for(state["cuda"], index), index)
