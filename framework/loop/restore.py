"""Restoring a checkpoint into a built run: every registered part checked against this run before any is loaded
(a checkpoint that does not fit leaves nothing half-restored), then loaded; the checks of the parts whose saved
form depends on the run (optimizer, precision, callbacks) live here too."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Union

import torch
from omegaconf import DictConfig

from framework.callbacks.base import CallbackList
from framework.checkpoint import (
    Checkpoint,
    CheckpointManager,
    DamagedCheckpoint,
    check_compatible,
    open_checkpoint,
    validate_state,
)
from framework.checkpoint.state import TrainingState
from framework.config.saved import from_checkpoint
from framework.core.errors import ConfigError
from framework.optim.groups import apply_changed_options, changed_options, check_optimizer_state
from framework.optim.optimizers import Optimizers, as_optimizers
from framework.parallel.strategy import Strategy

log = logging.getLogger(__name__)


def restore(
    checkpoint: Checkpoint,
    cfg: DictConfig,
    state: TrainingState,
    *,
    module: Any,
    strategy: Any,
    optimizers: Any,
    scheduler: Any,
) -> Any:
    """Load `checkpoint` into the run; returns the task's saved part, which the trainer loads once the task's start
    hooks ran (a reset there, as lightning-hydra-template does, must not undo the resume)."""
    where = f"resume={str(checkpoint.path)!r}"
    if strategy.sharded and not checkpoint.sharded:
        raise ConfigError(
            f"{where}: a checkpoint of a run without parallel=fsdp (its weights and state whole) cannot "
            "be resumed with parallel=fsdp; expected "
            f"parallel={checkpoint.meta['config'].get('parallel', {}).get('strategy', 'single')}, "
            "or init_from= for its weights alone"
        )
    # A sharded checkpoint is read for this run's ranks: each gets its own part of every sharded tensor.
    weights = checkpoint.model_state(strategy.mesh)
    check_compatible(module, weights, where, strict=True)
    saved = checkpoint.state(strategy.mesh)
    saved_cfg = from_checkpoint(checkpoint).values  # as this version reads it (framework/config/saved.py)
    same_schedule = (saved_cfg.get("scheduler") or {}).get("_target_") == cfg.scheduler.get("_target_")
    load_scheduler = same_schedule and isinstance(saved, dict) and bool(saved.get("scheduler"))
    skip = () if load_scheduler else ("scheduler",)  # scheduler= changed on resume: the new one starts fresh
    state.check(saved, f"checkpoint {checkpoint.path}", skip)
    module.load_state_dict(weights)
    optimizers = as_optimizers(optimizers)
    if not optimizers.single:  # named optimizers: their options and schedules as saved
        state.load(saved, ("task",))
        return saved.get("task")
    optimizer = optimizers.only
    configured = [dict(group) for group in optimizer.param_groups]  # from this run's config
    state.load(saved, (*skip, "task"))
    if not same_schedule:  # the new schedule starts here, from its start
        for group, fresh in zip(optimizer.param_groups, configured):
            group.update({k: fresh[k] for k in ("lr", "initial_lr") if k in fresh})
    rebased = apply_changed_options(
        optimizer, configured, changed_options(saved_cfg.get("optimizer") or {}, cfg.optimizer)
    )
    for group, base_lr in rebased.items() if scheduler is not None and same_schedule else ():
        scheduler.rebase(group, base_lr)
    saved_ranks = checkpoint.meta.get("world_size", 1)
    if checkpoint.sharded and saved_ranks != strategy.world_size and strategy.is_rank_zero:
        log.warning(
            "resume: %s was saved by %d processes and is resharded over %d; the data order differs "
            "from the saved run's from here on",
            checkpoint.path,
            saved_ranks,
            strategy.world_size,
        )
    return saved.get("task")


def optimizer_check(optimizer: Union[torch.optim.Optimizer, Optimizers]) -> Callable[[Any, str], None]:
    """The saved optimizer state against this run's: the one optimizer's as it always was, or each named one's."""
    optimizers = as_optimizers(optimizer)

    def check(saved: Any, where: str) -> None:
        pairs = [(saved, optimizers.only, where)] if optimizers.single else []
        if not optimizers.single:
            validate_state(saved, {name: {} for name in optimizers.named}, where)  # by name, these and no others
            pairs = [(saved[name], opt, f"{where}/{name}") for name, opt in optimizers.named.items()]
        for state, optimizer, at in pairs:
            validate_state(state, optimizer.state_dict(), at)
            problem = check_optimizer_state(state, optimizer, at)
            if problem is not None:
                raise DamagedCheckpoint(problem)
        for name, scheduler in optimizers.schedulers.items():
            if f"{name}/scheduler" not in saved:
                raise DamagedCheckpoint(f"{where}: no {name}/scheduler; expected optimizer.{name}'s schedule")

    return check


def precision_check(precision: Any) -> Callable[[Any, str], None]:
    def check(saved: Any, where: str) -> None:
        live = precision.state_dict()
        if isinstance(saved, dict) and not saved.get("scaler"):  # saved without a GradScaler (precision changed)
            live = {**live, "scaler": {}}
        validate_state(saved, live, where)

    return check


def callbacks_check(callbacks: CallbackList) -> Callable[[Any, str], None]:
    def check(saved: Any, where: str) -> None:
        validate_state(saved, {}, where)  # a dict, of any names
        for name, callback in callbacks:
            if name in saved:
                validate_state(saved[name], callback.state_dict(), f"{where}/{name}")
            elif callback.state_dict():
                log.info("resume: callbacks.%s is new in this run: it starts fresh", name)
        for name in saved:
            if name not in callbacks.callbacks and saved[name]:
                log.warning("resume: %s/%s is not configured in this run; its saved state is not used", where, name)

    return check


def load_test_weights(
    cfg: DictConfig, checkpoints: CheckpointManager, strategy: Strategy, module: torch.nn.Module
) -> str:
    """Put into `module` the weights fit's test uses, as trainer.test_ckpt says (Lightning's ckpt_path; by default the
    best checkpoint's when a monitored top-k keeps one, else the final weights); returns which, for the summary.
    Rank 0 knows the checkpoints; every rank loads the same."""
    ck, choice = cfg.checkpoint, cfg.trainer.test_ckpt
    if choice is None:
        choice = "best" if ck.monitor and ck.save_top_k != 0 and not cfg.trainer.fast_dev_run else "last"
    best = checkpoints.best_path() if strategy.is_rank_zero and choice == "best" else None
    if best is not None and not best.is_dir():  # a run resumed into a new directory: its best is the old run's
        best = None
    chosen = strategy.broadcast_object(str(best) if best is not None else None)
    if chosen is not None:
        try:
            checkpoint = open_checkpoint(Path(chosen))
            weights = checkpoint.model_state(strategy.mesh)
        except DamagedCheckpoint as err:  # the run itself is fine: its final weights are tested instead
            if strategy.is_rank_zero:
                log.warning("trainer.test_ckpt=best: %s; testing the final weights", err)
            return "last (the best checkpoint is damaged)"
        module.load_state_dict(weights)
        if strategy.is_rank_zero:
            log.info("Testing the best checkpoint's weights (step %d, %s)", checkpoint.step, chosen)
        return f"best (step {checkpoint.step})"
    if choice == "best":
        if strategy.is_rank_zero:
            log.warning(
                "trainer.test_ckpt=best: no best checkpoint in this run directory (no validation ran, or the "
                "best is in the run this one was resumed from): testing the final weights"
            )
        return "last (no best checkpoint was saved)"
    return "last"
