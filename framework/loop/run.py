"""A run, built: its parts from config (`build`), wired (the metric logger, the task's handle, the evaluator, the
stop, the state registry), a checkpoint restored into it (`restore`), and what callbacks see of it, by
Lightning's names. The loop that runs it is the Trainer (trainer.py)."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

import framework
from framework.checkpoint import Checkpoint, CheckpointManager, open_checkpoint
from framework.checkpoint.restore import callbacks_check, optimizer_check, precision_check, restore
from framework.checkpoint.state import Progress, RngState, TaskState, TrainingState
from framework.config.interpolation import interpolations, sources
from framework.core import reproducibility
from framework.core.errors import ConfigError
from framework.data.module import DataCheck, DataModule, check_data
from framework.data.streaming import StreamState
from framework.loop.build import build_components
from framework.loop.evaluate import Evaluator, move_to
from framework.loop.stop import Stop
from framework.observe.compile_report import compile_report
from framework.observe.metric_logger import MetricLogger, TaskHandle, TrainLog
from framework.observe.model_summary import summarize
from framework.observe.progress import ProgressBar
from framework.observe.setup_report import describe_setup
from framework.observe.tensorboard import TensorBoardLogger
from framework.optim.groups import group_names
from framework.parallel.memory import PeakMemory, model_devices
from framework.parallel.strategy import build_strategy
from framework.task import hooks as task_hooks
from framework.task.task import step_function

log = logging.getLogger("framework.loop.trainer")  # the name run.log and the tests know its lines by


class Run:
    """A run's parts, built and wired, and what callbacks see of it, by Lightning's names (global_step,
    current_epoch, callback_metrics, is_global_zero, should_stop, request_stop, log). The Trainer runs it."""

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: Path,
        resume_from: Optional[Checkpoint] = None,
        hparams: Optional[dict[str, Any]] = None,
        choices: Optional[dict[str, Any]] = None,
    ) -> None:
        self.cfg, self.hparams, t = cfg, hparams or {}, cfg.trainer
        self.fast_dev_run = t.fast_dev_run
        self.max_steps = 1 if self.fast_dev_run else t.max_steps
        self.max_epochs = 1 if self.fast_dev_run else t.max_epochs
        self.accumulate, self.log_every_n_steps = t.accumulate_grad_batches, t.log_every_n_steps
        reproducibility.set_deterministic(t.deterministic)
        reproducibility.seed_everything(cfg.seed)
        self.strategy = build_strategy(cfg.parallel, t.device)
        self.device = self.strategy.device
        self.peak_memory = PeakMemory(model_devices(self.device, data_parallel=self.strategy.name == "dp"))
        self.run_dir, self.resume_from = self._agree_on_run(run_dir, resume_from)
        parts = self.parts = build_components(cfg, self.strategy, self.run_dir)
        self.data, self.task, self.model_attr, self.precision = (
            parts.data,
            parts.task,
            parts.model_attr,
            parts.precision,
        )
        self.optimizer, self.scheduler, self.checkpoints = parts.optimizer, parts.scheduler, parts.checkpoints
        self.callbacks, self.train_batches, self.steps_per_epoch = (
            parts.callbacks,
            parts.train_batches,
            parts.steps_per_epoch,
        )
        self.param_group_names = group_names(self.optimizer)
        self.params = [p for p in self.task.parameters() if p.requires_grad]
        self.on_signal = cfg.checkpoint.on_signal and not self.fast_dev_run
        self.progress, self.stop = Progress(), Stop(self.strategy, t.min_epochs, t.min_steps)
        self._wire_logging()
        step_fns = {m: step_function(self.task, m) for m in ("training_step", "validation_step", "test_step")}
        self.training_step = step_fns["training_step"]
        self.evaluator = self._build_evaluator(step_fns)
        self._check_monitors_exist()
        self.tested = ""  # which weights fit's test used: best (step N) or last
        self._val_checked = False  # the monitors were checked against a validation round's metrics
        self._saved_task_state: Any = None  # a resume's task state, loaded once the task's start hooks ran
        self._started_at, self._epoch_rate = (time.perf_counter(), 0), 0.0  # for the ETA; samples/s of the last epoch
        self._val_names: list[str] = []  # the validation metrics, as the first val batch showed them
        self._clip_norm, self._clip_value = t.grad_clip_norm, t.grad_clip_value  # no config access per step
        self._val_every = t.val_every_n_steps if self.data.has("val") else 0
        # Ranks agree on stopping after every step when anything may ask (every rank must take part, or none).
        self._agree_on_stops = (
            self.on_signal
            or bool(self.callbacks.callbacks)
            or self.strategy.world_size == 1
            or task_hooks.task_callback(self.task) is not None
        )
        before_step = self.callbacks.bound("on_before_optimizer_step")  # (a partial: a step never enters run.py)
        self._before_step = functools.partial(before_step, self, self.task, self.optimizer) if before_step else None
        self._before_zero_grad = self.callbacks.bound("on_before_zero_grad")
        self.state = self._register_state(choices)
        self.callbacks.call("setup", self, self.task)

    def _wire_logging(self) -> None:
        """TensorBoard, the bar and the metric logger behind them; the task's handle (`task.trainer`) onto them."""
        cfg, t, rank_zero = self.cfg, self.cfg.trainer, self.strategy.is_rank_zero
        # On resume, TensorBoard drops whatever the killed run logged after its checkpoint's step.
        purge = self.resume_from.step + 1 if self.resume_from is not None else None
        self.logger = TensorBoardLogger(
            self.run_dir,
            enabled=rank_zero and cfg.logger.tensorboard and not self.fast_dev_run and not t.dry_run,
            purge_step=purge,
        )
        self.bar = ProgressBar(enabled=rank_zero and cfg.logger.progress_bar, every_s=cfg.logger.progress_every_s)
        self.metric_logger = MetricLogger(
            device=self.device,
            tensorboard=self.logger,
            bar=self.bar,
            run_dir=self.run_dir,
            accumulate=self.accumulate,
            steps_per_epoch=self.steps_per_epoch,
        )
        self.metric_logger.attach(self.task)
        self.task.trainer = TaskHandle(
            self.metric_logger,
            self.progress,
            self.stop,
            is_global_zero=rank_zero,
            world_size=self.strategy.world_size,
            max_epochs=self.max_epochs,
            max_steps=self.max_steps,
        )

    def _build_evaluator(self, step_fns: dict[str, Any]) -> Evaluator:
        t = self.cfg.trainer
        return Evaluator(
            task=self.task,
            model_attr=self.model_attr,
            data=self.data,
            strategy=self.strategy,
            precision=self.precision,
            metric_logger=self.metric_logger,
            step_fns=step_fns,
            limits={
                "val": 1 if self.fast_dev_run else t.limit_val_batches,
                "test": 1 if self.fast_dev_run else t.limit_test_batches,
            },
            overfit=self.parts.overfit,
        )

    def _agree_on_run(self, run_dir: Path, resume_from: Optional[Checkpoint]) -> tuple[Path, Optional[Checkpoint]]:
        """Under torchrun only rank 0 made a run directory (see app.py); every rank uses that one, and resumes from
        the checkpoint rank 0 picked (each rank looked on its own: a save or prune a killed rank 0 left half done
        can make them disagree)."""
        agreed = Path(self.strategy.broadcast_object(str(run_dir)))
        chosen = self.strategy.broadcast_object(str(resume_from.path) if resume_from is not None else None)
        if chosen is None:
            return agreed, None
        if resume_from is None or str(resume_from.path) != chosen:
            resume_from = open_checkpoint(Path(chosen))
        return agreed, resume_from

    def _register_state(self, choices: Optional[dict[str, Any]]) -> TrainingState:
        """Every piece of resumable state, once. The checkpoint's meta.json also holds the config, its
        interpolations and the groups' options (which resume rebuilds the run from), the data's identity (which a
        resume compares) and the number of processes."""
        self.data_check = _check_data(self.cfg, self.data, self.resume_from)  # before anything trains
        state = TrainingState(
            lambda: self.module,
            self.progress,
            self.metric_logger.metrics,
            info={
                "framework_version": framework.__version__,  # which version wrote it
                "world_size": self.strategy.world_size,
                "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),
                "interpolations": interpolations(self.cfg),  # what a resume re-derives (framework/app/resume.py)
                "data_identity": self.data_check.record,
                "choices": {g: o for g, o in (choices or {}).items() if not g.startswith("hydra")},
            },
        )
        state.register("optimizer", self.optimizer, check=optimizer_check(self.optimizer))
        if self.scheduler is not None:
            state.register("scheduler", self.scheduler)
        state.register("precision", self.precision, check=precision_check(self.precision))
        state.register("checkpoints", self.checkpoints, check=CheckpointManager.check_state_dict)
        state.register("train_loss", self.metric_logger.window, optional=True, check=TrainLog.check_state_dict)
        self.task_state = TaskState(self.task, self.model_attr, self.strategy)
        state.register("task", self.task_state, optional=True, check=self.task_state.check_state_dict)
        state.register("callbacks", self.callbacks, check=callbacks_check(self.callbacks), optional=True)
        if self.data.streams:  # their position is the loop's; this holds what it needs (framework/data/streaming.py)
            streams = StreamState(self.data.streams, self.progress, new_data=self.data_check.changed)
            state.register("data", streams, check=streams.check_state_dict, optional=True)
        rng = RngState(self.strategy)
        state.register("rng", rng, check=rng.check_state_dict)  # last: loading it must follow all the rest
        return state

    # ------------------------------------------------------------------ what callbacks see (Lightning's names)
    @property
    def model(self) -> torch.nn.Module:
        """The task's model as the loop runs it (wrapped by DDP/DP; trainer.compile compiles it in place), held in
        `task.<model_attr>`."""
        return getattr(self.task, self.model_attr)

    @property
    def module(self) -> torch.nn.Module:
        """The model itself, unwrapped from DDP/DP: what is saved, exported and averaged."""
        return self.strategy.unwrap(self.model)

    @property
    def global_step(self) -> int:
        return self.progress.step

    @property
    def current_epoch(self) -> int:
        return self.progress.epoch

    @property
    def callback_metrics(self) -> dict[str, float]:
        return self.metric_logger.metrics

    @property
    def metrics(self) -> dict[str, float]:
        return self.metric_logger.metrics

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_rank_zero

    @property
    def should_stop(self) -> bool:
        return bool(self.stop.reason)

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        """Lightning's `trainer.should_stop = True` from a callback: request_stop without a reason of its own."""
        if value:
            self.stop.request("a callback set trainer.should_stop")

    @property
    def stop_reason(self) -> str:
        return self.stop.reason

    def request_stop(self, reason: str) -> None:
        """Stop at the next optimizer-step boundary (every rank at the same one, once trainer.min_epochs and
        min_steps are reached); `reason` goes to the console and summary.json. The first reason given wins."""
        self.stop.request(reason)

    def log(self, name: str, value: Union[float, torch.Tensor]) -> None:
        """A scalar for TensorBoard at the next logging step (a tensor is read then, with the loss: no sync)."""
        self.metric_logger.log(name, value)

    def _monitors(self) -> dict[str, str]:
        """Every metric a component watches, by the config key that names it."""
        found = {
            "checkpoint.monitor": self.checkpoints.monitor if self.checkpoints.save_top_k else None,
            "scheduler.monitor": getattr(self.scheduler, "monitor", None),
            **{f"callbacks.{name}.monitor": getattr(cb, "monitor", None) for name, cb in self.callbacks},
        }
        return {key: monitor for key, monitor in found.items() if isinstance(monitor, str)}

    def _check_monitors_exist(self) -> None:
        """A monitor with no validation split to compute it is an error at start, not after the first epoch."""
        if self.data.has("val"):
            return
        for key, monitor in self._monitors().items():  # (checkpoint's: config.validate already refused it)
            remedy = "scheduler.monitor=null" if key == "scheduler.monitor" else f"{key.rsplit('.', 1)[0]}=null"
            raise ConfigError(
                f"{key}={monitor!r}: this run has no validation split (data.val is null), so the "
                f"metric never exists; expected a data.val split, or {remedy}"
            )

    def _restore(self, checkpoint: Checkpoint) -> None:
        self._saved_task_state = restore(
            checkpoint,
            self.cfg,
            self.state,
            module=self.module,
            strategy=self.strategy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
        )
        _start_on_new_data(self.data_check, self.progress, self.strategy.is_rank_zero)
        self.checkpoints.saved_step = self.progress.step
        if self.strategy.is_rank_zero:
            p = self.progress
            resumed = f"Resumed from {checkpoint.path} at step {p.step} (epoch {p.epoch}, batch {p.batch_in_epoch})"
            log.info("%s", resumed)
            self.logger.log_text("history", resumed, p.step)

    def _describe_setup(self) -> None:
        """The summary's forward runs on every rank (a sharded model's forward gathers weights from all of them)."""
        summary = None
        if self.cfg.trainer.dry_run:
            batch = move_to(next(iter(self.data.batches("train"))), self.device)
            summary = summarize(self.module, lambda: self.task.validation_step(batch))
        if self.strategy.is_rank_zero:
            describe_setup(
                self.cfg,
                self.parts,
                world_size=self.strategy.world_size,
                run_dir=self.run_dir,
                tensorboard=self.logger,
                fresh=self.progress.step == 0,
                charts=[*self._monitors().values(), *self._val_names],
                hparams=self.hparams,
                model_summary=summary,
            )

    # ------------------------------------------------------------------ results
    def _summary(self, seconds: float) -> dict[str, Any]:
        summary: dict[str, Any] = dict(self.metrics)
        best = self.checkpoints.best_path()
        p = self.progress
        summary.update(
            status="ok",
            step=p.step,
            epoch=p.epoch,
            batch_in_epoch=p.batch_in_epoch,
            epoch_batches=self.train_batches,
            seconds=round(seconds, 3),
            world_size=self.strategy.world_size,
            precision=self.precision.name,
            best_checkpoint=str(best) if best is not None else None,
            stopped=self.stop.reason or None,
            tested=self.tested or None,
        )
        if self.cfg.trainer.compile:  # how often torch.compile compiled during this fit (recompilations logged)
            summary["compile"] = compile_report(time.time() - seconds, self.strategy.is_rank_zero)
        if self.data.skip_corrupt:  # a collective: every rank makes the summary
            indexed, read = self.data.skipped()
            every = self.strategy.gather_objects(read)  # a sample is read by another rank in another epoch
            summary["data_skipped"] = indexed + sum(len(set().union(*(r[split] for r in every))) for split in read)
        return summary


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
