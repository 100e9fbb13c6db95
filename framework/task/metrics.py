"""Metrics for tasks, of two kinds.

Batch metrics: `(output, target) -> scalar tensor`, computed on device without a host sync; the trainer
averages them over the epoch weighted by batch size, which is exact for means such as accuracy. Their class's
`higher_is_better`, as torchmetrics names it, is their direction (ClassificationTask.metric_modes).
Stateful metrics: `torchmetrics.Metric` objects (update per batch, compute at epoch end over every rank,
reset), for what a mean of batch values gets wrong, such as macro-F1 or AUROC.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from framework.core.compat import set_update_count


def is_stateful(metric: Any) -> bool:
    """A torchmetrics.Metric, known by what it does: torchmetrics takes seconds to import, so only a config
    that names one of its metrics pays for it."""
    return isinstance(metric, nn.Module) and all(
        callable(getattr(metric, name, None)) for name in ("update", "compute", "reset")
    )


class Accuracy:
    """Share of samples whose target is among the `top_k` highest scores."""

    higher_is_better = True  # as torchmetrics declares its metrics' direction: what best/val/<name> is kept by

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
    higher_is_better = False

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).abs().mean()


# ---------------------------------------------------------------------------------- a Metric's state, resumable
# torchmetrics saves a Metric's states in state_dict() only when made persistent, and load_state_dict() never
# restores how many updates it has seen (`update_count`, which compute() and forward() read). Both are read here
# through the public `metric_state` and `update_count`; the count goes back through framework.core.compat.


def metric_state(metric: Any) -> dict[str, Any]:
    """A torchmetrics Metric's states (tensors, or lists of tensors for `cat` states) and update count, on the
    CPU, as a checkpoint holds them."""
    states = {
        name: ([t.detach().cpu() for t in value] if isinstance(value, list) else value.detach().cpu())
        for name, value in metric.metric_state.items()
    }
    return {"states": states, "updates": int(metric.update_count)}


def load_metric_state(metric: Any, saved: dict[str, Any], device: torch.device) -> None:
    """Put back what `metric_state` returned."""
    for name, value in saved["states"].items():
        setattr(metric, name, [t.to(device) for t in value] if isinstance(value, list) else value.to(device))
    set_update_count(metric, saved["updates"])
