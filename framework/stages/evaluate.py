"""The stages beside fit. After training: `validate` and `test` the weights of a saved run, as LightningCLI's
subcommands do (`python run.py test ckpt=RUN_DIR`), in a run directory of their own; the saved run is only read.
Before it: `lr_find`, the LR range test on the config's own run (framework/stages/lr_find.py); `run_stage` picks one.

`ckpt=` names a run directory (its `best` checkpoint when it kept one, else its newest intact one: `last`), a
checkpoint directory, or `RUN_DIR/checkpoints/NAME`. The run's own config is the base (app.py settles it as for
resume=, under the same trust rules); this command line's overrides change the data, the split's limits,
`parallel=`, `precision=` or the batch size, never the model. The weights evaluated are the ones the run evaluated:
its EMA's where its EMA callback had `use_for_eval`. The training run's callbacks are not built (they belong to
training); the task's own hooks (`on_test_start`, ...) are called as in fit.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Optional, Sized, cast

import torch
from omegaconf import DictConfig, open_dict

from framework.checkpoint import Checkpoint, DamagedCheckpoint, check_compatible, find_latest, open_checkpoint
from framework.config.instantiate import FULL_ERROR_HINT, build, error_line
from framework.core.errors import ConfigError, UserError
from framework.core.files import write_text
from framework.loop.evaluate import move_to
from framework.loop.preflight import check_first_batches
from framework.loop.run import Run
from framework.observe.tensorboard import print_summary, write_json
from framework.stages.predictions import PredictionWriter, merge
from framework.task import hooks as task_hooks
from framework.task.describe import describe
from framework.task.task import step_function

log = logging.getLogger("framework.loop.trainer")  # run.log's lines of a run, whatever its stage
SPLITS = {"validate": "val", "test": "test"}  # the split each evaluating stage reads
PREDICTIONS = "predictions.parquet"


def run_stage(
    cfg: DictConfig, run_dir: Path, checkpoint: Optional[Checkpoint], choices: Optional[dict[str, Any]]
) -> dict[str, Any]:
    """The stage `cfg.stage` names, other than fit, on every rank: lr_find (framework/stages/lr_find.py) trains from the
    config's own start; validate, test and predict evaluate `checkpoint`'s weights."""
    if cfg.stage == "lr_find":
        from framework.stages.lr_find import find_lr

        return find_lr(cfg, run_dir, choices)
    assert checkpoint is not None, "a stage evaluates a checkpoint (app.py found it)"
    return (predict if cfg.stage == "predict" else evaluate)(cfg, run_dir, checkpoint, choices)


def find_checkpoint(ckpt: str) -> Checkpoint:
    """The checkpoint `ckpt=` names: a checkpoint directory, or a run directory's best, else its newest intact one
    (a damaged best is skipped with a warning, as resume skips a damaged checkpoint)."""
    path, where = Path(ckpt), f"ckpt={ckpt!r}"
    expected = (
        "expected a run directory (its best checkpoint, else last), a checkpoint directory or RUN_DIR/checkpoints/NAME"
    )
    if not path.is_dir():
        raise ConfigError(f"{where}: {'not a directory' if path.exists() else 'no such directory'}; {expected}")
    if (path / "meta.json").exists():
        try:
            return open_checkpoint(path)
        except DamagedCheckpoint as err:
            raise ConfigError(f"{where}: {err}") from None
    if not (path / "checkpoints").is_dir():
        raise ConfigError(
            f"{where}: neither a checkpoint (no meta.json) nor a run directory (no checkpoints/); {expected}"
        )
    best = path / "checkpoints" / "best"
    if best.is_dir():
        try:
            return open_checkpoint(best)
        except DamagedCheckpoint as err:
            log.warning("%s: its best checkpoint is damaged (%s); using its newest intact one", where, err)
    found = find_latest(path)
    if found is None:
        raise ConfigError(f"{where}: no intact checkpoint under {path / 'checkpoints'}; {expected}")
    return found


def evaluate(
    cfg: DictConfig, run_dir: Path, checkpoint: Checkpoint, choices: Optional[dict[str, Any]]
) -> dict[str, Any]:
    """Validate or test `checkpoint`'s weights on this config's data, on every rank; rank 0 writes summary.json and
    prints the closing lines. Returns the summary."""
    start, stage = time.perf_counter(), str(cfg.stage)
    split = SPLITS[stage]
    run = Run(cfg, run_dir, choices=choices)
    finished = False
    try:
        if not run.data.has(split):
            raise ConfigError(
                f"data.{split}: null, so there is nothing to {stage}; expected a data.{split} split "
                f"(e.g. data.{split}=... on the command line)"
            )
        which = _load_weights(run, checkpoint)
        check_first_batches(run.task, run.model_attr, run.evaluator, {}, (split,))  # data that does not fit: one line
        run.callbacks.call(f"on_{'validation' if split == 'val' else 'test'}_start", run, run.task)
        metrics = run.evaluator.run(split, checkpoint.step)
        with run.metric_logger.no_logging(f"on_{'validation' if split == 'val' else 'test'}_end"):
            run.callbacks.call(f"on_{'validation' if split == 'val' else 'test'}_end", run, run.task, metrics)
        finished = True
    finally:
        run.logger.close()
        task_hooks.call_if_defined(run.task, "teardown", stage)
        run.strategy.teardown(finished)
    summary = _summary(run, stage, checkpoint, which, metrics, time.perf_counter() - start)
    if run.strategy.is_rank_zero:
        write_json(run_dir / "summary.json", summary)
        print_summary(summary, run_dir)
    return summary


def predict(
    cfg: DictConfig, run_dir: Path, checkpoint: Checkpoint, choices: Optional[dict[str, Any]]
) -> dict[str, Any]:
    """`Task.predict_step` over `data.predict` (a dataset node given on the command line), else the test split: each
    rank streams its unpadded share to Parquet parts, rank 0 merges them into `predictions.parquet`, one row per
    sample in dataset order. A run killed midway and started again in its directory keeps the parts it wrote."""
    start = time.perf_counter()
    run = Run(cfg, run_dir, choices=choices)
    strategy, finished = run.strategy, False
    try:
        source, total = _predict_source(cfg, run)
        which = _load_weights(run, checkpoint)
        dest = run_dir / PREDICTIONS
        chunk = cfg.trainer.predict_chunk_rows
        writer = PredictionWriter(
            run_dir / f"{PREDICTIONS}.parts", strategy.rank, strategy.world_size, chunk_rows=chunk
        )
        step_fn = step_function(run.task, "predict_step")
        wrapped = getattr(run.task, run.model_attr)
        setattr(run.task, run.model_attr, run.module)  # no DDP/DP wrapper: each rank runs its own samples alone
        run.task.eval()
        batches = run.data.predict_batches(source, strategy.rank, strategy.world_size, writer.done(), seed=cfg.seed)
        with torch.inference_mode(), run.precision.autocast():  # the writer's CPU copies and cat are not autocast
            for i, (indices, batch) in enumerate(batches):
                out = step_fn(move_to(batch, run.device), i) if i else _first_step(step_fn, batch, run)
                writer.write(indices, out)
        writer.close()
        setattr(run.task, run.model_attr, wrapped)
        strategy.gather_objects(None)  # every rank's parts are on disk before rank 0 merges them
        rows = merge(writer.out_dir, total, dest) if strategy.is_rank_zero else total
        files = getattr(source, "files", None)  # ImageFiles: which file each index is
        if strategy.is_rank_zero and isinstance(files, list):
            files_txt = run_dir / f"{PREDICTIONS.rsplit('.', 1)[0]}.files.txt"
            write_text(files_txt, "".join(f"{f}\n" for f in files))
        finished = True
    finally:
        parts = run_dir / f"{PREDICTIONS}.parts"
        with contextlib.suppress(OSError):  # nothing kept: nothing left behind (never hiding the error that ended it)
            if not finished and parts.is_dir() and not any(parts.iterdir()):
                parts.rmdir()
        run.logger.close()
        task_hooks.call_if_defined(run.task, "teardown", "predict")
        strategy.teardown(finished)
    summary = {
        **_summary(run, "predict", checkpoint, which, {}, time.perf_counter() - start),
        "predictions": str(dest),
        "rows": rows,
    }
    if strategy.is_rank_zero:
        write_json(run_dir / "summary.json", summary)
        print_summary(summary, run_dir)
    return summary


def _first_step(step_fn: Any, batch: Any, run: Run) -> Any:
    """The first predict batch through the task: what fails there is the data's or the task's, in one line."""
    where = f"{type(run.task).__name__}.predict_step"
    try:
        return step_fn(move_to(batch, run.device), 0)
    except UserError:
        raise
    except Exception as err:
        raise ConfigError(
            f"task: {where} on the first batch to predict ({describe(batch)}) raised {error_line(err)}; "
            f"expected data whose samples the model takes {FULL_ERROR_HINT}"
        ) from err


def _predict_source(cfg: DictConfig, run: Run) -> tuple[Any, int]:
    """What predict runs over, and its number of samples: the dataset `predict_data` (moved there from
    `data.predict` by `evaluation_only`), else the run's test split."""
    node = cfg.get("predict_data")
    if node is not None:
        dataset = build(node, "data.predict")
        try:
            return dataset, len(dataset)
        except TypeError:
            raise ConfigError(
                f"data.predict: {type(dataset).__name__} has no len(); expected a map-style dataset "
                "(torch.utils.data.Dataset with __len__ and __getitem__)"
            ) from None
    if not run.data.has("test"):
        raise ConfigError(
            "data.predict is not set and data.test is null: nothing to predict; expected a dataset node, e.g. "
            "'+data.predict={_target_: framework.zoo.datasets.image_files, root: DIR}', or a data.test split"
        )
    return "test", len(cast(Sized, run.data.datasets["test"]))


def _load_weights(run: Run, checkpoint: Checkpoint) -> str:
    """The weights the run evaluated into the model, on every rank; which, in words."""
    from framework.stages.export import eval_weights

    if run.strategy.sharded:  # each rank reads its own shards of the weights (its EMA's averages are not gathered)
        run.module.load_state_dict(checkpoint.model_state(run.strategy.mesh))
        return "trained weights"
    weights, which = eval_weights(checkpoint)
    check_compatible(run.module, weights, f"ckpt={str(checkpoint.path)!r}", strict=True)  # one line naming the keys
    run.module.load_state_dict(weights)
    if run.strategy.is_rank_zero:
        log.info("Evaluating %s of %s (step %d)", which.split(" (")[0], checkpoint.path, checkpoint.step)
    return which.split(" (")[0]


def _summary(
    run: Run, stage: str, checkpoint: Checkpoint, which: str, metrics: dict[str, float], seconds: float
) -> dict[str, Any]:
    """What the stage reports: its metrics, what it evaluated, and the fields fit's closing lines read."""
    return {
        **metrics,
        "status": "ok",
        "stage": stage,
        "checkpoint": str(checkpoint.path),
        "weights": which,
        "step": checkpoint.step,
        "epoch": int(checkpoint.meta.get("epoch", 0)),
        "seconds": round(seconds, 3),
        "world_size": run.strategy.world_size,
        "precision": run.precision.name,
    }


def evaluation_only(cfg: DictConfig) -> None:
    """What of the saved config belongs to training, off: its callbacks (early stopping, EMA, timers), a scheduler
    (a monitored one would ask for a val split), and checkpoint policies (a stage saves none). `data.predict` (no
    DataModule argument) moves to the root as `predict_data`."""
    with open_dict(cfg):
        if "predict" in cfg.data:
            cfg.predict_data = cfg.data.pop("predict")
        cfg.callbacks = {}
        cfg.scheduler = {"_target_": None}
        cfg.checkpoint.monitor, cfg.checkpoint.save_top_k, cfg.checkpoint.save_last = None, 0, False
        cfg.checkpoint.every_n_steps, cfg.checkpoint.every_n_epochs = 0, 0
        cfg.trainer.test_ckpt = None
