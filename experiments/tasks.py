"""An example of a user's own Task: classification plus a penalty term, used by `experiment=digits_penalty`."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn

from framework.task import ClassificationTask, Metric, StepOutput


class LogitPenaltyTask(ClassificationTask):
    """Cross-entropy plus `weight * mean(logits**2)`, which keeps logits small (a simple confidence penalty).

    Shows the two things a custom task usually does: change the loss, and report an extra metric.
    """

    def __init__(self, model: nn.Module, loss: Optional[nn.Module] = None,
                 metrics: Optional[Mapping[str, Metric]] = None, weight: float = 1e-3) -> None:
        super().__init__(model, loss, metrics)
        self.weight = weight

    def _penalized(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        penalty = logits.pow(2).mean()
        return self.loss(logits, target) + self.weight * penalty, penalty

    def training_step(self, batch: Any) -> StepOutput:
        inputs, target = batch
        loss, _ = self._penalized(self.model(inputs), target)
        return StepOutput(loss)

    def validation_step(self, batch: Any) -> StepOutput:
        inputs, target = batch
        logits = self.model(inputs)
        loss, penalty = self._penalized(logits, target)
        metrics = {name: metric(logits, target) for name, metric in self.metrics.items()}
        metrics["logit_penalty"] = penalty.detach()
        return StepOutput(loss, metrics)
