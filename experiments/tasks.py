"""Examples of a user's own Task: classification plus a penalty term (`experiment=digits_penalty`), and one that
shows the misclassified validation images in TensorBoard (`experiment=digits_misclassified`)."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn
from torchvision.utils import make_grid

from framework.task.classification import ClassificationTask
from framework.task.task import Metric, StepOutput


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

    def evaluation_step(self, batch: Any, split: str) -> StepOutput:
        inputs, target = batch
        logits = self.model(inputs)
        loss, penalty = self._penalized(logits, target)
        metrics = self.step_metrics(logits, target, split)
        metrics["logit_penalty"] = penalty.detach()
        return StepOutput(loss, metrics)


class MisclassifiedImagesTask(ClassificationTask):
    """Logs a grid of the first `num_images` misclassified validation images (of rank 0's shard) to
    TensorBoard at the end of each validation, as `val/misclassified`.

    Shows the epoch-end hook: collect on the device during the steps, log once in `on_validation_epoch_end`
    through `self.logger.experiment` (the SummaryWriter; None on other ranks).
    """

    def __init__(self, model: nn.Module, loss: Optional[nn.Module] = None,
                 metrics: Optional[Mapping[str, Metric]] = None, num_images: int = 32) -> None:
        super().__init__(model, loss, metrics)
        self.num_images = num_images
        self._images: Optional[torch.Tensor] = None  # up to num_images candidates, misclassified ones first
        self._wrong: Optional[torch.Tensor] = None  # which of them are misclassified

    def validation_step(self, batch: Any) -> StepOutput:
        inputs, target = batch
        logits = self.model(inputs)
        self._collect(inputs, logits.argmax(dim=1) != target)
        return StepOutput(self.loss(logits, target), self.step_metrics(logits, target, "val"))

    def _collect(self, inputs: torch.Tensor, wrong: torch.Tensor) -> None:
        """Keep the first `num_images` misclassified inputs seen so far, without a host sync: a stable sort
        puts them first (selecting them with the mask would have to wait for their count)."""
        if self._images is not None:
            inputs, wrong = torch.cat([self._images, inputs]), torch.cat([self._wrong, wrong])
        first = torch.argsort(wrong.logical_not().to(torch.uint8), stable=True)[:self.num_images]
        self._images, self._wrong = inputs[first].detach(), wrong[first]

    def on_validation_epoch_end(self) -> None:
        images, wrong = self._images, self._wrong
        self._images = self._wrong = None
        writer = self.logger.experiment if self.logger is not None else None
        if writer is None or images is None:
            return
        images = images[wrong]  # the one host sync, once per validation
        if len(images) == 0:
            return
        scale = max(1, 32 // images.shape[-1])  # tiny images (8x8 digits) made visible, pixels kept sharp
        images = images.float().repeat_interleave(scale, dim=-1).repeat_interleave(scale, dim=-2)
        grid = make_grid(images, nrow=8, normalize=True, pad_value=1.0)
        writer.add_image("val/misclassified", grid, self.trainer.global_step)

    def check_batch(self, batch: Any, split: str, **kwargs: Any) -> StepOutput:
        out = super().check_batch(batch, split, **kwargs)
        self._images = self._wrong = None  # the check's batch is no part of the first validation
        return out
