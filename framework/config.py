"""Structured-config schemas for the groups whose shape the framework owns.

Registered with Hydra's ConfigStore so a typo or a wrong type is rejected while the config is composed,
before anything runs. Group YAML files start with `defaults: [schema, _self_]` to pick these up.
Cross-field checks that a type cannot express live in `validate()`, called once by the app.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from framework.errors import ConfigError


@dataclass
class TrainerConfig:
    max_epochs: int = 20
    max_steps: int = -1  # optimizer steps; -1 means "no limit" (Lightning's convention)
    val_every_n_epochs: int = 1
    log_every_n_steps: int = 50
    accumulate_grad_batches: int = 1
    grad_clip_norm: Optional[float] = None
    grad_clip_value: Optional[float] = None
    # An int is a number of batches, a float a fraction of the epoch (as in Lightning).
    limit_train_batches: Union[int, float] = 1.0
    limit_val_batches: Union[int, float] = 1.0
    limit_test_batches: Union[int, float] = 1.0
    fast_dev_run: bool = False
    dry_run: bool = False
    test: bool = True
    deterministic: bool = False
    compile: bool = False
    device: str = "auto"


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    progress_bar: bool = True


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


@dataclass
class ParallelConfig:
    strategy: StrategyName = StrategyName.single
    devices: Optional[int] = None
    backend: Optional[str] = None
    find_unused_parameters: bool = False
    static_graph: bool = False
    timeout_s: int = 1800


@dataclass
class RootConfig:
    name: str = MISSING
    seed: int = 42
    resume: Optional[str] = None  # RUN_DIR, CHECKPOINT_DIR or auto
    init_from: Optional[str] = None  # weights only (fine-tuning)
    init_strict: bool = True
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


def register() -> None:
    """Make the schemas visible to Hydra's defaults lists (`schema` inside each group, `base_config` at the root)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RootConfig)
    cs.store(group="trainer", name="schema", node=TrainerConfig)
    cs.store(group="logger", name="schema", node=LoggerConfig)
    cs.store(group="checkpoint", name="schema", node=CheckpointConfig)
    cs.store(group="precision", name="schema", node=PrecisionConfig)
    cs.store(group="parallel", name="schema", node=ParallelConfig)


# The groups whose every key the framework defines: a key they do not define is an error (even with `+`).
CLOSED_GROUPS = {"trainer": TrainerConfig, "logger": LoggerConfig, "checkpoint": CheckpointConfig,
                 "precision": PrecisionConfig, "parallel": ParallelConfig}

# Lightning's names (Trainer and ModelCheckpoint arguments) and their homes here, for "did you mean" hints.
LIGHTNING_NAMES = {
    "check_val_every_n_epoch": "trainer.val_every_n_epochs",
    "val_check_interval": "trainer.val_every_n_epochs",
    "gradient_clip_val": "trainer.grad_clip_norm",
    "gradient_clip_algorithm": "trainer.grad_clip_norm",
    "max_epoch": "trainer.max_epochs",
    "epochs": "trainer.max_epochs",
    "max_step": "trainer.max_steps",
    "limit_train_batch": "trainer.limit_train_batches",
    "limit_val_batch": "trainer.limit_val_batches",
    "limit_test_batch": "trainer.limit_test_batches",
    "accumulate_grad_batch": "trainer.accumulate_grad_batches",
    "log_every_n_step": "trainer.log_every_n_steps",
    "accelerator": "trainer.device",
    "devices": "parallel.devices",
    "num_nodes": "parallel.devices",
    "strategy": "parallel.strategy",
    "sync_batchnorm": "parallel.strategy",
    "precision": "precision.mode",
    "enable_progress_bar": "logger.progress_bar",
    "enable_checkpointing": "checkpoint.save_last",
    "default_root_dir": "hydra.run.dir",
    "dirpath": "hydra.run.dir",
    "every_n_train_steps": "checkpoint.every_n_steps",
    "every_n_step": "checkpoint.every_n_steps",
    "every_n_epoch": "checkpoint.every_n_epochs",
    "save_top_n": "checkpoint.save_top_k",
    "top_k": "checkpoint.save_top_k",
    "save_on_train_epoch_end": "checkpoint.every_n_epochs",
    "seed_everything": "seed",
    "ckpt_path": "resume",
    "resume_from_checkpoint": "resume",
}


def _keys_of(group: str) -> list[str]:
    schema = CLOSED_GROUPS.get(group, RootConfig if group == "" else None)
    return [f.name for f in fields(schema)] if schema is not None else []


def suggest_key(dotted: str) -> Optional[str]:
    """The real key closest to a wrong one, as a full dotted key: Lightning's name for it first
    (`trainer.check_val_every_n_epoch` -> `trainer.val_every_n_epochs`), else the closest spelling in its
    group (`trainer.max_epoch` -> `trainer.max_epochs`), else None."""
    group, _, name = dotted.rpartition(".")
    if name in LIGHTNING_NAMES:
        return LIGHTNING_NAMES[name]
    close = difflib.get_close_matches(name, _keys_of(group), n=1, cutoff=0.6)
    if close:
        return f"{group}.{close[0]}" if group else close[0]
    # A key of another framework group typed under the wrong one (trainer.save_top_k).
    for other in CLOSED_GROUPS:
        if name in _keys_of(other):
            return f"{other}.{name}"
    return None


def check_closed_keys(cfg: DictConfig) -> None:
    """A key the framework does not define in one of its own groups is a mistake, even when added with `+`
    (Hydra lets `+trainer.max_epoch=1` through): name it, with the closest real key."""
    for group in ("", *CLOSED_GROUPS):
        node = cfg.get(group) if group else cfg
        if not isinstance(node, DictConfig):
            continue
        known = set(_keys_of(group))
        for name in node:
            if name not in known:
                key = f"{group}.{name}" if group else str(name)
                hint = suggest_key(key)
                raise ConfigError(f"{key}={node._get_node(name)._value()!r}: {group or 'the root config'} has no "
                                  f"key '{name}'; {f'did you mean {hint}? ' if hint else ''}expected one of: "
                                  f"{', '.join(sorted(known))}")


def _require(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


def _check_limit(key: str, value: Union[int, float]) -> None:
    if isinstance(value, float):
        _require(0.0 < value <= 1.0, key, value, "a fraction in (0, 1] or a whole number of batches >= 1")
    else:
        _require(value >= 1, key, value, "a whole number of batches >= 1 or a fraction in (0, 1]")


def validate(cfg: DictConfig) -> None:
    """Checks that need more than one field or a range; types were already checked when composing."""
    check_closed_keys(cfg)
    t = cfg.trainer
    _require(t.max_epochs >= 1 or t.max_steps >= 1, "trainer.max_epochs", t.max_epochs,
             ">= 1 (or set trainer.max_steps >= 1)")
    _require(t.max_steps == -1 or t.max_steps >= 1, "trainer.max_steps", t.max_steps, "-1 (no limit) or >= 1")
    _require(t.val_every_n_epochs >= 1, "trainer.val_every_n_epochs", t.val_every_n_epochs, ">= 1")
    _require(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", t.log_every_n_steps, ">= 1")
    _require(t.accumulate_grad_batches >= 1, "trainer.accumulate_grad_batches", t.accumulate_grad_batches, ">= 1")
    for key in ("grad_clip_norm", "grad_clip_value"):
        value = t[key]
        _require(value is None or value > 0, f"trainer.{key}", value, "null or a positive number")
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        _check_limit(f"trainer.{key}", t[key])
    _require(t.device == "auto" or t.device.split(":")[0] in ("cpu", "cuda", "mps"), "trainer.device", t.device,
             "'auto', 'cpu', 'cuda' or 'cuda:N'")
