"""Lightning's names and typos, answered: the closed groups (every key the framework defines, so `+key=` cannot add
one), where each Lightning Trainer argument lives here (`LIGHTNING_NAMES`), and the one-line hint a wrong key gets."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Iterable, Optional, cast

from omegaconf import DictConfig, OmegaConf

from framework.config.schema import (
    CheckpointConfig,
    LoggerConfig,
    ParallelConfig,
    PrecisionConfig,
    RootConfig,
    TrainerConfig,
)
from framework.core.errors import ConfigError

# The groups whose every key the framework defines: a key they do not define is an error (even with `+`).
CLOSED_GROUPS = {
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "checkpoint": CheckpointConfig,
    "precision": PrecisionConfig,
    "parallel": ParallelConfig,
}


@dataclass(frozen=True)
class Home:
    """Where a Lightning argument lives here: `key`, with `why` a short note on the difference; or `key=None`
    (there is no equivalent) and `why` the reason. `by_value`: a value that picks another key instead."""

    key: Optional[str]
    why: str = ""
    by_value: tuple[tuple[str, str], ...] = ()

    def key_for(self, value: Any) -> Optional[str]:
        return dict(self.by_value).get(str(value), self.key)


def _none(why: str) -> Home:
    return Home(None, why)


_NO_SAMPLER = _none("the data module shards every split over the ranks itself (its EpochSampler)")
_NO_RELOAD = _none("the data loaders are built once per run")
_CHECKPOINTS_ON = Home("checkpoint.save_last", "checkpoint=none saves nothing")

# The arguments of Lightning's Trainer (2.x, and 1.x's that users still type), ModelCheckpoint and EarlyStopping
# that are not our keys under the same name, for the hints of an unknown key: where each lives here, or why
# nothing does. The ones we share (max_epochs, min_steps, limit_val_batches, overfit_batches, detect_anomaly,
# deterministic, save_top_k, monitor, ...) are real keys, which a mistyped group finds without this table.
LIGHTNING_NAMES: dict[str, Home] = {
    # Trainer
    "accelerator": Home("trainer.device", "cpu, cuda, cuda:N, mps or auto"),
    "strategy": Home("parallel.strategy", "parallel=ddp"),
    "devices": Home("parallel.devices", "processes with parallel=ddp"),
    "num_nodes": _none("start the run under torchrun --nnodes=N (or srun): the world size comes from the launcher"),
    "precision": Home("precision.mode", "precision=bf16"),
    "logger": Home("logger.tensorboard", "the logger group"),
    "callbacks": Home("callbacks", "the callbacks group: callbacks=[default,ema]"),
    "limit_predict_batches": _none(
        "`python run.py predict ckpt=RUN_DIR` writes a row for every sample of data.predict (else the test split)"
    ),
    "val_check_interval": Home("trainer.val_every_n_steps", "every N optimizer steps"),
    "check_val_every_n_epoch": Home("trainer.val_every_n_epochs"),
    "num_sanity_val_steps": _none("the pre-flight check runs one batch of each split and leaves no trace in the task"),
    "enable_checkpointing": _CHECKPOINTS_ON,
    "enable_progress_bar": Home("logger.progress_bar"),
    "gradient_clip_val": Home("trainer.grad_clip_norm", "trainer.grad_clip_value clips by value"),
    "gradient_clip_algorithm": Home(
        "trainer.grad_clip_norm",
        "the key you set picks the algorithm",
        by_value=(("value", "trainer.grad_clip_value"),),
    ),
    "benchmark": _none("set torch.backends.cudnn.benchmark in your own code"),
    "inference_mode": _none("evaluation runs under torch.no_grad"),
    "use_distributed_sampler": _NO_SAMPLER,
    "barebones": _none(
        "turn the extras off one by one: logger.tensorboard=false logger.progress_bar=false "
        "checkpoint=none callbacks=none"
    ),
    "plugins": _none("precision, parallelism and checkpoint I/O are the precision, parallel and checkpoint groups"),
    "sync_batchnorm": _none("convert the model in its own code: torch.nn.SyncBatchNorm.convert_sync_batchnorm"),
    "reload_dataloaders_every_n_epochs": _NO_RELOAD,
    "default_root_dir": Home("hydra.run.dir"),
    "enable_autolog_hparams": _none("the composed config is always saved (.hydra/config.yaml, TensorBoard's text)"),
    "model_registry": _none("python -m framework export writes the weights; upload them with your registry's tool"),
    # Trainer, Lightning 1.x
    "gpus": Home("parallel.devices", "processes with parallel=ddp; trainer.device=cpu for none"),
    "num_processes": Home("parallel.devices", "processes with parallel=ddp"),
    "tpu_cores": _none("the devices are CUDA GPUs, MPS or the CPU"),
    "ipus": _none("the devices are CUDA GPUs, MPS or the CPU"),
    "auto_select_gpus": _none("trainer.device=auto takes the visible GPUs; choose them with CUDA_VISIBLE_DEVICES"),
    "distributed_backend": Home("parallel.strategy", "parallel=ddp"),
    "replace_sampler_ddp": _NO_SAMPLER,
    "reload_dataloaders_every_epoch": _NO_RELOAD,
    "track_grad_norm": Home("callbacks.grad_norm", "logs grad_norm/* at the logging steps"),
    "auto_lr_find": _none("the LR range test is a stage: python run.py lr_find prints the optimizer.lr= to use"),
    "auto_scale_batch_size": _none("set data.batch_size; a sweep (-m) can try several"),
    "resume_from_checkpoint": Home("resume"),
    "checkpoint_callback": _CHECKPOINTS_ON,
    "weights_summary": Home(
        "trainer.model_summary_max_depth", "top is 1, full is -1; null is trainer.enable_model_summary=false"
    ),
    "weights_save_path": Home("hydra.run.dir", "checkpoints go to its checkpoints/"),
    "progress_bar_refresh_rate": Home(
        "logger.progress_bar", "logger.progress_every_s paces output that is not a terminal"
    ),
    "flush_logs_every_n_steps": _none("TensorBoard's writer flushes on its own"),
    "log_gpu_memory": _none("perf/max_memory_mb is always logged, per epoch"),
    "terminate_on_nan": Home("callbacks.early_stopping.check_finite", "trainer.detect_anomaly names the op"),
    "stochastic_weight_avg": _none("callbacks=[default,ema] averages the weights exponentially"),
    "amp_backend": Home("precision.mode", "precision=amp"),
    "amp_level": Home("precision.mode", "precision=amp"),
    "move_metrics_to_cpu": _none("metrics stay on the device until they are logged"),
    "multiple_trainloader_mode": _none("a run has one train loader"),
    "truncated_bptt_steps": _none("split the sequence in your task's training_step"),
    "prepare_data_per_node": _none("the data module has no download step"),
    # ModelCheckpoint
    "dirpath": Home("hydra.run.dir", "checkpoints go to its checkpoints/"),
    "filename": _none("checkpoints are named checkpoints/last, best and step-<N>"),
    "every_n_train_steps": Home("checkpoint.every_n_steps"),
    "train_time_interval": _none(
        "save every N steps or epochs (checkpoint.every_n_steps); trainer.max_time saves last when time is up"
    ),
    "save_on_train_epoch_end": Home("checkpoint.every_n_epochs"),
    "save_weights_only": _none(
        "a checkpoint holds the whole training state; python -m framework export writes the weights alone"
    ),
    "auto_insert_metric_name": _none("checkpoints are named checkpoints/last, best and step-<N>"),
    "enable_version_counter": _none("every run has a directory of its own"),
    "save_top_n": Home("checkpoint.save_top_k"),
    "top_k": Home("checkpoint.save_top_k"),
    # EarlyStopping (the early_stopping callback)
    "early_stopping": Home("callbacks.early_stopping"),
    "earlystopping": Home("callbacks.early_stopping"),
    "patience": Home("callbacks.early_stopping.patience"),
    "min_delta": Home("callbacks.early_stopping.min_delta"),
    "stopping_threshold": Home("callbacks.early_stopping.stopping_threshold"),
    "check_finite": Home("callbacks.early_stopping.check_finite"),
    "divergence_threshold": _none(
        "callbacks.early_stopping.check_finite stops on NaN or inf; nothing stops on a bad value"
    ),
    "check_on_train_epoch_end": _none("early stopping checks after each validation"),
    "strict": _none("a monitor no validation computes is refused when the run starts"),
    "log_rank_zero_only": _none("only rank 0 says why the run stopped"),
    "verbose": Home("hydra.verbose", "DEBUG log lines, as debug=default has"),
    # Other names for ours
    "epochs": Home("trainer.max_epochs"),
    "seed_everything": Home("seed"),
    "ckpt_path": Home(
        "ckpt",
        "python run.py test ckpt=RUN_DIR evaluates a saved run; resume= continues one; trainer.test_ckpt picks fit's",
    ),
}


def _keys_of(group: str) -> list[str]:
    schema = CLOSED_GROUPS.get(group, RootConfig if group == "" else None)
    return [f.name for f in fields(schema)] if schema is not None else []


def suggest_key(dotted: str, value: Any = None) -> Optional[str]:
    """The real key closest to a wrong one, as a full dotted key: Lightning's name for it first
    (`trainer.check_val_every_n_epoch` -> `trainer.val_every_n_epochs`; None when nothing here is), else the
    closest spelling in its group (`trainer.max_epoch` -> `trainer.max_epochs`), else None. `value`: what was
    set, for a name whose value picks the key (`gradient_clip_algorithm=value` -> `trainer.grad_clip_value`)."""
    group, _, name = dotted.rpartition(".")
    if name in LIGHTNING_NAMES:
        return LIGHTNING_NAMES[name].key_for(value)
    close = difflib.get_close_matches(name, _keys_of(group), n=1, cutoff=0.6)
    if close:
        return f"{group}.{close[0]}" if group else close[0]
    # A key of another framework group typed under the wrong one (trainer.save_top_k).
    for other in CLOSED_GROUPS:
        if name in _keys_of(other):
            return f"{other}.{name}"
    return None


def key_hint(dotted: str, value: Any = None) -> str:
    """What to tell a user who set `dotted`, a key its group does not define: "did you mean 'KEY'? " (with
    Lightning's difference in brackets), "Lightning's NAME has no equivalent here: WHY; ", or ""."""
    name = dotted.rpartition(".")[2]
    home = LIGHTNING_NAMES.get(name)
    if home is not None and home.key is None:
        return f"Lightning's {name} has no equivalent here: {home.why}; "
    key = suggest_key(dotted, value)
    note = f" ({home.why})" if home is not None and home.why else ""
    return f"did you mean {key!r}{note}? " if key else ""


def check_closed_keys(cfg: DictConfig) -> None:
    """A key the framework does not define in one of its own groups is a mistake, even when added with `+`
    (Hydra lets `+trainer.max_epoch=1` through): name it, with the closest real key."""
    for group in ("", *CLOSED_GROUPS):
        node = cfg.get(group) if group else cfg
        if not isinstance(node, DictConfig):
            continue
        known = set(_keys_of(group))
        for name in cast(Iterable[str], node):  # a group's keys are strings: YAML keys and dataclass fields
            if name not in known:
                key = f"{group}.{name}" if group else str(name)
                value = cast(dict, OmegaConf.to_container(node, resolve=False))[name]  # as written: ${...} unresolved
                raise ConfigError(
                    f"{key}={value!r}: {group or 'the root config'} has no key '{name}'; "
                    f"{key_hint(key, value)}expected one of: {', '.join(sorted(known))}"
                )
