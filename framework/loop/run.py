"""A run, built: its components from config (`build`), wired (the metric logger, the view the task and callbacks
see, the evaluator, the stop, the state registry). `Run` is plain data: the Trainer (fit) runs it, the evaluation
stages and lr_find use its parts. Also here: what a checkpoint restores into it, its monitors, its setup report."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf

import framework
from framework.callbacks import task_hooks
from framework.callbacks.base import CallbackList
from framework.checkpoint import Checkpoint, CheckpointManager, open_checkpoint
from framework.checkpoint.state import Progress, RngState, TaskParameters, TaskState, TrainingState
from framework.config.interpolation import interpolations, sources
from framework.core import reproducibility
from framework.core.errors import ConfigError
from framework.data.module import DataCheck, DataModule, check_data
from framework.data.streaming import StreamState
from framework.loop.build import Components, build_components
from framework.loop.evaluate import Evaluator
from framework.loop.restore import callbacks_check, optimizer_check, precision_check, restore
from framework.loop.stop import Stop
from framework.loop.view import RunView
from framework.observe.best import MODES, Best
from framework.observe.logged import TrainLog
from framework.observe.metric_logger import MetricLogger
from framework.observe.progress import ProgressBar
from framework.observe.setup_report import describe_setup
from framework.observe.tensorboard import TensorBoardLogger
from framework.observe.trackers import Trackers
from framework.optim.groups import group_names
from framework.optim.optimizers import Optimizers, outside_model
from framework.parallel.memory import PeakMemory, model_devices
from framework.parallel.precision import Precision
from framework.parallel.strategy import Strategy, build_strategy
from framework.task.task import Task, check_dataloader_idx, step_function

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """The loop's lengths and cadences, read from the config once: the loop reads no config per step."""

    max_steps: int
    max_epochs: int
    fast_dev_run: bool
    accumulate: int
    log_every_n_steps: int
    val_every_n_steps: int  # 0: validation by epoch only (or no validation)
    val_every_n_epochs: int
    validates: bool  # there is validation: a val split and a task with validation_step (`evaluates`)
    tests: bool  # fit tests at its end: trainer.test, a test split and a step for it
    grad_clip_norm: Optional[float]
    grad_clip_value: Optional[float]
    on_signal: bool  # a watched signal saves `last` and stops the run


@dataclass
class Run:
    """A run's parts, built and wired. `model` is the task's model as the loop runs it (wrapped by DDP/DP, compiled in
    place by trainer.compile); the task holds its own as `task.<model_attr>` (see Components)."""

    cfg: DictConfig
    run_dir: Path
    resume_from: Optional[Checkpoint]
    hparams: dict[str, Any]
    limits: Limits
    strategy: Strategy
    # the components (framework/loop/build.py)
    data: DataModule
    task: Task
    model_attr: str
    model: torch.nn.Module
    precision: Precision
    optimizers: Optimizers
    frozen: Any
    scheduler: Any
    train_batches: int
    steps_per_epoch: int
    overfit: int
    checkpoints: CheckpointManager
    callbacks: CallbackList
    # the wiring
    param_group_names: list[str]
    params: list[torch.nn.Parameter]  # what is trained: clipped, stepped
    progress: Progress
    stop: Stop
    tensorboard: TensorBoardLogger
    bar: ProgressBar
    metric_logger: MetricLogger
    view: RunView
    evaluator: Evaluator
    training_step: Callable[[Any, int], Any]
    state: TrainingState
    task_state: TaskState
    data_check: DataCheck
    peak_memory: PeakMemory
    hosts: list[str]  # every rank's host, by rank

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    @property
    def module(self) -> torch.nn.Module:
        """The model itself, unwrapped from DDP/DP: what is saved, exported and averaged."""
        return self.strategy.unwrap(self.model)


def limits_of(cfg: DictConfig, data: DataModule, task: Task) -> Limits:
    t, validates = cfg.trainer, evaluates(data, task, "val")
    return Limits(
        max_steps=1 if t.fast_dev_run else t.max_steps,
        max_epochs=1 if t.fast_dev_run else t.max_epochs,
        fast_dev_run=t.fast_dev_run,
        accumulate=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        val_every_n_steps=t.val_every_n_steps if validates else 0,
        val_every_n_epochs=t.val_every_n_epochs,
        validates=validates,
        tests=bool(t.test) and evaluates(data, task, "test"),
        grad_clip_norm=t.grad_clip_norm,
        grad_clip_value=t.grad_clip_value,
        on_signal=cfg.checkpoint.on_signal and not t.fast_dev_run,
    )


def evaluates(data: DataModule, task: Task, split: str) -> bool:
    """Whether `split` ("val" or "test") is evaluated at all: the data has it and the task has a step for it. As in
    Lightning, a task that defines no validation_step (anywhere below Task) is not validated; a test runs its
    test_step, else its validation_step (ours, not Lightning's, which requires a test_step)."""
    steps = ("validation_step",) if split == "val" else ("test_step", "validation_step")
    return data.has(split) and any(task_hooks.defines(task, step) for step in steps)


def check_set_steps(data: DataModule, task: Task) -> None:
    """Each evaluated split's step against its number of sets: with several, it is given a dataloader_idx (as in
    Lightning), so it must take one; with one, none, so it must not need one."""
    for split, method in (("val", "validation_step"), ("test", "test_step")):
        if not evaluates(data, task, split):
            _refuse_unevaluated_sets(data, task, split)
            continue
        sets = [f"data.{key}" for key in data.sets(split)]
        which = f"{' and '.join(sets)} are {len(sets)} sets" if len(sets) > 1 else f"{sets[0]} is the one set"
        check_dataloader_idx(task, method if task_hooks.defines(task, method) else "validation_step", len(sets), which)


def _refuse_unevaluated_sets(data: DataModule, task: Task, split: str) -> None:
    """Sets named beside the default one (`data.val_sets.<name>`) for a split the run never evaluates: a mistake (a
    default `data.val` the task does not use is not; Lightning skips it too)."""
    extra = [key for key in data.sets(split) if key != split]
    if not extra:
        return
    name = type(task).__name__  # (a null default set beside named ones is refused with the config: validate.py)
    steps = "validation_step" if split == "val" else "test_step or validation_step"
    raise ConfigError(
        f"data.{extra[0]}: the task {name} defines no {steps}, so this set is never evaluated; expected a {steps} "
        f"in {name}, or no data.{split}_sets"
    )


def assemble(
    cfg: DictConfig,
    run_dir: Path,
    resume_from: Optional[Checkpoint] = None,
    hparams: Optional[dict[str, Any]] = None,
    choices: Optional[dict[str, Any]] = None,
) -> Run:
    """Seed, build the strategy and the components, wire them, register the resumable state; then the callbacks'
    `setup`. Every rank calls it."""
    t = cfg.trainer
    reproducibility.set_deterministic(t.deterministic)
    reproducibility.seed_everything(cfg.seed)
    strategy = build_strategy(cfg.parallel, t.device)
    run_dir, resume_from = _agree_on_run(strategy, run_dir, resume_from)
    hosts = strategy.gather_objects(socket.gethostname())  # the job's record (summary.json), where no launcher has it
    parts = build_components(cfg, strategy, run_dir)
    check_monitors_exist(parts)
    check_set_steps(parts.data, parts.task)
    limits = limits_of(cfg, parts.data, parts.task)
    progress, stop = Progress(), Stop(strategy, t.min_epochs, t.min_steps)
    tensorboard, bar, metric_logger = _reporting(cfg, strategy, parts, limits, run_dir, resume_from)
    declare_modes(parts, metric_logger.best)
    names = group_names(parts.optimizers)
    view = RunView(parts, names, metric_logger, progress, stop, strategy, limits, run_dir)
    parts.task.trainer = view  # Lightning's `self.trainer` (a view of the run, not the loop)
    step_fns = {m: step_function(parts.task, m) for m in ("training_step", "validation_step", "test_step")}
    data_check = _check_data(cfg, parts.data, resume_from)  # before anything trains
    run = Run(
        cfg=cfg,
        run_dir=run_dir,
        resume_from=resume_from,
        hparams=hparams or {},
        limits=limits,
        strategy=strategy,
        **vars(parts),
        param_group_names=names,
        params=[p for p in parts.task.parameters() if p.requires_grad],
        progress=progress,
        stop=stop,
        tensorboard=tensorboard,
        bar=bar,
        metric_logger=metric_logger,
        view=view,
        evaluator=_evaluator(cfg, strategy, parts, limits, metric_logger, step_fns),
        training_step=step_fns["training_step"],
        state=TrainingState(
            lambda: strategy.unwrap(parts.model),
            progress,
            metric_logger.metrics,
            info=_saved_with_state(cfg, strategy, data_check, choices, parts.model_attr),
        ),
        task_state=TaskState(parts.task, parts.model_attr, strategy),
        data_check=data_check,
        peak_memory=PeakMemory(model_devices(strategy.device, data_parallel=strategy.name == "dp")),
        hosts=hosts,
    )
    _register_state(run)
    parts.callbacks.call("setup", view, parts.task)
    return run


def _reporting(
    cfg: DictConfig,
    strategy: Strategy,
    parts: Components,
    limits: Limits,
    run_dir: Path,
    resume_from: Optional[Checkpoint],
) -> tuple[TensorBoardLogger, ProgressBar, MetricLogger]:
    """TensorBoard, the bar and the metric logger in front of them (rank 0's write; the others' are off)."""
    rank_zero, t = strategy.is_rank_zero, cfg.trainer
    # On resume, TensorBoard drops whatever the killed run logged after its checkpoint's step.
    tensorboard = TensorBoardLogger(
        run_dir,
        enabled=rank_zero and cfg.logger.tensorboard and not limits.fast_dev_run and not t.dry_run,
        purge_step=resume_from.step + 1 if resume_from is not None else None,
    )
    bar = ProgressBar(enabled=rank_zero and cfg.logger.progress_bar, every_s=cfg.logger.progress_every_s)
    metric_logger = MetricLogger(
        device=strategy.device,
        tensorboard=tensorboard,
        bar=bar,
        run_dir=run_dir,
        accumulate=limits.accumulate,
        steps_per_epoch=parts.steps_per_epoch,
    )
    metric_logger.attach(parts.task)
    return tensorboard, bar, metric_logger


def _evaluator(
    cfg: DictConfig,
    strategy: Strategy,
    parts: Components,
    limits: Limits,
    metric_logger: MetricLogger,
    step_fns: dict[str, Callable[[Any, int], Any]],
) -> Evaluator:
    t = cfg.trainer
    return Evaluator(
        task=parts.task,
        model_attr=parts.model_attr,
        model=parts.model,
        data=parts.data,
        strategy=strategy,
        precision=parts.precision,
        metric_logger=metric_logger,
        step_fns=step_fns,
        limits={
            "val": 1 if limits.fast_dev_run else t.limit_val_batches,
            "test": 1 if limits.fast_dev_run else t.limit_test_batches,
        },
        overfit=parts.overfit,
    )


def _agree_on_run(
    strategy: Strategy, run_dir: Path, resume_from: Optional[Checkpoint]
) -> tuple[Path, Optional[Checkpoint]]:
    """Under torchrun only rank 0 made a run directory (see framework/app/main.py); every rank uses that one, and
    resumes from the checkpoint rank 0 picked (each rank looked on its own: a save or prune a killed rank 0 left
    half done can make them disagree)."""
    agreed = Path(strategy.broadcast_object(str(run_dir)))
    chosen = strategy.broadcast_object(str(resume_from.path) if resume_from is not None else None)
    if chosen is None:
        return agreed, None
    if resume_from is None or str(resume_from.path) != chosen:
        resume_from = open_checkpoint(Path(chosen))
    return agreed, resume_from


def _saved_with_state(
    cfg: DictConfig, strategy: Strategy, data_check: DataCheck, choices: Optional[dict[str, Any]], model_attr: str
) -> dict[str, Any]:
    """What a checkpoint's meta.json holds beside the state: the config, its interpolations and the groups' options
    (which a resume rebuilds the run from), the data's identity (which a resume compares), the number of processes,
    the task's attribute its weights are of ("": the task itself, which built its nets) and the version that wrote
    it."""
    return {
        "framework_version": framework.__version__,
        "world_size": strategy.world_size,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "interpolations": interpolations(cfg),  # what a resume re-derives (framework/config/saved.py)
        "data_identity": data_check.record,
        "choices": {g: o for g, o in (choices or {}).items() if not g.startswith("hydra")},
        "model_attr": model_attr,
    }


def _register_state(run: Run) -> None:
    """Every piece of resumable state, once."""
    state = run.state
    state.register("optimizer", run.optimizers, check=optimizer_check(run.optimizers))
    if outside_model(run.task, run.model_attr):  # trained beside the model: saved and restored with it
        params = TaskParameters(run.task, run.model_attr)
        state.register("task_parameters", params)
    if run.scheduler is not None:
        state.register("scheduler", run.scheduler)
    state.register("precision", run.precision, check=precision_check(run.precision))
    state.register("checkpoints", run.checkpoints, check=CheckpointManager.check_state_dict)
    state.register("train_loss", run.metric_logger.window, optional=True, check=TrainLog.check_state_dict)
    state.register("task", run.task_state, optional=True, check=run.task_state.check_state_dict)
    state.register("callbacks", run.callbacks, check=callbacks_check(run.callbacks), optional=True)
    if run.data.streams:  # their position is the loop's; this holds what it needs (framework/data/streaming.py)
        streams = StreamState(run.data.streams, run.progress, new_data=run.data_check.changed)
        state.register("data", streams, check=streams.check_state_dict, optional=True)
    rng = RngState(run.strategy)
    state.register("rng", rng, check=rng.check_state_dict)  # last: loading it must follow all the rest


def monitors(parts: Any) -> dict[str, str]:
    """Every metric a component watches, by the config key that names it (`parts`: a Run or its Components)."""
    found = {
        "checkpoint.monitor": parts.checkpoints.monitor if parts.checkpoints.save_top_k else None,
        "scheduler.monitor": getattr(parts.scheduler, "monitor", None),
        **{f"callbacks.{name}.monitor": getattr(cb, "monitor", None) for name, cb in parts.callbacks},
    }
    return {key: monitor for key, monitor in found.items() if isinstance(monitor, str)}


def check_monitors_exist(parts: Components) -> None:
    """A monitor with no validation to compute it (no val split, or a task without validation_step) is an error at
    start, not after the first epoch."""
    if evaluates(parts.data, parts.task, "val"):
        return
    for key, monitor in monitors(parts).items():
        remedies = {"scheduler.monitor": "scheduler.monitor=null", "checkpoint.monitor": "checkpoint.save_top_k=0"}
        remedy, task = remedies.get(key, f"{key.rsplit('.', 1)[0]}=null"), type(parts.task).__name__
        why, wanted = (
            ("this run has no validation split (data.val is null)", "a data.val split")
            if not parts.data.has("val")
            else (f"the task {task} defines no validation_step (it is not validated)", f"a validation_step in {task}")
        )
        raise ConfigError(f"{key}={monitor!r}: {why}, so the metric never exists; expected {wanted}, or {remedy}")


def declare_modes(parts: Components, best: Best) -> None:
    """The directions the config's monitors (each with its mode) and the task (`metric_modes`) declare, checked
    against each other now (framework/observe/best.py)."""
    found = [
        ("checkpoint", parts.checkpoints.monitor, parts.checkpoints.mode),
        ("scheduler", getattr(parts.scheduler, "monitor", None), getattr(parts.scheduler, "mode", None)),
        *((f"callbacks.{name}", getattr(c, "monitor", None), getattr(c, "mode", None)) for name, c in parts.callbacks),
    ]
    for where, monitor, mode in found:
        if isinstance(monitor, str) and mode in MODES:
            best.declare(monitor, mode, f"{where}.monitor={monitor!r} with {where}.mode={mode}")
    best.declare_task(parts.task, "val", list(parts.data.sets("val").values()))


def restore_into(run: Run, checkpoint: Checkpoint) -> Any:
    """The checkpoint's state into the run's parts (every part checked first); returns the task's saved state, which
    is loaded once the task's start hooks have run."""
    saved_task_state = restore(
        checkpoint,
        run.cfg,
        run.state,
        module=run.module,
        strategy=run.strategy,
        optimizers=run.optimizers,
        scheduler=run.scheduler,
    )
    _start_on_new_data(run.data_check, run.progress, run.strategy.is_rank_zero)
    run.checkpoints.resumed_at(run.progress.step)
    if run.strategy.is_rank_zero:
        p = run.progress
        resumed = f"Resumed from {checkpoint.path} at step {p.step} (epoch {p.epoch}, batch {p.batch_in_epoch})"
        log.info("%s", resumed)
        run.tensorboard.log_text("history", resumed, p.step)
    return saved_task_state


def report_setup(run: Run, charts: list[str]) -> None:
    """What a user checks before trusting the run (framework/observe/setup_report.py), then the trackers opened: a run
    that keeps something is tracked from here on."""
    if not run.strategy.is_rank_zero:
        return
    describe_setup(
        run.cfg,
        run,
        world_size=run.strategy.world_size,
        run_dir=run.run_dir,
        tensorboard=run.tensorboard,
        fresh=run.progress.step == 0,
        charts=charts,
        hparams=run.hparams,
    )
    if not run.cfg.trainer.dry_run and not run.limits.fast_dev_run:  # runs that keep nothing are tracked nowhere
        resume_step = run.resume_from.step if run.resume_from is not None else None
        run.metric_logger.start_trackers(Trackers.open(run.cfg, run.run_dir, resume_step))


def agree_on_stops(run: Run) -> bool:
    """Ranks agree on stopping after every step when anything may ask (every rank must take part, or none)."""
    return (
        run.limits.on_signal
        or bool(run.callbacks.callbacks)
        or run.strategy.world_size == 1
        or task_hooks.task_callback(run.task) is not None
    )


def _check_data(cfg: DictConfig, data: DataModule, checkpoint: Optional[Checkpoint]) -> DataCheck:
    """This run's data (each split's samples, shard files and the config it is made from) against the identity the
    checkpoint it resumes from recorded: refused where it differs, unless resume_on_new_data."""
    current = {split: {**found, "config": sources(cfg, f"data.{split}")} for split, found in data.identity().items()}
    if checkpoint is None:
        return DataCheck(current, {})
    saved = checkpoint.meta.get("data_identity")
    return check_data(current, saved, accept=bool(cfg.get("resume_on_new_data")), where=str(checkpoint.path))


def _start_on_new_data(check: DataCheck, progress: Progress, rank_zero: bool) -> None:
    """After a restore that resume_on_new_data let through: a new train split starts at the next epoch's batch 0."""
    if not check.changed:
        return
    if "train" in check.changed:
        progress.start_next_epoch()
    if rank_zero:
        log.warning("%s", check.announcement(progress.epoch, progress.step))
