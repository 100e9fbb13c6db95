"""Models for the built-in presets. Each takes the data's `input_shape` and `num_classes` from the config."""
from __future__ import annotations

import math
from typing import Sequence

from torch import nn


class MLP(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (256, 256),
                 dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    """Two conv-BN-ReLU blocks and global pooling: works for any image size from 8x8 up."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (32, 64)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = input_shape[0]
        for i, size in enumerate(channels):
            layers += [nn.Conv2d(width, size, 3, padding=1, bias=False), nn.BatchNorm2d(size), nn.ReLU()]
            if i < len(channels) - 1:
                layers.append(nn.MaxPool2d(2))
            width = size
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.features(x)).flatten(1))


def resnet18(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18, no pretrained weights; the stem follows the data's channel count.

    State-dict keys stay torchvision's own (`conv1.weight`, `fc.weight`, ...), so torchvision weights load.
    """
    import torchvision  # imported here: most runs never need it, and it costs start-up time

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if input_shape[0] != 3:
        model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
