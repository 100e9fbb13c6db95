"""What fit reports at its end (summary.json, the closing lines, a sweep's row): the run's metrics as its series
last held them, where it stopped and why, and which weights its test used."""

from __future__ import annotations

import time
from typing import Any

from framework.loop.run import Run
from framework.observe.compile_report import compile_report


def fit_summary(run: Run, seconds: float, tested: str) -> dict[str, Any]:
    """A collective: every rank makes it (the count of skipped samples gathers)."""
    summary: dict[str, Any] = dict(run.metric_logger.metrics)
    best = run.checkpoints.best_path()
    p = run.progress
    summary.update(
        status="ok",
        step=p.step,
        epoch=p.epoch,
        batch_in_epoch=p.batch_in_epoch,
        epoch_batches=run.train_batches,
        seconds=round(seconds, 3),
        world_size=run.strategy.world_size,
        hosts=run.hosts,
        precision=run.precision.name,
        best_checkpoint=str(best) if best is not None else None,
        stopped=run.stop.reason or None,
        tested=tested or None,
    )
    if run.cfg.trainer.compile:  # how often torch.compile compiled during this fit (recompilations logged)
        summary["compile"] = compile_report(time.time() - seconds, run.strategy.is_rank_zero)
    if run.data.skip_corrupt:
        indexed, read = run.data.skipped()
        every = run.strategy.gather_objects(read)  # a sample is read by another rank in another epoch
        summary["data_skipped"] = indexed + sum(len(set().union(*(r[split] for r in every))) for split in read)
    return summary
