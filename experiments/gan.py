"""Lightning's basic GAN (lightning/examples/pytorch/domain_templates/generative_adversarial_net.py), ported to the
digits (docs/gan.md).

What changed from Lightning's: the imports, the base class (`Task` for `LightningModule`) and `configure_optimizers`
(the two Adams are `optimizer.generator` and `optimizer.discriminator` in conf/experiment/gan.yaml, each owning its
net, their learning rate and betas the task's `lr`, `b1` and `b2`). The nets are sized for 8x8 digits, and the data
gives pixels in the generator's tanh range (`data.*.pixel_range: [-1, 1]`). The task builds both nets itself, as
Lightning's does, so the task is the run's model: a checkpoint's weights hold both, and export exports its `forward`
(the generator) on `example_input_array`. Added: `predict_step`, which samples digits (`python run.py predict`).
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
        )

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)  # a logit: the loss takes it with the sigmoid, which autocast allows


class GAN(Task):
    def __init__(
        self,
        img_shape: Sequence[int] = (1, 8, 8),
        lr: float = 0.0002,
        b1: float = 0.5,
        b2: float = 0.999,
        latent_dim: int = 32,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        # networks
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)

        self.validation_z = torch.randn(8, self.hparams.latent_dim)

        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch: Any) -> None:
        imgs, _ = batch

        opt_g, opt_d = self.optimizers()

        # sample noise
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # train the generator: how well does it fool the discriminator into labelling its images real?
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # train the discriminator: how well does it label the real images real and the generated ones fake?
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        # the discriminator's loss is the mean of the two
        d_loss = (real_loss + fake_loss) / 2

        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def on_train_epoch_end(self) -> None:
        z = self.validation_z.type_as(self.generator.model[0].weight)

        # a grid of digits generated from the same noise every epoch (TensorBoard's IMAGES tab)
        sample_imgs = self(z)
        grid = torchvision.utils.make_grid(sample_imgs)
        for logger in self.loggers:
            logger.experiment.add_image("generated_images", grid, self.current_epoch)

    def predict_step(self, batch: Any, batch_idx: int = 0) -> dict[str, torch.Tensor]:
        """Generated digits, one per sample of the batch: the images, flattened, as column "image"."""
        imgs = batch[0] if isinstance(batch, (tuple, list)) else batch
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)
        return {"image": self(z).flatten(1)}
