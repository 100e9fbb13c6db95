"""Structured-config schemas for the groups whose shape the framework owns.

Registered with Hydra's ConfigStore so a typo or a wrong type is rejected while the config is composed,
before anything runs. Group YAML files start with `defaults: [/trainer_schema, _self_]` (and so on) to pick these
up; the schemas sit at the root of the store, so `--help` lists no `schema` option.
What a type cannot express (the valid range of every value, checks across fields, the DataModule's counts,
the hardware a setting names) lives in `validate()`, called once by the app before anything is built.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
from dataclasses import dataclass, field, fields
from datetime import timedelta
from enum import Enum
from typing import Any, Iterable, Iterator, Optional, TypeGuard, Union, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, Container, DictConfig, ListConfig, OmegaConf

from framework.core.errors import ConfigError
from framework.core.signals import DEFAULT_SIGNALS
from framework.core.signals import parse as parse_signal


@dataclass
class ProfilerScheduleConfig:
    """trainer.profiler=pytorch's window of optimizer steps, as torch.profiler.schedule takes it."""

    wait: int = 1  # steps untraced first
    warmup: int = 1  # then traced and dropped (the profiler's own start-up)
    active: int = 3  # then traced and kept


@dataclass
class TrainerConfig:
    max_epochs: int = 20
    max_steps: int = -1  # optimizer steps; -1 means "no limit" (Lightning's convention)
    min_epochs: int = 0  # early stopping (a callback's request_stop) waits until this many epochs are complete
    min_steps: int = 0  # ... and this many optimizer steps
    val_every_n_epochs: int = 1
    val_every_n_steps: int = 0  # also validate every N optimizer steps, counted across epochs (0: never)
    max_time: Optional[str] = None  # this job's wall-clock budget, DD:HH:MM:SS or seconds (each start gets it anew)
    log_every_n_steps: int = 50
    accumulate_grad_batches: int = 1
    grad_clip_norm: Optional[float] = None
    grad_clip_value: Optional[float] = None
    # An int is a number of batches, a float a fraction of the epoch (as in Lightning).
    limit_train_batches: Union[int, float] = 1.0
    limit_val_batches: Union[int, float] = 1.0
    limit_test_batches: Union[int, float] = 1.0
    # Lightning's overfit_batches: the same first N train batches (a float: a fraction) every epoch, unshuffled,
    # and validation on those same batches. 0: off.
    overfit_batches: Union[int, float] = 0
    fast_dev_run: bool = False
    dry_run: bool = False
    test: bool = True
    # Which weights fit's test uses (Lightning's ckpt_path): best, last, or null (best when a monitored top-k
    # checkpoint is kept, else the final weights).
    test_ckpt: Optional[str] = None
    predict_chunk_rows: int = 4096  # `predict`: rows a rank writes at a time (a killed predict keeps whole chunks)
    detect_anomaly: bool = False  # torch.autograd's anomaly mode: the op that made a NaN/inf gradient, named
    deterministic: bool = False
    compile: bool = False
    device: str = "auto"
    # glibc malloc with fixed thresholds, so a step's freed tensors serve the next step (framework/parallel/allocator.py)
    malloc_tuning: bool = True
    # Where the time goes (framework/observe/profiler.py): null, simple (a table of time per phase at the end) or pytorch (a
    # torch.profiler trace of profiler_schedule's steps per rank, under RUN_DIR/profiler/, cut to profiler_max_mb).
    profiler: Optional[str] = None
    profiler_schedule: ProfilerScheduleConfig = field(default_factory=ProfilerScheduleConfig)
    profiler_max_mb: float = 100.0


@dataclass
class CsvConfig:
    enabled: bool = False  # logger=csv (or a list naming it) turns it on
    filename: str = "metrics.csv"  # in the run directory: step,name,value rows


@dataclass
class MlflowConfig:
    enabled: bool = False  # logger=mlflow (or a list naming it) turns it on
    # conf/logger/mlflow.yaml: $MLFLOW_TRACKING_URI first; null: mlflow.db beside the run directory (tracker_mlflow)
    tracking_uri: Optional[str] = None
    experiment_name: Optional[str] = None  # null: the run's `name`
    run_name: Optional[str] = None  # null: the run directory's name
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class WandbConfig:
    enabled: bool = False  # logger=wandb (or a list naming it) turns it on
    mode: str = "offline"  # offline: files under `dir`, uploaded by `wandb sync`; online: sent as the run goes
    project: Optional[str] = None  # null: the run's `name`
    entity: Optional[str] = None  # null: W&B's default for the API key (online)
    dir: Optional[str] = None  # null: the run directory (RUN_DIR/wandb/...)
    group: Optional[str] = None  # null: a multirun's jobs are grouped by the sweep directory's name
    name: Optional[str] = None  # null: the run directory's name
    tags: list[str] = field(default_factory=list)


WANDB_MODES = ("offline", "online")


@dataclass
class LoggerConfig:
    # The backends: `logger=[tensorboard,csv,mlflow]` turns several on (framework/observe/trackers.py). Each one's node is
    # always there, so setting a key of one not chosen is no composition error (it stays off).
    tensorboard: bool = False  # conf/logger/tensorboard.yaml (the default option) turns it on
    csv: CsvConfig = field(default_factory=CsvConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_bar: bool = True
    progress_every_s: float = 30.0  # output that is not a terminal: also a line every N seconds within an epoch


class Mode(str, Enum):
    min = "min"
    max = "max"


@dataclass
class CheckpointConfig:
    save_last: bool = False
    every_n_steps: int = 0
    every_n_epochs: int = 0
    keep_last: int = 1
    monitor: Optional[str] = None
    mode: Mode = Mode.max
    save_top_k: int = 0
    on_signal: bool = False
    # What on_signal stops on (SLURM's --signal=USR1@90, submitit's USR2; plus $SUBMITIT_PREEMPT_SIGNAL).
    signals: list[str] = field(default_factory=lambda: list(DEFAULT_SIGNALS))
    requeue: Any = "auto"  # after saving on a signal other than TERM/INT: auto (under SLURM/submitit), true, false
    fsync: bool = True  # flush each checkpoint to disk before it counts (false: atomic for the process only)
    async_save: bool = True  # write on a background thread; the loop waits only for a copy of the state


class PrecisionMode(str, Enum):
    fp32 = "fp32"
    amp = "amp"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class PrecisionConfig:
    mode: PrecisionMode = PrecisionMode.fp32


class StrategyName(str, Enum):
    single = "single"
    dp = "dp"
    ddp = "ddp"
    fsdp = "fsdp"


# The strategies that run one process per device (spawned by the app, or under torchrun).
PROCESS_STRATEGIES = (StrategyName.ddp, StrategyName.fsdp)


@dataclass
class ParallelConfig:
    strategy: StrategyName = StrategyName.single
    devices: Optional[int] = None
    backend: Optional[str] = None
    find_unused_parameters: bool = False
    static_graph: bool = False
    timeout_s: int = 1800
    # FSDP's own (parallel=fsdp): the module classes that become shard units (null: the model's blocks, [] :
    # the root only), whether a unit frees its gathered weights after forward, and weights kept on the CPU.
    shard_modules: Optional[list[str]] = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # Modules recomputed in backward (framework/parallel/activation_checkpointing.py): none, full (every block / shard
    # unit) or selective (the module classes named in activation_checkpointing_modules).
    activation_checkpointing: str = "none"
    activation_checkpointing_modules: Optional[list[str]] = None
    # parallel=fsdp: build the model on the meta device and give each rank only its shards (framework/parallel/meta_init.py).
    meta_init: bool = True


@dataclass
class LrFindConfig:
    """`python run.py lr_find` (framework/stages/lr_find.py): the LR range test's span, length, early stop and smoothing."""

    min_lr: float = 1.0e-6
    max_lr: float = 1.0
    num_steps: int = 100  # optimizer steps (each of accumulate_grad_batches micro-batches)
    early_stop_threshold: Optional[float] = 4.0  # stop once the smoothed loss passes this x its minimum; null: never
    # The loss's exponential moving average (bias-corrected). fastai's and Lightning's 0.98 spans half a 100-step test
    # and lags it: its lowest point came at the last step on the digits MLP (seed 3); docs/lr_find.md.
    smoothing: float = 0.95


@dataclass
class RootConfig:
    name: str = MISSING
    seed: int = 42
    resume: Optional[str] = None  # RUN_DIR, CHECKPOINT_DIR or auto
    # What the command does (LightningCLI's subcommands: `python run.py test ckpt=RUN_DIR`): fit, or validate, test
    # or predict the weights of `ckpt` (a run directory, its best else last; or a checkpoint directory), or lr_find
    # (the LR range test on this config: framework/stages/lr_find.py).
    stage: str = "fit"
    ckpt: Optional[str] = None
    predict_data: Any = None  # what `predict` runs over: data.predict, moved here (no DataModule argument)
    init_from: Optional[str] = None  # weights only (fine-tuning)
    init_strict: bool = True
    trust_saved_config: bool = False  # resume may build any _target_ the saved config names (a run you trust)
    # A resume whose data differs from what its run was first saved with (other shards, another split's size, the
    # config a split is made from: framework/data/module.py, check_data) is refused; true starts the next epoch, from
    # batch 0, on the new data instead, with the run's step count, weights and optimizer. This command line's own.
    resume_on_new_data: bool = False
    model: Any = MISSING
    data: Any = MISSING
    task: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    precision: Any = MISSING
    parallel: Any = MISSING
    checkpoint: Any = MISSING
    logger: Any = MISSING
    trainer: Any = MISSING
    callbacks: Any = field(default_factory=dict)  # name -> a _target_ node, or null (off)
    lr_find: LrFindConfig = field(default_factory=LrFindConfig)  # the lr_find stage's settings


def register() -> None:
    """Make the schemas visible to Hydra's defaults lists: `base_config` for the root, `<group>_schema` for each
    group (`- /trainer_schema` in conf/trainer/*.yaml). Not stored inside the groups: they are no options."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RootConfig)
    cs.store(name="trainer_schema", node=TrainerConfig)
    cs.store(name="logger_schema", node=LoggerConfig)
    cs.store(name="checkpoint_schema", node=CheckpointConfig)
    cs.store(name="precision_schema", node=PrecisionConfig)
    cs.store(name="parallel_schema", node=ParallelConfig)


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
        "there is no predict loop; python -m framework export writes a model to serve"
    ),
    "val_check_interval": Home("trainer.val_every_n_steps", "every N optimizer steps"),
    "check_val_every_n_epoch": Home("trainer.val_every_n_epochs"),
    "num_sanity_val_steps": _none("the pre-flight check runs one batch of each split and leaves no trace in the task"),
    "enable_checkpointing": _CHECKPOINTS_ON,
    "enable_progress_bar": Home("logger.progress_bar"),
    "enable_model_summary": Home("trainer.dry_run", "prints the model summary, then exits without training"),
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
    "model_registry": _none(
        "python -m framework export writes the weights; upload them with your registry's tool"
    ),
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
    "weights_summary": Home("trainer.dry_run", "prints the model summary, then exits without training"),
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


def _require(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as typed: true, not True
        raise ConfigError(f"{key}={shown}: expected {expected}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(key: str, value: object, low: int, *, null: bool = False, expected: str = "") -> None:
    """A whole number >= `low`, or null when `null`. The type is checked too: data.* has no schema."""
    if value is None and null:
        return
    _require(
        _is_int(value) and value >= low, key, value, expected or f"{'null or ' if null else ''}a whole number >= {low}"
    )


def _check_positive(key: str, value: Optional[float]) -> None:
    _require(value is None or (math.isfinite(value) and value > 0), key, value, "null or a finite number > 0")


def _check_limit(key: str, value: Union[int, float]) -> None:
    if isinstance(value, float):
        _require(0.0 < value <= 1.0, key, value, "a fraction in (0, 1] or a whole number of batches >= 1")
    else:
        _require(value >= 1, key, value, "a whole number of batches >= 1 or a fraction in (0, 1]")


# numpy's seed range and Lightning's; the data order seeds torch generators with seed + epoch, which stays in range.
SEED_RANGE = (0, 2**32 - 1)
DEVICE = re.compile(r"(cpu|cuda|mps)(:\d+)?")
# What torch.distributed.init_process_group takes: one backend, or one per device as "cpu:gloo,cuda:nccl".
DIST_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
# The DataModule's own counts (framework/data/module.py), checked here so a bad one fails before any dataset is
# loaded: (key, lowest value, null allowed). With num_workers=0, prefetch_factor and persistent_workers are
# ignored rather than refused (as torch's DataLoader would), so `data=mnist data.num_workers=0` just works.
DATA_COUNTS = (
    ("batch_size", 1, False),
    ("eval_batch_size", 1, True),
    ("num_workers", 0, False),
    ("prefetch_factor", 1, True),
    ("num_classes", 1, True),
    ("shuffle_buffer", 1, False),  # a streaming split's shuffle window (framework/data/streaming.py)
)


def validate(cfg: DictConfig) -> None:
    """Every value of the framework's own groups, the root's and the DataModule's counts against its range,
    and the checks that need more than one field; types were checked when composing. Runs once, before
    anything is built."""
    check_closed_keys(cfg)
    _check_trainer(cfg.trainer)
    _require(
        cfg.logger.progress_every_s > 0,
        "logger.progress_every_s",
        cfg.logger.progress_every_s,
        "a number of seconds > 0",
    )
    _require(
        cfg.logger.wandb.mode in WANDB_MODES,
        "logger.wandb.mode",
        cfg.logger.wandb.mode,
        f"one of {', '.join(WANDB_MODES)} (offline writes files under the run directory for `wandb sync`)",
    )
    _check_trackers_installed(cfg.logger)
    _check_callbacks(cfg.get("callbacks", DictConfig({})))
    _check_checkpoint(cfg.checkpoint, cfg.data)
    _check_test_ckpt(cfg.trainer.test_ckpt, cfg.checkpoint, cfg.data)
    _check_parallel(cfg.parallel, cfg.trainer.device, cfg.trainer, cfg.precision)
    low, high = SEED_RANGE
    _require(_is_int(cfg.seed) and low <= cfg.seed <= high, "seed", cfg.seed, f"a whole number in {low}..{high}")
    if isinstance(cfg.data, DictConfig):
        _check_data(cfg.data)
    _check_hardware(cfg.trainer.device, cfg.parallel)
    check_stage(cfg)


def _check_trackers_installed(logger: DictConfig) -> None:
    """A chosen tracker whose package is missing is refused before the run starts (imported only when used)."""
    from framework.observe.trackers import PACKAGES

    for name, package in PACKAGES.items():
        if OmegaConf.select(logger, f"{name}.enabled") and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"logger={name}: the {package} package is not installed; expected it installed "
                f"(pip install 'hydra-torch-framework[trackers]', or pip install {package}), or logger={name} "
                "left out of the logger list"
            )


STAGES = ("fit", "validate", "test", "predict", "lr_find")


def check_stage(cfg: DictConfig) -> None:
    """fit trains (resume= continues a run); validate, test and predict evaluate the weights of ckpt=; lr_find
    runs the LR range test from the config's own start (init_from's weights, if any)."""
    stage = cfg.get("stage", "fit")
    _require(stage in STAGES, "stage", stage, f"one of {', '.join(STAGES)} (the first word: python run.py test ...)")
    if stage == "lr_find":
        _check_lr_find(cfg)
        return
    if stage == "fit":
        _require(
            cfg.get("ckpt") is None,
            "ckpt",
            cfg.get("ckpt"),
            "null for fit (resume=RUN_DIR continues a run, init_from=PATH starts one from its weights), or "
            "validate/test/predict as the first word to evaluate it",
        )
        return
    if cfg.get("ckpt") is None:
        raise ConfigError(
            f"{stage}: ckpt is not set; expected the run directory or checkpoint directory whose weights to "
            f"{stage}, e.g. python run.py {stage} ckpt=outputs/NAME/TIME"
        )
    _require(
        not cfg.resume, "resume", cfg.resume, f"null with {stage} (resume= continues training; ckpt= names the weights)"
    )


def _check_lr_find(cfg: DictConfig) -> None:
    s = cfg.lr_find
    _require(not cfg.get("ckpt"), "ckpt", cfg.get("ckpt"), "null with lr_find (it starts from the config's weights)")
    _require(  # auto: a sweep job's own directory (an lr_find there is run again, from the start)
        cfg.resume in (None, "auto"),
        "resume",
        cfg.resume,
        "null with lr_find (it starts from the config's weights; init_from=PATH starts from a checkpoint's)",
    )
    _require(s.min_lr > 0 and math.isfinite(s.min_lr), "lr_find.min_lr", s.min_lr, "a learning rate > 0")
    _require(
        math.isfinite(s.max_lr) and s.max_lr > s.min_lr,
        "lr_find.max_lr",
        s.max_lr,
        f"a learning rate > lr_find.min_lr={s.min_lr!r}",  # the other end named: either may be the mistake
    )
    _require(s.num_steps >= 2, "lr_find.num_steps", s.num_steps, "a number of optimizer steps >= 2")
    _require(
        s.early_stop_threshold is None or s.early_stop_threshold > 1,
        "lr_find.early_stop_threshold",
        s.early_stop_threshold,
        "null (never stop early) or a factor > 1 of the lowest loss",
    )
    _require(0 <= s.smoothing < 1, "lr_find.smoothing", s.smoothing, "a factor in [0, 1) (0: no smoothing)")
    lr = OmegaConf.select(cfg, "optimizer.lr")
    _require(
        isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0,
        "optimizer.lr",
        lr,
        "a learning rate > 0: lr_find scales each parameter group's lr by lr_find's lr / optimizer.lr",
    )


def _check_trainer(t: DictConfig) -> None:
    _require(t.predict_chunk_rows >= 1, "trainer.predict_chunk_rows", t.predict_chunk_rows, "a number of rows >= 1")
    _require(t.max_steps == -1 or t.max_steps >= 1, "trainer.max_steps", t.max_steps, "-1 (no limit) or >= 1")
    _require(
        t.max_epochs >= 1 or (t.max_steps >= 1 and t.max_epochs >= -1),
        "trainer.max_epochs",
        t.max_epochs,
        ">= 1 (or -1 or 0 with trainer.max_steps >= 1, which then alone decides the length)",
    )
    _check_int("trainer.min_epochs", t.min_epochs, 0)
    _check_int("trainer.min_steps", t.min_steps, 0)
    if t.max_steps >= 1:  # the run ends at max_steps, before a longer minimum could be reached
        _require(
            t.min_steps <= t.max_steps,
            "trainer.min_steps",
            t.min_steps,
            f"<= trainer.max_steps ({t.max_steps}), which ends the run first",
        )
    else:
        _require(
            t.min_epochs <= t.max_epochs,
            "trainer.min_epochs",
            t.min_epochs,
            f"<= trainer.max_epochs ({t.max_epochs}), which ends the run first",
        )
    _require(t.val_every_n_epochs >= 1, "trainer.val_every_n_epochs", t.val_every_n_epochs, ">= 1")
    _require(
        t.val_every_n_steps >= 0, "trainer.val_every_n_steps", t.val_every_n_steps, ">= 0 (0: validate by epoch only)"
    )
    if t.max_time is not None:
        _require(
            parse_duration(t.max_time) is not None,
            "trainer.max_time",
            t.max_time,
            "a duration DD:HH:MM:SS (e.g. 00:12:00:00, or HH:MM:SS) or a number of seconds > 0",
        )
    _require(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", t.log_every_n_steps, ">= 1")
    _require(t.accumulate_grad_batches >= 1, "trainer.accumulate_grad_batches", t.accumulate_grad_batches, ">= 1")
    _check_positive("trainer.grad_clip_norm", t.grad_clip_norm)
    _check_positive("trainer.grad_clip_value", t.grad_clip_value)
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        _check_limit(f"trainer.{key}", t[key])
    _check_overfit(t)
    _check_profiler(t)
    _require(
        t.device == "auto" or DEVICE.fullmatch(t.device) is not None,
        "trainer.device",
        t.device,
        "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'",
    )


def _check_profiler(t: DictConfig) -> None:
    _require(
        t.profiler is None or t.profiler in ("simple", "pytorch"),
        "trainer.profiler",
        t.profiler,
        "null (off), simple (time per phase) or pytorch (a torch.profiler trace)",
    )
    s = t.profiler_schedule
    _check_int("trainer.profiler_schedule.wait", s.wait, 0)
    _check_int("trainer.profiler_schedule.warmup", s.warmup, 0)
    _check_int("trainer.profiler_schedule.active", s.active, 1)
    _require(
        math.isfinite(t.profiler_max_mb) and t.profiler_max_mb > 0,
        "trainer.profiler_max_mb",
        t.profiler_max_mb,
        "a size in MB > 0 (each rank's trace is cut to it)",
    )


def _check_overfit(t: DictConfig) -> None:
    """Lightning's overfit_batches, except that it does not silently override limit_train/val_batches: it
    chooses both, so a limit set beside it is a contradiction (limit_test_batches still applies)."""
    n = t.overfit_batches
    _require(
        0.0 <= n <= 1.0 if isinstance(n, float) else n >= 0,
        "trainer.overfit_batches",
        n,
        "0 (off), a whole number of batches >= 1 or a fraction in (0, 1]",
    )
    if n == 0:
        return
    for key in ("limit_train_batches", "limit_val_batches"):
        limit = t[key]
        _require(
            isinstance(limit, float) and limit == 1.0,
            f"trainer.{key}",
            limit,
            f"1.0 with trainer.overfit_batches={n} (which picks the train and validation batches itself), "
            "or trainer.overfit_batches=0",
        )


TEST_CKPTS = ("best", "last", None)


def _check_test_ckpt(test_ckpt: Optional[str], ck: DictConfig, data: Any) -> None:
    """`best` needs a best checkpoint: a validation split to rank by and a top-k checkpoint that keeps it."""
    _require(
        test_ckpt in TEST_CKPTS,
        "trainer.test_ckpt",
        test_ckpt,
        "best, last or null (best when a top-k checkpoint is kept, else the final weights)",
    )
    if test_ckpt != "best":
        return
    _require(
        not isinstance(data, DictConfig) or data.get("val") is not None,
        "trainer.test_ckpt",
        test_ckpt,
        "last with data.val=null (nothing is validated, so no checkpoint is best), or a data.val split",
    )
    # With save_top_k >= 1 (or -1), _check_checkpoint made sure a monitor ranks them.
    _require(
        ck.save_top_k != 0,
        "trainer.test_ckpt",
        test_ckpt,
        f"a best checkpoint to test, which checkpoint.save_top_k=0 never keeps: set checkpoint.monitor="
        f"{ck.monitor or 'val/acc'} checkpoint.save_top_k=1, or trainer.test_ckpt=last",
    )


def parse_duration(value: Any) -> Optional[float]:
    """Lightning's max_time as seconds: "DD:HH:MM:SS" (or "HH:MM:SS", "MM:SS"), or a number of seconds; None when
    it is neither, or not > 0."""
    text = str(value).strip() if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    elif re.fullmatch(r"\d+(:\d+){1,3}", text):
        parts = [int(p) for p in text.split(":")]
        seconds = float(sum(p * unit for p, unit in zip(reversed(parts), (1, 60, 3600, 86400))))
    else:
        return None
    return seconds if 0 < seconds < math.inf else None


def _check_callbacks(callbacks: Any) -> None:
    """A dict of callback nodes: each a node with a _target_, or null (turned off)."""
    _require(
        isinstance(callbacks, DictConfig),
        "callbacks",
        callbacks,
        "a dict of name: {_target_: ...} (e.g. callbacks=default, or callbacks=none)",
    )
    for name, node in callbacks.items_ex(resolve=False):
        if node is None:
            continue
        _require(
            isinstance(node, DictConfig) and "_target_" in node,
            f"callbacks.{name}",
            node,
            "a node with a _target_ (a framework.callbacks.base.Callback subclass), or null to turn it off",
        )


def _check_checkpoint(ck: DictConfig, data: Any) -> None:
    for i, name in enumerate(ck.signals):
        _require(
            parse_signal(name) is not None,
            f"checkpoint.signals[{i}]",
            name,
            "a signal name such as SIGTERM, SIGUSR1 or USR2",
        )
    _require(
        ck.requeue in ("auto", True, False),
        "checkpoint.requeue",
        ck.requeue,
        "auto (requeue under SLURM or submitit), true or false",
    )
    _require(ck.every_n_steps >= 0, "checkpoint.every_n_steps", ck.every_n_steps, ">= 0 (0: never)")
    _require(ck.every_n_epochs >= 0, "checkpoint.every_n_epochs", ck.every_n_epochs, ">= 0 (0: never)")
    _require(ck.keep_last >= -1, "checkpoint.keep_last", ck.keep_last, ">= 0, or -1 to keep them all")
    _require(ck.save_top_k >= -1, "checkpoint.save_top_k", ck.save_top_k, ">= 0, or -1 to keep them all")
    if ck.save_top_k == 0:  # a monitor alone is fine: it also names a sweep's objective
        return
    _require(
        ck.monitor is not None,
        "checkpoint.save_top_k",
        ck.save_top_k,
        "0 with checkpoint.monitor=null, or a metric to rank by: checkpoint.monitor=val/loss (or val/acc)",
    )
    _require(
        ck.monitor.startswith("val/") and len(ck.monitor) > len("val/"),
        "checkpoint.monitor",
        ck.monitor,
        "a validation metric 'val/<name>' to rank checkpoints by, e.g. val/loss or val/acc",
    )
    _require(
        not isinstance(data, DictConfig) or data.get("val") is not None,
        "checkpoint.save_top_k",
        ck.save_top_k,
        f"0 when data.val=null (nothing computes {ck.monitor}), or a data.val split",
    )


def _check_parallel(p: DictConfig, device: str, trainer: DictConfig, precision: DictConfig) -> None:
    _check_processes(p, device)
    _check_fsdp(p, trainer, precision)
    _check_activation_checkpointing(p)
    _require(
        not (p.strategy == StrategyName.dp and trainer.compile),
        "trainer.compile",
        trainer.compile,
        "false with parallel=dp (DataParallel's replicas would all run the compiled module of cuda:0), "
        "or parallel=ddp to compile",
    )


def _check_processes(p: DictConfig, device: str) -> None:
    """The options of the strategies that start processes (ddp, fsdp), at their defaults under the others."""
    processes = p.strategy in PROCESS_STRATEGIES
    strategy = getattr(p.strategy, "value", p.strategy)
    _require(
        p.devices is None or p.devices >= 1,
        "parallel.devices",
        p.devices,
        "null (one process per GPU, or 2 on CPU) or a number of processes >= 1",
    )
    _require(
        p.devices is None or processes,
        "parallel.devices",
        p.devices,
        f"null with parallel={strategy} (only parallel=ddp and parallel=fsdp start processes), or parallel=ddp",
    )
    if p.backend is not None:
        _require(
            _backends(p.backend) is not None,
            "parallel.backend",
            p.backend,
            f"null (nccl on CUDA, gloo on CPU), one of {', '.join(DIST_BACKENDS)}, or one per device "
            "as cpu:gloo,cuda:nccl",
        )
        _require(processes, "parallel.backend", p.backend, f"null with parallel={strategy}, or parallel=ddp")
    for key in ("find_unused_parameters", "static_graph"):  # DDP's own options
        _require(
            p.strategy == StrategyName.ddp or not p[key],
            f"parallel.{key}",
            p[key],
            f"false with parallel={strategy}, or parallel=ddp",
        )
    longest = int(timedelta.max.total_seconds())
    _require(1 <= p.timeout_s <= longest, "parallel.timeout_s", p.timeout_s, f"a number of seconds in 1..{longest}")
    _require(
        not (processes and device.startswith("cuda")),
        "trainer.device",
        device,
        f"'auto' with parallel={strategy} (each process takes the GPU of its local rank), or 'cpu'",
    )


def _check_fsdp(p: DictConfig, trainer: DictConfig, precision: DictConfig) -> None:
    """FSDP's own options, at their defaults under any other strategy, and what FSDP does not take."""
    fsdp = p.strategy == StrategyName.fsdp
    strategy = getattr(p.strategy, "value", p.strategy)
    _require(
        fsdp or p.shard_modules is None,
        "parallel.shard_modules",
        _listed(p.shard_modules),
        f"null with parallel={strategy}, or parallel=fsdp",
    )
    _require(
        fsdp or p.reshard_after_forward,
        "parallel.reshard_after_forward",
        p.reshard_after_forward,
        f"true with parallel={strategy}, or parallel=fsdp",
    )
    _require(
        fsdp or not p.cpu_offload,
        "parallel.cpu_offload",
        p.cpu_offload,
        f"false with parallel={strategy}, or parallel=fsdp",
    )
    _require(
        fsdp or p.get("meta_init", True),
        "parallel.meta_init",
        p.get("meta_init"),
        f"true with parallel={strategy}, or parallel=fsdp",
    )
    for i, name in enumerate(p.shard_modules or []):
        _require(
            re.fullmatch(r"[A-Za-z_][\w.]*", name) is not None,
            f"parallel.shard_modules[{i}]",
            name,
            "the dotted path of an nn.Module class, e.g. torch.nn.TransformerEncoderLayer",
        )
    if fsdp:
        mode = getattr(precision.mode, "value", precision.mode)
        _require(
            mode != "fp16",
            "precision.mode",
            mode,
            "fp32 or bf16 with parallel=fsdp (FSDP computes in bf16 with fp32 master weights and reductions; "
            "fp16's GradScaler does not see gradients sharded over ranks)",
        )


def _check_activation_checkpointing(p: DictConfig) -> None:
    mode, names = p.get("activation_checkpointing", "none"), p.get("activation_checkpointing_modules")
    _require(
        mode in ("none", "full", "selective"),
        "parallel.activation_checkpointing",
        mode,
        "none, full (every block, or shard unit under fsdp) or selective (the classes in "
        "parallel.activation_checkpointing_modules)",
    )
    _require(
        (mode == "selective") == bool(names),
        "parallel.activation_checkpointing_modules",
        _listed(names),
        "a non-empty list of module classes with parallel.activation_checkpointing=selective, e.g. "
        "[torch.nn.TransformerEncoderLayer], and null with none or full",
    )
    for i, name in enumerate(names or []):
        _require(
            re.fullmatch(r"[A-Za-z_][\w.]*", name) is not None,
            f"parallel.activation_checkpointing_modules[{i}]",
            name,
            "the dotted path of an nn.Module class, e.g. torch.nn.TransformerEncoderLayer",
        )


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, ListConfig) else value


def _backends(value: str) -> Optional[list[str]]:
    """The backend names in a `parallel.backend` (`gloo`, `cpu:gloo,cuda:nccl`), or None when it is malformed."""
    names = []
    for part in value.split(","):
        device, _, name = part.rpartition(":")
        if name not in DIST_BACKENDS or device not in ("", "cpu", "cuda"):
            return None
        names.append(name)
    return names


def _check_data(data: DictConfig) -> None:
    _require(
        "train" not in data or data.train is not None,
        "data.train",
        None,
        "a dataset node (with _target_): every run trains on data.train",
    )
    for name, low, null in DATA_COUNTS:
        if name in data:
            _check_int(f"data.{name}", data[name], low, null=null)
    shape = data.get("input_shape")
    _require(
        shape is None
        or (isinstance(shape, ListConfig) and len(shape) > 0 and all(_is_int(size) and size >= 1 for size in shape)),
        "data.input_shape",
        list(shape) if isinstance(shape, ListConfig) else shape,
        "null or the shape of one sample, sizes >= 1, e.g. [1, 28, 28]",
    )


def _check_hardware(device: str, p: DictConfig) -> None:
    """What this machine has, for settings that name hardware (a GPU, a number of GPUs, a backend). torch is
    imported only for them: `auto` and `cpu` need no check, so most bad configs still fail before it loads."""
    ddp = p.strategy in PROCESS_STRATEGIES
    if device in ("auto", "cpu") and not (ddp and (p.devices is not None or p.backend is not None)):
        return
    import torch

    def refuse(key: str, value: object, problem: str, expected: str) -> None:
        raise ConfigError(f"{key}={value!r}: {problem}; expected {expected}")

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind, _, index = device.partition(":")
    if kind == "cuda" and gpus == 0:
        refuse("trainer.device", device, "no CUDA device is visible", "'auto' or 'cpu'")
    if kind == "cuda" and index and int(index) >= gpus:
        refuse(
            "trainer.device",
            device,
            f"{gpus} CUDA device{'s are' if gpus > 1 else ' is'} visible",
            f"one of cuda:0..cuda:{gpus - 1}, 'cuda' or 'auto'",
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        refuse("trainer.device", device, "MPS is not available", "'auto' or 'cpu'")
    on_cuda = gpus > 0 and kind in ("auto", "cuda")
    if ddp and on_cuda and p.devices is not None and p.devices > gpus:
        refuse(
            "parallel.devices",
            p.devices,
            f"{gpus} CUDA device{'s are' if gpus > 1 else ' is'} visible",
            f"at most {gpus}, one process per device (or trainer.device=cpu for processes on the CPU)",
        )
    if ddp and p.backend is not None:
        import torch.distributed as dist

        backends = _backends(p.backend)
        assert backends is not None  # _check_parallel refused a malformed one
        for name in backends:
            if not (dist.is_available() and dist.is_backend_available(name)):
                refuse("parallel.backend", p.backend, f"this torch build has no {name} backend", "gloo, or null")
        if not on_cuda and "nccl" in backends:  # even as cuda:nccl: the group is made at start
            refuse(
                "parallel.backend", p.backend, "nccl needs CUDA, and these processes run on the CPU", "gloo, or null"
            )


# ---------------------------------------------------------------------------------------------- interpolations
# A checkpoint saves the config resolved (what the run used) and, beside it, the nodes that were written as references
# to other keys (`data.train.shards: ${data.train_shards}`), so that a resume setting such a key re-derives the nodes
# made from it (framework/app/resume.py). Only plain references are kept: what a resolver gave (`${now:...}`,
# `${oc.env:...}`, `${hydra:...}`) stays what it was when the run started, and a `_target_` (code) is never derived.
_REFERENCE = re.compile(r"\$\{(\.*[\w-]+(?:\.[\w-]+|\[\d+\])*)\}")


def nodes(container: Container, key: str = "") -> Iterator[tuple[str, Container, Any]]:
    """Every node under `container` as (full key, parent, name in parent), without resolving anything."""
    names: Iterable[Any] = (
        range(len(container)) if isinstance(container, ListConfig) else cast(DictConfig, container).keys()
    )
    for name in names:
        full_key = f"{key}[{name}]" if isinstance(container, ListConfig) else f"{key}.{name}" if key else str(name)
        yield full_key, container, name
        if not (OmegaConf.is_missing(container, name) or OmegaConf.is_interpolation(container, name)):
            child = container[name]  # neither missing nor an interpolation: reading it resolves nothing
            if isinstance(child, Container):
                yield from nodes(child, full_key)


def _parent(key: str) -> str:
    return key[: key.rindex("[")] if key.endswith("]") else key.rpartition(".")[0]


def references(written: str, key: str) -> Optional[list[str]]:
    """The full keys that a value written as `written` at `key` refers to, when it does nothing but refer to other
    keys (`${data.root}`, `${data.root}/train`, `${..lr}`); None when it calls a resolver, escapes `\\${` or refers
    to nothing."""
    if "\\${" in written:
        return None
    found = _REFERENCE.findall(written)
    if not found or "${" in _REFERENCE.sub("", written):
        return None
    keys = []
    for ref in found:
        dots = len(ref) - len(ref.lstrip("."))
        base = key
        for _ in range(dots):  # `${.x}` is a sibling of the node, each further dot one level up
            base = _parent(base)
        keys.append(f"{base}.{ref[dots:]}" if dots and base else ref[dots:])
    return keys


def _written(parent: Container, name: Any) -> Any:
    """A node as written: `${...}` unresolved."""
    return cast(Any, OmegaConf.to_container(parent, resolve=False))[name]


def interpolations(cfg: Container) -> dict[str, str]:
    """Every node of `cfg` written as plain references to other keys (see `references`), by full key, as written."""
    found = {}
    for key, parent, name in nodes(cfg):
        if name != "_target_" and OmegaConf.is_interpolation(parent, name):
            written = _written(parent, name)
            if isinstance(written, str) and references(written, key) is not None:
                found[key] = written
    return found


def resolve_calls(cfg: DictConfig) -> None:
    """Resolve in place every interpolation that calls a resolver, keeping plain references to other keys: the
    config a spawned worker gets, which has no HydraConfig for `${hydra:...}` (and must not read `${now:...}`
    again), and whose checkpoints record the references as a run in this process does."""
    for key, parent, name in list(nodes(cfg)):
        if OmegaConf.is_interpolation(parent, name):
            written = _written(parent, name)
            if not (isinstance(written, str) and references(written, key) is not None):
                value = parent[name]
                parent[name] = OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf of a plain dict (lists are leaves)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def sources(cfg: DictConfig, key: str) -> dict[str, Any]:
    """What the node at `key` is made from, resolved, by full key: its leaves and those of every key its references
    reach, at any depth (`data.train_shards` for `data.train`, whose `shards` is `${data.train_shards}`)."""
    written = interpolations(cfg)
    reached = [key]
    for at in reached:  # grows as references are found
        for node_key, text in written.items():
            if node_key == at or node_key.startswith((f"{at}.", f"{at}[")):
                reached += [ref for ref in references(text, node_key) or () if ref not in reached]
    found: dict[str, Any] = {}
    for at in reached:
        value = OmegaConf.select(cfg, at)
        if isinstance(value, Container):
            found.update(leaves(OmegaConf.to_container(value, resolve=True, enum_to_str=True), at))
        else:
            found[at] = value.name if isinstance(value, Enum) else value
    return found
