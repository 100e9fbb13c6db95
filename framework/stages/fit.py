"""fit: the Trainer built on the config and run, in this process or in a spawned worker, and freed afterwards."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from framework.checkpoint import Checkpoint
from framework.core.errors import TrainingFailed, UserError
from framework.loop.trainer import Trainer
from framework.parallel import allocator


def fit(
    cfg: DictConfig,
    run_dir: Path,
    checkpoint: Optional[Checkpoint] = None,
    hparams: Optional[dict[str, Any]] = None,
    choices: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Train from `checkpoint` (None: from the start) and return the summary."""
    if cfg.trainer.malloc_tuning:
        allocator.keep_freed_memory()  # each step reuses the memory the last one freed (parallel/allocator.py)
    trainer = Trainer(cfg, run_dir, resume_from=checkpoint, hparams=hparams, choices=choices)
    try:
        return trainer.fit()
    except UserError as err:
        if trainer.failed_after_training(err):  # a loss gone NaN, data gone mid-epoch: the run failed
            raise TrainingFailed(str(err)) from err
        raise
    finally:
        # Freed now: a sweep's next job does not start with the last one's model, optimizer and data still in
        # memory. Nothing of the run refers back to the trainer (the task sees a RunView), so dropping it frees the
        # run without a collection, unless a cycle still holds it: user code's (a callback holding the trainer), or
        # an exception some library raised and caught during the run, whose traceback's frames hold the run's
        # locals until collected. Those are young, mostly: the young generations are collected first (~1 ms), and
        # a full collection (~0.3 s in a large process) is made only if the run is still held. With several
        # ranks, run_stage collects anyway (framework/app/stage.py: the process group).
        trainer.run.data.close()  # see DataModule.close
        built = [weakref.ref(part) for part in (trainer, trainer.run.task, trainer.run.model)]
        del trainer
        for generation in (1, 2):
            if all(part() is None for part in built):
                break
            gc.collect(generation)
