"""Time per optimizer step of DDP with gradient accumulation: the framework's `no_sync` against an all-reduce
on every micro-batch.

    python bench/ddp_no_sync.py                      # 2 gloo processes on the CPU, accumulate 4, 5 repetitions
    python bench/ddp_no_sync.py --reps 7 --hidden 1024,1024

The workload is `experiment=bench` (synthetic in-memory data, SGD, fp32) with `parallel=ddp` on the CPU,
`trainer.accumulate_grad_batches=4` and a wider MLP (128-2048-2048-10 by default: 4.5 M parameters, an
18 MB gradient to all-reduce), so the all-reduce is a real share of a step. Two contenders:
- no_sync   the framework as it is: micro-batches before the last of a window run under
            DistributedDataParallel.no_sync, one all-reduce per optimizer step;
- every     DDPStrategy.no_sync returning None (the base Strategy's answer; patched here only), so every
            backward all-reduces: one all-reduce per micro-batch.

Two worker processes are spawned once and run every fit, each `Trainer(cfg).fit()` joining a fresh process
group on its own port. As in bench/overhead.py, each contender runs a short and a long length, and its
marginal cost is (t_long - t_short) / (long - short) optimizer steps, measured on rank 0 (start-up, process
group rendezvous included, cancels); contenders alternate within each repetition, the order rotating, after
one unmeasured warm-up run each; figures are medians over repetitions, a ratio the median of per-repetition
ratios. Nothing here is asserted by the test suite.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):  # `python bench/ddp_no_sync.py` from anywhere
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from overhead import Timings, compose_bench  # noqa: E402

CONTENDERS = ("no_sync", "every")
WORLD_SIZE = 2


def plan(reps: int, short: int, long: int) -> list[tuple[str, int, Optional[int]]]:
    """Every fit in order, as (contender, max_steps, repetition or None for a warm-up)."""
    fits: list[tuple[str, int, Optional[int]]] = [(name, short, None) for name in CONTENDERS]
    for rep in range(reps):
        order = CONTENDERS[rep % len(CONTENDERS):] + CONTENDERS[: rep % len(CONTENDERS)]
        fits += [(name, steps, rep) for name in order for steps in (short, long)]
    return fits


def _worker(rank: int, configs: dict[int, Any], fits: list[tuple[str, int, Optional[int]]], ports: list[int],
            threads: int, result: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    from framework.loop.trainer import Trainer
    from framework.parallel.strategy import DDPStrategy, Strategy

    framework_no_sync = DDPStrategy.no_sync
    seconds: list[float] = []
    for (name, steps, rep), port in zip(fits, ports):
        DDPStrategy.no_sync = framework_no_sync if name == "no_sync" else Strategy.no_sync
        os.environ["MASTER_PORT"] = str(port)
        with tempfile.TemporaryDirectory(prefix="bench-") as log_dir, contextlib.redirect_stdout(io.StringIO()):
            gc.collect()
            start = time.perf_counter()
            summary = Trainer(copy.deepcopy(configs[steps]), Path(log_dir)).fit()
            seconds.append(time.perf_counter() - start)
        assert summary["step"] == steps, summary
        if rank == 0 and rep is not None and len(seconds) % 2 == 0:  # a short and a long run: report them
            short_steps = fits[len(seconds) - 2][1]
            marginal = 1000 * (seconds[-1] - seconds[-2]) / (steps - short_steps)
            print(f"  rep {rep + 1}: {name} {marginal:.1f} ms/step", flush=True)
    if rank == 0:
        Path(result).write_text(json.dumps(seconds))


def measure(args: argparse.Namespace) -> Timings:
    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    from framework.app.launch import free_port

    extra = ("parallel=ddp", f"parallel.devices={WORLD_SIZE}", f"trainer.accumulate_grad_batches={args.accumulate}",
             f"data.batch_size={args.batch_size}", f"model.hidden=[{args.hidden}]", "callbacks=none")
    configs = {}
    for steps in (args.short, args.long):
        configs[steps] = compose_bench(steps, "cpu", extra)
        OmegaConf.resolve(configs[steps])  # spawned workers have no HydraConfig to resolve `${hydra:...}` with
    fits = plan(args.reps, args.short, args.long)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        result = os.path.join(tmp, "seconds.json")
        mp.start_processes(_worker, args=(configs, fits, [free_port() for _ in fits], args.threads, result),
                           nprocs=WORLD_SIZE, start_method="spawn")
        seconds = json.loads(Path(result).read_text())
    timings = Timings(list(CONTENDERS), args.short, args.long)
    measured = [(name, steps, s) for (name, steps, rep), s in zip(fits, seconds) if rep is not None]
    for (name, _, t_short), (_, _, t_long) in zip(measured[::2], measured[1::2]):
        timings.runs[name].append((t_short, t_long))
    return timings


def main(argv: Optional[list[str]] = None) -> Timings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions (default 5)")
    parser.add_argument("--short", type=int, default=10, help="optimizer steps of the short run (default 10)")
    parser.add_argument("--long", type=int, default=40, help="optimizer steps of the long run (default 40)")
    parser.add_argument("--accumulate", type=int, default=4, help="trainer.accumulate_grad_batches (default 4)")
    parser.add_argument("--batch-size", type=int, default=64, help="micro-batch size per process (default 64)")
    parser.add_argument("--hidden", default="2048,2048", help="hidden widths of the MLP (default 2048,2048)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // WORLD_SIZE),
                        help="torch threads per process (default: CPUs / 2)")
    args = parser.parse_args(argv)
    if args.long <= args.short or args.short < 1 or args.reps < 1 or args.accumulate < 2:
        parser.error("expected 1 <= --short < --long, --reps >= 1 and --accumulate >= 2")
    try:
        hidden = [int(w) for w in args.hidden.split(",")]
    except ValueError:
        parser.error(f"--hidden={args.hidden!r}: expected comma-separated widths such as 2048,2048")
    widths = [128, *hidden, 10]
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))

    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {WORLD_SIZE} gloo processes x {args.threads} threads, {os.cpu_count()} CPUs, "
          f"load average {load:.2f}")
    print(f"MLP {'-'.join(map(str, widths))} ({params / 1e6:.2f} M parameters, {4 * params / 2**20:.1f} MiB of "
          f"gradient), micro-batch {args.batch_size} per process, accumulate {args.accumulate}")
    print(f"{args.reps} alternating repetitions of {args.short} and {args.long} optimizer steps; "
          f"marginal ms/step = (t_long - t_short) / {args.long - args.short}, wall clock on rank 0")
    start = time.perf_counter()
    timings = measure(args)
    seconds = time.perf_counter() - start

    print()
    print(f"{'ms per optimizer step':22s} {'median':>8s} {'min':>8s} {'max':>8s} {'best-case':>10s}")
    for name in CONTENDERS:
        values = timings.marginal(name)
        print(f"{name:22s} {timings.median(name):8.1f} {min(values):8.1f} {max(values):8.1f} "
              f"{timings.best(name):10.1f}")
    print()
    print(f"every / no_sync: {timings.ratio('every', 'no_sync'):.3f} median "
          f"({timings.best('every') / timings.best('no_sync'):.3f} best-case; per rep "
          f"{', '.join(f'{x:.3f}' for x in timings.ratios('every', 'no_sync'))})")
    saved = statistics.median(a - b for a, b in zip(timings.marginal("every"), timings.marginal("no_sync")))
    print(f"saved per optimizer step: {saved:.1f} ms (median), for {args.accumulate - 1} all-reduces fewer")
    print(f"\n{seconds:.0f} s in all; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    return timings


if __name__ == "__main__":
    main()
