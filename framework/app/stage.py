"""The stage a command names, dispatched here, on every rank: fit (the default) and lr_find train from the config's
start (or fit from `checkpoint`, a resume); validate, test and predict evaluate `checkpoint`'s weights; each is a
peer in framework/stages/. Imported once the config is known good (torch)."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import DictConfig

from framework.checkpoint import Checkpoint, open_checkpoint


def run_stage(
    cfg: DictConfig,
    run_dir: Path,
    checkpoint: Union[None, Path, Checkpoint] = None,
    hparams: Optional[dict[str, Any]] = None,
    choices: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Run `cfg.stage` and return its summary. `checkpoint`: what fit resumes from, or what a stage evaluates (a
    spawned worker gets its path). With several ranks, what the stage built is collected before this returns, while
    the interpreter is whole: anything in a reference cycle that holds the gloo process group (a DDP model) would be
    destroyed during interpreter shutdown instead, with gloo's C++ threads (std::terminate, SIGABRT: a torchrun rank
    after fit, a spawned worker after predict, each once)."""
    try:
        return _run(cfg, run_dir, checkpoint, hparams, choices)
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            gc.collect()


def _run(
    cfg: DictConfig,
    run_dir: Path,
    checkpoint: Union[None, Path, Checkpoint],
    hparams: Optional[dict[str, Any]],
    choices: Optional[dict[str, Any]],
) -> dict[str, Any]:
    if isinstance(checkpoint, Path):
        checkpoint = open_checkpoint(checkpoint)
    stage = cfg.get("stage", "fit")
    if stage == "fit":
        from framework.stages.fit import fit

        return fit(cfg, run_dir, checkpoint, hparams, choices)
    if stage == "lr_find":
        from framework.stages.lr_find import find_lr

        return find_lr(cfg, run_dir, choices)
    assert checkpoint is not None, "a stage evaluates a checkpoint (framework/app/main.py found it)"
    if stage == "predict":
        from framework.stages.predict import predict

        return predict(cfg, run_dir, checkpoint, choices)
    from framework.stages.evaluate import evaluate

    return evaluate(cfg, run_dir, checkpoint, choices)
