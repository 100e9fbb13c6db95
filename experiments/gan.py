"""Lightning's basic GAN (lightning/examples/pytorch/domain_templates/generative_adversarial_net.py), ported to the
digits (docs/recipes/gan.md).

What changed from Lightning's: the imports, the base class (`Task` for `LightningModule`), `configure_optimizers`
(the two Adams, betas (0.5, 0.999), are `optimizer.generator` and `optimizer.discriminator` in
conf/experiment/gan.yaml, each owning its net), and the generator given by the `model` config group as `net` (the
model a checkpoint's weights, predict and export are of) instead of built from `latent_dim` here. The rest is
Lightning's: manual optimization with the generator's and the discriminator's alternating updates, each toggled, a
grid of generated digits logged to TensorBoard at every epoch's end.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from framework.task.task import Task


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 32, img_shape: Sequence[int] = (1, 8, 8)) -> None:
        super().__init__()
        self.img_shape = tuple(img_shape)

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 64, normalize=False),
            *block(64, 128),
            nn.Linear(128, math.prod(self.img_shape)),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: Sequence[int] = (1, 8, 8)) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(math.prod(img_shape), 128),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(128, 64),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(64, 1),
            nn.Sigmoid(),
        )

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.model(img.view(img.size(0), -1))


class GAN(Task):
    def __init__(self, net: Generator, latent_dim: int = 32, img_shape: Sequence[int] = (1, 8, 8)) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.automatic_optimization = False

        self.generator = net
        self.discriminator = Discriminator(img_shape=img_shape)

        self.validation_z = torch.randn(8, latent_dim)
        self.example_input_array = torch.zeros(2, latent_dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def adversarial_loss(self, y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy(y_hat, y)

    def training_step(self, batch: Any) -> None:
        imgs, _ = batch
        imgs = imgs * 2.0 - 1.0  # the digits' pixels (0..1) in the generator's tanh range
        optimizer_g, optimizer_d = self.optimizers()

        # sample noise
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # train generator
        self.toggle_optimizer(optimizer_g)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        # train discriminator: how well can it label as real the real and as fake the generated?
        self.toggle_optimizer(optimizer_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def on_train_epoch_end(self) -> None:
        """A grid of digits generated from the same noise every epoch (TensorBoard's IMAGES tab)."""
        if self.logger is None or self.logger.experiment is None:
            return
        was_training = self.generator.training
        self.generator.eval()
        with torch.no_grad():
            sample_imgs = self(self.validation_z.type_as(self.generator.model[0].weight))
        self.generator.train(was_training)
        grid = torchvision.utils.make_grid((sample_imgs + 1) / 2, nrow=4)
        self.logger.experiment.add_image("generated_images", grid, self.current_epoch)

    def predict_step(self, batch: Any, batch_idx: int = 0) -> dict[str, torch.Tensor]:
        """Generated digits, one per sample of the batch: the images, flattened, as column "image"."""
        imgs = batch[0] if isinstance(batch, (tuple, list)) else batch
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)
        return {"image": self(z).flatten(1)}
