"""Activation checkpointing on the LM (conf/experiment/lm.yaml): peak activation memory and step time, without it
and with `parallel.activation_checkpointing=full` (or selective of the transformer layers).

    python bench/activation_checkpointing.py [--steps 20] [--threads 1] [--batch 16]

The model and batch are experiment=lm's (TransformerLM, 4 layers of width 128, windows of 64 bytes, batch 16,
AdamW), built from the composed config, checkpointed by framework/parallel/activation_checkpointing.py as a run would.
Memory: bytes in use by the process's allocator (glibc's mallinfo2: heap and mmap'd blocks; torch's CPU
allocator is malloc, with no cache), sampled before the forward and at every module's forward (which also runs
during backward's recompute) and after the loss: the peak over the step minus the bytes before it is the step's
activation memory (with the gradients the backward has made by then, the same in every mode). Time: median wall
time of a training step (forward, backward, AdamW step, zero_grad), the modes' steps interleaved so that load on
the machine falls on each alike; no sampling hooks while timing. Target: >= 40% less activation memory for
<= 1.35x the step time.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo2


def in_use() -> int:
    """Bytes the allocator has handed out and not had back: small blocks in its arenas plus mmap'd large ones."""
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def build(mode: str, compose: Callable[..., Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from framework.config.instantiate import build as instantiate
    from framework.parallel import activation_checkpointing

    overrides = [f"parallel.activation_checkpointing={mode}"]
    if mode == "selective":
        overrides.append("parallel.activation_checkpointing_modules=[torch.nn.TransformerEncoderLayer]")
    cfg = compose(*overrides)
    torch.manual_seed(0)
    model = instantiate(cfg.model, "model")
    activation_checkpointing.apply(model, cfg.parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, peak: list[int]) -> None:
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    if peak:
        peak[0] = max(peak[0], in_use())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def activation_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> int:
    peak = [0]
    sample = lambda *_: peak.__setitem__(0, max(peak[0], in_use()))  # noqa: E731
    hooks = [m.register_forward_hook(sample) for m in model.modules()]
    try:
        results = []
        for _ in range(3):
            before = in_use()
            peak[0] = before
            step(model, optimizer, batch, peak)
            results.append(peak[0] - before)
        return min(results)
    finally:
        for hook in hooks:
            hook.remove()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=None, help="windows per step (default: experiment=lm's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from fsdp import compose_lm  # bench/fsdp.py's composition of experiment=lm

    print(f"load average before: {os.getloadavg()}")
    modes = ("none", "full", "selective")
    built = {mode: build(mode, compose_lm) for mode in modes}
    cfg = compose_lm()
    batch_size = args.batch or cfg.data.batch_size
    batch = torch.randint(0, 256, (batch_size, cfg.model.block_size + 1), generator=torch.Generator().manual_seed(0))
    for mode in modes:  # warm-up (AdamW's state allocated)
        for _ in range(2):
            step(*built[mode], batch, [])
    memory = {mode: activation_bytes(*built[mode], batch) for mode in modes}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.steps):
        for mode in modes:
            start = time.perf_counter()
            step(*built[mode], batch, [])
            seconds[mode].append(time.perf_counter() - start)
    parameters = sum(p.numel() for p in built["none"][0].parameters())
    print(f"experiment=lm: TransformerLM {parameters / 1e6:.2f} M parameters, batch {batch_size} x "
          f"{cfg.model.block_size}, {args.threads} thread(s), median of {args.steps} steps")
    print(f"{'activation_checkpointing':<36} {'activation MiB':>14} {'vs none':>8} {'step ms':>8} {'vs none':>8}")
    base_mem, base_time = memory["none"], statistics.median(seconds["none"])
    for mode in modes:
        t = statistics.median(seconds[mode])
        label = mode + (" (TransformerEncoderLayer)" if mode == "selective" else "")
        print(f"{label:<36} {memory[mode] / 2**20:>14.2f} {memory[mode] / base_mem:>8.2f} {1000 * t:>8.1f} "
              f"{t / base_time:>8.2f}")
    for mode in ("full", "selective"):
        saved, slower = 1 - memory[mode] / base_mem, statistics.median(seconds[mode]) / base_time
        met = saved >= 0.40 and slower <= 1.35
        print(f"{mode}: {100 * saved:.0f}% less activation memory for {slower:.2f}x the step time (target >= 40% "
              f"for <= 1.35x: {'met' if met else 'NOT met'})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
