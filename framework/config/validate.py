"""What a type cannot express, checked once by the app before anything is built: the valid range of every value,
checks across fields, the DataModule's counts, the stage's keys and the hardware a setting names. A mistake is one
ConfigError naming the key, the value and what was expected."""

from __future__ import annotations

import importlib.util
import math
import re
from datetime import timedelta
from typing import Any, Optional, TypeGuard, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.config.hints import check_closed_keys
from framework.config.schema import PROCESS_STRATEGIES, WANDB_MODES, StrategyName
from framework.core.errors import ConfigError
from framework.core.signals import parse as parse_signal

# The logger group's backends that need a package of their own (the `trackers` extra installs them).
TRACKER_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


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
    for name, package in TRACKER_PACKAGES.items():
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
    if OmegaConf.select(cfg, "optimizer._target_") is None:
        named = ", ".join(str(k) for k in cfg.optimizer)
        raise ConfigError(
            f"lr_find: the run has named optimizers ({named}); expected one optimizer (optimizer._target_), "
            "whose learning rate lr_find sweeps"
        )
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
    _require(
        t.model_summary_max_depth == -1 or t.model_summary_max_depth >= 1,
        "trainer.model_summary_max_depth",
        t.model_summary_max_depth,
        ">= 1 (1: the task's children) or -1 (every leaf module); trainer.enable_model_summary=false turns it off",
    )
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


SET_NAME = re.compile(r"[A-Za-z0-9_-]+")  # one path component of a metric name: val/loss/<set>


def _check_sets(data: DictConfig) -> None:
    """data.val_sets / data.test_sets: more validation and test sets beside data.val / data.test (the default set), by
    name, each a dataset node or null (off); a name is the suffix of the set's metric names (docs/logging.md)."""
    for split in ("val", "test"):
        key = f"{split}_sets"
        named = data.get(key)
        if named is None:
            continue
        example = f"data.{key}: {{noisy: {{_target_: ...}}}}"
        _require(
            isinstance(named, DictConfig), f"data.{key}", named, f"a mapping of set name to dataset, e.g. {example}"
        )
        for name in named:
            _require(
                isinstance(name, str) and SET_NAME.fullmatch(name) is not None,
                f"data.{key}",
                name,
                "set names of letters, digits, _ and - (a set's metrics are named <name>/<set>, e.g. val/loss/noisy)",
            )
        sets = [name for name, node in named.items() if node is not None]
        _require(
            not sets or data.get(split) is not None or (split == "val" and data.get("fold") is not None),
            f"data.{split}",
            None,
            f"a dataset node beside data.{key} ({', '.join(sets)}): data.{split} is the default set, whose metrics "
            f"keep their names ({split}/loss), and the sets of data.{key} are added to it",
        )


def _check_data(data: DictConfig) -> None:
    _require(
        "train" not in data or data.train is not None,
        "data.train",
        None,
        "a dataset node (with _target_): every run trains on data.train",
    )
    _check_sets(data)
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
