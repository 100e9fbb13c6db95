"""Resume modes: which run directory a resumed run uses, which checkpoint it starts from, and its config.

- `resume=RUN_DIR`: continue that run in place, from its newest intact checkpoint, with its saved config; a run
  killed before its first checkpoint starts again from step 0 in place, with the config Hydra saved for it
  (`.hydra/config.yaml`), as `resume=auto` would start it.
- `resume=CHECKPOINT_DIR`: a new run directory, starting from that checkpoint's full state and config.
- `resume=auto`: with a fixed `hydra.run.dir`, resume it if it holds a checkpoint, else start fresh
  (what SLURM requeues and torchrun restarts need). A Hydra multirun job and a SLURM batch job (whose run
  directory is `outputs/<name>/slurm-<job id>`, the same after a requeue) get it without asking.

The resumed config (framework/config/saved.py) is the one saved with the checkpoint, exactly: group choices, presets,
`+` keys and config files of the user's own all come back from it, never from a fresh composition of the defaults. It is
saved resolved, with a record of the nodes that were plain references to other keys (`data.train.shards:
${data.train_shards}`), which come back as such, so that a key set on this command line reaches the nodes made from it.
This command line's overrides apply on top: a value override sets its key; a group option other than the saved one
replaces that group's node as a whole, or, for groups whose state the checkpoint holds (model, optimizer, data), is an
error. So that Hydra composes value overrides against the right options, `argv_with_saved_choices` adds the
saved run's group choices to the command line before Hydra starts.

A saved config is data, not code: it may only build `_target_`s that the user's own code names (the config
trees the run is composed from, the framework's included; this command line; the framework's package and the
project's, i.e. the packages under the current directory), unless `trust_saved_config=true`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from framework.checkpoint.discovery import holds_run, is_checkpoint, is_run_dir
from framework.config.saved import SavedRun, from_checkpoint, from_hydra_record, hydra_choices, read_record
from framework.core.errors import ConfigError
from framework.parallel.cluster import INTERACTIVE_JOB_NAMES

log = logging.getLogger(__name__)


AUTO = "auto"


def job_identity() -> Optional[str]:
    """A SLURM batch job's name for its run directory, the same after every requeue: `slurm-<job id>`, or
    `slurm-<array job id>_<task id>` for an array task. None outside SLURM and in an interactive allocation."""
    if os.environ.get("SLURM_JOB_NAME", "") in INTERACTIVE_JOB_NAMES:
        return None
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"slurm-{array}_{task}"
    job = os.environ.get("SLURM_JOB_ID")
    return f"slurm-{job}" if job else None


def run_dir_resolver(resume: Optional[str], default: str, requeue: Any = "auto") -> str:
    """`hydra.run.dir`: the resumed run's own directory for resume=RUN_DIR; in a SLURM batch job (unless
    checkpoint.requeue=false) `outputs/<name>/slurm-<job id>`, which a requeued job finds again; else the usual
    new, timestamped one."""
    if resume and resume != AUTO and is_run_dir(Path(resume)):
        return str(resume)
    identity = job_identity() if requeue is not False and str(requeue).lower() != "false" else None
    if identity is not None:
        return str(Path(default).parent / identity)
    return default


def continues_in_place(multirun: bool, run_dir: Path) -> bool:
    """A job that may be a requeue of itself, so takes resume=auto: a Hydra multirun job (its directory is fixed
    by the sweep and the job's overrides) or a SLURM batch job in its `slurm-<id>` directory."""
    return multirun or (job_identity() is not None and run_dir.name == job_identity())


# The first answer per run directory, for this invocation: Hydra resolves the subdir again once it has written
# `.hydra/` there (which then holds a run). A new invocation in the same process (framework/app/api.py) forgets them.
_subdirs: dict[tuple[Optional[str], str], str] = {}


def new_invocation() -> None:
    """A new command (a run of the Python API) decides its `.hydra/` subdir afresh."""
    _subdirs.clear()


def hydra_subdir_resolver(resume: Optional[str], run_dir: str, *, _root_: DictConfig) -> str:
    """`hydra.output_subdir`: a directory that already holds a run keeps its original `.hydra/`; this
    invocation's goes beside it (`resumed-<time>`, or `attempt-<time>` for a fresh run, which app.py refuses
    and removes). Decided once per run directory: once Hydra has written `.hydra/`, the directory holds a run.
    A multirun job's directory is not `run_dir` but `hydra.runtime.output_dir`, set as the job starts; a job
    run again in it (the same sweep directory) continues in place, so its record is a `resumed-` one."""
    multirun = getattr(OmegaConf.select(_root_, "hydra.mode"), "name", None) == "MULTIRUN"
    if multirun:
        run_dir = OmegaConf.select(_root_, "hydra.runtime.output_dir", default=None, throw_on_missing=False) or run_dir
    key = (resume, str(Path(run_dir).absolute()))
    if key not in _subdirs:
        kind = "resumed" if resume or continues_in_place(multirun, Path(run_dir)) else "attempt"
        held = holds_run(Path(run_dir))
        _subdirs[key] = f".hydra/{kind}-{datetime.datetime.now():%Y-%m-%d_%H-%M-%S-%f}" if held else ".hydra"
    return _subdirs[key]


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("run_dir", run_dir_resolver, replace=True)
    OmegaConf.register_new_resolver("hydra_subdir", hydra_subdir_resolver, replace=True)


def never_saved(run_dir: Path) -> bool:
    """Has no checkpoint of the run in `run_dir` ever been completed (at most a `NAME.tmp/` of a save cut short)?"""
    try:
        return all(name.endswith(".tmp") for name in os.listdir(run_dir / "checkpoints"))
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False


def finished_unsaved(run_dir: Path) -> bool:
    """A run that finished (its summary.json) without saving a checkpoint (checkpoint=none): nothing to continue.
    Not a run that failed: that one starts again (`failed_unsaved`)."""
    return (run_dir / "summary.json").exists() and never_saved(run_dir) and failure(run_dir) is None


def failure(run_dir: Path) -> Optional[str]:
    """The error that ended the run in `run_dir`, as its summary.json records it (`status: failed`: an exception in
    a hook, a crash); None where the run did not fail, or has no readable summary."""
    try:
        summary = json.loads(read_record(run_dir / "summary.json"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(summary, dict) or summary.get("status") != "failed":
        return None
    return str(summary.get("error") or "an error")


def failed_unsaved(run_dir: Path) -> bool:
    """A run that failed before its first checkpoint: nothing to continue, so a new run may take its directory
    over (framework/app/rundir.py sets its files aside)."""
    return failure(run_dir) is not None and never_saved(run_dir)


def find_checkpoint(resume: Optional[str], run_dir: Path) -> Optional[Any]:
    """The checkpoint a run starts from, or None for a start from step 0: a fresh run, resume=auto without a
    checkpoint, or resume=RUN_DIR of a run killed before its first one (`saved_run` gives its config)."""
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
        raise ConfigError(
            f"resume={resume!r}: {'not a directory' if path.exists() else 'no such directory'}; "
            "expected a run directory, a checkpoint directory (with meta.json) or 'auto'"
        )
    if is_checkpoint(path):
        try:
            return open_checkpoint(path)
        except DamagedCheckpoint as err:
            raise ConfigError(f"resume={resume!r}: {err}") from None
    if not is_run_dir(path):
        raise ConfigError(
            f"resume={resume!r}: neither a run directory (it has no .hydra/ nor checkpoints/) nor a "
            "checkpoint directory (no meta.json); expected one of those, or 'auto'"
        )
    found = find_latest(path)
    if found is not None:
        return found
    if not never_saved(path):
        raise ConfigError(
            f"resume={resume!r}: no intact checkpoint under {path / 'checkpoints'} (each is named "
            "above, with what is wrong with it); expected a run with a checkpoint this version can "
            "restore"
        )
    if finished_unsaved(path):
        raise ConfigError(
            f"resume={resume!r}: the run finished without saving a checkpoint (checkpoint.save_last="
            "false), so nothing of it can be continued; expected a new run in another directory"
        )
    log.info(
        "resume=%s: the run saved no checkpoint before it stopped; starting it again from step 0 with its saved config",
        resume,
    )
    return None


def find_weights(init_from: str) -> str:
    """What init_from=PATH loads, checked before anything is built so that its errors name the key: a checkpoint
    directory (its layout; its files are verified as they are loaded), a run directory's newest intact checkpoint,
    or a file, as it is (framework/checkpoint/weights.py reads it)."""
    from framework.checkpoint import DamagedCheckpoint, UnreadableCheckpoint, find_latest, open_checkpoint

    path, where = Path(init_from), f"init_from={init_from!r}"
    expected = "expected a checkpoint directory, a run directory, a .safetensors file or a torch.save state dict"
    if not path.exists():
        raise ConfigError(f"{where}: no such file or directory; {expected}")
    if not path.is_dir():
        return init_from
    if is_checkpoint(path):
        try:
            open_checkpoint(path, verify=False)
        except (DamagedCheckpoint, UnreadableCheckpoint) as err:
            raise ConfigError(f"{where}: {err}") from None
        return init_from
    if not is_run_dir(path):
        raise ConfigError(
            f"{where}: a directory that is neither a checkpoint (no meta.json) nor a run directory "
            f"(no .hydra/ nor checkpoints/); {expected}"
        )
    found = find_latest(path)
    if found is None:
        raise ConfigError(
            f"{where}: a run directory with no intact checkpoint under {path / 'checkpoints'}; "
            "expected a run that saved one, a checkpoint directory, a .safetensors file or a "
            "torch.save state dict"
        )
    log.info("init_from=%s: its newest intact checkpoint, %s (step %d)", init_from, found.path, found.step)
    return str(found.path)


def fall_back(resume: Optional[str], failed: Any, err: Exception) -> Any:
    """The checkpoint to try after `failed` could not be restored (its state does not fit this run's
    components): for resume=RUN_DIR or auto, the newest intact one of an earlier step; a checkpoint named
    explicitly is the user's choice, and its error stands."""
    from framework.checkpoint import find_latest

    if resume not in (AUTO, None) and is_checkpoint(Path(resume)):
        raise err
    log.warning("Skipping a damaged checkpoint: %s", err)
    older = find_latest(failed.path.parent.parent, below_step=failed.step)
    if older is None:
        raise ConfigError(
            f"resume={resume!r}: no intact checkpoint left before step {failed.step} ({err}); "
            "expected a run with a checkpoint this version can restore"
        ) from None
    return older


def saved_run(resume: Optional[str], checkpoint: Any) -> Optional[SavedRun]:
    """The saved run a run's config comes from: the checkpoint it resumes from, or, for resume=RUN_DIR of a run
    that never saved one (find_checkpoint found none), the config Hydra saved for it; None for a fresh start."""
    if checkpoint is not None:
        return from_checkpoint(checkpoint)
    if not resume or resume == AUTO or not is_run_dir(Path(resume)):
        return None
    return from_hydra_record(resume, Path(resume))


# ---------------------------------------------------------------------------------------------- argv
def _read_meta(path: Path) -> Optional[dict[str, Any]]:
    """A checkpoint's meta.json as a dict, or None: only a regular file of sane size is read (never a FIFO)."""
    try:
        meta = json.loads(read_record(path / "meta.json"))
    except (OSError, ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None


def _newest_meta(run_dir: Path) -> Optional[dict[str, Any]]:
    """The meta.json of the checkpoint with the highest step (read, not verified: only its choices are used)."""
    folder = run_dir / "checkpoints"
    best: Optional[dict[str, Any]] = None
    if not folder.is_dir():
        return None
    for path in folder.iterdir():
        if path.name.endswith((".tmp", ".old")) or not path.is_dir():
            continue
        meta = _read_meta(path)
        step = meta.get("step") if meta else None
        if isinstance(step, int) and (best is None or step > best["step"]):
            best = meta
    return best


def _override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def _primary_groups(conf_dirs: list[Path], config_name: str, seen: Optional[set[str]] = None) -> set[str]:
    """Groups named in the primary config's defaults list, or in that of a config it starts from (`htf`): only
    those can be overridden without `+`. The first tree that has a config wins, as in Hydra's search path."""
    seen = seen if seen is not None else set()
    path = next(
        (folder / f"{config_name}.yaml" for folder in conf_dirs if (folder / f"{config_name}.yaml").is_file()), None
    )
    if path is None or config_name in seen:
        return set()
    seen.add(config_name)
    try:
        defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults", [])
    except (yaml.YAMLError, OSError, AttributeError):
        return set()
    groups: set[str] = set()
    for item in defaults if isinstance(defaults, list) else ():
        if isinstance(item, str) and item != "_self_":  # another config, e.g. the framework's `htf`
            groups |= _primary_groups(conf_dirs, item.lstrip("/"), seen)
        elif isinstance(item, dict) and len(item) == 1:  # group: option, `override group: option`
            key = str(next(iter(item))).split()[-1]
            groups.add(key.lstrip("/").split("@", 1)[0])
    return groups


def argv_with_saved_choices(argv: list[str], conf_dirs: list[Path], config_name: str = "config") -> list[str]:
    """For `resume=...`: the command line plus the saved run's group choices it does not set itself
    (`model=cnn` for a cnn run), so Hydra composes this command line's value overrides against the options
    the run used. `conf_dirs`: the config trees, in Hydra's search order; choices whose option file none has
    are left to the saved config alone."""
    args = argv[1:]
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    # resume= continues a run; ckpt= names the one a validate/test/predict stage evaluates: both compose as it did.
    resume = next((a.split("=", 1)[1] for a in overrides if _override_key(a) in ("resume", "ckpt")), None)
    if not resume or "-m" in args or "--multirun" in args:
        return argv
    if resume == AUTO:
        run_dir = next((a.split("=", 1)[1] for a in overrides if _override_key(a) == "hydra.run.dir"), None)
        meta = _newest_meta(Path(run_dir)) if run_dir else None
    else:
        path = Path(resume)
        meta = _read_meta(path) if (path / "meta.json").exists() else _newest_meta(path)
        if meta is None and is_run_dir(path):  # a run that never saved a checkpoint: Hydra's record of it
            meta = {"choices": hydra_choices(path)}
    choices = (meta or {}).get("choices")
    if not isinstance(choices, dict):
        return argv
    given = {_override_key(a) for a in overrides}
    groups = _primary_groups(conf_dirs, config_name)
    added = [
        f"{group}={option}"
        for group, option in choices.items()
        if isinstance(group, str)
        and isinstance(option, str)
        and group in groups
        and group not in given
        and not group.startswith("hydra")
        and option.replace("_", "").replace("-", "").isalnum()
        and any((folder / group / f"{option}.yaml").is_file() for folder in conf_dirs)
    ]
    return [argv[0], *args, *added]
