"""Building a run's components from its config: data, task and model (placed, compiled, wrapped by the parallel
strategy), precision, optimizer, scheduler, checkpoint policies and callbacks. One function, no loop state: the
trainer calls `build_components` once and wires what it returns."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union, cast

import torch
from omegaconf import DictConfig, OmegaConf

from framework.callbacks import task_hooks
from framework.callbacks.base import Callback, CallbackList
from framework.callbacks.timer import Timer
from framework.checkpoint import CheckpointManager, check_compatible, load_weights
from framework.checkpoint.mirror import RemoteMirror
from framework.checkpoint.weights import accept_plain_keys
from framework.config.instantiate import build, locate
from framework.core import startup
from framework.core.errors import ConfigError
from framework.core.stores import open_store
from framework.data.folds import write_record as write_fold_record
from framework.data.module import DataModule
from framework.optim.optimizers import Optimizers, build_named_schedulers, build_optimizers, outside_model
from framework.optim.schedulers import build_scheduler
from framework.parallel import activation_checkpointing, meta_init
from framework.parallel.precision import Precision
from framework.parallel.strategy import Strategy
from framework.task.task import Task


@dataclass
class Components:
    """What a run is made of. The task keeps its model as `task.<model_attr>`; `model` is that model as the loop
    runs it (wrapped by DDP or DP; compiled in place), put in the task's place while a stage runs (task.swapped)."""

    data: DataModule
    task: Task
    model_attr: str
    model: torch.nn.Module
    precision: Precision
    optimizers: Optimizers  # one, or several by name (framework/optim/optimizers.py)
    frozen: Any  # the parameters no group trains (for the parameter-group table)
    scheduler: Any  # the `scheduler` group's, over the one optimizer (None: constant, or several optimizers)
    train_batches: int  # per epoch, after the limits
    steps_per_epoch: int
    overfit: int  # trainer.overfit_batches as a number of batches (0: off)
    checkpoints: CheckpointManager
    callbacks: CallbackList


def limit(value: Union[int, float], available: int) -> int:
    """Lightning's limit_*_batches: an int is a count, a float a fraction of the epoch."""
    if isinstance(value, float):
        return max(1, int(available * value)) if available else 0
    return min(value, available)


def build_components(cfg: DictConfig, strategy: Strategy, run_dir: Path) -> Components:
    t, fast_dev_run = cfg.trainer, cfg.trainer.fast_dev_run
    data = build_data(cfg, strategy)
    if data.fold_split is not None and strategy.is_rank_zero:  # data.folds: the fold's samples, kept with the run
        write_fold_record(data.fold_split, run_dir)
    on_meta = meta_init.Builder(strategy) if strategy.sharded and cfg.parallel.get("meta_init", False) else None
    task, model_attr = build_task(cfg, on_meta)
    refuse_own_model(task, model_attr, strategy)
    task_hooks.refuse_replaced(task)
    task_hooks.call_if_defined(task, "setup", cfg.get("stage", "fit"))  # before placing and wrapping, as Lightning
    accept_plain_keys(task)  # a submodule the task compiled itself (in setup, say) loads checkpoints' plain keys
    model: Any = place(cfg, task, model_attr, strategy, load=on_meta is None or on_meta.recorder is None)
    precision = Precision(cfg.precision.mode.value, strategy.device)
    # Activation checkpointing, then compile, then the DDP/FSDP wrapping (torchtitan's order): the recompute sits
    # inside what is compiled, and FSDP's hooks around the recomputed modules.
    activation_checkpointing.apply(model, cfg.parallel)
    if t.compile:  # in place (nn.Module.compile): the module keeps its class, and its keys have no `_orig_mod.`
        model.compile()
    # Wrapped before the optimizer is built: FSDP replaces the parameters by their shards (DTensors), which
    # the optimizer must hold (DDP and DataParallel keep the same ones).
    wrapped = strategy.wrap(model, param_dtype=precision.dtype)
    if on_meta is not None and on_meta.recorder is not None:  # each rank's shards get their values only now
        on_meta.materialise(model, cfg)
    optimizers = build_optimizers(cfg.optimizer, task, model_attr, model)
    check_optimization(cfg, task, model_attr, strategy, optimizers)
    # overfit_batches: the same first batches of epoch 0's order every epoch, validated on too (Lightning's).
    overfit = limit(t.overfit_batches, data.num_batches("train")) if t.overfit_batches else 0
    train_batches = limit(1 if fast_dev_run else (overfit or t.limit_train_batches), data.num_batches("train"))
    if train_batches == 0:
        raise ConfigError(
            "data.train: the training set gives no batch (is it empty, or smaller than "
            "data.batch_size with data.drop_last=true?)"
        )
    steps_per_epoch = math.ceil(train_batches / t.accumulate_grad_batches)
    lengths = {
        "max_steps": 1 if fast_dev_run else t.max_steps,
        "max_epochs": 1 if fast_dev_run else t.max_epochs,
        "steps_per_epoch": steps_per_epoch,
    }
    scheduler = build_scheduler(cfg.scheduler, optimizers.only, **lengths) if optimizers.single else None
    build_named_schedulers(cfg.optimizer, optimizers, build_scheduler, **lengths)
    checkpoints = build_checkpoints(cfg, strategy, run_dir)
    callbacks = CallbackList(build_callbacks(cfg), first=task_hooks.task_callback(task))
    startup.resume_collector()  # the run's long-lived objects exist: collect as usual from here (startup.py)
    return Components(
        data,
        task,
        model_attr,
        wrapped,
        precision,
        optimizers,
        optimizers.frozen,
        scheduler,
        train_batches,
        steps_per_epoch,
        overfit,
        checkpoints,
        callbacks,
    )


def refuse_own_model(task: Task, model_attr: str, strategy: Strategy) -> None:
    """A task that built several nets itself is its own model (`model_attr` ""): its steps call its nets, not a
    wrapper's forward, so DDP, FSDP and DP (which work through the wrapped model's forward) cannot train it."""
    if model_attr or strategy.name == "single":
        return
    nets = ", ".join(name for name, child in task.named_children() if any(True for _ in child.parameters()))
    raise ConfigError(
        f"parallel.strategy={strategy.name}: {type(task).__name__} builds its nets itself ({nets}), so it is its own "
        "model, which this framework trains in one process only so far; expected parallel=single, or the model "
        "given by the model group as the task's `model` (or `net`)"
    )


def check_optimization(
    cfg: DictConfig, task: Task, model_attr: str, strategy: Strategy, optimizers: Optimizers
) -> None:
    """What the loop cannot do with these optimizers, refused before the first step (Lightning 2's rules for manual
    optimization; what is not built here yet, named)."""
    name, t = type(task).__name__, cfg.trainer
    manual = not task.automatic_optimization
    if len(optimizers) > 1 and not manual:
        raise ConfigError(
            f"optimizer: {len(optimizers)} optimizers ({', '.join(optimizers.named)}) under automatic optimization; "
            f"expected one, or `self.automatic_optimization = False` in {name}.__init__ and a training_step that "
            "steps them (manual optimization, as Lightning 2 requires)"
        )
    if len(optimizers) > 1 and cfg.scheduler.get("_target_") is not None:
        raise ConfigError(
            f"scheduler._target_={cfg.scheduler._target_!r}: one schedule for {len(optimizers)} optimizers; "
            "expected scheduler=none and a `scheduler` node under each optimizer.<name> that has one"
        )
    if manual:
        for key, value, fix in (
            ("trainer.accumulate_grad_batches", t.accumulate_grad_batches, 1),
            ("trainer.grad_clip_norm", t.grad_clip_norm, None),
            ("trainer.grad_clip_value", t.grad_clip_value, None),
        ):
            if value != fix:
                raise ConfigError(
                    f"{key}={value}: {name} optimizes manually (automatic_optimization = False), and its "
                    f"training_step accumulates and clips itself (self.clip_gradients); expected {key}={fix}"
                )
    outside = outside_model(task, model_attr)
    if strategy.name != "single" and (manual or outside):
        what = "optimizes manually" if manual else f"holds parameters outside its model ({', '.join(outside[:4])})"
        raise ConfigError(
            f"parallel.strategy={strategy.name}: {name} {what}, which this framework trains in one process only "
            "so far; expected parallel=single"
        )


def build_checkpoints(cfg: DictConfig, strategy: Strategy, run_dir: Path) -> CheckpointManager:
    """The checkpoint policies of `checkpoint.*`; a fast_dev_run keeps nothing."""
    ck, fast_dev_run = cfg.checkpoint, cfg.trainer.fast_dev_run
    return CheckpointManager(
        run_dir / "checkpoints",
        save_last=ck.save_last,
        every_n_steps=ck.every_n_steps,
        every_n_epochs=ck.every_n_epochs,
        keep_last=ck.keep_last,
        monitor=ck.monitor,
        mode=ck.mode.value,
        save_top_k=ck.save_top_k,
        enabled=strategy.is_rank_zero and not fast_dev_run,
        fsync=ck.fsync,
        async_save=ck.async_save,
        shards=strategy if strategy.sharded and not fast_dev_run else None,
        remote=build_remote(cfg, run_dir) if strategy.is_rank_zero and not fast_dev_run else None,
    )


def build_remote(cfg: DictConfig, run_dir: Path) -> Optional[RemoteMirror]:
    """checkpoint.remote's mirror, uploading what the policies keep (checked, and probed, at the edge)."""
    if not cfg.checkpoint.get("remote") or cfg.get("stage", "fit") != "fit":  # evaluating a run uploads nothing
        return None
    options = OmegaConf.to_container(cfg.checkpoint.remote_options, resolve=True)
    return RemoteMirror(open_store("checkpoint.remote", str(cfg.checkpoint.remote), cast(dict, options)), run_dir)


def build_data(cfg: DictConfig, strategy: Strategy) -> DataModule:
    data = build(cfg.data, "data")
    if not isinstance(data, DataModule):
        raise ConfigError(
            f"data._target_={cfg.data._target_!r}: expected a framework.data.module.DataModule "
            f"(or subclass), got {type(data).__name__}"
        )
    data.setup(seed=cfg.seed, rank=strategy.rank, world_size=strategy.world_size)
    return data


def place(cfg: DictConfig, task: Task, model_attr: str, strategy: Strategy, load: bool = True) -> torch.nn.Module:
    """The task on the device (under FSDP, all but the model, whose shards wrap moves: a model larger than one
    device is never whole on one) and, with `load`, `init_from`'s weights in the model (a model built on the meta
    device gets them shard by shard once sharded). Returns the model."""
    model = task.get_submodule(model_attr)
    strategy.place(task, model)
    if cfg.get("init_from") and load:
        weights = load_weights(Path(cfg.init_from))
        check_compatible(model, weights, f"init_from={cfg.init_from!r}", cfg.init_strict)
        model.load_state_dict(weights, strict=cfg.init_strict)
    return model


def model_parameter(cfg: DictConfig) -> Optional[str]:
    """The task constructor's parameter the built `model` group is given as (`model`, or `net`), or None: the task
    builds its model (or its nets) itself."""
    target = locate(cfg.task.get("_target_"), "task")
    params = inspect.signature(target).parameters if inspect.isclass(target) else {}
    takes = set(params) | (
        {"model"} if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) else set()
    )  # (*args, **kwargs): passed on to Task's own `model`
    return next((name for name in ("model", "net") if name in takes and name not in cfg.task), None)


def build_task(cfg: DictConfig, on_meta: Optional[meta_init.Builder] = None) -> tuple[Task, str]:
    """The task, given the built `model` group as its constructor's `model` (or, in a port of a LightningModule,
    `net`: lightning-hydra-template's name), and the name of the attribute that holds it. A task whose config
    builds its model itself (`task.net: ${model}`, or a constructor that makes one) holds it in its one
    submodule with parameters. `on_meta`: builds the model group with its parameters on the meta device."""
    given = model_parameter(cfg)
    model: Optional[torch.nn.Module] = None
    if given is not None:
        model = on_meta.build(lambda: build(cfg.model, "model")) if on_meta else build(cfg.model, "model")
        task = build(cfg.task, "task", partial=True, provided=(given,))(**{given: model})
    else:
        task = build(cfg.task, "task")
    if not isinstance(task, Task):
        raise ConfigError(f"task._target_={cfg.task._target_!r}: expected a framework.task.task.Task subclass")
    holders = [name for name, child in task.named_children() if child is model] if model is not None else []
    if not holders:
        holders = [name for name, child in task.named_children() if any(True for _ in child.parameters())]
        if len(holders) > 1:  # it built several nets itself (a GAN's two, as a LightningModule does): all its own
            return task, ""
    if len(holders) != 1:
        found = (
            f"its submodules with parameters are {', '.join(holders)}"
            if holders
            else "it has no submodule with parameters"
        )
        raise ConfigError(
            f"task._target_={cfg.task._target_!r}: cannot tell which attribute holds the model ({found}); "
            "expected the constructor to take the model as `model` (given the model group) and keep "
            "it as an attribute, or one submodule with parameters"
        )
    return task, holders[0]


def build_callbacks(cfg: DictConfig) -> dict[str, Callback]:
    """The `callbacks` group's nodes (a null one is off), plus Lightning's Timer for `trainer.max_time`."""
    callbacks: dict[str, Callback] = {}
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is None:
            continue
        callback = build(node, f"callbacks.{name}")
        if not isinstance(callback, Callback):
            raise ConfigError(
                f"callbacks.{name}._target_={node.get('_target_')!r} built a "
                f"{type(callback).__name__}; expected a framework.callbacks.base.Callback subclass"
            )
        callbacks[str(name)] = callback
    if cfg.trainer.max_time is not None and not any(isinstance(c, Timer) for c in callbacks.values()):
        callbacks["timer"] = Timer(cfg.trainer.max_time)
    return callbacks
