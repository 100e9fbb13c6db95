"""Resume modes: which run directory a resumed run uses, which checkpoint it starts from, and its config.

- `resume=RUN_DIR`: continue that run in place, from its newest intact checkpoint, with its saved config;
  this command line's overrides still apply, and every key that changes is listed in a warning.
- `resume=CHECKPOINT_DIR`: a new run directory, starting from that checkpoint's full state and config.
- `resume=auto`: with a fixed `hydra.run.dir`, resume it if it holds a checkpoint, else start fresh
  (what SLURM requeues and torchrun restarts need).
The two resolvers are used by conf/config.yaml to choose the run directory before Hydra creates it.
"""
from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from framework.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"


def _is_checkpoint(path: Path) -> bool:
    return (path / "meta.json").is_file() or (path / "model.safetensors").is_file()


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and not _is_checkpoint(path) and ((path / "checkpoints").is_dir() or (path / ".hydra").is_dir())


def run_dir_resolver(resume: Optional[str], default: str) -> str:
    """`hydra.run.dir`: the resumed run's own directory for resume=RUN_DIR, else the usual new one."""
    if resume and resume != AUTO and _is_run_dir(Path(resume)):
        return str(resume)
    return default


def hydra_subdir_resolver(resume: Optional[str], run_dir: str) -> str:
    """`hydra.output_subdir`: a resumed run keeps its original `.hydra/`; this invocation's goes beside it."""
    resumed = Path(resume) if resume and resume != AUTO else Path(run_dir) if resume == AUTO else None
    if resumed is not None and _is_run_dir(resumed):
        return f".hydra/resumed-{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
    return ".hydra"


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("run_dir", run_dir_resolver, replace=True)
    OmegaConf.register_new_resolver("hydra_subdir", hydra_subdir_resolver, replace=True)


def find_checkpoint(resume: Optional[str], run_dir: Path) -> Optional[Any]:
    """The checkpoint a run starts from, or None for a fresh start."""
    from framework.checkpoint import DamagedCheckpoint, find_latest, open_checkpoint  # torch: import late

    if not resume:
        return None
    if resume == AUTO:
        found = find_latest(run_dir)
        if found is None:
            log.info("resume=auto: no checkpoint in %s; starting fresh", run_dir)
        return found
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"resume={resume!r}: no such directory; expected a run directory, a checkpoint "
                          "directory (with meta.json) or 'auto'")
    if _is_checkpoint(path):
        try:
            return open_checkpoint(path)
        except DamagedCheckpoint as err:
            raise ConfigError(f"resume={resume!r}: {err}") from None
    found = find_latest(path)
    if found is None:
        raise ConfigError(f"resume={resume!r}: no intact checkpoint under {path / 'checkpoints'}; expected a run "
                          "that saved at least one (checkpoint=default saves checkpoints/last every epoch)")
    return found


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf (lists are leaves)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def _overridden(key: str, overrides: list[str]) -> bool:
    return any(key == o or key.startswith(o + ".") for o in overrides)


def merged_config(cfg: DictConfig, saved: dict[str, Any], overrides: list[str]) -> DictConfig:
    """The saved config, with this command line's overrides applied on top.

    `overrides` are the keys (or groups) set on this command line; for them the freshly composed value wins,
    for every other key the saved one does. Keys that change from the saved run are listed in a warning.
    """
    merged = cfg.copy()
    composed = _leaves(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    saved_leaves = _leaves(saved)
    with open_dict(merged):
        for key, value in saved_leaves.items():
            if not _overridden(key, overrides) and key not in ("resume", "init_from"):
                OmegaConf.update(merged, key, value, merge=False, force_add=True)
    changed = [f"{key}: {saved_leaves.get(key)!r} -> {value!r}" for key, value in composed.items()
               if _overridden(key, overrides) and key not in ("resume",) and saved_leaves.get(key) != value]
    if changed:
        log.warning("Resuming with a changed config (from this command line):\n  %s", "\n  ".join(changed))
    return merged


def override_keys(task_overrides: ListConfig | list[str]) -> list[str]:
    """The keys or groups named by Hydra's task overrides (`a.b=1`, `+a.c=2`, `~a.d`, `model=cnn`)."""
    keys = []
    for override in task_overrides:
        key = str(override).split("=", 1)[0].lstrip("+~")
        keys.append(key.split("@", 1)[0].replace("/", "."))
    return keys
