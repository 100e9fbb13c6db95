"""Marginal time per epoch on a realistic small workload: ResNet-18 on 3,000 32x32 PNGs read by torchvision's
ImageFolder, the framework against a hand-written loop and Lightning.

    python bench/realistic.py                                    # w0, w2 and ddp; no checkpoints; 3 repetitions
    python bench/realistic.py --settings w2 --checkpoint none,default --reps 5
    PYTHONPATH=<lightning> python bench/realistic.py             # Lightning too (not a dependency)

The data (written once, cached in the temp dir): scikit-learn's 8x8 digits (package data, no download), each
drawn 22-30 px high at a random place of a 32x32 RGB image, light ink of a random hue on a dark background of
another, with pixel noise; 10 class folders, 3,000 train PNGs made from 1,497 of the digits and 600 val PNGs
from the other 300.

Every contender trains the same thing: torchvision's resnet18(num_classes=10) as it is, seed 42 (what
conf/model/resnet18.yaml builds with model.stem=imagenet; its `auto` picks the CIFAR stem for 32x32 images, 16x
the compute, while the issue measured torchvision's own model), Resize(32, 32) + ToTensor, batch 64 shuffled,
val batch 256 after every epoch, SGD momentum 0.9 weight decay 5e-4 except biases and BatchNorm weights
(conf/optimizer/sgd.yaml) with lr 0.02 (the preset's 0.1 diverges in the first steps: 0.53 val accuracy after
2 epochs, against 0.8-0.9 at 0.02), fp32 on the CPU, train/loss to TensorBoard every 50 steps, and with
`--checkpoint default` a checkpoint after every epoch's validation:
- framework    `python run.py model=resnet18 data=image_folder ...` in a subprocess, as a user runs it (default
               callbacks, logger and checkpoint presets); timing read back from its TensorBoard events;
- handwritten  the loop of the PyTorch tutorials: DataLoader(num_workers=...) with torch's other defaults (its
               workers start again every epoch), `torch.save` of model and optimizer state to one file each
               epoch; DDP as in the PyTorch DDP tutorial (torch.multiprocessing.spawn, gloo,
               DistributedSampler), which leaves torch's thread settings alone (each process: all cores);
- lightning    a LightningModule under `lightning.pytorch.Trainer` (default ModelCheckpoint, strategy="ddp"
               for DDP; persistent workers, as Lightning advises), when `lightning` is importable; skipped
               otherwise.
The framework's defaults that an ordinary loop lacks (persistent workers; one intra-op thread per core under
DDP) count for it: that is what its users get.

Settings: w0 (DataLoader workers 0), w2 (workers 2), ddp (2 processes on the CPU, gloo, workers 0). Every run is a fresh process. Its marginal time per epoch is
(t_end(last epoch) - t_end(first epoch)) / (epochs - 1), where t_end is the moment an epoch's last training
batch is done (rank 0): start-up, imports and the first epoch's cold caches cancel; validation and
checkpointing stay in, at their real rate. Contenders alternate within each repetition and their order
rotates across repetitions; a ratio is the median of per-repetition ratios, with their spread (min-max).
Each contender must learn: its final val accuracy is printed (chance is 0.10).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]

NUM_CLASSES, SIZE = 10, 32
BATCH_SIZE, EVAL_BATCH_SIZE = 64, 256       # conf/data/image_folder.yaml
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.9, 5e-4  # conf/optimizer/sgd.yaml but for optimizer.lr (see above)
SEED = 42                                    # conf/config.yaml
LOG_EVERY = 50                               # conf/trainer/default.yaml
SETTINGS = {"w0": {"workers": 0, "procs": 1}, "w2": {"workers": 2, "procs": 1}, "ddp": {"workers": 0, "procs": 2}}
CHECKPOINTS = ("none", "default")
CONTENDERS = ("framework", "handwritten", "lightning")


# ---------------------------------------------------------------------------------------------- data
def make_images(root: Path, n_train: int = 3000, n_val: int = 600) -> Path:
    """The ImageFolder at `root` (written once: a finished folder is reused as it is)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    if (root / "done").exists():
        return root
    digits = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(digits.images))
    by_class = {split: [[i for i in part if digits.target[i] == c] for c in range(NUM_CLASSES)]
                for split, part in (("val", order[:300]), ("train", order[300:]))}
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    for split, count in (("train", n_train), ("val", n_val)):
        for c in range(NUM_CLASSES):
            (tmp / split / str(c)).mkdir(parents=True)
        for i in range(count):
            sources = by_class[split][i % NUM_CLASSES]  # every class in turn: each split has them all
            index = sources[i // NUM_CLASSES % len(sources)]
            size = int(rng.integers(22, 31))
            glyph = Image.fromarray((digits.images[index] * (255 / 16)).astype(np.uint8))
            mask = np.asarray(glyph.resize((size, size), Image.BILINEAR), dtype=np.float32)[..., None] / 255
            background, ink = rng.integers(0, 100, 3), rng.integers(160, 256, 3)  # light on dark, any hue
            image = np.broadcast_to(background.astype(np.float32), (SIZE, SIZE, 3)).copy()
            top, left = rng.integers(0, SIZE - size + 1, 2)
            patch = image[top:top + size, left:left + size]
            image[top:top + size, left:left + size] = patch * (1 - mask) + ink * mask
            image += rng.normal(0, 8, image.shape)
            pixels = np.clip(image, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp / split / str(digits.target[index]) / f"{i:05d}.png")
    (tmp / "done").touch()
    try:
        tmp.rename(root)
    except OSError:  # another invocation finished first: use its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return root


# ---------------------------------------------------------------------------------------------- shared pieces
def make_model() -> Any:
    """conf/model/resnet18.yaml's model with model.stem=imagenet for 3-channel images: torchvision's as it is."""
    import torch
    import torchvision

    torch.manual_seed(SEED)
    return torchvision.models.resnet18(weights=None, num_classes=NUM_CLASSES)


def make_optimizer(model: Any) -> Any:
    """conf/optimizer/sgd.yaml: no weight decay for biases and normalization-layer weights."""
    import torch
    from torch import nn

    norm = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
    no_decay = {id(p) for m in model.modules() if isinstance(m, norm) for p in m.parameters(recurse=False)}
    no_decay |= {id(p) for name, p in model.named_parameters() if name.endswith("bias")}
    params = list(model.parameters())
    groups = [{"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
              {"params": [p for p in params if id(p) not in no_decay]}]
    return torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def make_datasets(data: Path) -> dict[str, Any]:
    """conf/data/image_folder.yaml's transforms."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    transform = transforms.Compose([transforms.Resize((SIZE, SIZE)), transforms.ToTensor()])
    return {split: ImageFolder(str(data / split), transform=transform) for split in ("train", "val")}


def loader_options(workers: int) -> dict[str, Any]:
    """conf/data/image_folder.yaml's, which Lightning also advises (pin_memory is moot on the CPU)."""
    return {"num_workers": workers, "persistent_workers": workers > 0, "prefetch_factor": 2 if workers else None}


def thread_settings() -> dict[str, Any]:
    import torch

    return {"pid": os.getpid(), "num_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


# ---------------------------------------------------------------------------------------------- hand-written
def handwritten_worker(rank: int, world: int, port: int, data: Path, out: Path, workers: int, epochs: int,
                       checkpoint: str) -> None:
    """Rank `rank` of the hand-written loop's `world` processes (one: no DDP)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler
    from torch.utils.tensorboard import SummaryWriter

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    datasets = make_datasets(data)
    model = make_model()
    optimizer = make_optimizer(model)
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    loss_fn = nn.CrossEntropyLoss()
    samplers = {split: DistributedSampler(ds, shuffle=split == "train", seed=SEED) if world > 1 else None
                for split, ds in datasets.items()}
    train = DataLoader(datasets["train"], BATCH_SIZE, shuffle=samplers["train"] is None, sampler=samplers["train"],
                       num_workers=workers)  # torch's defaults otherwise: the workers restart every epoch
    val = DataLoader(datasets["val"], EVAL_BATCH_SIZE, sampler=samplers["val"], num_workers=workers)
    writer = SummaryWriter(str(out.parent / "tb")) if rank == 0 else None
    stamps, step, acc = [], 0, float("nan")
    for epoch in range(epochs):
        if samplers["train"] is not None:
            samplers["train"].set_epoch(epoch)
        net.train()
        for x, y in train:
            loss = loss_fn(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % LOG_EVERY == 0 and writer is not None:
                writer.add_scalar("train/loss", loss.item(), step)
        stamps.append(time.time())
        model.eval()
        totals = torch.zeros(3)  # loss sum, correct, count
        with torch.no_grad():
            for x, y in val:
                logits = model(x)
                totals += torch.stack([loss_fn(logits, y) * len(y), (logits.argmax(1) == y).sum(),
                                       torch.tensor(len(y))])
        if world > 1:
            dist.all_reduce(totals)
        acc = float(totals[1] / totals[2])
        if rank == 0:
            writer.add_scalar("val/loss", float(totals[0] / totals[2]), step)
            writer.add_scalar("val/acc", acc, step)
            if checkpoint == "default":
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           out.parent / "last.pt")
    if rank == 0:
        writer.close()
        out.write_text(json.dumps({"stamps": stamps, "val_acc": acc, "threads": thread_settings()}))
    if world > 1:
        dist.destroy_process_group()


def handwritten(data: Path, out: Path, workers: int, procs: int, epochs: int, checkpoint: str) -> None:
    if procs == 1:
        handwritten_worker(0, 1, 0, data, out, workers, epochs, checkpoint)
        return
    import torch.multiprocessing as mp

    mp.spawn(handwritten_worker, args=(procs, free_port(), data, out, workers, epochs, checkpoint), nprocs=procs)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- lightning
def lightning_available() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("lightning", "pytorch_lightning"))


def lightning(data: Path, out: Path, workers: int, procs: int, epochs: int, checkpoint: str) -> None:
    """The same training as a LightningModule. With strategy="ddp" Lightning runs this script again for rank 1."""
    import logging
    import warnings

    from torch import nn
    from torch.utils.data import DataLoader

    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl  # type: ignore[no-redef]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()
            self.loss_fn = nn.CrossEntropyLoss()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = self.loss_fn(self.model(x), y)
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self.model(x)
            self.log("val/loss", self.loss_fn(logits, y), sync_dist=True)
            self.log("val/acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

        def configure_optimizers(self) -> Any:
            return make_optimizer(self.model)

    class Stamps(pl.Callback):
        """When each epoch's last training batch is done (Lightning validates right after it)."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx + 1 == trainer.num_training_batches:
                self.stamps.append(time.time())

    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    datasets = make_datasets(data)
    stamps = Stamps()
    trainer = pl.Trainer(
        accelerator="cpu", devices=procs, strategy="ddp" if procs > 1 else "auto", precision="32-true",
        max_epochs=epochs, callbacks=[stamps], enable_checkpointing=checkpoint == "default",
        logger=pl.loggers.TensorBoardLogger(str(out.parent), name="", version=""), log_every_n_steps=LOG_EVERY,
        enable_progress_bar=False, default_root_dir=str(out.parent))
    trainer.fit(Module(), DataLoader(datasets["train"], BATCH_SIZE, shuffle=True, **loader_options(workers)),
                DataLoader(datasets["val"], EVAL_BATCH_SIZE, **loader_options(workers)))
    if trainer.is_global_zero:
        out.write_text(json.dumps({"stamps": stamps.stamps, "val_acc": float(trainer.callback_metrics["val/acc"]),
                                   "threads": thread_settings()}))


# ---------------------------------------------------------------------------------------------- framework
def framework_overrides(data: Path, run_dir: Path, workers: int, procs: int, epochs: int,
                        checkpoint: str) -> list[str]:
    """The command line a user would type: the presets by name, the workload's values as overrides."""
    return ["model=resnet18", "model.stem=imagenet", "data=image_folder", f"data.root={data}",
            f"data.num_classes={NUM_CLASSES}", f"data.input_shape=[3,{SIZE},{SIZE}]", f"data.num_workers={workers}",
            f"optimizer.lr={LR}", f"trainer.max_epochs={epochs}", "trainer.device=cpu", f"checkpoint={checkpoint}",
            f"parallel={'ddp' if procs > 1 else 'single'}", "logger.progress_bar=false", f"hydra.run.dir={run_dir}"]


def framework_result(run_dir: Path) -> dict[str, Any]:
    """Its epochs' ends from the run directory: the wall time of each epoch's perf/samples_per_s event, which the
    trainer logs when the epoch's last training batch is done, before validation."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"stamps": [e.wall_time for e in events.Scalars("perf/samples_per_s")], "val_acc": summary["val/acc"]}


# ---------------------------------------------------------------------------------------------- measuring
def run_once(contender: str, setting: str, checkpoint: str, data: Path, epochs: int, base: Path) -> dict[str, Any]:
    """One fresh run of `contender`: {"epoch_s": marginal seconds per epoch, "val_acc": ..., ...}."""
    work = Path(tempfile.mkdtemp(prefix=f"{contender}-{setting}-", dir=base))
    workers, procs = SETTINGS[setting]["workers"], SETTINGS[setting]["procs"]
    if contender == "framework":
        command = [sys.executable, str(ROOT / "run.py"),
                   *framework_overrides(data, work / "run", workers, procs, epochs, checkpoint)]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--run", contender, "--data", str(data),
                   "--out", str(work / "result.json"), "--settings", setting, "--checkpoint", checkpoint,
                   "--epochs", str(epochs)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:  # kept, with its output, for a look at what went wrong
        (work / "stdout.txt").write_text(proc.stdout)
        (work / "stderr.txt").write_text(proc.stderr)
        kept = Path(tempfile.gettempdir()) / f"bench-realistic-failed-{work.name}"
        shutil.move(str(work), kept)
        raise RuntimeError(f"{contender} ({setting}, checkpoint {checkpoint}) failed (exit code {proc.returncode}; "
                           f"its files and output are in {kept}):\n{proc.stderr[-3000:]}")
    try:
        result = (framework_result(work / "run") if contender == "framework"
                  else json.loads((work / "result.json").read_text()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stamps = result["stamps"]
    assert len(stamps) == epochs, (contender, stamps)
    result["epoch_s"] = (stamps[-1] - stamps[0]) / (epochs - 1)
    return result


def busy_fraction(seconds: float = 5.0) -> float:
    """The fraction of the machine's CPU time spent busy over the next `seconds` (Linux: /proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:8]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    total, idle = sample()
    time.sleep(seconds)
    total2, idle2 = sample()
    return 1 - (idle2 - idle) / max(1, total2 - total)


def wait_until_quiet(limit_s: float, threshold: float = 0.10) -> float:
    """Wait (at most `limit_s`) until other processes keep the CPUs under `threshold` busy; returns the last
    busy fraction seen. On a shared machine a run measured while others compute says little."""
    deadline = time.monotonic() + limit_s
    busy = busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction()
    return busy


def measure(contenders: list[str], settings: list[str], checkpoints: list[str], data: Path, epochs: int, reps: int,
            quiet_s: float = 0.0, report: Any = print) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """Every (setting, checkpoint, contender) once per repetition: within a setting the runs alternate, and their
    order rotates from one repetition to the next. With `quiet_s`, each run first waits (up to that long) for
    the machine to be idle. Returns the runs of each, in repetition order."""
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {
        (s, c, name): [] for s in settings for c in checkpoints for name in contenders}
    with tempfile.TemporaryDirectory(prefix="bench-realistic-") as base:
        for rep in range(reps):
            for setting in settings:
                jobs = [(c, name) for c in checkpoints for name in contenders]
                jobs = jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]
                line, busy = [], []
                for checkpoint, name in jobs:
                    if quiet_s:
                        busy.append(wait_until_quiet(quiet_s))
                    result = run_once(name, setting, checkpoint, data, epochs, Path(base))
                    runs[setting, checkpoint, name].append(result)
                    line.append(f"{name}/{checkpoint} {result['epoch_s']:.2f} s (acc {result['val_acc']:.2f})")
                others = f" [CPUs busy before each run: up to {100 * max(busy):.0f}%]" if busy else ""
                report(f"  rep {rep + 1}/{reps} {setting}: " + ", ".join(line) + others)
    return runs


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def summarize(runs: dict[tuple[str, str, str], list[dict[str, Any]]], contenders: list[str], settings: list[str],
              checkpoints: list[str], n_train: int, report: Any = print) -> dict[str, list[float]]:
    """The table per setting and checkpoint mode, then the ratios: median of per-repetition ratios (min-max)."""
    ratios: dict[str, list[float]] = {}
    for setting in settings:
        for checkpoint in checkpoints:
            report(f"\n{setting} ({SETTINGS[setting]['workers']} workers, {SETTINGS[setting]['procs']} process(es)), "
                   f"checkpoint {checkpoint}")
            report(f"  {'contender':12s} {'s/epoch median (min-max)':>26s} {'samples/s':>10s}  val acc (per rep)")
            for name in contenders:
                seconds = [r["epoch_s"] for r in runs[setting, checkpoint, name]]
                accs = ", ".join(f"{r['val_acc']:.2f}" for r in runs[setting, checkpoint, name])
                report(f"  {name:12s} {spread(seconds):>26s} {n_train / statistics.median(seconds):10.0f}  {accs}")
            for other in contenders[1:]:
                key = f"{setting}/{checkpoint}: {contenders[0]} / {other}"
                ratios[key] = [a["epoch_s"] / b["epoch_s"] for a, b in
                               zip(runs[setting, checkpoint, contenders[0]], runs[setting, checkpoint, other])]
        if set(CHECKPOINTS) <= set(checkpoints):
            for name in contenders:
                key = f"{setting}: {name} checkpoint default / none"
                ratios[key] = [a["epoch_s"] / b["epoch_s"] for a, b in
                               zip(runs[setting, "default", name], runs[setting, "none", name])]
    report(f"\n{'ratio of s/epoch':48s} {'median (min-max)':>22s}  per rep")
    for key, values in ratios.items():
        report(f"{key:48s} {spread(values):>22s}  {', '.join(f'{v:.3f}' for v in values)}")
    low = [f"{s}/{c}/{n}" for (s, c, n), rs in runs.items() for r in rs if r["val_acc"] < 0.5]
    if low:
        report(f"\nWARNING: val accuracy under 0.5 in {', '.join(sorted(set(low)))}: not learning as expected")
    return ratios


def main(argv: Optional[list[str]] = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions (default 3)")
    parser.add_argument("--settings", default="w0,w2,ddp", help=f"of {', '.join(SETTINGS)} (default all)")
    parser.add_argument("--checkpoint", default="none",
                        help="none (checkpoint=none), default (the default checkpoints) or none,default")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run, >= 2 (default 2)")
    parser.add_argument("--contenders", default=None,
                        help=f"of {', '.join(CONTENDERS)} (default: all, lightning when installed)")
    parser.add_argument("--data", type=Path, default=None,
                        help="the ImageFolder's folder, written there if not yet (default: a cache in the temp dir)")
    parser.add_argument("--images", type=int, default=3000, help="training images (default 3000; val: a fifth)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each run, wait up to SECONDS for the CPUs to be idle (under 10%% busy over 5 s): "
                             "for a machine shared with other work (default 0: do not wait)")
    parser.add_argument("--run", choices=CONTENDERS[1:], help=argparse.SUPPRESS)  # one run, in this process
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings, checkpoints = args.settings.split(","), args.checkpoint.split(",")
    if args.run:
        run = handwritten if args.run == "handwritten" else lightning
        run(args.data, args.out, SETTINGS[settings[0]]["workers"], SETTINGS[settings[0]]["procs"], args.epochs,
            checkpoints[0])
        return {}
    contenders = (args.contenders.split(",") if args.contenders
                  else [c for c in CONTENDERS if c != "lightning" or lightning_available()])
    for names, known, option in ((settings, SETTINGS, "--settings"), (checkpoints, CHECKPOINTS, "--checkpoint"),
                                 (contenders, CONTENDERS, "--contenders")):
        if not names or any(n not in known for n in names):
            parser.error(f"{option}: expected a comma-separated list of {', '.join(known)}")
    if args.epochs < 2 or args.reps < 1 or args.images < NUM_CLASSES:
        parser.error("expected --epochs >= 2, --reps >= 1 and --images >= 10")
    n_val = max(NUM_CLASSES, args.images // 5)
    data = args.data or Path(tempfile.gettempdir()) / f"bench-realistic-{args.images}-v1"
    make_images(data, args.images, n_val)

    import torch

    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load:.2f}; data {data} "
          f"({args.images} train + {n_val} val PNGs)")
    print(f"{args.reps} repetitions of {', '.join(contenders)}; {args.epochs} epochs per run; marginal s/epoch = "
          f"(end of epoch {args.epochs} - end of epoch 1) / {args.epochs - 1}")
    if "lightning" not in contenders:
        print("lightning: not installed (or not in --contenders); skipped")
    start = time.perf_counter()
    runs = measure(contenders, settings, checkpoints, data, args.epochs, args.reps, args.wait_quiet)
    ratios = summarize(runs, contenders, settings, checkpoints, args.images)
    print(f"\n{time.perf_counter() - start:.0f} s of measurement; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    return ratios


if __name__ == "__main__":
    main()
