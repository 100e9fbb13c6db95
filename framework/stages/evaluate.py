"""`validate` and `test` the weights of a saved run, as LightningCLI's subcommands do (`python run.py test
ckpt=RUN_DIR`), in a run directory of their own; the saved run is only read. `predict` (framework/stages/predict.py)
shares how the checkpoint is found, its config settled and its weights loaded.

`ckpt=` names a run directory (its `best` checkpoint when it kept one, else its newest intact one: `last`), a
checkpoint directory, or `RUN_DIR/checkpoints/NAME`. The run's own config is the base (app.py settles it as for
resume=, under the same trust rules); this command line's overrides change the data, the split's limits,
`parallel=`, `precision=` or the batch size, never the model. The weights evaluated are the ones the run evaluated:
its EMA's where its EMA callback had `use_for_eval`. The training run's callbacks are not built (they belong to
training); the task's own hooks (`on_test_start`, ...) are called as in fit.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, open_dict

from framework.callbacks import task_hooks
from framework.checkpoint import Checkpoint, DamagedCheckpoint, check_compatible, find_latest, open_checkpoint
from framework.core.errors import ConfigError
from framework.core.files import write_json
from framework.loop.hooks import Hooks
from framework.loop.preflight import check_first_batches
from framework.loop.run import Run, assemble, evaluates
from framework.observe.summary import print_summary

log = logging.getLogger(__name__)
SPLITS = {"validate": "val", "test": "test"}  # the split each evaluating stage reads


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
    run = assemble(cfg, run_dir, choices=choices)
    finished = False
    try:
        if not run.data.has(split):
            raise ConfigError(
                f"data.{split}: null, so there is nothing to {stage}; expected a data.{split} split "
                f"(e.g. data.{split}=... on the command line)"
            )
        if not evaluates(run.data, run.task, split):
            task, steps = type(run.task).__name__, "validation_step" if split == "val" else "test_step"
            raise ConfigError(
                f"task._target_={cfg.task.get('_target_')!r}: {task} defines no {steps}"
                f"{'' if split == 'val' else ' (nor validation_step, which a test runs by default)'}, so there is "
                f"nothing to {stage}; expected a task with {steps}(self, batch[, batch_idx]), as Lightning does"
            )
        which = load_weights(run, checkpoint)
        check_first_batches(run.task, run.model_attr, run.evaluator, {}, (split,))  # data that does not fit: one line
        hooks = Hooks(run.callbacks, run.view, run.task, run.metric_logger)
        hooks.call(f"on_{'validation' if split == 'val' else 'test'}_start")
        metrics = run.evaluator.run(split, checkpoint.step)
        hooks.quiet(f"on_{'validation' if split == 'val' else 'test'}_end", metrics)
        finished = True
    finally:
        run.metric_logger.close()
        task_hooks.call_if_defined(run.task, "teardown", stage)
        run.strategy.teardown(finished)
    summary = stage_summary(run, stage, checkpoint, which, metrics, time.perf_counter() - start)
    if run.strategy.is_rank_zero:
        write_json(run_dir / "summary.json", summary)
        print_summary(summary, run_dir)
    return summary


def load_weights(run: Run, checkpoint: Checkpoint) -> str:
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


def stage_summary(
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
