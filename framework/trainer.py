"""The fit loop. Its parts do the work, each in its own module: `build` (components from config), `metric_logger`
(what is logged, and `TaskHandle`, the task's view of the run), `evaluate` (validation and test), `preflight` (the
check before training), `restore` (a checkpoint into the run), `stop` (early stops agreed by every rank), the
checkpoint policies (`checkpoint.policies`) and the state registry (`state`).

One training step, top to bottom, is in `_train_epoch`: batch -> autocast forward -> backward -> (every
`accumulate_grad_batches`) unscale/clip/step -> scheduler -> callbacks -> log -> stop? -> validate/checkpoint.
At an epoch's end, `_end_epoch`: callbacks -> epoch means -> validation -> epoch scheduler -> checkpoint.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

import framework
from framework import allocator, reproducibility, task_hooks
from framework.build import build_components
from framework.checkpoint import Checkpoint, CheckpointManager, CheckpointSaveError, open_checkpoint
from framework.errors import ConfigError, Interrupted, UserError
from framework.evaluate import Evaluator, move_to
from framework.instantiate import error_line
from framework.loggers import TensorBoardLogger, print_summary, write_json
from framework.metric_logger import MetricLogger, TaskHandle, TrainLog
from framework.model_summary import summarize
from framework.optim import group_names
from framework.parallel import build_strategy
from framework.preflight import check_first_batches
from framework.progress import ProgressBar
from framework.restore import callbacks_check, optimizer_check, precision_check, restore
from framework.setup_report import describe_setup
from framework.signals import SignalWatch, watched
from framework.state import Progress, RngState, TaskState, TrainingState
from framework.stop import Stop
from framework.task import StepOutput, as_step_output, step_function

log = logging.getLogger(__name__)


def train(cfg: DictConfig, run_dir: Path, resume_from: Union[None, Path, Checkpoint] = None,
          hparams: Optional[dict[str, Any]] = None, choices: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Build the Trainer and fit: the one place a run is started, in this process or in a spawned worker."""
    allocator.keep_freed_memory()  # each step reuses the memory the last one freed (framework/allocator.py)
    _import_torch_dynamo()
    checkpoint = open_checkpoint(resume_from) if isinstance(resume_from, Path) else resume_from
    trainer = Trainer(cfg, run_dir, resume_from=checkpoint, hparams=hparams, choices=choices)
    try:
        return trainer.fit()
    finally:
        # Freed now, while the interpreter is whole: a DDP model holds the gloo process group, whose C++ threads,
        # destroyed during interpreter shutdown instead, aborted a worker now and then; and a sweep's next job
        # does not start with the last one's model, optimizer and data still in memory. Nothing of the run refers
        # back to the trainer (the task sees a TaskHandle), so dropping it frees the run without a collection.
        trainer.data.close()  # see DataModule.close
        del trainer
        gc.collect()  # what user code may still have tied in cycles (a callback holding the trainer)


def _import_torch_dynamo() -> None:
    """torch.optim imports torch._dynamo with a process's first optimizer: ~1 s and ~250k objects that live as
    long as the process. Imported here instead, before anything of the run exists, with the cyclic collector
    off (the dozens of collections the import triggers each scanned the whole heap: ~0.1-0.2 s of start-up),
    then frozen with all that is alive: no later collection scans it again. Once per process."""
    if "torch._dynamo" in sys.modules:
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401
    finally:
        if enabled:
            gc.freeze()
            gc.enable()


def _max_memory_mb(device: torch.device) -> float:
    """Peak memory: CUDA's max_memory_allocated on a GPU, else this process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Trainer:
    """Wires the parts and runs fit -> validate -> test. What callbacks see has Lightning's names (global_step,
    current_epoch, callback_metrics, is_global_zero, should_stop, request_stop, log)."""

    def __init__(self, cfg: DictConfig, run_dir: Path, resume_from: Optional[Checkpoint] = None,
                 hparams: Optional[dict[str, Any]] = None, choices: Optional[dict[str, Any]] = None) -> None:
        self.cfg, self.hparams, t = cfg, hparams or {}, cfg.trainer
        self.fast_dev_run = t.fast_dev_run
        self.max_steps = 1 if self.fast_dev_run else t.max_steps
        self.max_epochs = 1 if self.fast_dev_run else t.max_epochs
        self.accumulate, self.log_every_n_steps = t.accumulate_grad_batches, t.log_every_n_steps
        reproducibility.set_deterministic(t.deterministic)
        reproducibility.seed_everything(cfg.seed)
        self.strategy = build_strategy(cfg.parallel, t.device)
        self.device = self.strategy.device
        self.run_dir, self.resume_from = self._agree_on_run(run_dir, resume_from)
        parts = self.parts = build_components(cfg, self.strategy, self.run_dir)
        self.data, self.task, self.model_attr, self.precision = parts.data, parts.task, parts.model_attr, parts.precision
        self.optimizer, self.scheduler, self.checkpoints = parts.optimizer, parts.scheduler, parts.checkpoints
        self.callbacks, self.train_batches, self.steps_per_epoch = parts.callbacks, parts.train_batches, \
            parts.steps_per_epoch
        self.param_group_names = group_names(self.optimizer)
        self.params = [p for p in self.task.parameters() if p.requires_grad]
        rank_zero = self.strategy.is_rank_zero
        self.on_signal = cfg.checkpoint.on_signal and not self.fast_dev_run
        # On resume, TensorBoard drops whatever the killed run logged after its checkpoint's step.
        purge = self.resume_from.step + 1 if self.resume_from is not None else None
        self.logger = TensorBoardLogger(self.run_dir, enabled=rank_zero and cfg.logger.tensorboard
                                        and not self.fast_dev_run and not t.dry_run, purge_step=purge)
        self.bar = ProgressBar(enabled=rank_zero and cfg.logger.progress_bar, every_s=cfg.logger.progress_every_s)
        self.metric_logger = MetricLogger(device=self.device, tensorboard=self.logger, bar=self.bar,
                                          run_dir=self.run_dir, accumulate=self.accumulate,
                                          steps_per_epoch=self.steps_per_epoch)
        self.metric_logger.attach(self.task)
        self.progress, self.stop = Progress(), Stop(self.strategy, t.min_epochs, t.min_steps)
        self.task.trainer = TaskHandle(self.metric_logger, self.progress, self.stop, is_global_zero=rank_zero,
                                       world_size=self.strategy.world_size, max_epochs=self.max_epochs,
                                       max_steps=self.max_steps)
        step_fns = {m: step_function(self.task, m) for m in ("training_step", "validation_step", "test_step")}
        self.training_step = step_fns["training_step"]
        self.evaluator = Evaluator(task=self.task, model_attr=self.model_attr, data=self.data, strategy=self.strategy,
                                   precision=self.precision, metric_logger=self.metric_logger, step_fns=step_fns,
                                   limits={"val": 1 if self.fast_dev_run else t.limit_val_batches,
                                           "test": 1 if self.fast_dev_run else t.limit_test_batches},
                                   overfit=parts.overfit)
        self._check_monitors_exist()
        self.tested = ""  # which weights fit's test used: best (step N) or last
        self._val_checked = False  # the monitors were checked against a validation round's metrics
        self._saved_task_state: Any = None  # a resume's task state, loaded once the task's start hooks ran
        self._started_at, self._epoch_rate = (time.perf_counter(), 0), 0.0  # for the ETA; samples/s of the last epoch
        self._val_names: list[str] = []  # the validation metrics, as the first val batch showed them
        self._clip_norm, self._clip_value = t.grad_clip_norm, t.grad_clip_value  # no config access per step
        self._val_every = t.val_every_n_steps if self.data.has("val") else 0
        # Ranks agree on stopping after every step when anything may ask (every rank must take part, or none).
        self._agree_on_stops = self.on_signal or bool(self.callbacks.callbacks) or self.strategy.world_size == 1 \
            or task_hooks.task_callback(self.task) is not None
        before_step = self.callbacks.bound("on_before_optimizer_step")
        self._before_step = (lambda: before_step(self, self.task, self.optimizer)) if before_step else None
        self._before_zero_grad = self.callbacks.bound("on_before_zero_grad")
        self.state = self._register_state(choices)
        self.callbacks.call("setup", self, self.task)

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
        """Every piece of resumable state, once. The checkpoint's meta.json also holds the config and the groups'
        options (which resume rebuilds the run from) and the number of processes."""
        state = TrainingState(lambda: self.module, self.progress, self.metric_logger.metrics, info={
            "framework_version": framework.__version__,  # which version wrote it
            "world_size": self.strategy.world_size,
            "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),
            "choices": {g: o for g, o in (choices or {}).items() if not g.startswith("hydra")}})
        state.register("optimizer", self.optimizer, check=optimizer_check(self.optimizer))
        if self.scheduler is not None:
            state.register("scheduler", self.scheduler)
        state.register("precision", self.precision, check=precision_check(self.precision))
        state.register("checkpoints", self.checkpoints, check=CheckpointManager.check_state_dict)
        state.register("train_loss", self.metric_logger.window, optional=True, check=TrainLog.check_state_dict)
        self.task_state = TaskState(self.task, self.model_attr, self.strategy)
        state.register("task", self.task_state, optional=True, check=self.task_state.check_state_dict)
        state.register("callbacks", self.callbacks, check=callbacks_check(self.callbacks), optional=True)
        rng = RngState(self.strategy)
        state.register("rng", rng, check=rng.check_state_dict)  # last: loading it must follow all the rest
        return state

    # ------------------------------------------------------------------ what callbacks see (Lightning's names)
    @property
    def model(self) -> torch.nn.Module:
        """The task's model as the loop runs it (wrapped by DDP/DP/compile), held in `task.<model_attr>`."""
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

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        if self.resume_from is not None:
            self._restore(self.resume_from)
        self._started_at = (time.perf_counter(), self.progress.step)
        self._val_names = check_first_batches(self.task, self.model_attr, self.evaluator, self._monitors())
        self._describe_setup()
        if self.cfg.trainer.dry_run:
            self.logger.close()
            return {}
        # Watched until fit returns: a time-limit signal that comes after the last step (while validating, saving
        # or testing) is noted and the run finishes, instead of reaching the handler from before the run
        # (submitit's would requeue a run that is complete; SIGUSR1's default would kill it).
        watch = SignalWatch(watched(self.cfg.checkpoint.signals) if self.on_signal else ())  # () watches nothing
        finished = False
        with watch:
            try:
                self._start_hooks()
                with torch.autograd.set_detect_anomaly(self.cfg.trainer.detect_anomaly), self._anomaly_as_error():
                    while not self._finished():
                        self._train_epoch(watch)
                        if self.progress.batch_in_epoch >= self.train_batches:  # a whole epoch, not a stop mid-epoch
                            self._end_epoch()
                watch.after_training = True
                summary = self._after_training(start)
                finished = True
            except BaseException as err:
                finished = isinstance(err, Interrupted)  # a signal stop is agreed by every rank: still in step
                self._on_exception(err)
                raise
            finally:
                self.bar.close()
                self.logger.close()
                task_hooks.call_if_defined(self.task, "teardown", "fit")
                self.strategy.teardown(finished)
            if self.strategy.is_rank_zero:
                write_json(self.run_dir / "summary.json", summary)
                print_summary(summary, self.run_dir)
        return summary

    def _start_hooks(self) -> None:
        self.callbacks.call("on_fit_start", self, self.task)
        self.callbacks.call("on_train_start", self, self.task)
        if self._saved_task_state is not None:  # after the hooks: a reset there (as lightning-hydra-template
            self.task_state.load_state_dict(self._saved_task_state)  # does) keeps the resume exact
            self._saved_task_state = None

    def _after_training(self, start: float) -> dict[str, Any]:
        """The final validation (the summary always reports the final weights), `last`, the test, the summary."""
        self._flush_train_log()
        self.bar.close()
        p = self.progress
        if self.stop.reason and self.strategy.is_rank_zero:
            log.warning("Stopped at step %d (epoch %d): %s", p.step, p.epoch, self.stop.reason)
        if self.data.has("val") and p.last_val_step != p.step:
            self._validate()
        if self.checkpoints.save_last and self.checkpoints.saved_step != p.step:
            self.checkpoints.save(self.state, p.step, periodic=False)
        self.checkpoints.writer.close()  # every checkpoint on disk before the summary names them
        self.callbacks.call("on_train_end", self, self.task)
        if self.cfg.trainer.test and self.data.has("test"):
            self._test()
        summary = self._summary(time.perf_counter() - start)
        self.logger.log_metrics({k: v for k, v in summary.items() if k.startswith("best/")}, p.step)
        if self.hparams:
            self.logger.end_hparams_session()
        self.callbacks.call("on_fit_end", self, self.task)
        return summary

    @contextlib.contextmanager
    def _anomaly_as_error(self) -> Iterator[None]:
        """Under trainer.detect_anomaly, the op whose backward made a NaN is one Error: line (anomaly mode has
        printed the forward's traceback that created it just before), not a traceback from inside backward."""
        try:
            yield
        except RuntimeError as err:
            if not self.cfg.trainer.detect_anomaly or "nan values" not in str(err):
                raise
            p = self.progress
            raise UserError(f"trainer.detect_anomaly: {error_line(err).rstrip('.')} at step {p.step + 1} (epoch "
                            f"{p.epoch}, batch {p.batch_in_epoch}); the forward that made it is in the traceback "
                            f"printed above; what was already written in {self.run_dir} is kept") from err

    def _end_epoch(self) -> None:
        """A completed epoch: its callbacks, its means, validation (by epoch, or by step when this step is due),
        the epoch scheduler, then the checkpoint policies (periodic, top-k, last)."""
        p = self.progress
        p.epoch += 1
        p.batch_in_epoch = 0
        self.metric_logger.epoch_hook = True  # self.log in on_train_epoch_end is an epoch value, as in Lightning
        try:
            self.callbacks.call("on_train_epoch_end", self, self.task)
        finally:
            self.metric_logger.epoch_hook = False
        lrs = {f"lr/{name}": group["lr"] for name, group in zip(self.param_group_names, self.optimizer.param_groups)
               if p.step % self.log_every_n_steps}  # a point every epoch, unless this step's logging wrote one
        train = self.metric_logger.end_epoch(self.task, p.step, lrs)
        by_step = self.cfg.trainer.val_every_n_steps > 0 and p.step % self.cfg.trainer.val_every_n_steps == 0
        due = p.epoch % self.cfg.trainer.val_every_n_epochs == 0 or by_step
        val = self._validation_round() if self.data.has("val") and due and p.last_val_step != p.step else None
        started, first_step = self._started_at
        total = self.max_steps if self.max_steps > 0 else self.max_epochs * self.steps_per_epoch
        elapsed = time.perf_counter() - started
        eta = elapsed / (p.step - first_step) * max(0, total - p.step) if p.step > first_step else None
        self.metric_logger.report_epoch(p.step, train, val, self._epoch_rate, eta)
        s = self.scheduler  # the one place an unmonitored epoch scheduler steps: every `frequency` completed epochs
        if s is not None and s.interval == "epoch" and s.monitor is None and p.epoch % s.frequency == 0:
            s.scheduler.step()
        periodic = self.checkpoints.due_periodic(p.step, completed_epochs=p.epoch)
        self.checkpoints.save(self.state, p.step, periodic=periodic, metrics=val)

    def _on_exception(self, err: BaseException) -> None:
        """On the way out of a failed or stopped run: the callbacks hear of it, and a save still in flight is
        finished (a failure of its own is logged, not raised over the error that ends the run; when that error is a
        failed save too, the run's one error line already says so)."""
        try:
            self.callbacks.call("on_exception", self, self.task, err)
        except Exception as hook_err:  # noqa: BLE001  (the error that ends the run is the one to report)
            log.error("A callback's on_exception failed: %s: %s", type(hook_err).__name__, hook_err)
        try:
            self.checkpoints.writer.close()
        except Exception as save_err:  # noqa: BLE001
            if isinstance(err, CheckpointSaveError) and isinstance(save_err, CheckpointSaveError):
                log.debug("A later checkpoint save failed too: %s", save_err)
            else:
                log.error("A checkpoint save failed: %s: %s", type(save_err).__name__, save_err)

    def _monitors(self) -> dict[str, str]:
        """Every metric a component watches, by the config key that names it."""
        found = {"checkpoint.monitor": self.checkpoints.monitor if self.checkpoints.save_top_k else None,
                 "scheduler.monitor": getattr(self.scheduler, "monitor", None),
                 **{f"callbacks.{name}.monitor": getattr(cb, "monitor", None) for name, cb in self.callbacks}}
        return {key: monitor for key, monitor in found.items() if isinstance(monitor, str)}

    def _check_monitors_exist(self) -> None:
        """A monitor with no validation split to compute it is an error at start, not after the first epoch."""
        if self.data.has("val"):
            return
        for key, monitor in self._monitors().items():  # (checkpoint's: config.validate already refused it)
            remedy = "scheduler.monitor=null" if key == "scheduler.monitor" else f"{key.rsplit('.', 1)[0]}=null"
            raise ConfigError(f"{key}={monitor!r}: this run has no validation split (data.val is null), so the "
                              f"metric never exists; expected a data.val split, or {remedy}")

    def _restore(self, checkpoint: Checkpoint) -> None:
        self._saved_task_state = restore(checkpoint, self.cfg, self.state, module=self.module, strategy=self.strategy,
                                         optimizer=self.optimizer, scheduler=self.scheduler)
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
            describe_setup(self.cfg, self.parts, world_size=self.strategy.world_size, run_dir=self.run_dir,
                           tensorboard=self.logger, fresh=self.progress.step == 0,
                           charts=[*self._monitors().values(), *self._val_names], hparams=self.hparams,
                           model_summary=summary)

    def _finished(self) -> bool:
        if self.stop.granted(self.progress):  # a requested stop (on resume: a callback's again in on_fit_start)
            return True
        if self.max_steps > 0:  # max_steps, when set, alone decides the length of the run
            return self.progress.step >= self.max_steps
        return self.progress.epoch >= self.max_epochs

    # ------------------------------------------------------------------ one epoch of training
    def _train_epoch(self, watch: Any) -> None:
        """The hot loop. Everything reached per batch is bound to a local first, and nothing in it reads the
        config, syncs with the device or allocates beyond the step itself (bench/overhead.py measures it).
        A callback hook nobody implements is not called at all."""
        p, task, logger = self.progress, self.task, self.metric_logger
        task.train()
        self.callbacks.call("on_train_epoch_start", self, task)
        self.bar.start_epoch(p.epoch, self.train_batches, initial=p.batch_in_epoch,
                             max_epochs=0 if self.max_steps > 0 else self.max_epochs)
        batches = self._train_batches()
        training_step, batch_size, losses = self.training_step, task.batch_size, logger.window.losses
        precision, bar, where = self.precision, self.bar if self.bar.enabled else None, f"{type(task).__name__}.training_step"
        autocast = precision.autocast if precision.dtype is not None else None
        to_device = None if self.device.type == "cpu" else move_to  # batches are made on the CPU
        no_sync = self.strategy.no_sync(self.model) if self.accumulate > 1 else None
        plain = contextlib.nullcontext()
        batch_start, after_backward, batch_end = (self.callbacks.bound(hook) for hook in (
            "on_train_batch_start", "on_after_backward", "on_train_batch_end"))
        accumulate, train_batches = self.accumulate, self.train_batches
        clock = time.perf_counter
        epoch_start, samples, first_batch, data_wait = clock(), 0, p.batch_in_epoch, 0.0
        while True:
            waited_from = clock()
            batch = next(batches, None)
            data_wait += clock() - waited_from
            if batch is None:
                break
            if to_device is not None:
                batch = to_device(batch, self.device)
            steps_now = accumulate == 1 or (p.batch_in_epoch + 1) % accumulate == 0 \
                or p.batch_in_epoch + 1 == train_batches
            n = logger.batch_n = batch_size(batch)  # what the task logs in this step is weighted by it
            if batch_start is not None:
                batch_start(self, task, batch, p.batch_in_epoch)
            with (plain if no_sync is None or steps_now else no_sync()):  # one all-reduce per optimizer step
                with (autocast() if autocast is not None else plain):
                    out = training_step(batch, p.batch_in_epoch)
                if type(out) is not StepOutput:  # a loss tensor or a dict with "loss", as in Lightning
                    out = as_step_output(out, where, training=True)
                precision.backward(out.loss / accumulate if accumulate > 1 else out.loss)
            if after_backward is not None:
                after_backward(self, task)
            losses.append(out.loss.detach())
            for name, value in out.metrics.items():  # a task's train metrics: train/<name>, each step and epoch
                logger.task_log(f"train/{name}", value, on_step=True, on_epoch=True)
            p.batch_in_epoch += 1
            samples += n
            if bar is not None:
                bar.update()
            if steps_now:
                self._optimizer_step()
            if batch_end is not None:
                batch_end(self, task, out, batch, p.batch_in_epoch - 1)
            if steps_now and self._after_step(watch):
                break
        self._epoch_rate = samples / (clock() - epoch_start) if samples else self._epoch_rate
        logger.epoch_perf(p.step, samples, p.batch_in_epoch - first_batch, clock() - epoch_start, data_wait,
                          _max_memory_mb(self.device))

    def _train_batches(self) -> Iterator[Any]:
        """This epoch's batches from where it stands (under overfit_batches, the same ones every epoch)."""
        p = self.progress
        if self.evaluator.overfit:
            return iter(itertools.islice(self.evaluator.overfit_batches(), p.batch_in_epoch, self.train_batches))
        return iter(itertools.islice(self.data.batches("train", p.epoch, start_batch=p.batch_in_epoch),
                                     self.train_batches - p.batch_in_epoch))

    def _optimizer_step(self) -> None:
        stepped = self.precision.step(self.optimizer, self.params, self._clip_norm, self._clip_value,
                                      before_step=self._before_step)
        if self._before_zero_grad is not None:
            self._before_zero_grad(self, self.task, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        # The scheduler follows the optimizer, and does not advance for a step the GradScaler skipped.
        s = self.scheduler
        if stepped and s is not None and s.interval == "step" and s.monitor is None \
                and self.progress.step % s.frequency == 0:
            s.scheduler.step()

    def _after_step(self, watch: Any) -> bool:
        """After an optimizer step: log, stop on a signal or a request, validate or save mid-epoch (at an epoch's
        end, _end_epoch does). True: this epoch ends here."""
        p, checkpoints = self.progress, self.checkpoints
        if p.step % self.log_every_n_steps == 0:
            self._flush_train_log()
        if self._agree_on_stops:
            signum = self.stop.agreed(watch)
            if signum is not None:
                self._stop_on_signal(signum, watch)
        mid_epoch, val_every = p.batch_in_epoch < self.train_batches, self._val_every
        periodic = checkpoints.every_n_steps > 0  # mid-epoch saves happen by step only
        if mid_epoch and val_every and p.step % val_every == 0:
            val = self._validation_round()
            checkpoints.save(self.state, p.step, periodic=periodic and checkpoints.due_periodic(p.step), metrics=val)
        elif mid_epoch and periodic and checkpoints.due_periodic(p.step):
            checkpoints.save(self.state, p.step, periodic=True)
        return self.stop.granted(p) or 0 < self.max_steps <= p.step

    def _flush_train_log(self) -> None:
        extras = {"epoch": float(self.progress.epoch)}
        for name, group in zip(self.param_group_names, self.optimizer.param_groups):
            extras[f"lr/{name}"] = group["lr"]
        if self.precision.scaler is not None:
            extras["amp/scale"] = self.precision.scaler.get_scale()
            extras["amp/skipped_steps"] = float(self.precision.skipped_steps)
        self.metric_logger.flush(self.progress.step, extras)

    def _stop_on_signal(self, signum: int, watch: Any) -> None:
        """Save `last` at this exact position (mid-epoch included), then end the run."""
        self.bar.close()
        self.checkpoints.save_now(self.state, self.progress.step, "last")
        self.checkpoints.writer.wait()
        p = self.progress
        stopped = f"Stopped by {signal.Signals(signum).name} at step {p.step} (epoch {p.epoch}, batch {p.batch_in_epoch})"
        self.logger.log_text("history", stopped, p.step)
        raise Interrupted(signum, f"{stopped}; saved {self.checkpoints.folder / 'last'}. Resume with: python run.py "
                                  f"resume={self.run_dir}", getattr(watch, "previous", lambda _: None)(signum))

    # ------------------------------------------------------------------ evaluation
    def _validate(self) -> dict[str, float]:
        self.callbacks.call("on_validation_start", self, self.task)
        metrics = self.evaluator.run("val", self.progress.step)
        self._check_first_validation(metrics)
        for name, value in metrics.items():  # best over the run: the lowest loss or perplexity, the highest of the rest
            best = self.metrics.get(f"best/{name}", value)
            lower = "loss" in name or "ppl" in name or "perplexity" in name
            self.metrics[f"best/{name}"] = min(best, value) if lower else max(best, value)
        self.progress.last_val_step = self.progress.step
        self.progress.validations += 1
        self.callbacks.call("on_validation_end", self, self.task, metrics)
        return metrics

    def _check_first_validation(self, metrics: dict[str, float]) -> None:
        """The first validation round shows every metric there is (what the steps and the epoch-end hook logged):
        a monitor naming none of them is one line, before anything acts on it."""
        if self._val_checked:
            return
        self._val_checked = True
        for key, monitor in self._monitors().items():
            if monitor not in metrics:
                raise ConfigError(f"{key}={monitor!r}: no such metric in the first validation; expected one of "
                                  f"{', '.join(metrics)}")

    def _validation_round(self) -> dict[str, float]:
        """A validation during training (by epoch or by step), then the scheduler that monitors its metric."""
        val = self._validate()
        s = self.scheduler
        if s is not None and s.monitor is not None and self.progress.validations % s.frequency == 0:
            s.scheduler.step(val[s.monitor])
        return val

    def _test(self) -> None:
        """The test, on the weights trainer.test_ckpt names (Lightning's ckpt_path; by default the best checkpoint's
        when a monitored top-k keeps one, else the final weights). Rank 0 knows the checkpoints."""
        ck, choice = self.cfg.checkpoint, self.cfg.trainer.test_ckpt
        if choice is None:
            choice = "best" if ck.monitor and ck.save_top_k > 0 and not self.fast_dev_run else "last"
        best = self.checkpoints.best_path() if self.strategy.is_rank_zero and choice == "best" else None
        chosen = self.strategy.broadcast_object(str(best) if best is not None else None)
        self.tested = "last"
        if chosen is not None:
            checkpoint = open_checkpoint(Path(chosen))
            self.module.load_state_dict(checkpoint.model_state(self.strategy.mesh))
            self.tested = f"best (step {checkpoint.step})"
            if self.strategy.is_rank_zero:
                log.info("Testing the best checkpoint's weights (step %d, %s)", checkpoint.step, chosen)
        elif choice == "best":
            if self.strategy.is_rank_zero:
                log.warning("trainer.test_ckpt=best: no best checkpoint was saved (no validation ran): testing "
                            "the final weights")
            self.tested = "last (no best checkpoint was saved)"
        self.callbacks.call("on_test_start", self, self.task)
        metrics = self.evaluator.run("test", self.progress.step)
        self.callbacks.call("on_test_end", self, self.task, metrics)

    # ------------------------------------------------------------------ results
    def _summary(self, seconds: float) -> dict[str, Any]:
        summary: dict[str, Any] = dict(self.metrics)
        best = self.checkpoints.best_path()
        p = self.progress
        summary.update(status="ok", step=p.step, epoch=p.epoch, batch_in_epoch=p.batch_in_epoch,
                       epoch_batches=self.train_batches, seconds=round(seconds, 3),
                       world_size=self.strategy.world_size, precision=self.precision.name,
                       best_checkpoint=str(best) if best is not None else None, stopped=self.stop.reason or None,
                       tested=self.tested or None)
        return summary
