"""`python run.py predict ckpt=RUN_DIR`: `Task.predict_step` over `data.predict` (a dataset node given on the command
line), else the test split, each rank's share streamed to Parquet parts (framework/stages/predictions.py) that rank 0
merges into `predictions.parquet`, one row per sample in dataset order."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Optional, Sized, cast

import torch
from omegaconf import DictConfig

from framework.callbacks import task_hooks
from framework.checkpoint import Checkpoint
from framework.config.instantiate import FULL_ERROR_HINT, build, error_line
from framework.core.errors import ConfigError, UserError
from framework.core.files import write_json, write_text
from framework.loop.evaluate import move_to
from framework.loop.run import Run, assemble
from framework.observe.summary import print_summary
from framework.stages.evaluate import load_weights, stage_summary
from framework.stages.predictions import PredictionWriter, merge
from framework.task.describe import describe
from framework.task.task import step_function

PREDICTIONS = "predictions.parquet"  # in the run directory; its parts in PREDICTIONS.parts/ until merged


def predict(
    cfg: DictConfig, run_dir: Path, checkpoint: Checkpoint, choices: Optional[dict[str, Any]]
) -> dict[str, Any]:
    """`Task.predict_step` over `data.predict` (a dataset node given on the command line), else the test split: each
    rank streams its unpadded share to Parquet parts, rank 0 merges them into `predictions.parquet`, one row per
    sample in dataset order. A run killed midway and started again in its directory keeps the parts it wrote."""
    start = time.perf_counter()
    run = assemble(cfg, run_dir, choices=choices)
    strategy, finished = run.strategy, False
    try:
        source, total = _predict_source(cfg, run)
        which = load_weights(run, checkpoint)
        dest = run_dir / PREDICTIONS
        chunk = cfg.trainer.predict_chunk_rows
        writer = PredictionWriter(
            run_dir / f"{PREDICTIONS}.parts", strategy.rank, strategy.world_size, chunk_rows=chunk
        )
        step_fn = step_function(run.task, "predict_step")
        run.task.eval()  # the task's own model, unwrapped: each rank runs its own samples alone
        batches = run.data.predict_batches(source, strategy.rank, strategy.world_size, writer.done(), seed=cfg.seed)
        with torch.inference_mode(), run.precision.autocast():  # the writer's CPU copies and cat are not autocast
            for i, (indices, batch) in enumerate(batches):
                out = step_fn(move_to(batch, run.device), i) if i else _first_step(step_fn, batch, run)
                writer.write(indices, out)
        writer.close()
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
        run.metric_logger.close()
        task_hooks.call_if_defined(run.task, "teardown", "predict")
        strategy.teardown(finished)
    summary = {
        **stage_summary(run, "predict", checkpoint, which, {}, time.perf_counter() - start),
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
            "'+data.predict={_target_: framework.zoo.datasets.ImageFiles, root: DIR}', or a data.test split"
        )
    return "test", len(cast(Sized, run.data.datasets["test"]))
