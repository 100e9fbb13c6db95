"""A torchsummary-style table of a model: each leaf layer's output shape and parameters, for one batch."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def _shape(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return str(list(output.shape))
    if isinstance(output, (tuple, list)):
        return ", ".join(_shape(o) for o in output)
    return type(output).__name__


def summarize(model: nn.Module, run_batch: Callable[[], Any]) -> str:
    """Runs `run_batch()` (one forward pass through `model`) with hooks on every leaf module."""
    rows: list[tuple[str, str, str, int]] = []
    hooks = []
    for name, module in model.named_modules():
        if next(module.children(), None) is None:

            def record(mod: nn.Module, _inputs: Any, output: Any, name: str = name) -> None:
                params = sum(p.numel() for p in mod.parameters(recurse=False))
                rows.append((name, type(mod).__name__, _shape(output), params))

            hooks.append(module.register_forward_hook(record))
    try:
        with torch.no_grad():
            run_batch()
    finally:
        for hook in hooks:
            hook.remove()
    header = ("layer", "type", "output shape", "params")
    table = [header] + [(n, t, s, f"{p:,}") for n, t, s, p in rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in table]
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    size_mb = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**20
    lines.append(f"total params: {total:,}  trainable: {trainable:,}  size: {size_mb:.2f} MB")
    return "\n".join(lines)
