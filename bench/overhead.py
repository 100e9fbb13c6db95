"""Marginal time per training step: the framework on `experiment=bench` against the loops users write by hand.

    python bench/overhead.py                 # 5 repetitions, 300 and 1300 steps
    python bench/overhead.py --reps 9 --threads 1

Everything runs in this one process. Each contender is run for a short and a long length, and its marginal
cost is (t_long - t_short) / (long - short): start-up (building the trainer, the data, the SummaryWriter,
imports) cancels, and what is left is the cost of one more step, epoch boundaries and log steps included
at their real rate. Contenders alternate within each repetition (the order rotates from one repetition to
the next), so a slow patch of the machine hits them all; reported figures are medians over repetitions,
and a ratio is the median of the per-repetition ratios.

Contenders:
- framework    `Trainer(cfg).fit()` on the config `python run.py experiment=bench` composes;
- dataloader   bench/handwritten.py: a loop over DataLoader(TensorDataset(x, y), 128, shuffle, drop_last);
- permutation  bench/handwritten.py: a loop indexing the tensors through a per-epoch random permutation;
- lightning    the same model as a LightningModule on the same DataLoader, when `lightning` (or
               `pytorch_lightning`) is installed; skipped otherwise (it is not a dependency).

Targets (the performance issue): framework <= 0.80 x dataloader, framework <= 1.10 x permutation.
Nothing here is asserted by the test suite: wall-clock time depends on the machine and on what else runs.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):  # `python bench/overhead.py` from anywhere
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import handwritten  # noqa: E402

TARGETS = {"dataloader": 0.80, "permutation": 1.10}


# ---------------------------------------------------------------------------------------------- framework
def compose_bench(max_steps: int, device: str, extra: tuple[str, ...] = (), experiment: str = "bench") -> Any:
    """The config `python run.py experiment=bench trainer.max_steps=N` gets (or another `experiment`'s), composed
    with Hydra's compose API."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import framework.app.main  # noqa: F401  (the resolvers conf/config.yaml uses)
    import framework.config.schema

    framework.config.schema.register()  # the schemas conf/ is composed against
    from framework.config.validate import validate

    overrides = [f"experiment={experiment}", f"trainer.max_steps={max_steps}", f"trainer.device={device}", *extra]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # as Hydra does for a job, so `${hydra:...}` resolves
    with open_dict(cfg):
        del cfg["hydra"]
    framework.app.main.resolve_all(cfg)
    validate(cfg)
    return cfg


def framework_runner(device: str, lengths: tuple[int, ...],
                     hidden: tuple[int, ...] = handwritten.HIDDEN) -> Callable[[int, str], None]:
    """Runs `Trainer(cfg).fit()`; the configs of every length are composed here, outside the timed runs."""
    from framework.loop.trainer import Trainer

    extra = () if hidden == handwritten.HIDDEN else (f"model.hidden=[{','.join(map(str, hidden))}]",)
    configs = {n: compose_bench(n, device, extra) for n in lengths}

    def run(max_steps: int, log_dir: str) -> None:
        cfg = copy.deepcopy(configs[max_steps])
        with contextlib.redirect_stdout(io.StringIO()):  # the closing summary
            summary = Trainer(cfg, Path(log_dir)).fit()
        assert summary["step"] == max_steps, summary

    return run


# ---------------------------------------------------------------------------------------------- lightning
def lightning_runner(device: str, hidden: tuple[int, ...] = handwritten.HIDDEN) -> Optional[Callable[[int, str], None]]:
    """The workload under Lightning, or None when Lightning is not installed."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl  # type: ignore[no-redef]
        except ImportError:
            return None
    from torch import nn
    from torch.utils.data import DataLoader

    from framework.zoo.synthetic import classification

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = handwritten.make_model(hidden=hidden)
            self.loss_fn = nn.CrossEntropyLoss()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.loss_fn(self.model(x), y)
            self.log("train/loss", loss)  # logged every log_every_n_steps=50
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=handwritten.LR, momentum=handwritten.MOMENTUM)

    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    def run(max_steps: int, log_dir: str) -> None:
        torch.manual_seed(handwritten.SEED)
        dataset = classification(seed=handwritten.DATA_SEED)
        module = Module()
        loader = DataLoader(dataset, batch_size=handwritten.BATCH_SIZE, shuffle=True, drop_last=True)
        trainer = pl.Trainer(
            accelerator="cpu" if device == "cpu" else "gpu", devices=1, precision="32-true",
            max_steps=max_steps, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
            logger=pl.loggers.TensorBoardLogger(log_dir, name="", version=""), log_every_n_steps=handwritten.LOG_EVERY,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=log_dir)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            trainer.fit(module, loader)
        assert trainer.global_step == max_steps, trainer.global_step

    return run


# ---------------------------------------------------------------------------------------------- measuring
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(run: Callable[[int, str], Any], steps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-") as log_dir:
        gc.collect()
        start = clock()
        run(steps, log_dir)
        return clock() - start


class Timings:
    """Seconds of every short and long run, per contender, in repetition order."""

    def __init__(self, names: list[str], short: int, long: int) -> None:
        self.short, self.long = short, long
        self.runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}

    def marginal(self, name: str) -> list[float]:
        """ms/step of one more step, one value per repetition."""
        return [1000 * (t_long - t_short) / (self.long - self.short) for t_short, t_long in self.runs[name]]

    def median(self, name: str) -> float:
        return statistics.median(self.marginal(name))

    def best(self, name: str) -> float:
        """(fastest long run - fastest short run) / extra steps: another machine's load only ever adds time, so
        this is the least disturbed figure when repetitions disagree; a cross-check, not the headline."""
        shorts, longs = zip(*self.runs[name])
        return 1000 * (min(longs) - min(shorts)) / (self.long - self.short)

    def ratios(self, num: str, den: str) -> list[float]:
        """num / den per repetition: each pair ran seconds apart, in the same state of the machine."""
        return [a / b for a, b in zip(self.marginal(num), self.marginal(den))]

    def ratio(self, num: str, den: str) -> float:
        return statistics.median(self.ratios(num, den))


def measure(contenders: dict[str, Callable[[int, str], Any]], reps: int, short: int, long: int,
            report: Callable[[str], None] = print, clock: Callable[[], float] = time.perf_counter) -> Timings:
    """Short and long runs of every contender, contenders alternating, their order rotating each repetition."""
    names = list(contenders)
    for name in names:  # warm-up: imports, allocator, first-call costs; not measured
        timed(contenders[name], short, clock)
    timings = Timings(names, short, long)
    for rep in range(reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        line = []
        for name in order:
            t_short = timed(contenders[name], short, clock)
            t_long = timed(contenders[name], long, clock)
            timings.runs[name].append((t_short, t_long))
            line.append(f"{name} {timings.marginal(name)[-1]:.3f}")
        report(f"  rep {rep + 1}/{reps}: " + ", ".join(line) + " ms/step")
    return timings


def main(argv: Optional[list[str]] = None) -> Timings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions (default 5)")
    parser.add_argument("--short", type=int, default=300, help="steps of the short run (default 300)")
    parser.add_argument("--long", type=int, default=1300, help="steps of the long run (default 1300)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present, as trainer.device=auto), cpu or cuda")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall (default): elapsed time, what the targets are about; cpu: this process's CPU "
                             "time, which time spent waiting for other processes does not inflate (use it with "
                             "--threads 1 on a shared machine: with more threads it also counts idle spinning)")
    parser.add_argument("--no-lightning", action="store_true", help="leave Lightning out even when installed")
    parser.add_argument("--hidden", default="256,256",
                        help="hidden widths of the MLP (default 256,256, the bench workload); '' makes it one "
                             "Linear(128, 10), so the time per step is almost all overhead (a diagnostic, not the "
                             "workload the targets are about)")
    args = parser.parse_args(argv)
    if args.long <= args.short or args.short < 1 or args.reps < 1:
        parser.error("expected 1 <= --short < --long and --reps >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        hidden = tuple(int(w) for w in args.hidden.split(",") if w.strip())
    except ValueError:
        parser.error(f"--hidden={args.hidden!r}: expected comma-separated widths such as 256,256, or ''")

    contenders: dict[str, Callable[[int, str], Any]] = {
        "framework": framework_runner(args.device, (args.short, args.long), hidden),
        "dataloader": lambda n, d: handwritten.dataloader_loop(n, d, args.device, hidden),
        "permutation": lambda n, d: handwritten.permutation_loop(n, d, args.device, hidden),
    }
    lightning = None if args.no_lightning else lightning_runner(args.device, hidden)
    if lightning is not None:
        contenders["lightning"] = lightning

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {load:.2f}")
    if hidden != handwritten.HIDDEN:
        print(f"DIAGNOSTIC: MLP hidden widths {list(hidden)} instead of the bench workload's [256, 256]")
    print(f"{args.reps} alternating repetitions of {args.short} and {args.long} steps; "
          f"marginal ms/step = (t_long - t_short) / {args.long - args.short}, {args.clock} clock")
    if lightning is None:
        print("lightning: not installed (or --no-lightning); skipped")
    start = time.perf_counter()
    timings = measure(contenders, args.reps, args.short, args.long, clock=CLOCKS[args.clock])
    seconds = time.perf_counter() - start
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    print()
    print(f"{'marginal ms/step':16s} {'median':>8s} {'min':>8s} {'max':>8s} {'best-case':>10s}")
    for name in contenders:
        values = timings.marginal(name)
        print(f"{name:16s} {timings.median(name):8.3f} {min(values):8.3f} {max(values):8.3f} "
              f"{timings.best(name):10.3f}")
    print()
    print(f"{'ratio':26s} {'median':>7s} {'best-case':>10s}  target")
    for den, target in TARGETS.items():
        med = timings.ratio("framework", den)
        print(f"{'framework / ' + den:26s} {med:7.3f} {timings.best('framework') / timings.best(den):10.3f}  "
              f"<= {target:.2f}: {'PASS' if med <= target else 'FAIL'}   "
              f"(per rep {', '.join(f'{x:.3f}' for x in timings.ratios('framework', den))})")
    if lightning is not None:
        for num, den in (("lightning", "dataloader"), ("lightning", "permutation"), ("framework", "lightning")):
            print(f"{num + ' / ' + den:26s} {timings.ratio(num, den):7.3f} "
                  f"{timings.best(num) / timings.best(den):10.3f}")
    busy = load >= 1.0  # over the minute before the start, something else kept a core busy
    print(f"\n{seconds:.0f} s of measurement; load average {load:.2f} before, {load_after:.2f} after"
          + ("  (other processes were busy before the start: figures may be noisy)" if busy else ""))
    return timings


if __name__ == "__main__":
    main()
