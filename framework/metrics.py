"""Metrics for tasks, of two kinds.

Batch metrics: `(output, target) -> scalar tensor`, computed on device without a host sync; the trainer
averages them over the epoch weighted by batch size, which is exact for means such as accuracy.
Stateful metrics: `torchmetrics.Metric` objects (update per batch, compute at epoch end over every rank,
reset), for what a mean of batch values gets wrong, such as macro-F1 or AUROC.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def is_stateful(metric: Any) -> bool:
    """A torchmetrics.Metric, known by what it does: torchmetrics takes seconds to import, so only a config
    that names one of its metrics pays for it."""
    return isinstance(metric, nn.Module) and all(callable(getattr(metric, name, None))
                                                 for name in ("update", "compute", "reset"))


class Accuracy:
    """Share of samples whose target is among the `top_k` highest scores."""

    def __init__(self, top_k: int = 1) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k={top_k!r}: expected a whole number >= 1")
        self.top_k = top_k

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.top_k == 1:
            return (logits.argmax(dim=-1) == target).float().mean()
        top = logits.topk(self.top_k, dim=-1).indices
        return (top == target.unsqueeze(-1)).any(dim=-1).float().mean()


class MeanAbsoluteError:
    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).abs().mean()
