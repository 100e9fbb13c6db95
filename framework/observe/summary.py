"""The closing summary a user reads at the end of a stage: its metrics, where the run is and how to look at it,
printed by rank 0 through the `framework.summary` logger (stdout and run.log)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Mapping

# The closing summary's logger: conf/hydra/job_logging/framework.yaml (and launch.py, for spawned workers) send
# it to stdout as plain lines, as print() would, and to run.log, so the log holds what the console showed.
SUMMARY_LOGGER = "framework.summary"


# What a job's summary.json records beside its metrics (loop/summary.py's fit_summary, app/main.py's failed job and
# the app's other records): every other number in it is a metric, named as the trainer or the task logged it.
RUN_FIELDS = frozenset(
    {
        "status",
        "error",
        "step",
        "epoch",
        "batch_in_epoch",
        "epoch_batches",
        "seconds",
        "world_size",
        "precision",
        "best_checkpoint",
        "stopped",
        "framework_version",
    }
)


def is_metric(name: str, value: Any) -> bool:
    """Is `name` in a summary a metric (a number the trainer or the task logged), not one of RUN_FIELDS?"""
    return name not in RUN_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool)


def print_summary(summary: Mapping[str, Any], run_dir: Path, kept: bool = True) -> None:
    """The closing lines a user reads: final metrics, where the run is, how to look at it; or, for a run that
    keeps nothing (`kept=False`: a fast_dev_run, whose run directory the app removes), that nothing was kept."""
    # every metric, those the task logged under names of its own ("g_loss") too; not the counts said elsewhere
    metrics = {k: v for k, v in summary.items() if is_metric(k, v) and k not in ("data_skipped", "rows")}
    shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if not math.isnan(v))
    how = f"({summary['precision']}, world size {summary['world_size']})"
    if summary.get("stage", "fit") != "fit":  # validate/test/predict of a saved run's weights
        lines = [
            f"{str(summary['stage']).capitalize()} done in {summary['seconds']:.1f} s: the {summary['weights']} of "
            f"{summary['checkpoint']} (step {summary['step']}) {how}"
        ]
    else:
        epochs = _count(summary["epoch"], "epoch")
        if summary.get("batch_in_epoch"):  # stopped mid-epoch (max_steps, a signal, a callback)
            epochs += f" and {summary['batch_in_epoch']} of {summary['epoch_batches']} batches"
        lines = [f"Done in {summary['seconds']:.1f} s: {epochs}, {_count(summary['step'], 'step')} {how}"]
    if shown:
        lines.append(f"  {shown}")
    if summary.get("predictions"):
        lines.append(f"  {summary['rows']} rows in {summary['predictions']}")
    if kept and summary.get("stage") == "predict":  # rows, not scalars: nothing for TensorBoard to show
        lines.append(f"Run directory: {run_dir}")
    elif kept:
        lines += [
            f"Run directory: {run_dir}",
            f"View it with:  tensorboard --logdir {_shell_path(run_dir)}   "
            "(its CUSTOM SCALARS tab shows loss, metrics and LR first)",
        ]
    else:
        lines.append(
            "fast_dev_run: nothing was kept (no checkpoint, no TensorBoard events, and outside a sweep, whose "
            "summary reads it, no run directory)"
        )
    if summary.get("profile"):  # trainer.profiler=simple: the time per phase ends the run
        from framework.observe.profiler import table  # (imports torch, which a summary of a failed start may not have)

        lines += table(summary["profile"], summary["world_size"])
    logger = logging.getLogger(SUMMARY_LOGGER)
    for line in lines:  # one record a line: each is a complete, prefixed line in run.log
        if logger.hasHandlers():
            logger.info(line)
        else:  # logging not configured (trainer.train called directly): still shown
            print(line)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _shell_path(path: Path) -> str:
    try:
        path = path.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    text = str(path)
    return f"'{text}'" if any(c in text for c in " =,'\"") else text
