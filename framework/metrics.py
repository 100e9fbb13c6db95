"""Metric functions for tasks: `(output, target) -> scalar tensor`, computed on device without a host sync."""
from __future__ import annotations

import torch


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
