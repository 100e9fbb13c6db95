"""In-memory synthetic classification for `experiment=bench` (and for the hand-written loops it is compared with).

Features are standard-normal float32; the label of a sample is the argmax of `x @ W`, with `W` a
standard-normal `num_features x num_classes` matrix. Both come from one private generator seeded by
`seed`, so the framework and `bench/handwritten.py` train on bit-identical tensors, and the global RNG
(which seeds model initialisation) is left untouched.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from framework.core.errors import ConfigError
from framework.core.reproducibility import generator


def classification(
    num_samples: int = 32_768, num_features: int = 128, num_classes: int = 10, seed: int = 0
) -> TensorDataset:
    """`TensorDataset(x, y)`: x float32 [num_samples, num_features], y int64 [num_samples] in [0, num_classes)."""
    for key, value in (("num_samples", num_samples), ("num_features", num_features), ("num_classes", num_classes)):
        if value < 1:
            raise ConfigError(f"data.train.{key}={value!r}: expected a whole number >= 1")
    g = generator(seed)
    x = torch.randn(num_samples, num_features, generator=g, dtype=torch.float32)
    w = torch.randn(num_features, num_classes, generator=g, dtype=torch.float32)
    y = (x @ w).argmax(dim=1)
    return TensorDataset(x, y)
