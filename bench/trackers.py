"""What the trackers cost a training step: experiment=bench (log_every_n_steps=50) with every backend on at once
(logger=many: TensorBoard, CSV, MLflow on a SQLite store, W&B offline) against TensorBoard alone.

    python bench/trackers.py                 # 5 repetitions of 4 epochs (1,024 steps) each
    python bench/trackers.py --reps 9 --epochs 6

Every run is `python run.py experiment=bench ...` in a fresh process, one intra-op thread. A run's step time is
the median of its `perf/step_ms` over the epochs after the first (read from its TensorBoard events, which both
contenders write): start-up, imports and the MLflow store's opening are not in it; each epoch's MLflow and CSV
writes (at its end, and every 10 s) are. The contenders alternate within a repetition and their order rotates
across repetitions; the ratio is the median of per-repetition ratios, with their spread (min-max). The MLflow
store is made once before the first run, so every run opens an existing database. Target: <= 1.05.

On a machine whose speed varies between runs, that ratio's spread is wider than 5%. The script therefore also
times the trackers alone: every scalar the last `many` run wrote to metrics.csv, replayed in this process, step by
step, into fresh CSV, MLflow and offline W&B trackers (`Trackers`, as the run had them), with a flush at each epoch's end as the run
does; their time divided by the run's steps is the trackers' cost per step, set against TensorBoard alone's step
time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 256  # 32,768 samples / batch 128, drop_last
CONTENDERS = {"tensorboard": ("logger=tensorboard",), "many": ("logger=many",)}


def run(run_dir: Path, store: str, epochs: int, chosen: tuple[str, ...]) -> float:
    args = [sys.executable, str(ROOT / "run.py"), "experiment=bench", f"hydra.run.dir={run_dir}",
            f"trainer.max_steps={epochs * STEPS_PER_EPOCH}", f"logger.mlflow.tracking_uri={store}", *chosen]
    if chosen == CONTENDERS["tensorboard"]:
        args.remove(f"logger.mlflow.tracking_uri={store}")  # not chosen: its key does not exist
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "WANDB_SILENT": "true"}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout + proc.stderr)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return statistics.median(e.value for e in acc.Scalars("perf/step_ms")[1:])


def replay(metrics_csv: Path, tmp: Path, store: str, epochs: int) -> tuple[float, float, float]:
    """The trackers' own time: per training step (a run's scalars, logged again as the run logged them), of one
    commit of them all to MLflow, and of closing (once a run), in milliseconds."""
    import csv
    import time

    from omegaconf import OmegaConf

    from framework.observe.trackers import Trackers

    by_step: dict[int, dict[str, float]] = {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            by_step.setdefault(int(row["step"]), {})[row["name"]] = float(row["value"])
    run_dir = tmp / "replay"
    run_dir.mkdir()
    cfg = OmegaConf.create(
        {"name": "replay", "logger": {"csv": {"enabled": True, "filename": "metrics.csv"},
                                      "mlflow": {"enabled": True, "tracking_uri": store, "experiment_name": None,
                                                 "run_name": None, "tags": {}},
                    "wandb": {"enabled": True, "mode": "offline", "project": "bench", "entity": None, "dir": None,
                              "group": None, "name": None, "tags": []}}}
    )
    trackers = Trackers.open(cfg, run_dir, None)
    assert len(trackers.active) == 3, trackers.failed
    clock = time.perf_counter
    start = clock()
    for step, metrics in sorted(by_step.items()):
        trackers.log_metrics(metrics, step)
        if step % STEPS_PER_EPOCH == 0:
            trackers.flush()  # the run's epoch end (epoch_perf): written if 10 s have passed
    logged = clock()
    trackers.flush(now=True)  # one SQLite commit of everything kept (what every 10 s, or an evaluation, costs)
    committed = clock()
    trackers.close()
    closed = clock()
    per_step = 1000 * (logged - start) / (epochs * STEPS_PER_EPOCH)
    return per_step, 1000 * (committed - logged), 1000 * (closed - committed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=store).search_experiments()  # the tables made once, before the first run
        ratios, times = [], {name: [] for name in CONTENDERS}
        for rep in range(args.reps):
            order = list(CONTENDERS)[rep % 2 :] + list(CONTENDERS)[: rep % 2]
            ms = {name: run(Path(tmp) / f"{rep}_{name}", store, args.epochs, CONTENDERS[name]) for name in order}
            for name, value in ms.items():
                times[name].append(value)
            ratios.append(ms["many"] / ms["tensorboard"])
            shown = "  ".join(f"{n} {v:.3f} ms/step" for n, v in ms.items())
            print(f"rep {rep}: {shown}  ratio {ratios[-1]:.3f}")
        replayed = replay(Path(tmp) / f"{args.reps - 1}_many" / "metrics.csv", Path(tmp), store, args.epochs)
    step_ms, (per_step, commit, close) = statistics.median(times["tensorboard"]), replayed
    print(
        f"trackers alone (CSV + MLflow + W&B offline, replayed): {per_step:.4f} ms per step = {per_step / step_ms:.2%} of "
        f"TensorBoard alone's {step_ms:.3f} ms/step; one MLflow commit (every 10 s, and after each evaluation) "
        f"{commit:.1f} ms = {commit / 10_000:.2%} of 10 s; closing, once a run, {close:.1f} ms"
    )
    print(
        "step time, median over repetitions: "
        + "  ".join(f"{n} {statistics.median(v):.3f} ms" for n, v in times.items())
        + f"\nmany / tensorboard: {statistics.median(ratios):.3f} (spread {min(ratios):.3f}-{max(ratios):.3f}; "
        "target <= 1.05)"
    )


if __name__ == "__main__":
    main()
