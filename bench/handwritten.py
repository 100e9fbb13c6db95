"""The two training loops a careful user writes by hand for the `experiment=bench` workload.

Same data (framework/zoo/synthetic.py, same seed), same model layers and initialisation (global seed 42, as the
framework's `seed`), same optimizer, same batch size and the same TensorBoard logging of `train/loss`
every 50 steps, so `bench/overhead.py` compares the framework's own cost per step and nothing else.

- `dataloader_loop`: `DataLoader(TensorDataset(x, y), batch_size=128, shuffle=True, drop_last=True)`, the
  loop in every PyTorch tutorial;
- `permutation_loop`: no DataLoader; each epoch draws a random permutation and each batch indexes the
  tensors with its slice of it, the loop people write once they notice what the DataLoader costs.

Each returns the number of optimizer steps taken (always `max_steps`) and the last loss logged.
Run directly for a quick look: `python bench/handwritten.py --steps 500`.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/handwritten.py` from anywhere
    sys.path.insert(0, str(ROOT))

from framework.zoo.synthetic import classification  # noqa: E402  (the framework's own data, bit for bit)

SEED = 42          # conf/htf.yaml's seed: model initialisation is the same as the framework's
DATA_SEED = 0      # conf/experiment/bench.yaml's data.train.seed
BATCH_SIZE = 128
LR, MOMENTUM = 0.05, 0.9
LOG_EVERY = 50
HIDDEN = (256, 256)  # `--hidden` in overhead.py changes it, to look at overhead alone


def make_model(num_features: int = 128, num_classes: int = 10, hidden: Sequence[int] = HIDDEN) -> nn.Module:
    """128-256-256-10 with ReLU, written out as users do: the layers of framework.zoo.models.MLP (minus its no-op
    Flatten), created in the same order, so the same seed gives the same initial weights."""
    layers: list[nn.Module] = []
    width = num_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _setup(device: torch.device, hidden: Sequence[int]):
    torch.manual_seed(SEED)
    dataset = classification(seed=DATA_SEED)
    model = make_model(hidden=hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=0.0)
    return dataset, model, optimizer, nn.CrossEntropyLoss()


def dataloader_loop(max_steps: int, log_dir: str | Path, device: str | torch.device = "cpu",
                    hidden: Sequence[int] = HIDDEN) -> tuple[int, float]:
    """The textbook loop over a shuffling DataLoader."""
    from torch.utils.tensorboard import SummaryWriter

    device = torch.device(device)
    dataset, model, optimizer, loss_fn = _setup(device, hidden)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True,
                        pin_memory=device.type == "cuda")
    writer = SummaryWriter(log_dir=str(log_dir))
    model.train()
    step, last = 0, float("nan")
    while step < max_steps:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % LOG_EVERY == 0:  # the only host sync: once per 50 steps
                last = loss.item()
                writer.add_scalar("train/loss", last, step)
            if step >= max_steps:
                break
    writer.close()
    return step, last


def permutation_loop(max_steps: int, log_dir: str | Path, device: str | torch.device = "cpu",
                     hidden: Sequence[int] = HIDDEN) -> tuple[int, float]:
    """No DataLoader: the tensors on the device, a permutation per epoch, a gather per batch."""
    from torch.utils.tensorboard import SummaryWriter

    device = torch.device(device)
    dataset, model, optimizer, loss_fn = _setup(device, hidden)
    x_all, y_all = (t.to(device) for t in dataset.tensors)
    usable = len(x_all) - len(x_all) % BATCH_SIZE  # drop_last
    writer = SummaryWriter(log_dir=str(log_dir))
    model.train()
    step, last = 0, float("nan")
    while step < max_steps:
        perm = torch.randperm(len(x_all), device=device)
        for i in range(0, usable, BATCH_SIZE):
            idx = perm[i: i + BATCH_SIZE]
            loss = loss_fn(model(x_all[idx]), y_all[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % LOG_EVERY == 0:
                last = loss.item()
                writer.add_scalar("train/loss", last, step)
            if step >= max_steps:
                break
    writer.close()
    return step, last


LOOPS: dict[str, Callable[..., tuple[int, float]]] = {
    "dataloader": dataloader_loop,
    "permutation": permutation_loop,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    for name, loop in LOOPS.items():
        with tempfile.TemporaryDirectory() as log_dir:
            start = time.perf_counter()
            steps, last = loop(args.steps, log_dir, args.device)
            seconds = time.perf_counter() - start
        print(f"{name:12s} {steps} steps in {seconds:.2f} s ({1000 * seconds / steps:.3f} ms/step incl. start-up), "
              f"last logged loss {last:.4f}")


if __name__ == "__main__":
    main()
