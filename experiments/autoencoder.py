"""Lightning's autoencoder (lightning/examples/pytorch/basics/autoencoder.py), ported to the digits, with two validation
sets (docs/autoencoder.md).

What changed from Lightning's: the imports, the base class (`Task` for `LightningModule`), `configure_optimizers` (its
Adam is `optimizer=adamw` in conf/experiment/autoencoder.yaml), and the encoder and decoder given by the `model` config
group as `net` (an `AutoEncoder`: the model a checkpoint's weights, predict and export are of) instead of built from
`hidden_dim` here. The steps return their loss, which the framework averages over each set and names `<stage>/loss`
(Lightning's logs `{stage}_loss` itself). What is new is the second validation set: the held-out digits
(`data.val`, dataloader_idx 0, `val/loss`) and the same digits under Gaussian noise, to be reconstructed as the clean
ones (`data.val_sets.noisy`, dataloader_idx 1, `val/loss/noisy`): how far from the digit a corrupted input lands.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from framework.core.reproducibility import generator
from framework.task.task import Task
from framework.zoo.datasets import digits


class AutoEncoder(nn.Module):
    """Lightning's encoder and decoder: an image to `latent_dim` numbers and back, through `hidden_dim` units."""

    def __init__(self, input_shape: Sequence[int] = (1, 8, 8), hidden_dim: int = 64, latent_dim: int = 3) -> None:
        super().__init__()
        self.input_shape, pixels = tuple(input_shape), math.prod(input_shape)
        self.encoder = nn.Sequential(nn.Linear(pixels, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, latent_dim))
        self.decoder = nn.Sequential(nn.Linear(latent_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, pixels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x.flatten(1))).view(-1, *self.input_shape)


def noisy_digits(split: str, std: float = 0.3, noise_seed: int = 0, **digits_options: Any) -> TensorDataset:
    """The digits of `split` (framework.zoo.datasets.digits, with its options) as (noisy image, clean image) pairs:
    Gaussian noise of `std`, drawn once from `noise_seed` (the same set at every validation), pixels kept in 0..1."""
    images, _labels = digits(split, **digits_options).tensors
    noise = torch.randn(images.shape, generator=generator(noise_seed)) * std
    return TensorDataset((images + noise).clamp(0.0, 1.0), images)


class LitAutoEncoder(Task):
    def __init__(self, net: AutoEncoder) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self._common_step(batch, batch_idx, "val", dataloader_idx)

    def predict_step(self, batch: Any, batch_idx: int = 0) -> dict[str, torch.Tensor]:
        """Each digit's reconstruction, flattened, as column "reconstruction"."""
        x, _ = self._prepare_batch(batch)
        return {"reconstruction": self(x).flatten(1)}

    def _prepare_batch(self, batch: Any, dataloader_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, the image it should come back as): a digit and itself; in the noisy set (dataloader_idx 1), a
        corrupted digit and the clean one."""
        x, y = batch
        return x, (x if dataloader_idx == 0 else y)

    def _common_step(self, batch: Any, batch_idx: int, stage: str, dataloader_idx: int = 0) -> torch.Tensor:
        x, target = self._prepare_batch(batch, dataloader_idx)
        return F.mse_loss(self(x), target)
