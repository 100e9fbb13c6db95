"""The Lightning-style Task: it holds the model and says what one training, validation or test step computes.

A step returns a `StepOutput`: the loss (for backward) and a dict of metric tensors, averaged over the batch.
The trainer prefixes metric names with the stage (`train/`, `val/`, `test/`) and averages them over the
epoch weighted by batch size. Subclass `Task` (or `ClassificationTask`) in `experiments/` to go further.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from framework.metrics import Accuracy

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Task(nn.Module):
    """Holds `self.model`; the parallel strategy may replace it by a wrapper (DDP) for training only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def training_step(self, batch: Any) -> StepOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch)")

    def validation_step(self, batch: Any) -> StepOutput:
        return self.training_step(batch)

    def test_step(self, batch: Any) -> StepOutput:
        return self.validation_step(batch)

    def batch_size(self, batch: Any) -> int:
        """Samples in a batch, used to weight epoch averages; the first tensor's length by default."""
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        return len(first)


class ClassificationTask(Task):
    """`(inputs, labels)` batches, a loss (cross-entropy by default) and metrics (accuracy by default)."""

    def __init__(self, model: nn.Module, loss: Optional[nn.Module] = None,
                 metrics: Optional[Mapping[str, Metric]] = None) -> None:
        super().__init__(model)
        self.loss = loss if loss is not None else nn.CrossEntropyLoss()
        self.metrics = dict(metrics) if metrics is not None else {"acc": Accuracy()}

    def training_step(self, batch: Any) -> StepOutput:
        # Training metrics are left out on purpose: the hot path computes only what backward needs.
        inputs, target = batch
        return StepOutput(self.loss(self.model(inputs), target))

    def validation_step(self, batch: Any) -> StepOutput:
        inputs, target = batch
        output = self.model(inputs)
        metrics = {name: metric(output, target) for name, metric in self.metrics.items()}
        return StepOutput(self.loss(output, target), metrics)
