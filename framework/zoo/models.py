"""Models for the built-in presets. Each takes the data's `input_shape` and `num_classes` from the config."""

from __future__ import annotations

import math
from typing import Sequence

from torch import nn


class MLP(nn.Module):
    def __init__(
        self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (256, 256), dropout: float = 0.0
    ) -> None:
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


RESNET_STEMS = ("auto", "cifar", "imagenet")
CIFAR_STEM_MAX_SIDE = 64  # images up to this size get the CIFAR stem under stem=auto


def resnet18(input_shape: Sequence[int], num_classes: int, stem: str = "auto") -> nn.Module:
    """torchvision's ResNet-18, no pretrained weights; the stem follows the data's channel count and size.

    `stem`: `imagenet` is torchvision's (7x7 stride-2 conv, then a 3x3 stride-2 max-pool: a 32x32 image reaches
    layer4 as 1x1 and learns far worse); `cifar` is the CIFAR ResNet's (3x3 stride-1 conv, no max-pool: 32x32
    reaches layer4 as 4x4); `auto` picks `cifar` for images of at most 64 pixels a side, `imagenet` above.
    State-dict keys stay torchvision's own (`conv1.weight`, `fc.weight`, ...), so torchvision weights load
    (with the ImageNet stem; the CIFAR stem's conv1 has another shape).
    """
    import torchvision  # imported here: most runs never need it, and it costs start-up time

    if stem not in RESNET_STEMS:
        raise ValueError(f"stem={stem!r}: expected one of {', '.join(RESNET_STEMS)}")
    if stem == "auto":
        stem = "cifar" if max(input_shape[1:]) <= CIFAR_STEM_MAX_SIDE else "imagenet"
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if stem == "cifar":
        model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif input_shape[0] != 3:
        model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
    if stem == "cifar" or input_shape[0] != 3:  # a new conv1: initialised as torchvision initialises its own
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model
