"""Marginal time per training step of `experiment=gan` (manual optimization, two optimizers) in the framework,
against the same GAN trained by a loop written by hand.

    python bench/gan.py                      # 5 repetitions, 200 and 800 steps
    python bench/gan.py --reps 9 --threads 1

Measured as bench/overhead.py measures (its `measure`, in this one process): each contender runs a short and a long
length, its marginal cost is (t_long - t_short) / (long - short), contenders alternate within each repetition (the
order rotating), figures are medians over repetitions and the ratio is the median of per-repetition ratios.

Contenders:
- framework  `Trainer(cfg, run_dir).fit()` on the config `python run.py experiment=gan` composes, quietened as
             overhead.py's `experiment=bench` is: no checkpoints, no validation or test, no progress bar,
             TensorBoard every 50 steps (the experiment's own `callbacks: none` is kept);
- hand       `hand_loop` below: the same Generator and Discriminator (experiments/gan.py), built in the same order
             from the same seed, the digits' train split as tensors, batches of 64 through a per-epoch permutation
             gathered once (what the framework's in-memory path does; fairer to the hand loop than a DataLoader,
             which costs more per batch), the task's step written out: the other net's parameters frozen with
             requires_grad_(False) while one net trains (Lightning's toggle/untoggle), BCE losses, each Adam
             (lr 2e-4, betas 0.5, 0.999) stepped and zeroed, one `torch.randn` noise per step; g_loss and d_loss
             to a SummaryWriter every 50 steps and, as the task's on_train_epoch_end, a grid of generated digits
             at each epoch's end.

Target (issue 44): framework <= 1.10 x the hand loop. Nothing here is asserted by the test suite: wall-clock time
depends on the machine and on what else runs.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):  # `python bench/gan.py` from anywhere
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import overhead  # noqa: E402

from experiments.gan import Discriminator, Generator  # noqa: E402
from framework.zoo.datasets import digits  # noqa: E402  (the framework's own data, bit for bit)

TARGET = 1.10
SEED = 42  # conf/htf.yaml's seed: the hand loop's nets start from the framework's weights
LATENT_DIM, IMG_SHAPE = 32, (1, 8, 8)  # conf/model/gan_generator.yaml, conf/data/digits.yaml
BATCH_SIZE = 64  # conf/data/digits.yaml (drop_last false: each epoch ends with a short batch)
LR, BETAS = 2.0e-4, (0.5, 0.999)  # conf/experiment/gan.yaml's two Adams
LOG_EVERY = 50
QUIET = ("checkpoint=none", "data.val=null", "data.test=null", "trainer.test=false", "logger.progress_bar=false",
         "logger.tensorboard=true", f"trainer.log_every_n_steps={LOG_EVERY}")


# ---------------------------------------------------------------------------------------------- framework
def framework_runner(device: str, lengths: tuple[int, ...]) -> Callable[[int, str], None]:
    """Runs `Trainer(cfg).fit()`; the configs of every length are composed here, outside the timed runs."""
    from framework.loop.trainer import Trainer

    configs = {n: overhead.compose_bench(n, device, QUIET, experiment="gan") for n in lengths}

    def run(max_steps: int, log_dir: str) -> None:
        cfg = copy.deepcopy(configs[max_steps])
        with contextlib.redirect_stdout(io.StringIO()):  # the closing summary
            summary = Trainer(cfg, Path(log_dir)).fit()
        assert summary["step"] == max_steps, summary

    return run


# ---------------------------------------------------------------------------------------------- by hand
def make_nets() -> tuple[Generator, Discriminator, torch.Tensor]:
    """The generator, the discriminator and the epoch-end grid's noise, drawn in the task's order (its generator,
    discriminator and validation_z) from the same seed: the same initial weights."""
    torch.manual_seed(SEED)
    generator = Generator(latent_dim=LATENT_DIM, img_shape=IMG_SHAPE)
    discriminator = Discriminator(img_shape=IMG_SHAPE)
    return generator, discriminator, torch.randn(8, LATENT_DIM)


def set_requires_grad(params: list[torch.nn.Parameter], flag: bool) -> None:
    for param in params:
        param.requires_grad_(flag)


def hand_loop(max_steps: int, log_dir: str | Path, device: str | torch.device = "cpu") -> tuple[int, float, float]:
    """Lightning's basic GAN step by hand; returns the steps taken and the last g_loss and d_loss logged."""
    import torchvision
    from torch.utils.tensorboard import SummaryWriter

    device = torch.device(device)
    generator, discriminator, validation_z = make_nets()
    generator.to(device), discriminator.to(device)
    validation_z = validation_z.to(device)
    g_params, d_params = list(generator.parameters()), list(discriminator.parameters())
    opt_g = torch.optim.Adam(g_params, lr=LR, betas=BETAS)
    opt_d = torch.optim.Adam(d_params, lr=LR, betas=BETAS)
    images = digits("train", pixel_range=(-1.0, 1.0)).tensors[0].to(device)  # as experiment=gan's data
    order_rng = torch.Generator().manual_seed(SEED)
    writer = SummaryWriter(log_dir=str(log_dir))
    step, epoch, last = 0, 0, (float("nan"), float("nan"))
    while step < max_steps:
        generator.train(), discriminator.train()
        shuffled = images.index_select(0, torch.randperm(len(images), generator=order_rng).to(device))
        for i in range(0, len(shuffled), BATCH_SIZE):
            imgs = shuffled[i: i + BATCH_SIZE]
            z = torch.randn(imgs.shape[0], LATENT_DIM).type_as(imgs)

            set_requires_grad(d_params, False)  # the generator's step
            valid = torch.ones(imgs.size(0), 1).type_as(imgs)
            g_loss = F.binary_cross_entropy_with_logits(discriminator(generator(z)), valid)
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            set_requires_grad(d_params, True)

            set_requires_grad(g_params, False)  # the discriminator's step
            real_loss = F.binary_cross_entropy_with_logits(discriminator(imgs), valid)
            fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
            fake_loss = F.binary_cross_entropy_with_logits(discriminator(generator(z).detach()), fake)
            d_loss = (real_loss + fake_loss) / 2
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            set_requires_grad(g_params, True)

            step += 1
            if step % LOG_EVERY == 0:  # the only host syncs
                last = (g_loss.item(), d_loss.item())
                writer.add_scalar("g_loss", last[0], step)
                writer.add_scalar("d_loss", last[1], step)
            if step >= max_steps:
                break
        else:  # a whole epoch: the task's on_train_epoch_end (Lightning's: in training mode, with autograd)
            sample_imgs = generator(validation_z)
            writer.add_image("generated_images", torchvision.utils.make_grid(sample_imgs), epoch)
            epoch += 1
    writer.close()
    return step, *last


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> overhead.Timings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions (default 5)")
    parser.add_argument("--short", type=int, default=200, help="steps of the short run (default 200)")
    parser.add_argument("--long", type=int, default=800, help="steps of the long run (default 800)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own default)")
    parser.add_argument("--clock", choices=sorted(overhead.CLOCKS), default="wall",
                        help="wall (default) or cpu (this process's CPU time; with --threads 1 on a shared machine)")
    args = parser.parse_args(argv)
    if args.long <= args.short or args.short < 1 or args.reps < 1:
        parser.error("expected 1 <= --short < --long and --reps >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    contenders: dict[str, Callable[[int, str], Any]] = {
        "framework": framework_runner(args.device, (args.short, args.long)),
        "hand": lambda n, d: hand_loop(n, d, args.device),
    }
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {load:.2f}")
    print(f"{args.reps} alternating repetitions of {args.short} and {args.long} steps; "
          f"marginal ms/step = (t_long - t_short) / {args.long - args.short}, {args.clock} clock")
    start = time.perf_counter()
    timings = overhead.measure(contenders, args.reps, args.short, args.long, clock=overhead.CLOCKS[args.clock])
    seconds = time.perf_counter() - start
    load_after = os.getloadavg()[0]

    print()
    print(f"{'marginal ms/step':16s} {'median':>8s} {'min':>8s} {'max':>8s} {'best-case':>10s}")
    for name in contenders:
        values = timings.marginal(name)
        print(f"{name:16s} {timings.median(name):8.3f} {min(values):8.3f} {max(values):8.3f} "
              f"{timings.best(name):10.3f}")
    med = timings.ratio("framework", "hand")
    print()
    print(f"{'ratio':20s} {'median':>7s} {'best-case':>10s}  target")
    print(f"{'framework / hand':20s} {med:7.3f} {timings.best('framework') / timings.best('hand'):10.3f}  "
          f"<= {TARGET:.2f}: {'PASS' if med <= TARGET else 'FAIL'}   "
          f"(per rep {', '.join(f'{x:.3f}' for x in timings.ratios('framework', 'hand'))})")
    busy = load >= 1.0
    print(f"\n{seconds:.0f} s of measurement; load average {load:.2f} before, {load_after:.2f} after"
          + ("  (other processes were busy before the start: figures may be noisy)" if busy else ""))
    return timings


if __name__ == "__main__":
    main()
