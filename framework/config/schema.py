"""Structured-config schemas for the groups whose shape the framework owns.

Registered with Hydra's ConfigStore so a typo or a wrong type is rejected while the config is composed,
before anything runs. Group YAML files start with `defaults: [/trainer_schema, _self_]` (and so on) to pick these
up; the schemas sit at the root of the store, so `--help` lists no `schema` option.
What a type cannot express (the valid range of every value, checks across fields, the DataModule's counts,
the hardware a setting names) lives in framework/config/validate.py, called once by the app before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from omegaconf import MISSING

from framework.core.signals import DEFAULT_SIGNALS


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
    # Lightning's enable_model_summary: a table of the task's parameters by module at the start of every fit, its
    # rows model_summary_max_depth levels down (Lightning's ModelSummary(max_depth); -1: every leaf module)
    enable_model_summary: bool = True
    model_summary_max_depth: int = 1
    test: bool = True
    # Which weights fit's test uses (Lightning's ckpt_path): best, last, or null (best when a monitored top-k
    # checkpoint is kept, else the final weights).
    test_ckpt: Optional[str] = None
    predict_chunk_rows: int = 4096  # `predict`: rows a rank writes at a time (a killed predict keeps whole chunks)
    detect_anomaly: bool = False  # torch.autograd's anomaly mode: the op that made a NaN/inf gradient, named
    deterministic: bool = False
    compile: bool = False
    device: str = "auto"
    # glibc malloc with fixed thresholds, so a step's freed tensors serve the next step
    # (framework/parallel/allocator.py)
    malloc_tuning: bool = True
    # Where the time goes (framework/observe/profiler.py): null, simple (a table of time per phase at the end) or
    # pytorch (a torch.profiler trace of profiler_schedule's steps per rank, under RUN_DIR/profiler/, cut to
    # profiler_max_mb).
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
    # The backends: `logger=[tensorboard,csv,mlflow]` turns several on (framework/observe/trackers.py). Each one's node
    # is always there, so setting a key of one not chosen is no composition error (it stays off).
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
    # A URL (s3://bucket/prefix, any scheme fsspec knows) that every kept checkpoint and the run's records are
    # uploaded to, in the background (framework/checkpoint/mirror.py); null: local only.
    remote: Optional[str] = None
    # fsspec's storage options for it (s3fs: endpoint_url, client_kwargs, config_kwargs; others with `+`); never a
    # secret. A null is left out (endpoint_url: null is botocore's, from AWS_ENDPOINT_URL or AWS's own).
    remote_options: dict[str, Any] = field(default_factory=lambda: {"endpoint_url": None})


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
    # parallel=fsdp: build the model on the meta device and give each rank only its shards
    # (framework/parallel/meta_init.py).
    meta_init: bool = True


@dataclass
class LrFindConfig:
    """`python run.py lr_find` (framework/stages/lr_find.py): the LR range test's span, length, early stop and
    smoothing."""

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
    group (`- /trainer_schema` in conf/trainer/*.yaml). Not stored inside the groups: they are no options. Once per
    process: storing converts each dataclass to a config again (~15 ms), and the API registers before every run."""
    cs = ConfigStore.instance()
    if cs.get_type("parallel_schema.yaml") is ObjectType.CONFIG:  # stored last, below
        return
    cs.store(name="base_config", node=RootConfig)
    cs.store(name="trainer_schema", node=TrainerConfig)
    cs.store(name="logger_schema", node=LoggerConfig)
    cs.store(name="checkpoint_schema", node=CheckpointConfig)
    cs.store(name="precision_schema", node=PrecisionConfig)
    cs.store(name="parallel_schema", node=ParallelConfig)
