"""What a user checks before trusting a run, written once it is built: the global batch, the parameter groups
(`param_groups.json`), the model summary (on the console too, unless trainer.enable_model_summary=false), the LR
plan, the config and TensorBoard's layout and HParams session (a fresh run only). Printed and written by rank 0 only;
the run opens its trackers once this is written (framework/loop/run.py, report_setup), so the LR plan, a TensorBoard
chart, is not sent to them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.core.files import write_json
from framework.observe.layout import layout
from framework.observe.model_summary import format_summary, summarize
from framework.observe.progress import file_only
from framework.optim.groups import describe_groups, format_groups
from framework.optim.schedulers import lr_plan

log = logging.getLogger(__name__)

# Metrics shown in TensorBoard's HParams tab for every run (read from these scalar tags).
HPARAM_METRICS = ["val/acc", "val/loss", "best/val/acc", "best/val/loss", "test/acc", "test/loss"]


def describe_setup(
    cfg: DictConfig,
    parts: Any,
    *,
    world_size: int,
    run_dir: Path,
    tensorboard: Any,
    fresh: bool,
    charts: list[str],
    hparams: dict[str, Any],
) -> None:
    """`parts`: the run's Components; `charts`: the metrics TensorBoard's first screen shows."""
    dry_run = cfg.trainer.dry_run
    per_device, accumulate = parts.data.batch_size, cfg.trainer.accumulate_grad_batches
    # In run.log (and param_groups.json); on the console too in a dry run, which is for reading them.
    say = log.info if dry_run else (lambda msg, *args: file_only(msg % args, log))
    say(
        "Global batch: %d per process x %d process%s x %d accumulated = %d samples per optimizer step",
        per_device,
        world_size,
        "es" if world_size > 1 else "",
        accumulate,
        per_device * world_size * accumulate,
    )
    say("Parameter groups:\n%s", format_groups(parts.optimizers, parts.frozen))
    if cfg.trainer.enable_model_summary:  # counted from the parameters: no forward pass, nothing to wait for
        log.info("Model summary:\n%s", format_summary(summarize(parts.task, cfg.trainer.model_summary_max_depth)))
    plan = lr_plan(parts.scheduler, parts.optimizers.only, parts.steps_per_epoch) if parts.scheduler else {}
    write_json(run_dir / "param_groups.json", describe_groups(parts.optimizers))
    if fresh:  # a resumed run already logged these
        for name, points in plan.items():
            for step, lr in points:
                tensorboard.log_metrics({f"lr_plan/{name}": lr}, step)
        tensorboard.log_text("config", "```yaml\n" + OmegaConf.to_yaml(cfg, resolve=True) + "```")
        tensorboard.log_custom_scalars(layout(charts))
        if hparams:
            tensorboard.log_hparams(hparams, HPARAM_METRICS)
    if dry_run:
        for name, points in plan.items():
            shown = [points[round(i * (len(points) - 1) / 10)] for i in range(11)]
            log.info("LR plan of group '%s' (step: lr): %s", name, ", ".join(f"{step}: {lr:.4g}" for step, lr in shown))
        log.info("Dry run: everything built; exiting without training (trainer.dry_run=true).")
