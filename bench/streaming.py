"""Streaming from shards on disk: the framework's streaming split against the map-style in-memory loader and a
tar loop written by hand, on the bench workload.

    python bench/streaming.py                 # 3 repetitions, 200 and 1000 steps
    python bench/streaming.py --reps 5

The workload is `experiment=bench` (32,768 x 128 synthetic features, MLP 128-256-256-10, SGD, batch 128). Its
samples are written once, in storage order, as WebDataset shards in a temporary folder: 16 shards of 2,048
samples, each `KEY.npy` (128 float32) and `KEY.cls`. Contenders, each for a short and a long run, the cost per
step being (t_long - t_short) / (long - short) (start-up cancels), alternating within each repetition:

- stream       the framework, `experiment=bench` with `data.train` the shards (framework.data.shards.TarShards),
               data.num_workers=2 (persistent), shuffle_buffer 1000: the planned order, resumable at any batch;
- map          the framework, `experiment=bench` as it is: the in-memory tensors (the map-style fast path);
- hand         a tar loop as users write it: an IterableDataset giving each of 2 DataLoader workers every other
               shard (shard order shuffled per epoch), read front to back with `tarfile`, a shuffle buffer of
               1000, batches of 128 collated by the DataLoader; the same model, optimizer and logging.

Reported: samples/s of each (from the median cost per step), stream / hand (target >= 0.9) and the stream's
`perf/data_wait_frac` (the fraction of its training time spent waiting for a batch, the long runs' epochs).
Nothing here is asserted by the test suite: wall-clock time depends on the machine and on what else runs.
"""
from __future__ import annotations

import argparse
import copy
import io
import random
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):  # `python bench/streaming.py` from anywhere
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import handwritten  # noqa: E402
from overhead import compose_bench  # noqa: E402

from framework.zoo.shards import write_tar  # noqa: E402
from framework.zoo.synthetic import classification  # noqa: E402

SHARDS, PER_SHARD, WORKERS, BUFFER = 16, 2048, 2, 1000
TARGET = 0.9  # stream >= 0.9 x hand


def write_shards(folder: Path) -> str:
    """The bench data set as shards; returns their brace pattern."""
    x, y = classification(seed=handwritten.DATA_SEED).tensors
    for number in range(SHARDS):
        rows = range(number * PER_SHARD, (number + 1) * PER_SHARD)
        samples = []
        for i in rows:
            array = io.BytesIO()
            np.save(array, x[i].numpy())
            samples.append((f"{i:06d}", {"npy": array.getvalue(), "cls": str(int(y[i])).encode()}))
        write_tar(folder / f"bench-{number:06d}.tar", samples)
    return f"{folder}/bench-{{000000..{SHARDS - 1:06d}}}.tar"


# ---------------------------------------------------------------------------------------------- the framework
def framework_runner(lengths: tuple[int, ...], pattern: Optional[str]) -> Callable[[int, str], dict[str, Any]]:
    """`Trainer(cfg).fit()` on experiment=bench; with `pattern`, its training split streamed from the shards."""
    from omegaconf import open_dict

    from framework.loop.trainer import Trainer

    configs = {}
    for n in lengths:
        cfg = compose_bench(n, "cpu")
        if pattern is not None:
            with open_dict(cfg):
                cfg.data.train = {"_target_": "framework.data.shards.tar_shards", "shards": pattern}
                cfg.data.num_workers, cfg.data.persistent_workers, cfg.data.prefetch_factor = WORKERS, True, 2
                cfg.data.shuffle_buffer = BUFFER
        configs[n] = cfg

    def run(max_steps: int, log_dir: str) -> dict[str, Any]:
        import contextlib

        trainer = Trainer(copy.deepcopy(configs[max_steps]), Path(log_dir))
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                summary = trainer.fit()
        finally:
            trainer.data.close()  # its persistent workers, as framework.loop.trainer.train does
        assert summary["step"] == max_steps, summary
        return summary

    return run


# ---------------------------------------------------------------------------------------------- by hand
class TarStream(IterableDataset):
    """Each worker reads every WORKERS-th shard of a per-epoch shuffled list, front to back, through a buffer."""

    def __init__(self, paths: list[str]) -> None:
        self.paths, self.epoch = paths, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = random.Random(self.epoch)
        paths = list(self.paths)
        rng.shuffle(paths)
        buffer: list[tuple[torch.Tensor, int]] = []
        for path in paths[worker::workers]:
            with tarfile.open(path) as tar:
                pending: dict[str, Any] = {}
                for member in tar:
                    key, _, ext = member.name.partition(".")
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    pending[ext] = data
                    if "npy" in pending and "cls" in pending:
                        x = torch.from_numpy(np.load(io.BytesIO(pending["npy"])))
                        buffer.append((x, int(pending["cls"])))
                        pending = {}
                        if len(buffer) >= BUFFER:
                            yield buffer.pop(rng.randrange(len(buffer)))
        rng.shuffle(buffer)
        yield from buffer


def hand_loop(pattern: str) -> Callable[[int, str], dict[str, Any]]:
    from framework.data.streaming import expand_braces

    paths = expand_braces(pattern)

    def run(max_steps: int, log_dir: str) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        device = torch.device("cpu")
        _, model, optimizer, loss_fn = handwritten._setup(device, handwritten.HIDDEN)
        data = TarStream(paths)
        loader = DataLoader(data, batch_size=handwritten.BATCH_SIZE, num_workers=WORKERS, drop_last=True,
                            persistent_workers=False)
        writer = SummaryWriter(log_dir=log_dir)
        step = 0
        while step < max_steps:
            for x, y in loader:
                loss = loss_fn(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                if step % handwritten.LOG_EVERY == 0:
                    writer.add_scalar("train/loss", loss.item(), step)
                if step >= max_steps:
                    break
            data.epoch += 1
        writer.close()
        return {}

    return run


# ---------------------------------------------------------------------------------------------- measuring
def data_wait_frac(log_dir: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tag = "perf/data_wait_frac"
    return [e.value for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def measure(contenders: dict[str, Callable[[int, str], Any]], reps: int, short: int, long: int
            ) -> tuple[dict[str, list[float]], list[float]]:
    """Per contender, the cost per step of each repetition; and the stream's data-wait fractions."""
    costs: dict[str, list[float]] = {name: [] for name in contenders}
    waits: list[float] = []
    names = list(contenders)
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            seconds = {}
            for steps in (short, long):
                with tempfile.TemporaryDirectory(prefix="bench-") as log_dir:
                    start = time.perf_counter()
                    contenders[name](steps, log_dir)
                    seconds[steps] = time.perf_counter() - start
                    if name == "stream" and steps == long:
                        waits += data_wait_frac(log_dir)
            costs[name].append((seconds[long] - seconds[short]) / (long - short))
    return costs, waits


def main(argv: Optional[list[str]] = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--short", type=int, default=200)
    parser.add_argument("--long", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in this process")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="shards-") as folder:
        pattern = write_shards(Path(folder))
        lengths = (args.short, args.long)
        contenders = {"stream": framework_runner(lengths, pattern), "map": framework_runner(lengths, None),
                      "hand": hand_loop(pattern)}
        costs, waits = measure(contenders, args.reps, args.short, args.long)
    rates = {name: handwritten.BATCH_SIZE / statistics.median(c) for name, c in costs.items()}
    ratio = statistics.median(h / s for s, h in zip(costs["stream"], costs["hand"]))
    print(f"{'contender':<10} {'samples/s':>10}   ms/step (each repetition)")
    for name, c in costs.items():
        print(f"{name:<10} {rates[name]:>10.0f}   {'  '.join(f'{1000 * v:.3f}' for v in c)}")
    wait = statistics.mean(waits) if waits else float("nan")
    print(f"stream / hand = {ratio:.3f} (target >= {TARGET}); stream / map = {rates['stream'] / rates['map']:.3f}")
    print(f"stream perf/data_wait_frac = {wait:.3f} (mean over the long runs' epochs)")
    return {**{f"{n}_samples_per_s": r for n, r in rates.items()}, "stream_over_hand": ratio, "data_wait_frac": wait}


if __name__ == "__main__":
    main()
