"""The README's example: a model and a Task of your own, trained by `python run.py experiment=readme`
(conf/experiment/readme.yaml). Nothing in framework/ changes."""
import torch
import torch.nn.functional as F
from torch import nn

from framework.task.task import Task


class SmallCNN(nn.Module):
    """Two convolutions and a linear head; `input_shape` and `num_classes` come from the data's config."""

    def __init__(self, input_shape: list[int], num_classes: int, channels: int = 16) -> None:
        super().__init__()
        in_channels, height, width = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(2 * channels * (height // 2) * (width // 2), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsTask(Task):
    """What one step computes; the loop does the rest (device, backward, optimizer, logs, checkpoints)."""

    def training_step(self, batch):
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)  # the loss, logged as train/loss

    def validation_step(self, batch):
        images, labels = batch
        logits = self.model(images)
        self.log("val/loss", F.cross_entropy(logits, labels))  # a mean over the whole split
        self.log("val/acc", (logits.argmax(dim=1) == labels).float().mean())

    # test_step runs validation_step; during the test, val/ names are logged as test/.
