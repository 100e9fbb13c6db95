"""The built-in models' presets fit their data: ResNet-18's stem follows the image size (issue 17)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.zoo.models import resnet18

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shape, stem, cifar, layer4_side", [
    ((3, 32, 32), "auto", True, 4),        # CIFAR: 3x3 stride-1 conv, no max-pool
    ((1, 28, 28), "auto", True, 4),        # MNIST: the same, one channel
    ((3, 96, 96), "auto", False, 3),       # above 64 px: torchvision's ImageNet stem
    ((3, 32, 32), "imagenet", False, 1),   # forced: what the preset built before, layer4 sees 1x1
])
def test_resnet18_stem_follows_the_image_size(shape, stem, cifar, layer4_side):
    model = resnet18(shape, num_classes=10, stem=stem).eval()
    assert (model.conv1.kernel_size, model.conv1.stride) == (((3, 3), (1, 1)) if cifar else ((7, 7), (2, 2)))
    assert isinstance(model.maxpool, nn.Identity) == cifar
    assert model.conv1.in_channels == shape[0]
    seen = {}

    def layer4_side_of(_module, _inputs, out):
        seen["side"] = out.shape[-1]

    model.layer4.register_forward_hook(layer4_side_of)
    with torch.no_grad():
        assert model(torch.zeros(2, *shape)).shape == (2, 10)
    assert seen["side"] == layer4_side


def test_resnet18_keeps_torchvisions_state_dict_keys_and_refuses_an_unknown_stem():
    import torchvision

    assert resnet18((3, 32, 32), 10).state_dict().keys() == torchvision.models.resnet18(num_classes=10).state_dict().keys()
    with pytest.raises(ValueError, match="stem='tiny': expected one of auto, cifar, imagenet"):
        resnet18((3, 32, 32), 10, stem="tiny")
