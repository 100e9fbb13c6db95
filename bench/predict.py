"""Predict throughput on the bench workload: `python run.py predict ckpt=RUN_DIR` against Lightning's
`trainer.predict` and a hand-written `torch.inference_mode()` loop (issue 30, item 5).

    python bench/predict.py                      # 5 repetitions, 64 and 512 batches of 128
    PYTHONPATH=<lightning> python bench/predict.py --reps 7 --threads 1

On a shared machine use `--threads 1`: with one OpenMP thread per core, every contender's threads wait on the
other processes' and the figures spread tenfold (bench/RESULTS.md's run used it).

Set-up (not timed): a checkpoint of `experiment=bench` (the MLP 128-256-256-10, trained `--train-steps` steps in
this process, `checkpoint.save_last=true`), and the data to predict, `framework.zoo.synthetic.classification`
with seed 1 (not the training set), built once per length and held in memory: every contender predicts the same
TensorDataset object (the framework gets it through a dataset node, `+data.predict={_target_:
predict.dataset, ...}`), so building it is no contender's cost.

Contenders, all in this one process, on the same weights (the checkpoint's), batch 128, fp32, in dataset order;
every one computes per sample the class (argmax, int64) and the softmax probabilities (float32, 10 per sample):
- framework    `framework.app.stage.run_stage(cfg, run_dir, checkpoint)` on the config `python run.py predict
               ckpt=RUN_DIR +data.predict=...` settles to (composed from `experiment=bench`, the saved run's own
               experiment, with `stages.evaluation_only` applied as app.py does): the whole stage, from building
               the run to `predictions.parquet` merged (snappy, fsync'd) and summary.json written;
- handwritten  the same in-memory batches the framework's fast path makes (`x[i:i+128]`), the model under
               `torch.inference_mode()`, outputs collected, then one `pyarrow.parquet.write_table` (pyarrow's
               defaults) of the same columns (index, prediction, probabilities as a list of 10 float32);
- dataloader   the same loop over `DataLoader(dataset, batch_size=128)` (the tutorial loop; reference only);
- lightning    the model as a LightningModule whose predict_step returns the same dict, `Trainer(...).predict(
               module, DataLoader(dataset, batch_size=128))`, outputs kept as Lightning keeps them by default (a
               list in memory: nothing written to disk), when `lightning` (or `pytorch_lightning`) is importable.

Each contender runs a short and a long data set; ms per batch = (t_long - t_short) / (extra batches), so
what every contender pays once (building the run or the Lightning Trainer, loading the weights, opening files,
process start-up, which none of them pays here) cancels, and what remains is the cost of predicting and writing
one more batch. Contenders alternate within each repetition (the order rotates), figures are medians over
repetitions, and a ratio is the median of the per-repetition ratios. Targets (issue 30): framework <= 1.0x
Lightning's time, <= 1.10x the hand-written loop's. Nothing here is asserted by the test suite.
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
for path in (ROOT, ROOT / "bench"):  # `python bench/predict.py` from anywhere
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
if __name__ == "__main__":  # the dataset node's `_target_: predict.dataset` must find this module's cache
    sys.modules.setdefault("predict", sys.modules[__name__])

import handwritten  # noqa: E402
import overhead  # noqa: E402

BATCH = handwritten.BATCH_SIZE  # the bench workload's batch size, also its eval batch size
PREDICT_SEED = 1  # the data predicted: not the training set (seed 0)
TARGETS = {"lightning": 1.0, "handwritten": 1.10}
_DATASETS: dict[int, torch.utils.data.TensorDataset] = {}


def dataset(num_samples: int) -> torch.utils.data.TensorDataset:
    """The data to predict (a dataset node's target): built once per size, then the same object every time."""
    if num_samples not in _DATASETS:
        from framework.zoo.synthetic import classification

        _DATASETS[num_samples] = classification(num_samples=num_samples, seed=PREDICT_SEED)
    return _DATASETS[num_samples]


# ---------------------------------------------------------------------------------------------- set-up
def train_checkpoint(run_dir: Path, steps: int) -> Any:
    """`python run.py experiment=bench trainer.max_steps=STEPS checkpoint.save_last=true`, in this process; its
    checkpoint as `ckpt=RUN_DIR` finds it."""
    from framework.app.stage import run_stage
    from framework.stages.evaluate import find_checkpoint

    cfg = overhead.compose_bench(steps, "cpu", ("checkpoint.save_last=true",))
    with contextlib.redirect_stdout(io.StringIO()):
        run_stage(cfg, run_dir)
    return find_checkpoint(str(run_dir))


def checkpoint_model(checkpoint: Any) -> torch.nn.Module:
    """The model the run trained, as a user predicting with their own loop has it: `framework.zoo.models.MLP`
    (128-256-256-10, its Flatten included), built as `experiment=bench` builds it, with the checkpoint's
    evaluated weights. Every contender runs this same module, so the ratios measure loops and writers."""
    from framework.stages.export import eval_weights
    from framework.zoo.models import MLP

    weights, _ = eval_weights(checkpoint)
    model = MLP(input_shape=[128], num_classes=10, hidden=handwritten.HIDDEN)  # conf/experiment/bench.yaml's
    model.load_state_dict(weights)  # strict: every layer of both, same shapes
    return model.eval()


def outputs(scores: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ClassificationTask.predict_step returns for a batch's scores."""
    return {"prediction": scores.argmax(-1), "probabilities": scores.float().softmax(-1)}


# ---------------------------------------------------------------------------------------------- contenders
def framework_runner(run_dir: Path, checkpoint: Any, sizes: tuple[int, ...]) -> Callable[[int, Path], None]:
    """The predict stage as `python run.py predict ckpt=RUN_DIR +data.predict=...` runs it once app.py has
    settled its config (composed here, outside the timed runs)."""
    from framework.app import main as app
    from framework.app.stage import run_stage
    from framework.config.validate import check_stage, validate
    from framework.stages import evaluate as stages

    configs = {}
    for n in sizes:
        node = f"{{_target_: predict.dataset, num_samples: {n}}}"
        cfg = overhead.compose_bench(1000, "cpu", ("stage=predict", f"ckpt={run_dir}", f"+data.predict={node}"))
        check_stage(cfg)
        stages.evaluation_only(cfg)
        app.resolve_all(cfg)
        validate(cfg)
        configs[n] = cfg

    def run(n: int, out: Path) -> None:
        cfg = copy.deepcopy(configs[n])
        with contextlib.redirect_stdout(io.StringIO()):  # the closing summary
            summary = run_stage(cfg, out, checkpoint)
        assert summary["rows"] == n, summary

    return run


def handwritten_runner(model: torch.nn.Module, loader: bool) -> Callable[[int, Path], None]:
    """The loop a user writes: inference_mode, batches of 128 in order, outputs collected, one Parquet file."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    def run(n: int, out: Path) -> None:
        x, _ = dataset(n).tensors
        batches = (
            (b for b, _ in DataLoader(dataset(n), batch_size=BATCH))
            if loader
            else (x[i : i + BATCH] for i in range(0, n, BATCH))
        )
        predictions, probabilities = [], []
        with torch.inference_mode():
            for inputs in batches:
                out_batch = outputs(model(inputs))
                predictions.append(out_batch["prediction"].numpy())
                probabilities.append(out_batch["probabilities"].numpy())
        probs = np.concatenate(probabilities)
        table = pa.table({
            "index": pa.array(np.arange(n, dtype=np.int64)),
            "prediction": pa.array(np.concatenate(predictions)),
            "probabilities": pa.FixedSizeListArray.from_arrays(pa.array(probs.reshape(-1)), probs.shape[1]),
        })
        out.mkdir(parents=True)
        pq.write_table(table, out / "predictions.parquet")

    return run


def lightning_runner(model: torch.nn.Module) -> Optional[Callable[[int, Path], None]]:
    """`trainer.predict` on a LightningModule of the same model, or None when Lightning is not installed."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl  # type: ignore[no-redef]
        except ImportError:
            return None
    from torch.utils.data import DataLoader

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = copy.deepcopy(model)

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            inputs, _ = batch
            return outputs(self.model(inputs))

    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    module = Module()

    def run(n: int, out: Path) -> None:
        out.mkdir(parents=True)
        trainer = pl.Trainer(accelerator="cpu", devices=1, precision="32-true", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(out))
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            result = trainer.predict(module, DataLoader(dataset(n), batch_size=BATCH))
        assert result is not None and sum(len(r["prediction"]) for r in result) == n

    return run


def check_same_predictions(framework: Callable[[int, Path], None], hand: Callable[[int, Path], None], n: int) -> None:
    """The framework's predictions.parquet holds what the hand-written loop's file holds: the same columns, indices
    and classes, probabilities equal to float32 rounding."""
    import numpy as np
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="bench-predict-check-") as tmp:
        tables = []
        for name, run in (("framework", framework), ("handwritten", hand)):
            run(n, Path(tmp) / name)
            tables.append(pq.read_table(Path(tmp) / name / "predictions.parquet"))
    ours, theirs = tables
    assert ours.column_names == theirs.column_names == ["index", "prediction", "probabilities"], ours.schema
    for column in ("index", "prediction"):
        assert ours.column(column).to_pylist() == theirs.column(column).to_pylist(), column
    probs = [np.stack(t.column("probabilities").to_numpy(zero_copy_only=False)) for t in tables]
    assert probs[0].shape == (n, 10) and np.allclose(probs[0], probs[1], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- measuring
def timed(run: Callable[[int, Path], None], n: int) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as out:
        gc.collect()
        threads = torch.get_num_threads()
        start = time.perf_counter()
        run(n, Path(out) / "run")  # a run directory that does not exist yet, as Hydra's for a new job
        seconds = time.perf_counter() - start
        assert torch.get_num_threads() == threads, f"{run.__qualname__} changed torch's threads"
        return seconds


def main(argv: Optional[list[str]] = None) -> overhead.Timings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions (default 5)")
    parser.add_argument("--short", type=int, default=64, help="batches of 128 in the short data set (default 64)")
    parser.add_argument("--long", type=int, default=512, help="batches of 128 in the long data set (default 512)")
    parser.add_argument("--train-steps", type=int, default=20, help="steps of the run whose checkpoint is predicted")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-lightning", action="store_true", help="leave Lightning out even when installed")
    args = parser.parse_args(argv)
    if args.long <= args.short or args.short < 1 or args.reps < 1 or args.train_steps < 1:
        parser.error("expected 1 <= --short < --long, --reps >= 1 and --train-steps >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    short, long = args.short * BATCH, args.long * BATCH

    with tempfile.TemporaryDirectory(prefix="bench-predict-ckpt-") as tmp:
        checkpoint = train_checkpoint(Path(tmp) / "run", args.train_steps)
        model = checkpoint_model(checkpoint)
        for n in (short, long):
            dataset(n)
        contenders: dict[str, Callable[[int, Path], None]] = {
            "framework": framework_runner(Path(tmp) / "run", checkpoint, (short, long)),
            "handwritten": handwritten_runner(model, loader=False),
            "dataloader": handwritten_runner(model, loader=True),
        }
        check_same_predictions(contenders["framework"], contenders["handwritten"], short)
        lightning = None if args.no_lightning else lightning_runner(model)
        if lightning is not None:
            contenders["lightning"] = lightning

        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
              f"load average {load:.2f}")
        print(f"{args.reps} alternating repetitions of {args.short} and {args.long} batches of {BATCH}; "
              f"ms/batch = (t_long - t_short) / {args.long - args.short}")
        if lightning is None:
            print("lightning: not installed (or --no-lightning); skipped")
        start = time.perf_counter()
        timings = measure(contenders, args.reps, short, long)
        seconds = time.perf_counter() - start
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    # Timings counts "steps" in samples here; its marginal() is then ms per sample.
    print()
    print(f"{'contender':12s} {'ms/batch':>9s} {'min':>7s} {'max':>7s} {'samples/s':>10s} {'long run s':>11s}")
    for name in contenders:
        per_batch = [BATCH * v for v in timings.marginal(name)]
        med = statistics.median(per_batch)
        whole = statistics.median(t for _, t in timings.runs[name])
        print(f"{name:12s} {med:9.3f} {min(per_batch):7.3f} {max(per_batch):7.3f} {1000 * BATCH / med:10,.0f} "
              f"{whole:11.3f}")
    print()
    for den in ("lightning", "handwritten", "dataloader"):
        if den not in contenders:
            continue
        ratios = timings.ratios("framework", den)
        med = statistics.median(ratios)
        verdict = f"  <= {TARGETS[den]:.2f}: {'PASS' if med <= TARGETS[den] else 'FAIL'}" if den in TARGETS else ""
        print(f"{'framework / ' + den:26s} {med:6.3f}{verdict}   (per rep {', '.join(f'{r:.3f}' for r in ratios)})")
    busy = load >= 1.0
    print(f"\n{seconds:.0f} s of measurement; load average {load:.2f} before, {load_after:.2f} after"
          + ("  (other processes were busy before the start: figures may be noisy)" if busy else ""))
    return timings


def measure(contenders: dict[str, Callable[[int, Path], None]], reps: int, short: int, long: int,
            report: Callable[[str], None] = print) -> overhead.Timings:
    """Short and long runs of every contender, alternating, the order rotating each repetition (a warm-up first)."""
    names = list(contenders)
    for name in names:
        timed(contenders[name], short)
    timings = overhead.Timings(names, short, long)
    for rep in range(reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        line = []
        for name in order:
            t_short = timed(contenders[name], short)
            t_long = timed(contenders[name], long)
            timings.runs[name].append((t_short, t_long))
            line.append(f"{name} {BATCH * timings.marginal(name)[-1]:.3f}")
        report(f"  rep {rep + 1}/{reps}: " + ", ".join(line) + " ms/batch")
    return timings


if __name__ == "__main__":
    main()
