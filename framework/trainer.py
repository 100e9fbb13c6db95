"""The Trainer: builds every component from the config, then runs fit -> validate -> test.

One training step, top to bottom, is in `_train_epoch`: batch -> autocast forward -> backward -> (every
`accumulate_grad_batches`) unscale/clip/step -> scheduler -> callbacks -> log -> stop? -> validate/checkpoint.
Everything else is a call into the module that owns the concern; this file is the only place that knows them all.
Resumable state is registered once, in `__init__`, with `framework.state.TrainingState`; a checkpoint is what
that registry collects, and a resume is what it checks and loads.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

import framework

from framework import allocator, reproducibility, task_hooks
from framework.callbacks import Callback, CallbackList, Timer
from framework.checkpoint import (Checkpoint, CheckpointManager, CheckpointSaveError, DamagedCheckpoint,
                                  check_compatible, load_weights, open_checkpoint, validate_state)
from framework.data import DataModule
from framework.errors import ConfigError, Interrupted, UserError
from framework.instantiate import build, error_line, locate
from framework.loggers import TensorBoardLogger, print_summary, write_json
from framework.model_summary import summarize
from framework.optim import (apply_changed_options, build_optimizer, build_scheduler, changed_options,
                             check_optimizer_state, describe_groups, format_groups, group_names, lr_plan)
from framework.parallel import build_strategy
from framework.precision import Precision
from framework.progress import ProgressBar, file_only
from framework.signals import SignalWatch, watched
from framework.state import Progress, RngState, TaskState, TrainingState
from framework.task import StepOutput, Task, as_step_output, step_function, throwaway_copy
from framework.task_log import EvalLog, TrainLog, as_tensor, check_reduce_fx, metric_path, stage_name
from framework.tensorboard_layout import layout

log = logging.getLogger(__name__)
_SIGNAL_SLOTS = range(signal.NSIG)  # signal numbers, for agreeing on one across ranks

# Metrics shown in TensorBoard's HParams tab for every run (read from these scalar tags).
HPARAM_METRICS = ["val/acc", "val/loss", "best/val/acc", "best/val/loss", "test/acc", "test/loss"]


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
        # The trainer and what it built form reference cycles (the task knows its trainer), which only the cyclic
        # collector frees. Freed now, while the interpreter is whole: a DDP model holds the gloo process group,
        # whose C++ threads, destroyed during interpreter shutdown instead, aborted a worker now and then
        # ("terminate called without an active exception", SIGABRT after a finished run); and a sweep's next
        # job does not start with the last one's model, optimizer and data still in memory.
        trainer.data.close()  # before the collection: see DataModule.close
        del trainer
        gc.collect()


def _import_torch_dynamo() -> None:
    """torch.optim imports torch._dynamo with a process's first optimizer: ~1 s and ~250k objects that live as
    long as the process. Imported here instead, before anything of the run exists, with the cyclic collector
    off (the dozens of collections the import triggers each scanned the whole heap: ~0.1-0.2 s of start-up),
    then frozen with all that is alive (what starting the process imported, Hydra's config of this job): no later
    collection scans it again. Once per process: a sweep's later jobs, whose models must stay collectable,
    find it imported."""
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


def move_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def _max_memory_mb(device: torch.device) -> float:
    """Peak memory: CUDA's max_memory_allocated on a GPU, else this process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor (a value computed from sharded parameters, e.g. a gradient norm under FSDP) as the whole tensor,
    on every rank (a collective: every rank logs it at the same point); any other tensor as it is. Without
    torch.distributed.tensor imported (no FSDP), no DTensor can exist, and the import is not paid for."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return value.full_tensor() if dtensor is not None and isinstance(value, dtensor.DTensor) else value


def _rows(batch: Any, n: int) -> Any:
    """The first `n` samples of a batch (every tensor in it cut along its first dimension)."""
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_rows(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: _rows(v, n) for k, v in batch.items()}
    return batch


def _limit(limit: Union[int, float], available: int) -> int:
    """Lightning's limit_*_batches: an int is a count, a float a fraction of the epoch."""
    if isinstance(limit, float):
        return max(1, int(available * limit)) if available else 0
    return min(limit, available)


def _check_train_log(saved: Any, where: str) -> None:
    """The loss window and epoch sums; checkpoints written before `epoch_fx`/`epoch_metrics` existed lack them."""
    live = TrainLog(torch.device("cpu")).state_dict()
    if isinstance(saved, dict):
        saved = {**{k: v for k, v in live.items() if k not in saved}, **saved}
    validate_state(saved, {**live, "epoch_sums": {}, "epoch_counts": {}}, where)


def build_callbacks(cfg: DictConfig) -> dict[str, Callback]:
    """The `callbacks` group's nodes (a null one is off), plus Lightning's Timer for `trainer.max_time`."""
    callbacks: dict[str, Callback] = {}
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is None:
            continue
        callback = build(node, f"callbacks.{name}")
        if not isinstance(callback, Callback):
            raise ConfigError(f"callbacks.{name}._target_={node.get('_target_')!r} built a "
                              f"{type(callback).__name__}; expected a framework.callbacks.Callback subclass")
        callbacks[str(name)] = callback
    if cfg.trainer.max_time is not None and not any(isinstance(c, Timer) for c in callbacks.values()):
        callbacks["timer"] = Timer(cfg.trainer.max_time)
    return callbacks


class _CheckHandle:
    """What a task's `trainer` is while its first batches are checked: its logs are names only, kept to check the
    monitors against; it has no logger."""

    logger = None
    global_step = 0
    current_epoch = 0

    def __init__(self, trainer: "Trainer") -> None:
        self.stage, self.names, self.is_global_zero = "train", [], trainer.strategy.is_rank_zero

    def log_from_task(self, name: str, value: Any, **_options: Any) -> None:
        as_tensor(name, value)  # a value of the wrong kind is refused here, before training
        if self.stage == "val":
            self.names.append(name)


def build_task(cfg: DictConfig) -> tuple[Task, str]:
    """The task, given the built `model` group as its constructor's `model` (or, in a port of a LightningModule,
    `net`: lightning-hydra-template's name), and the name of the attribute that holds it. A task whose config
    builds its model itself (`task.net: ${model}`, or a constructor that makes one) holds it in its one
    submodule with parameters."""
    target = locate(cfg.task.get("_target_"), "task")
    params = dict(inspect.signature(target).parameters) if inspect.isclass(target) else {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        params.setdefault("model", None)  # (*args, **kwargs): passed on to Task's own `model`
    given = next((name for name in ("model", "net") if name in params and name not in cfg.task), None)
    if given is not None:
        model = build(cfg.model, "model")
        task = build(cfg.task, "task", partial=True, provided=(given,))(**{given: model})
    else:
        task, model = build(cfg.task, "task"), None
    if not isinstance(task, Task):
        raise ConfigError(f"task._target_={cfg.task._target_!r}: expected a framework.task.Task subclass")
    holders = [name for name, child in task.named_children() if child is model] if model is not None else []
    if not holders:
        holders = [name for name, child in task.named_children() if any(True for _ in child.parameters())]
    if len(holders) != 1:
        found = f"its submodules with parameters are {', '.join(holders)}" if holders else "it has no submodule " \
            "with parameters"
        raise ConfigError(f"task._target_={cfg.task._target_!r}: cannot tell which attribute holds the model ({found}); "
                          "expected the constructor to take the model as `model` (given the model group) and keep "
                          "it as an attribute, or one submodule with parameters")
    return task, holders[0]


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: Path, resume_from: Optional[Checkpoint] = None,
                 hparams: Optional[dict[str, Any]] = None, choices: Optional[dict[str, Any]] = None) -> None:
        self.cfg, self.run_dir, self.hparams = cfg, run_dir, hparams or {}
        t = cfg.trainer
        self.fast_dev_run = t.fast_dev_run
        self.max_steps = 1 if self.fast_dev_run else t.max_steps
        self.max_epochs = 1 if self.fast_dev_run else t.max_epochs
        self.accumulate = t.accumulate_grad_batches
        self.log_every_n_steps = t.log_every_n_steps
        self.val_every_n_steps = t.val_every_n_steps

        reproducibility.set_deterministic(t.deterministic)
        reproducibility.seed_everything(cfg.seed)
        self.strategy = build_strategy(cfg.parallel, t.device)
        self.device = self.strategy.device
        # Under torchrun only rank 0 made a run directory (see app.py); every rank uses that one, and resumes from
        # the checkpoint rank 0 picked (each rank looked on its own: a save or prune a killed rank 0 left half done
        # can make them disagree).
        self.run_dir = Path(self.strategy.broadcast_object(str(run_dir)))
        chosen = self.strategy.broadcast_object(str(resume_from.path) if resume_from is not None else None)
        if chosen is not None and (resume_from is None or str(resume_from.path) != chosen):
            resume_from = open_checkpoint(Path(chosen))
        elif chosen is None:
            resume_from = None

        self.data = build(cfg.data, "data")
        if not isinstance(self.data, DataModule):
            raise ConfigError(f"data._target_={cfg.data._target_!r}: expected a framework.data.DataModule "
                              f"(or subclass), got {type(self.data).__name__}")
        self.data.setup(seed=cfg.seed, rank=self.strategy.rank, world_size=self.strategy.world_size)

        self.task, self.model_attr = build_task(cfg)
        model = self.task.get_submodule(self.model_attr)
        self.task.trainer = self  # for the task's log() and logger
        task_hooks.refuse_replaced(self.task)
        self.step_fns = {method: step_function(self.task, method)
                         for method in ("training_step", "validation_step", "test_step")}
        if self.strategy.sharded:  # FSDP moves each rank's shards of the model to the device in wrap (below): a
            for child in self.task.children():  # model larger than one device is never whole on one
                if child is not model:
                    child.to(self.device)
        else:
            self.task.to(self.device)
        if cfg.get("init_from"):
            weights = load_weights(Path(cfg.init_from))
            check_compatible(model, weights, f"init_from={cfg.init_from!r}", cfg.init_strict)
            model.load_state_dict(weights, strict=cfg.init_strict)
        self.precision = Precision(cfg.precision.mode.value, self.device)
        if t.compile:
            self.model = torch.compile(self.model)
        # Wrapped before the optimizer is built: FSDP replaces the parameters by their shards (DTensors), which
        # the optimizer must hold (DDP and DataParallel keep the same ones).
        self.model = self.strategy.wrap(self.model, param_dtype=self.precision.dtype)
        self.optimizer, self.frozen = build_optimizer(cfg.optimizer, self.module)
        self.param_group_names = group_names(self.optimizer)
        # overfit_batches: the same first batches of epoch 0's order every epoch, validated on too (Lightning's).
        self.overfit = _limit(t.overfit_batches, self.data.num_batches("train")) if t.overfit_batches else 0
        train_limit = 1 if self.fast_dev_run else (self.overfit or t.limit_train_batches)
        self.train_batches = _limit(train_limit, self.data.num_batches("train"))
        if self.train_batches == 0:
            raise ConfigError("data.train: the training set gives no batch (is it empty, or smaller than "
                              "data.batch_size with data.drop_last=true?)")
        self.steps_per_epoch = math.ceil(self.train_batches / self.accumulate)
        self.scheduler = build_scheduler(cfg.scheduler, self.optimizer, max_steps=self.max_steps,
                                         max_epochs=self.max_epochs, steps_per_epoch=self.steps_per_epoch)
        self.params = [p for p in self.task.parameters() if p.requires_grad]

        rank_zero = self.strategy.is_rank_zero
        ck = cfg.checkpoint
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints", save_last=ck.save_last, every_n_steps=ck.every_n_steps,
            every_n_epochs=ck.every_n_epochs, keep_last=ck.keep_last, monitor=ck.monitor, mode=ck.mode.value,
            save_top_k=ck.save_top_k, enabled=rank_zero and not self.fast_dev_run, fsync=ck.fsync,
            async_save=ck.async_save, shards=self.strategy if self.strategy.sharded and not self.fast_dev_run else None)
        self.callbacks = CallbackList(build_callbacks(cfg), first=task_hooks.task_callback(self.task))
        self._check_monitors_exist()
        self.on_signal = ck.on_signal and not self.fast_dev_run
        self.resume_from = resume_from
        # On resume, TensorBoard drops whatever the killed run logged after its checkpoint's step.
        purge_step = resume_from.step + 1 if resume_from is not None else None
        self.logger = TensorBoardLogger(self.run_dir, enabled=rank_zero and cfg.logger.tensorboard
                                        and not self.fast_dev_run and not t.dry_run, purge_step=purge_step)
        self.bar = ProgressBar(enabled=rank_zero and cfg.logger.progress_bar, every_s=cfg.logger.progress_every_s)

        self.progress = Progress()
        self.stop_reason = ""  # why a callback stopped the run; not saved: on resume, callbacks decide again
        self.metrics: dict[str, float] = {}  # latest value of every metric, for the summary and the callbacks
        self.window = TrainLog(self.device)
        self._logged: dict[str, Any] = {}  # values given to Trainer.log(), written at the next logging step
        self._task_train_names: set[str] = set()  # what the task logs in training (its train/loss replaces ours)
        self._task_step: dict[str, Any] = {}  # the task's on_step values (or Metrics) for the next logging step
        self._stage = "train"  # what log_from_task is called during: train, val or test
        self._epoch_hook = False  # a training epoch hook is running: self.log defaults to on_epoch there
        self._eval_log: Optional[EvalLog] = None  # what the task logs in the evaluation running now
        self._batch_n = 1  # samples in the batch being stepped: the weight of what the task logs
        self._bar_names: set[str] = set()  # what the task asked to see in the progress bar
        self._hidden: set[str] = set()  # what the task logged with logger=False: not written to TensorBoard
        self._val_checked = False  # the monitors were checked against a validation round's metrics
        self.tested = ""  # which weights fit's test used: best (step N) or last
        self._overfit_kept: Optional[list[Any]] = None  # trainer.overfit_batches' batches, once read
        self._saved_task_state: Any = None  # a resume's task state, loaded once the task's start hooks ran
        self._started_at = (time.perf_counter(), 0)  # (when fit started, at which step): for the ETA
        self._epoch_rate = 0.0  # samples/s of the latest epoch
        self._val_names: list[str] = []  # the validation metrics, as the first val batch showed them
        self._clip_norm, self._clip_value = t.grad_clip_norm, t.grad_clip_value  # no config access per step
        before_step = self.callbacks.bound("on_before_optimizer_step")
        self._before_step = (lambda: before_step(self, self.task, self.optimizer)) if before_step else None
        self._before_zero_grad = self.callbacks.bound("on_before_zero_grad")

        # Every piece of resumable state, once. The checkpoint's meta.json also holds the config and the
        # groups' options (which resume rebuilds the run from) and the number of processes.
        self.state = TrainingState(lambda: self.module, self.progress, self.metrics, info={
            "framework_version": framework.__version__,  # which version wrote it
            "world_size": self.strategy.world_size,
            "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "choices": {g: o for g, o in (choices or {}).items() if not g.startswith("hydra")}})
        self.state.register("optimizer", self.optimizer, check=self._check_optimizer_state)
        if self.scheduler is not None:
            self.state.register("scheduler", self.scheduler)
        self.state.register("precision", self.precision, check=self._check_precision_state)
        self.state.register("checkpoints", self.checkpoints, check=CheckpointManager.check_state_dict)
        self.state.register("train_loss", self.window, optional=True, check=_check_train_log)
        self.task_state = TaskState(self.task, self.model_attr, self.strategy)
        self.state.register("task", self.task_state, optional=True, check=self.task_state.check_state_dict)
        self.state.register("callbacks", self.callbacks, check=self._check_callback_state, optional=True)
        rng = RngState(self.strategy)
        self.state.register("rng", rng, check=rng.check_state_dict)  # last: loading it must follow all the rest
        self.callbacks.call("setup", self, self.task)

    # ------------------------------------------------------------------ what callbacks see (Lightning's names)
    @property
    def model(self) -> torch.nn.Module:
        """The task's model as the loop runs it (wrapped by DDP/DP/compile), held in `task.<model_attr>`."""
        return getattr(self.task, self.model_attr)

    @model.setter
    def model(self, module: torch.nn.Module) -> None:
        setattr(self.task, self.model_attr, module)

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
        return self.metrics

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_rank_zero

    @property
    def should_stop(self) -> bool:
        return bool(self.stop_reason)

    def request_stop(self, reason: str) -> None:
        """Stop at the next optimizer-step boundary (every rank at the same one); `reason` goes to the console
        and summary.json. The first reason given wins."""
        if not self.stop_reason:
            self.stop_reason = reason

    def log(self, name: str, value: Union[float, torch.Tensor]) -> None:
        """A scalar for TensorBoard at the next logging step (a tensor is read then, with the loss: no sync)."""
        self._logged[name] = _whole(value.detach()) if isinstance(value, torch.Tensor) else value

    def log_from_task(self, name: str, value: Any, *, on_step: Optional[bool] = None, on_epoch: Optional[bool] = None,
                      prog_bar: bool = False, logger: bool = True, reduce_fx: Any = "mean",
                      batch_size: Optional[int] = None) -> None:
        """Task.log (framework/task_log.py says what each stage does with it)."""
        fx = check_reduce_fx(name, reduce_fx) if reduce_fx != "mean" else "mean"
        tensor = as_tensor(name, value)
        if tensor is not None and tensor.device != self.device:
            tensor = tensor.to(self.device, non_blocking=True)
        elif tensor is not None:
            tensor = _whole(tensor)
        name = stage_name(name, self._stage)
        if prog_bar:
            self._bar_names.add(name)
        if not logger:
            self._hidden.add(name)
        weight = batch_size if batch_size is not None else self._batch_n
        if self._eval_log is not None:
            if tensor is None:
                self._eval_log.metrics[name] = metric_path(self.task, value, name)
            else:
                self._eval_log.add(name, tensor, fx, weight)
            return
        self._task_train_names.add(name)
        on_step = (not self._epoch_hook) if on_step is None else on_step
        on_epoch = self._epoch_hook if on_epoch is None else on_epoch
        if on_step:
            self._task_step[name] = value if tensor is None else tensor
        if on_epoch:
            epoch_name = f"{name}_epoch" if on_step else name
            if tensor is None:
                self.window.epoch_metrics[epoch_name] = metric_path(self.task, value, name)
            else:
                self.window.add(epoch_name, tensor, weight, fx)

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        if self.resume_from is not None:
            self._restore(self.resume_from)
        self._started_at = (time.perf_counter(), self.progress.step)
        self._check_first_batches()
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
                self.callbacks.call("on_fit_start", self, self.task)
                self.callbacks.call("on_train_start", self, self.task)
                if self._saved_task_state is not None:  # after the hooks: a reset there (as lightning-hydra-
                    self.task_state.load_state_dict(self._saved_task_state)  # template does) keeps the resume exact
                    self._saved_task_state = None
                with torch.autograd.set_detect_anomaly(self.cfg.trainer.detect_anomaly), self._anomaly_as_error():
                    while not self._finished():
                        self._train_epoch(watch)
                        if self.progress.batch_in_epoch >= self.train_batches:  # a whole epoch, not a stop mid-epoch
                            self._end_epoch()
                watch.after_training = True
                self._flush_train_log()
                self.bar.close()
                if self.stop_reason and self.strategy.is_rank_zero:
                    log.warning("Stopped at step %d (epoch %d): %s", self.progress.step, self.progress.epoch,
                                self.stop_reason)
                if self.data.has("val") and self.progress.last_val_step != self.progress.step:
                    self._validate()  # the summary always reports the final weights
                if self.checkpoints.save_last and self.checkpoints.saved_step != self.progress.step:
                    self.checkpoints.save(self.state, self.progress.step, periodic=False)
                self.checkpoints.writer.close()  # every checkpoint on disk before the summary names them
                self.callbacks.call("on_train_end", self, self.task)
                if self.cfg.trainer.test and self.data.has("test"):
                    self._test_with(self._test_weights())
                summary = self._summary(time.perf_counter() - start)
                self.logger.log_metrics({k: v for k, v in summary.items() if k.startswith("best/")},
                                        self.progress.step)
                if self.hparams:
                    self.logger.end_hparams_session()
                self.callbacks.call("on_fit_end", self, self.task)
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

    @contextlib.contextmanager
    def _anomaly_as_error(self) -> Any:
        """Under trainer.detect_anomaly, the op whose backward made a NaN is one Error: line (anomaly mode has
        printed the forward's traceback that created it just before), not a traceback from inside backward."""
        try:
            yield
        except RuntimeError as err:
            if not self.cfg.trainer.detect_anomaly or "nan values" not in str(err):
                raise
            p = self.progress
            raise UserError(f"trainer.detect_anomaly: {error_line(err).rstrip('.')} at step {p.step + 1} (epoch {p.epoch}, batch "
                            f"{p.batch_in_epoch}); the forward that made it is in the traceback printed above; "
                            f"what was already written in {self.run_dir} is kept") from err

    def _end_epoch(self) -> None:
        """A completed epoch: its callbacks, validation (by epoch, or by step when this step is due), the epoch
        scheduler, then the checkpoint policies (periodic, top-k, last)."""
        p = self.progress
        p.epoch += 1
        p.batch_in_epoch = 0
        self._epoch_hook = True  # self.log in on_train_epoch_end is an epoch value, as in Lightning
        try:
            self.callbacks.call("on_train_epoch_end", self, self.task)
        finally:
            self._epoch_hook = False
        train = self._log_epoch_means()
        due = p.epoch % self.cfg.trainer.val_every_n_epochs == 0 or self._val_due_by_step()
        val = self._validation_round() if self.data.has("val") and due and p.last_val_step != p.step else None
        self._report_epoch(train, val)
        self._epoch_scheduler_step()
        periodic = self.checkpoints.due_periodic(p.step, completed_epochs=p.epoch)
        self.checkpoints.save(self.state, p.step, periodic=periodic, metrics=val)

    def _log_epoch_means(self) -> dict[str, float]:
        """The epoch's values of train/loss (as train/loss_epoch) and of what the task logged `on_epoch` (one host
        sync per epoch); the Metrics it logged are computed over every rank, then reset."""
        window = self.window
        window.count_losses(window.tensor())
        means = window.epoch_values()
        for name, path in window.epoch_metrics.items():
            metric = self.task.get_submodule(path)
            means[name] = float(metric.compute())
            metric.reset()
        window.epoch_metrics.clear()
        if not means:
            return {}
        # The LR curve gets a point every epoch too (unless this step was a logging step, which logged it).
        lrs = {f"lr/{name}": group["lr"] for name, group in zip(self.param_group_names, self.optimizer.param_groups)
               if self.progress.step % self.log_every_n_steps}
        self.logger.log_metrics({**{k: v for k, v in means.items() if k not in self._hidden}, **lrs},
                                self.progress.step)
        self._record(means)
        return means

    def _report_epoch(self, train: dict[str, float], val: Optional[dict[str, float]]) -> None:
        """The epoch's line (piped output) or the bar's closing state (a terminal), with the time left."""
        if not self.bar.enabled:
            return
        started, first_step = self._started_at
        p, elapsed = self.progress, time.perf_counter() - started
        total = self.max_steps if self.max_steps > 0 else self.max_epochs * self.steps_per_epoch
        eta = elapsed / (p.step - first_step) * max(0, total - p.step) if p.step > first_step else None
        shown = {**{k: v for k, v in train.items() if k == "train/loss_epoch" or k in self._bar_names}, **(val or {})}
        self.bar.end_epoch(p.step, {("train/loss" if k == "train/loss_epoch" else k): v for k, v in shown.items()},
                           self._epoch_rate, eta)

    def _val_due_by_step(self) -> bool:
        return self.val_every_n_steps > 0 and self.progress.step % self.val_every_n_steps == 0

    def _on_exception(self, err: BaseException) -> None:
        """On the way out of a failed or stopped run: the callbacks hear of it, and a save still in flight is
        finished (a failure of its own is logged, not raised over the error that ends the run)."""
        try:
            self.callbacks.call("on_exception", self, self.task, err)
        except Exception as hook_err:  # noqa: BLE001  (the error that ends the run is the one to report)
            log.error("A callback's on_exception failed: %s: %s", type(hook_err).__name__, hook_err)
        self._finish_saves(err)

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

    def _check_first_batches(self) -> None:
        """The first train and val batch through the task once, before anything is logged or trained: data of
        the wrong kind, or a model, loss, step output, metric or monitor that does not fit it, is one line naming
        its key (Task.check_batch). On a throw-away copy of the task sharing the plain module (the task's metrics,
        buffers and logs never see it), in eval mode, without grad, and with the RNG state put back, so training
        starts exactly as it would without it and no step pays for it."""
        wrapped, rng = self.model, reproducibility.rng_state()
        self.model = self.strategy.unwrap(wrapped)
        handle = _CheckHandle(self)
        try:
            shadow = throwaway_copy(self.task, self.model, handle)
        except Exception as err:  # noqa: BLE001  (a task holding a lock or a file: checked in place)
            log.debug("the task cannot be copied (%s: %s): its first batches are checked in place", type(err).__name__,
                      err)
            shadow, self.task.trainer = self.task, handle
        shadow.eval()
        try:
            for split in ("train", "val"):
                batch = self.data.first_batch(split) if self.data.has(split) else None
                method = "training_step" if split == "train" else "validation_step"
                handle.stage = split
                if batch is None:
                    if self.data.has(split) and self.strategy.collective_forward:  # this rank's shard is empty
                        self._idle_step(step_function(shadow, method), None)
                        if split == "val":
                            shadow.epoch_metrics("val")  # synchronised over the ranks, as theirs
                    continue
                with torch.no_grad(), self.precision.autocast():
                    out = shadow.check_batch(move_to(batch, self.device), split,
                                             input_shape=self.data.input_shape, num_classes=self.data.num_classes)
                if split == "val":
                    self._check_val_names(out, shadow, handle.names)
        finally:
            self.model = wrapped
            self.task.trainer = self
            self.task.train()
            reproducibility.set_rng_state(rng)

    def _check_val_names(self, out: Any, shadow: Task, logged: list[str]) -> None:
        """A monitor naming no metric of the first val batch is refused now, when nothing else could log it (the
        task has no validation epoch-end hook); otherwise the first validation round decides (_check_monitors)."""
        names = [*(["val/loss"] if out is not None else []), *(f"val/{n}" for n in (out.metrics if out else {})),
                 *logged, *(f"val/{name}" for name in shadow.epoch_metrics("val"))]
        self._val_names = list(dict.fromkeys(names))
        if any(task_hooks.defines(self.task, hook) for hook in ("on_validation_epoch_end", "on_validation_end")):
            return
        for key, monitor in self._monitors().items():
            if monitor not in self._val_names:
                raise ConfigError(f"{key}={monitor!r}: no such metric; expected one of {', '.join(self._val_names)}")

    # ------------------------------------------------------------------ checkpoints
    def _finish_saves(self, ending: BaseException) -> None:
        """On the way out of a failed run: a save still in flight is an intact checkpoint once finished
        (a failure of its own is logged, not raised over the error that ends the run; when that error is a
        failed save too, the run's one error line already says so)."""
        try:
            self.checkpoints.writer.close()
        except Exception as err:  # noqa: BLE001
            if isinstance(ending, CheckpointSaveError) and isinstance(err, CheckpointSaveError):
                log.debug("A later checkpoint save failed too: %s", err)
            else:
                log.error("A checkpoint save failed: %s: %s", type(err).__name__, err)

    # ------------------------------------------------------------------ resume
    def _check_optimizer_state(self, saved: Any, where: str) -> None:
        validate_state(saved, self.optimizer.state_dict(), where)
        problem = check_optimizer_state(saved, self.optimizer, where)
        if problem is not None:
            raise DamagedCheckpoint(problem)

    def _check_precision_state(self, saved: Any, where: str) -> None:
        live = self.precision.state_dict()
        if isinstance(saved, dict) and not saved.get("scaler"):  # saved without a GradScaler (precision changed)
            live = {**live, "scaler": {}}
        validate_state(saved, live, where)

    def _check_callback_state(self, saved: Any, where: str) -> None:
        validate_state(saved, {}, where)  # a dict, of any names
        for name, callback in self.callbacks:
            if name in saved:
                validate_state(saved[name], callback.state_dict(), f"{where}/{name}")
            elif callback.state_dict():
                log.info("resume: callbacks.%s is new in this run: it starts fresh", name)
        for name in saved:
            if name not in self.callbacks.callbacks and saved[name]:
                log.warning("resume: %s/%s is not configured in this run; its saved state is not used", where, name)

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Check every registered part of the checkpoint against this run before loading any of it, then load."""
        if self.strategy.sharded and not checkpoint.sharded:
            raise ConfigError(f"resume={str(checkpoint.path)!r}: a checkpoint of a run without parallel=fsdp (its "
                              "weights and state whole) cannot be resumed with parallel=fsdp; expected "
                              f"parallel={checkpoint.meta['config'].get('parallel', {}).get('strategy', 'single')}, "
                              "or init_from= for its weights alone")
        # A sharded checkpoint is read for this run's ranks: each gets its own part of every sharded tensor.
        weights = checkpoint.model_state(self.strategy.mesh)
        check_compatible(self.module, weights, f"resume={str(checkpoint.path)!r}", strict=True)
        state = checkpoint.state(self.strategy.mesh)
        saved_cfg = checkpoint.meta["config"]
        same_schedule = (saved_cfg.get("scheduler") or {}).get("_target_") == self.cfg.scheduler.get("_target_")
        load_scheduler = same_schedule and isinstance(state, dict) and bool(state.get("scheduler"))
        skip = () if load_scheduler else ("scheduler",)  # scheduler= changed on resume: the new one starts fresh
        self.state.check(state, f"checkpoint {checkpoint.path}", skip)
        self.module.load_state_dict(weights)
        configured = [dict(group) for group in self.optimizer.param_groups]  # from this run's config
        self.state.load(state, (*skip, "task"))  # the task's part after on_train_start (fit)
        self._saved_task_state = state.get("task")
        if not same_schedule:  # the new schedule starts here, from its start
            for group, fresh in zip(self.optimizer.param_groups, configured):
                group.update({k: fresh[k] for k in ("lr", "initial_lr") if k in fresh})
        apply_changed_options(self.optimizer, self.scheduler if same_schedule else None, configured,
                              changed_options(saved_cfg.get("optimizer") or {}, self.cfg.optimizer))
        self.checkpoints.saved_step = self.progress.step
        saved_ranks = checkpoint.meta.get("world_size", 1)
        if checkpoint.sharded and saved_ranks != self.strategy.world_size and self.strategy.is_rank_zero:
            log.warning("resume: %s was saved by %d processes and is resharded over %d; the data order differs "
                        "from the saved run's from here on", checkpoint.path, saved_ranks, self.strategy.world_size)
        if self.strategy.is_rank_zero:
            p = self.progress
            log.info("Resumed from %s at step %d (epoch %d, batch %d)", checkpoint.path, p.step, p.epoch,
                     p.batch_in_epoch)
            self.logger.log_text("history", f"Resumed from {checkpoint.path} at step {p.step} (epoch {p.epoch}, "
                                            f"batch {p.batch_in_epoch})", p.step)

    def _agreed_stop(self, watch: Any) -> Optional[int]:
        """After an optimizer step: the signal to stop on (if any), and whether a callback asked to stop, agreed by
        every rank (all must stop after the same step). Returns the signal; a callback's stop sets stop_reason."""
        received = getattr(watch, "received", None)
        if self.strategy.world_size > 1:
            # One slot per signal number, the last for a callback's stop: every rank learns which signals any rank
            # got (a signal reaches each worker at its own moment) and stops on the same one, the highest.
            flags = torch.zeros(len(_SIGNAL_SLOTS) + 1, device=self.device)
            if received is not None:
                flags[received] = 1.0
            flags[-1] = float(self.should_stop)
            summed = self.strategy.all_reduce_sum(flags).tolist()
            if summed[-1] and not self.should_stop:
                self.request_stop("another process's callback asked to stop")
            signalled = [signum for signum in _SIGNAL_SLOTS if summed[signum]]
            return signalled[-1] if signalled else None
        return received

    def _describe_setup(self) -> None:
        """What a user checks before trusting a run: parameter groups, LR plan, config (and, in a dry run,
        the model summary). Printed and written by rank 0 only; the summary's forward runs on every rank, as a
        sharded model's forward gathers weights from all of them."""
        summary = self._model_summary() if self.cfg.trainer.dry_run else None
        if not self.strategy.is_rank_zero:
            return
        per_device, world = self.data.batch_size, self.strategy.world_size
        # In run.log (and param_groups.json); on the console too in a dry run, which is for reading them.
        say = log.info if self.cfg.trainer.dry_run else (lambda msg, *args: file_only(msg % args, log))
        say("Global batch: %d per process x %d process%s x %d accumulated = %d samples per optimizer step",
            per_device, world, "es" if world > 1 else "", self.accumulate, per_device * world * self.accumulate)
        say("Parameter groups:\n%s", format_groups(self.optimizer, self.frozen))
        plan = lr_plan(self.scheduler, self.optimizer, self.steps_per_epoch) if self.scheduler else {}
        write_json(self.run_dir / "param_groups.json", describe_groups(self.optimizer))
        if self.progress.step == 0:  # a resumed run already logged these
            for name, points in plan.items():
                for step, lr in points:
                    self.logger.log_metrics({f"lr_plan/{name}": lr}, step)
            self.logger.log_text("config", "```yaml\n" + OmegaConf.to_yaml(self.cfg, resolve=True) + "```")
            self.logger.log_custom_scalars(layout([*self._monitors().values(), *self._val_names]))
            if self.hparams:
                self.logger.log_hparams(self.hparams, HPARAM_METRICS)
        if summary is not None:
            log.info("Model:\n%s", summary)
            for name, points in plan.items():
                shown = [points[round(i * (len(points) - 1) / 10)] for i in range(11)]
                log.info("LR plan of group '%s' (step: lr): %s", name,
                         ", ".join(f"{step}: {lr:.4g}" for step, lr in shown))
            log.info("Dry run: everything built; exiting without training (trainer.dry_run=true).")

    def _model_summary(self) -> str:
        batch = move_to(next(iter(self.data.batches("train"))), self.device)
        return summarize(self.strategy.unwrap(self.model), lambda: self.task.validation_step(batch))

    def _stop_granted(self) -> bool:
        """A callback's stop request counts once trainer.min_epochs and min_steps are reached; before that it is
        dropped (the callback asks again at its next check), as Lightning does."""
        p, t = self.progress, self.cfg.trainer
        if p.epoch >= t.min_epochs and p.step >= t.min_steps:
            return True
        if self.strategy.is_rank_zero:
            log.info("%s: not yet, trainer.min_epochs=%d and min_steps=%d (at epoch %d, step %d)", self.stop_reason,
                     t.min_epochs, t.min_steps, p.epoch, p.step)
        self.stop_reason = ""
        return False

    def _finished(self) -> bool:
        if self.stop_reason and self._stop_granted():  # a callback stopped the run (on resume: one that stops it
            return True  # again in on_fit_start)
        if self.max_steps > 0:  # max_steps, when set, alone decides the length of the run
            return self.progress.step >= self.max_steps
        return self.progress.epoch >= self.max_epochs

    # ------------------------------------------------------------------ one epoch of training
    def _train_epoch(self, watch: Any) -> None:
        """The hot loop. Everything reached per batch is bound to a local first, and nothing in it reads the
        config, syncs with the device or allocates beyond the step itself (bench/overhead.py measures it).
        A callback hook nobody implements is not called at all."""
        p, task = self.progress, self.task
        task.train()
        self.callbacks.call("on_train_epoch_start", self, task)
        self.bar.start_epoch(p.epoch, self.train_batches, initial=p.batch_in_epoch,
                             max_epochs=0 if self.max_steps > 0 else self.max_epochs)
        if self.overfit:  # the same batches every epoch
            batches = iter(itertools.islice(self._overfit_batches(), p.batch_in_epoch, self.train_batches))
        else:
            batches = iter(itertools.islice(self.data.batches("train", p.epoch, start_batch=p.batch_in_epoch),
                                            self.train_batches - p.batch_in_epoch))
        training_step, batch_size, losses = self.step_fns["training_step"], task.batch_size, self.window.losses
        where = f"{type(task).__name__}.training_step"
        precision, bar, checkpoints = self.precision, self.bar if self.bar.enabled else None, self.checkpoints
        autocast = precision.autocast if precision.dtype is not None else None
        to_device = None if self.device.type == "cpu" else move_to  # batches are made on the CPU
        no_sync = self.strategy.no_sync(self.model) if self.accumulate > 1 else None
        plain = contextlib.nullcontext()
        batch_start = self.callbacks.bound("on_train_batch_start")
        after_backward = self.callbacks.bound("on_after_backward")
        batch_end = self.callbacks.bound("on_train_batch_end")
        accumulate, train_batches, log_every, max_steps = (self.accumulate, self.train_batches,
                                                           self.log_every_n_steps, self.max_steps)
        val_every = self.val_every_n_steps if self.data.has("val") else 0
        periodic = checkpoints.every_n_steps > 0  # mid-epoch saves happen by step only
        check_stop = self.on_signal or bool(self.callbacks.callbacks)
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
            n = self._batch_n = batch_size(batch)  # what the task logs in this step is weighted by it
            if batch_start is not None:
                batch_start(self, task, batch, p.batch_in_epoch)
            with (plain if no_sync is None or steps_now else no_sync()):  # one all-reduce per optimizer step
                if autocast is None:
                    out = training_step(batch, p.batch_in_epoch)
                else:
                    with autocast():
                        out = training_step(batch, p.batch_in_epoch)
                if type(out) is not StepOutput:  # a loss tensor or a dict with "loss", as in Lightning
                    out = as_step_output(out, where, training=True)
                loss = out.loss
                precision.backward(loss / accumulate if accumulate > 1 else loss)
            if after_backward is not None:
                after_backward(self, task)
            losses.append(loss.detach())
            if out.metrics:  # a task's train metrics: train/<name> at logging steps and as epoch means
                for name, value in out.metrics.items():
                    self.log_from_task(f"train/{name}", value, on_step=True, on_epoch=True)
            p.batch_in_epoch += 1
            samples += n
            if bar is not None:
                bar.update()
            if steps_now:
                self._optimizer_step()
            if batch_end is not None:
                batch_end(self, task, out, batch, p.batch_in_epoch - 1)
            if not steps_now:
                continue
            if p.step % log_every == 0:
                self._flush_train_log()
            if check_stop:
                signum = self._agreed_stop(watch)
                if signum is not None:
                    self._stop(signum, watch)
            mid_epoch = p.batch_in_epoch < train_batches  # at an epoch's end, _end_epoch validates and saves
            if mid_epoch and val_every and p.step % val_every == 0:
                val = self._validation_round()
                checkpoints.save(self.state, p.step, periodic=periodic and checkpoints.due_periodic(p.step),
                                 metrics=val)
            elif mid_epoch and periodic and checkpoints.due_periodic(p.step):
                checkpoints.save(self.state, p.step, periodic=True)
            if (self.stop_reason and self._stop_granted()) or 0 < max_steps <= p.step:
                break
        seconds = clock() - epoch_start
        batches_run = p.batch_in_epoch - first_batch
        if batches_run and seconds > 0:
            self._epoch_rate = samples / seconds
            self.logger.log_metrics({"perf/samples_per_s": samples / seconds,
                                     "perf/step_ms": 1000 * seconds / batches_run,
                                     "perf/data_wait_frac": data_wait / seconds,
                                     "perf/max_memory_mb": _max_memory_mb(self.device)}, p.step)
        self.logger.flush()

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

    def _flush_train_log(self) -> None:
        """Log the window's mean loss and every value given to log() (one host sync for all of them; a logged
        Metric is computed, over every rank), and stop if any loss was not finite."""
        window = self.window
        if not window.losses:
            return
        losses = window.tensor()
        finite = torch.isfinite(losses)
        task_values = {k: (v.compute() if not isinstance(v, torch.Tensor) else v) for k, v in self._task_step.items()}
        logged = {name: v for name, v in self._logged.items() if isinstance(v, torch.Tensor)}
        logged.update(task_values)
        mean, all_finite, *values = torch.stack([losses.mean(), finite.all().float(),
                                                 *(v.reshape(()).float() for v in logged.values())]).tolist()
        if not all_finite:
            first = int((~finite).nonzero()[0])
            bad_step = window.first_step + first // self.accumulate + 1
            epoch = (bad_step - 1) // self.steps_per_epoch
            raise UserError(f"train/loss became {losses[first].item()} at step {bad_step} (epoch {epoch}); "
                            f"training stopped, and what was already written in {self.run_dir} is kept. "
                            "Expected a finite loss: try a lower optimizer.lr or set trainer.grad_clip_norm")
        own = {} if "train/loss" in self._task_train_names else {"train/loss": mean}  # the task's own wins
        metrics = {**own, "epoch": float(self.progress.epoch)}
        for name, group in zip(self.param_group_names, self.optimizer.param_groups):
            metrics[f"lr/{name}"] = group["lr"]
        if self.precision.scaler is not None:
            metrics["amp/scale"] = self.precision.scaler.get_scale()
            metrics["amp/skipped_steps"] = float(self.precision.skipped_steps)
        metrics.update({k: v for k, v in self._logged.items() if not isinstance(v, torch.Tensor)})
        metrics.update(zip(logged, values))
        self._logged.clear()
        self._task_step.clear()
        self.logger.log_metrics({k: v for k, v in metrics.items() if k not in self._hidden}, self.progress.step)
        self.bar.show({"train/loss": mean, **{k: v for k, v in metrics.items() if k in self._bar_names}})
        self._record({**own, **{k: metrics[k] for k in task_values}})
        window.count_losses(losses)
        window.losses.clear()  # in place: _train_epoch holds this list
        window.first_step, window.counted = self.progress.step, 0

    def _stop(self, signum: int, watch: Any) -> None:
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
        metrics = self._evaluate("val")
        self._check_monitors(metrics)
        self._record(metrics)
        for name, value in metrics.items():  # best over the run: the lowest loss or perplexity, the highest of the rest
            best = self.metrics.get(f"best/{name}", value)
            lower = "loss" in name or "ppl" in name or "perplexity" in name
            self.metrics[f"best/{name}"] = min(best, value) if lower else max(best, value)
        self.progress.last_val_step = self.progress.step
        self.progress.validations += 1
        self.callbacks.call("on_validation_end", self, self.task, metrics)
        return metrics

    def _check_monitors(self, metrics: dict[str, float]) -> None:
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

    def _epoch_scheduler_step(self) -> None:
        """The one place an epoch scheduler steps: once per completed epoch (every `frequency`), whether or not
        validation ran. One that monitors a metric steps after each validation instead (_validation_round)."""
        s = self.scheduler
        if s is not None and s.interval == "epoch" and s.monitor is None and self.progress.epoch % s.frequency == 0:
            s.scheduler.step()

    def _test_weights(self) -> Optional[Path]:
        """The checkpoint whose weights fit's test uses (trainer.test_ckpt, Lightning's ckpt_path), or None for the
        weights training ended with. Rank 0 knows the checkpoints; every rank loads the same."""
        ck, choice = self.cfg.checkpoint, self.cfg.trainer.test_ckpt
        if choice is None:
            choice = "best" if ck.monitor and ck.save_top_k > 0 and not self.fast_dev_run else "last"
        self.tested = "last"
        if choice == "last":
            return None
        best = self.checkpoints.best_path() if self.strategy.is_rank_zero else None
        chosen = self.strategy.broadcast_object(str(best) if best is not None else None)
        if chosen is None:
            if self.strategy.is_rank_zero:
                log.warning("trainer.test_ckpt=best: no best checkpoint was saved (no validation ran): testing "
                            "the final weights")
            self.tested = "last (no best checkpoint was saved)"
            return None
        return Path(chosen)

    def _test_with(self, weights: Optional[Path]) -> None:
        if weights is not None:
            checkpoint = open_checkpoint(weights)
            self.module.load_state_dict(checkpoint.model_state(self.strategy.mesh))
            self.tested = f"best (step {checkpoint.step})"
            if self.strategy.is_rank_zero:
                log.info("Testing the best checkpoint's weights (step %d, %s)", checkpoint.step, weights)
        self.callbacks.call("on_test_start", self, self.task)
        metrics = self._evaluate("test")
        self._record(metrics)
        self.callbacks.call("on_test_end", self, self.task, metrics)

    @torch.no_grad()
    def _evaluate(self, split: str) -> dict[str, float]:
        """Loss and metrics over `split` (under trainer.overfit_batches, validation runs on the training batches),
        weighted by batch size and reduced over all ranks; what the task logged (task_log.EvalLog); its stateful
        metrics (computed over every rank by the task). The epoch hooks run after the last batch, before what was
        logged is computed, as in Lightning."""
        t = self.cfg.trainer
        limit = 1 if self.fast_dev_run else (t.limit_val_batches if split == "val" else t.limit_test_batches)
        overfit = bool(self.overfit) and split == "val"
        step_fn = self.step_fns["validation_step" if split == "val" else "test_step"]
        where = f"{type(self.task).__name__}.{'validation_step' if split == 'val' else 'test_step'}"
        wrapped = self.model
        self.model = self.strategy.for_eval(wrapped)
        self.task.eval()
        self._stage, self._eval_log = split, EvalLog(split, self.device)
        sums: dict[str, torch.Tensor] = {}
        available = self.overfit if overfit else self.data.num_batches(split)
        count, batches, batch = 0, (self.overfit if overfit else _limit(limit, available)), None
        # A sharded model's forward gathers weights from every rank: a rank with fewer batches runs empty ones.
        rounds = max(self.strategy.gather_objects(batches)) if self.strategy.collective_forward else batches
        hook = "validation" if split == "val" else "test"
        try:
            task_hooks.call_if_defined(self.task, f"on_{hook}_epoch_start")
            data = self._overfit_batches() if overfit else self.data.batches(split)
            for i, batch in enumerate(itertools.islice(data, batches)):
                batch = move_to(batch, self.device)
                n = self.task.batch_size(batch)
                self._batch_n = n
                with self.precision.autocast():
                    out = as_step_output(step_fn(batch, i), where, training=False)
                if out is not None:
                    for name, value in itertools.chain((("loss", out.loss),), out.metrics.items()):
                        weighted = value.detach().float() * n
                        sums[name] = sums[name] + weighted if name in sums else weighted
                count += n
            for _ in range(rounds - batches):
                self._idle_step(step_fn, batch)
            task_hooks.call_if_defined(self.task, f"on_{hook}_epoch_end")
            stateful = {f"{split}/{name}": float(value) for name, value in self.task.epoch_metrics(split).items()}
            evaluated = self._eval_log
        finally:
            self._stage, self._eval_log, self._batch_n = "train", None, 1
            self.task.train()
            self.model = wrapped
        outputs, logged = evaluated.finish(self.strategy, self.task, sums, count)
        metrics = {**outputs, **logged, **stateful}
        self.logger.log_metrics({k: v for k, v in metrics.items() if k not in self._hidden}, self.progress.step)
        return metrics

    def _overfit_batches(self) -> list[Any]:
        """trainer.overfit_batches: the first N batches of epoch 0's order, kept, for every epoch's training and
        validation (as Lightning does; meant for a few batches)."""
        if self._overfit_kept is None:
            self._overfit_kept = list(itertools.islice(self.data.batches("train", 0), self.overfit))
        return self._overfit_kept

    def _idle_step(self, step_fn: Any, batch: Any) -> None:
        """A step on no samples (`batch` cut to none, or this rank's first training batch), for the collectives
        of its forward only: under FSDP every rank must gather each unit's weights as often as the others.
        What it logs is dropped; metrics see no sample."""
        empty = _rows(move_to(batch if batch is not None else self.data.first_batch("train"), self.device), 0)
        logged, self._eval_log = self._eval_log, EvalLog("idle", self.device)
        try:
            with torch.no_grad(), self.precision.autocast():
                step_fn(empty, 0)
        finally:
            self._eval_log = logged

    # ------------------------------------------------------------------ results
    def _record(self, metrics: dict[str, float]) -> None:
        self.metrics.update(metrics)

    def _summary(self, seconds: float) -> dict[str, Any]:
        summary: dict[str, Any] = dict(self.metrics)
        best = self.checkpoints.best_path()
        p = self.progress
        summary.update(status="ok", step=p.step, epoch=p.epoch, batch_in_epoch=p.batch_in_epoch,
                       epoch_batches=self.train_batches, seconds=round(seconds, 3),
                       world_size=self.strategy.world_size, precision=self.precision.name,
                       best_checkpoint=str(best) if best is not None else None, stopped=self.stop_reason or None,
                       tested=self.tested or None)
        return summary
