"""Resume modes: which run directory a resumed run uses, which checkpoint it starts from, and its config.

- `resume=RUN_DIR`: continue that run in place, from its newest intact checkpoint, with its saved config; a run
  killed before its first checkpoint starts again from step 0 in place, with the config Hydra saved for it
  (`.hydra/config.yaml`), as `resume=auto` would start it.
- `resume=CHECKPOINT_DIR`: a new run directory, starting from that checkpoint's full state and config.
- `resume=auto`: with a fixed `hydra.run.dir`, resume it if it holds a checkpoint, else start fresh
  (what SLURM requeues and torchrun restarts need). A Hydra multirun job and a SLURM batch job (whose run
  directory is `outputs/<name>/slurm-<job id>`, the same after a requeue) get it without asking.

The resumed config is the one saved with the checkpoint, exactly: group choices, presets, `+` keys and config
files of the user's own all come back from it, never from a fresh composition of the defaults. It is saved resolved,
with a record of the nodes that were plain references to other keys (`data.train.shards: ${data.train_shards}`),
which come back as such, so that a key set on this command line reaches the nodes made from it. This command
line's overrides apply on top: a value override sets its key; a group option other than the saved one replaces
that group's node as a whole, or, for groups whose state the checkpoint holds (model, optimizer, data), is an
error. So that Hydra composes value overrides against the right options, `argv_with_saved_choices` adds the
saved run's group choices to the command line before Hydra starts.

A saved config is data, not code: it may only build `_target_`s that the user's own code names (the config
trees the run is composed from, the framework's included; this command line; the framework's package and the
project's, i.e. the packages under the current directory), unless `trust_saved_config=true`.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import importlib.util
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Optional, cast

import yaml
from omegaconf import Container, DictConfig, OmegaConf, open_dict

from framework.config.interpolation import interpolations, leaves, references
from framework.core.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"
# Groups whose option the checkpoint's state belongs to: another option cannot carry that state over.
STATE_GROUPS = {
    "model": "its weights",
    "optimizer": "its optimizer state",
    "data": "its position in the data",
    "experiment": "a preset sets many groups at once",
}
# This invocation's own, never the saved run's.
_NOT_FROM_SAVED = ("resume", "init_from", "trust_saved_config", "resume_on_new_data", "stage", "ckpt")
_META_MAX_BYTES = 64 * 2**20


def _is_checkpoint(path: Path) -> bool:
    return (path / "meta.json").is_file() or (path / "model.safetensors").is_file()


def _is_run_dir(path: Path) -> bool:
    return (
        path.is_dir() and not _is_checkpoint(path) and ((path / "checkpoints").is_dir() or (path / ".hydra").is_dir())
    )


def holds_run(path: Path) -> bool:
    """Does `path` already hold a run (its config, checkpoints, summary or TensorBoard events)?"""
    if not path.is_dir():
        return False
    if (path / ".hydra" / "config.yaml").is_file() or (path / "summary.json").exists():
        return True
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return True
    return any(p.name.startswith("events.out.tfevents") for p in path.iterdir())


# SLURM job names of an interactive allocation (salloc, srun --pty bash): runs started there by hand are no job's.
INTERACTIVE_JOB_NAMES = ("bash", "sh", "zsh", "interactive")


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
    if resume and resume != AUTO and _is_run_dir(Path(resume)):
        return str(resume)
    identity = job_identity() if requeue is not False and str(requeue).lower() != "false" else None
    if identity is not None:
        return str(Path(default).parent / identity)
    return default


def continues_in_place(multirun: bool, run_dir: Path) -> bool:
    """A job that may be a requeue of itself, so takes resume=auto: a Hydra multirun job (its directory is fixed
    by the sweep and the job's overrides) or a SLURM batch job in its `slurm-<id>` directory."""
    return multirun or (job_identity() is not None and run_dir.name == job_identity())


_subdirs: dict[tuple[Optional[str], str], str] = {}  # the first answer per run: Hydra resolves it again later


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
    """A run that finished (its summary.json) without saving a checkpoint (checkpoint=none): nothing to continue."""
    return (run_dir / "summary.json").exists() and never_saved(run_dir)


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
    if _is_checkpoint(path):
        try:
            return open_checkpoint(path)
        except DamagedCheckpoint as err:
            raise ConfigError(f"resume={resume!r}: {err}") from None
    if not _is_run_dir(path):
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
    if _is_checkpoint(path):
        try:
            open_checkpoint(path, verify=False)
        except (DamagedCheckpoint, UnreadableCheckpoint) as err:
            raise ConfigError(f"{where}: {err}") from None
        return init_from
    if not _is_run_dir(path):
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

    if resume not in (AUTO, None) and _is_checkpoint(Path(resume)):
        raise err
    log.warning("Skipping a damaged checkpoint: %s", err)
    older = find_latest(failed.path.parent.parent, below_step=failed.step)
    if older is None:
        raise ConfigError(
            f"resume={resume!r}: no intact checkpoint left before step {failed.step} ({err}); "
            "expected a run with a checkpoint this version can restore"
        ) from None
    return older


# ---------------------------------------------------------------------------------------------- config trees
def package_dir(package: str) -> Optional[Path]:
    """The folder of an installed package of config files (Hydra's `pkg://PACKAGE`), or None without one."""
    try:
        folder = importlib.resources.files(package)
    except (ImportError, ValueError, TypeError):
        return None
    return folder if isinstance(folder, Path) and folder.is_dir() else None


def framework_conf_dir() -> Path:
    """The framework's own config tree: the one shipped with the `framework` package imported in this process.

    A wheel installs it inside the package (framework/conf); in a checkout it is conf/ beside framework/. Asking
    the import system for `framework.conf` instead would answer from the environment's editable install, which
    may point at another checkout (a worktree, a copy) whose tree then won over this checkout's own conf/."""
    here = Path(__file__).resolve().parents[1]  # the framework package
    wheel = here / "conf"
    return wheel if (wheel / "htf.yaml").is_file() else here.parent / "conf"


def source_dir(path: str, schema: Optional[str] = None) -> Optional[Path]:
    """The folder of a config source (`pkg://a.b`, `file://DIR` or `DIR`; or Hydra's recorded path and schema),
    or None where it is not one on disk."""
    if schema is None:
        schema, _, rest = path.partition("://")
        schema, path = (schema, rest) if rest else ("file", path)
    if schema == "pkg":
        return package_dir(path.replace("/", "."))
    folder = Path(path)
    return folder.resolve() if schema == "file" and folder.is_dir() else None


# ---------------------------------------------------------------------------------------------- argv
def _read_meta(path: Path) -> Optional[dict[str, Any]]:
    """A checkpoint's meta.json as a dict, or None: only a regular file of sane size is read (never a FIFO)."""
    try:
        st = os.stat(path / "meta.json")
        if not stat.S_ISREG(st.st_mode) or st.st_size > _META_MAX_BYTES:
            return None
        meta = json.loads((path / "meta.json").read_text())
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
        if meta is None and _is_run_dir(path):  # a run that never saved a checkpoint: Hydra's record of it
            meta = {"choices": _hydra_choices(path)}
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


# ---------------------------------------------------------------------------------------------- config
def as_data(value: Any) -> Any:
    """A saved (resolved) value as literal data: a `${...}` inside it must not become an interpolation."""
    if isinstance(value, dict):
        return {k: as_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_data(v) for v in value]
    if isinstance(value, str):
        return value.replace("${", "\\${")
    return value


def _raw(cfg: DictConfig, key: str) -> Any:
    """The node at `key` as written (interpolations unresolved, so they resolve in the config it moves to)."""
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig) or name not in parent:
        return OmegaConf.select(cfg, key)
    return cast(dict, OmegaConf.to_container(parent, resolve=False))[name]


def _delete(cfg: DictConfig, key: str) -> None:
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, DictConfig) and name in parent:
        with open_dict(parent):
            del parent[name]


def _hydra_choices(run_dir: Path) -> dict[str, Optional[str]]:
    """The group choices Hydra recorded for the run in `run_dir` (`.hydra/hydra.yaml`), or {} without a readable
    record."""
    path = run_dir / ".hydra" / "hydra.yaml"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _META_MAX_BYTES:  # never block on a FIFO
            return {}
        found = OmegaConf.select(OmegaConf.load(path), "hydra.runtime.choices")
    except Exception:  # noqa: BLE001  (no readable record: every group counts as unchanged)
        return {}
    return cast(dict[str, Optional[str]], OmegaConf.to_container(found)) if isinstance(found, DictConfig) else {}


def saved_choices(checkpoint: Any) -> dict[str, Optional[str]]:
    """The group choices the checkpoint's run was composed with (format 2 keeps them in meta.json; older
    checkpoints: the run directory's `.hydra/hydra.yaml`)."""
    choices = checkpoint.meta.get("choices")
    return choices if isinstance(choices, dict) else _hydra_choices(checkpoint.path.parent.parent)


@dataclasses.dataclass
class SavedRun:
    """What a resumed run's config starts from: a checkpoint's saved config (`state`: it brings the run's
    training state, which no other model, optimizer or data option, seed or init_from can take), or the config
    Hydra saved for a run killed before its first checkpoint, which starts again from step 0."""

    resume: str  # the resume= value that names it, for messages
    source: Path  # the checkpoint, or the run's .hydra/config.yaml
    config: dict[str, Any]  # what is merged: a checkpoint's values as data, or Hydra's config as composed
    values: dict[str, Any]  # the values the run had, to list what this command line changes
    choices: dict[str, Optional[str]]
    state: bool
    # Evaluated by a validate/test/predict stage, not continued: only its weights carry over, so another data,
    # optimizer or seed is fine, and another model (or preset) is not.
    evaluated: bool = False
    # A checkpoint's record of the nodes written as references to other keys (framework/config/schema.py, interpolations);
    # None where it has none (saved by an older version). Hydra's record of a run keeps its `${...}` in `config`.
    interpolations: Optional[dict[str, str]] = None

    def locked(self) -> dict[str, str]:
        """The groups whose option cannot change, and what of the run would not carry over."""
        if self.evaluated:
            return {g: why for g, why in STATE_GROUPS.items() if g in ("model", "experiment")}
        return STATE_GROUPS


def saved_run(resume: Optional[str], checkpoint: Any) -> Optional[SavedRun]:
    """The saved run a run's config comes from: the checkpoint it resumes from, or, for resume=RUN_DIR of a run
    that never saved one (find_checkpoint found none), the config Hydra saved for it; None for a fresh start."""
    if checkpoint is not None:
        where = f"resume={str(checkpoint.path)!r}"
        saved = checkpoint.meta.get("config")
        if not isinstance(saved, dict) or not all(isinstance(k, str) for k in saved):
            raise ConfigError(
                f"{where}: the checkpoint's saved config is not a mapping of keys; expected the "
                "config written by this framework"
            )
        run = SavedRun(str(checkpoint.path), checkpoint.path, as_data(saved), saved, saved_choices(checkpoint), True)
        run.interpolations = _saved_interpolations(checkpoint.meta.get("interpolations"))
        return run
    if not resume or resume == AUTO or not _is_run_dir(Path(resume)):
        return None
    path = Path(resume) / ".hydra" / "config.yaml"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _META_MAX_BYTES:  # never block on a FIFO
            raise ValueError("not a regular file of sane size")
        config: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as err:  # noqa: BLE001  (missing, unreadable, not YAML)
        raise ConfigError(
            f"resume={resume!r}: the run saved no checkpoint, and the config Hydra saved for it "
            f"({path}) cannot be read ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
            "expected the run's .hydra/config.yaml, or a new run in another directory"
        ) from None
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise ConfigError(
            f"resume={resume!r}: {path} is not a mapping of keys; expected the config Hydra saved "
            "for the run, or a new run in another directory"
        )
    try:  # its `${...}` resolved as in this job (the same run directory), only to list what changes
        values: Any = OmegaConf.to_container(OmegaConf.create(config), resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001  (an unresolvable value is reported by the app's own check)
        values = config
    return SavedRun(resume, path, config, values, _hydra_choices(Path(resume)), False)


def resumed_config(
    fresh: DictConfig, saved: SavedRun, choices: dict[str, Optional[str]], task_overrides: list[str]
) -> tuple[DictConfig, dict[str, Optional[str]]]:
    """The saved run's config, with this command line's overrides (`task_overrides`) applied on top, and the
    group choices it stands for.

    `fresh` is the config Hydra composed for this command line (its typed schemas and its values for the
    overridden keys); `choices` its group choices. Every key that differs from the saved run is listed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides([str(o) for o in task_overrides])
    rechosen = _rechosen(saved, overrides, choices)
    if saved.state and not saved.evaluated:
        given = {override.key_or_group for override in overrides}
        for key, why in (
            ("seed", "its random streams and data order are restored from the checkpoint"),
            ("init_from", "its weights come from the checkpoint"),
        ):
            if key in given and fresh.get(key) != (None if key == "init_from" else saved.config.get(key)):
                raise ConfigError(
                    f"{key}={fresh.get(key)}: a resumed run cannot take it ({why}); expected no "
                    f"{key}= with resume= (start a new run for that)"
                )
    # A run that never saved has no weights of its own: its init_from is its config's, like any other key.
    own = _NOT_FROM_SAVED if saved.state else tuple(k for k in _NOT_FROM_SAVED if k != "init_from")
    merged = _merged(fresh, saved, rechosen, own)
    if saved.state:
        _rederive(merged, saved, (*rechosen, *own), [o.key_or_group for o in overrides if not o.is_delete()], fresh)
    for override in overrides:
        key = override.key_or_group
        if (
            key in choices
            or key.startswith("hydra")
            or key in own
            or any(key.startswith(group + ".") for group in rechosen)
        ):
            continue
        if override.is_delete():
            _delete(merged, key)
        else:
            OmegaConf.update(merged, key, _raw(fresh, key), merge=False, force_add=True)
    for group in [g for g in ("model", "optimizer") if g in saved.locked()] if saved.state else ():
        old_target = (saved.config.get(group) or {}).get("_target_")
        new_target = OmegaConf.select(merged, f"{group}._target_")
        if old_target != new_target:
            raise ConfigError(
                f"{group}._target_={new_target!r}: the run used {old_target!r}, and "
                f"{STATE_GROUPS[group]} cannot carry over; expected {old_target!r}"
            )
    _report_changes(
        saved.values, merged, rechosen, saved.choices, choices, "Evaluating" if saved.evaluated else "Resuming"
    )
    kept = {group: option for group, option in saved.choices.items() if group not in rechosen}
    return merged, {**choices, **kept}


def _rechosen(saved: SavedRun, overrides: list[Any], choices: dict[str, Optional[str]]) -> list[str]:
    """The groups this command line chose another option of. A checkpoint's model, optimizer and data state
    cannot carry over to another option; a preset sets many groups at once, so it is never chosen again."""
    rechosen = []
    for override in overrides:
        group = override.key_or_group
        if group not in choices or group.startswith("hydra") or override.package:
            continue
        old, new = saved.choices.get(group, choices[group]), choices[group]
        if old == new:
            continue
        if group in saved.locked() and (saved.state or group == "experiment"):
            raise ConfigError(
                f"{group}={new}: the run used {group}={old}, and {saved.locked()[group]} cannot carry over "
                f"to another option{'' if saved.evaluated else ' on resume'}; expected {group}={old} or no {group}="
                f"{_new_run_hint(saved, group, new)}"
            )
        rechosen.append(group)
    return rechosen


def _new_run_hint(saved: SavedRun, group: str, new: Optional[str]) -> str:
    """For another optimizer: the command of a new run that starts from the checkpoint's weights, with the run's
    own preset and model (its weights fit no other; nor, in general, another data option's shapes)."""
    if not saved.state or group != "optimizer":
        return ""
    command = [f"init_from={saved.source}"]
    command += [f"{g}={saved.choices[g]}" for g in ("experiment", "model") if isinstance(saved.choices.get(g), str)]
    return f" (for a new run from its weights instead: {' '.join([*command, f'{group}={new}'])}, without resume=)"


def _merged(fresh: DictConfig, saved: SavedRun, rechosen: list[str], own: tuple[str, ...]) -> DictConfig:
    """`fresh` with every key of the saved config but the rechosen groups' and this invocation's `own` keys."""
    merged = fresh.copy()
    with open_dict(merged):
        for key, value in saved.config.items():
            if key in rechosen or key in own:
                continue
            try:
                if (
                    key in merged
                    and OmegaConf.get_type(merged, key) not in (dict, list, type(None))
                    and isinstance(value, dict)
                ):  # a typed framework group: keep its schema
                    for leaf, leaf_value in leaves(value, key).items():
                        OmegaConf.update(merged, leaf, leaf_value, merge=False)
                else:
                    merged[key] = value
            except Exception as err:  # noqa: BLE001  (omegaconf's validation and key errors)
                raise ConfigError(
                    f"resume={saved.resume!r}: its saved config does not fit this version at {key} "
                    f"({str(err).splitlines()[0]}); expected a config this framework accepts "
                    "(start a new run with init_from= for its weights)"
                ) from None
    return merged


def _saved_interpolations(record: Any) -> Optional[dict[str, str]]:
    """A checkpoint's record of interpolations, each a plain reference to other keys (anything else in it is not
    followed), or None where the checkpoint has none."""
    if not isinstance(record, dict):
        return None
    return {
        key: written
        for key, written in record.items()
        if isinstance(key, str) and isinstance(written, str) and references(written, key) is not None
    }


def _rederive(merged: DictConfig, saved: SavedRun, skip: tuple[str, ...], given: list[str], fresh: DictConfig) -> None:
    """Put the saved nodes that were written as references to other keys (`data.train.shards: ${data.train_shards}`)
    back over their resolved values, so that a key this command line sets (`given`) reaches the nodes made from it,
    as it would have in the run's first composition. Each comes back only where, over the saved values, it gives the
    value saved: a record that does not fit its config is not followed. Groups in `skip` are this command line's."""
    if saved.interpolations is None:  # not known for the saved run: only what this version's config would make
        made = interpolations(fresh)
        stale = [k for k, w in made.items() if k not in given and set(references(w, k) or ()) & set(given)]
        if stale:
            log.warning(
                "resume: %s was saved before checkpoints recorded interpolations: %s keep their saved values, though "
                "this version's config makes them from keys set here; set them too to change them",
                saved.source,
                ", ".join(sorted(stale)),
            )
        return
    probe, plain = OmegaConf.create(saved.config), OmegaConf.create(saved.config)
    record = {key: w for key, w in saved.interpolations.items() if _top(key) not in skip and _holds(plain, key)}
    for key, written in record.items():
        OmegaConf.update(probe, key, written, merge=False)
    for key, written in record.items():
        try:
            fits = _plain(OmegaConf.select(probe, key)) == _plain(OmegaConf.select(plain, key))
        except Exception:  # noqa: BLE001  (omegaconf's resolution errors: a reference to nothing)
            fits = False
        if fits:
            try:
                OmegaConf.update(merged, key, written, merge=False)
            except Exception as err:  # noqa: BLE001  (a node this version types otherwise: the saved value stays)
                log.debug("resume: %s stays as saved (%s)", key, str(err).splitlines()[0])
        else:
            log.info(
                "resume: %s=%r is kept as saved: its recorded interpolation %s does not give it",
                key,
                _plain(OmegaConf.select(plain, key)),
                written,
            )


_ABSENT = object()


def _holds(cfg: DictConfig, key: str) -> bool:
    """Is there a node at `key` (a full key, `a.b[0].c`)?"""
    try:
        return bool(key) and OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT
    except Exception:  # noqa: BLE001  (omegaconf's key errors: `a.b` into a list)
        return False


def _top(key: str) -> str:
    return key.split(".", 1)[0].split("[", 1)[0]


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True, enum_to_str=True) if isinstance(value, Container) else value


def _report_changes(
    saved: dict[str, Any],
    merged: DictConfig,
    rechosen: list[str],
    old_choices: dict[str, Any],
    choices: dict[str, Any],
    doing: str = "Resuming",
) -> None:
    try:
        now = leaves(OmegaConf.to_container(merged, resolve=True, enum_to_str=True))
    except Exception:  # noqa: BLE001  (an unresolvable value is reported by the app's own check)
        return
    before = leaves(saved)
    changed = [f"{group}: {old_choices.get(group)} -> {choices[group]}" for group in rechosen]
    changed += [
        f"{key}: {before.get(key, '(unset)')!r} -> {value!r}"
        for key, value in now.items()
        if key.split(".")[0] not in _NOT_FROM_SAVED and before.get(key, object()) != value
    ]
    changed += [
        f"{key}: {value!r} -> (removed)"
        for key, value in before.items()
        if key not in now and key.split(".")[0] not in _NOT_FROM_SAVED
    ]
    if changed:
        log.warning("%s with a changed config (from this command line):\n  %s", doing, "\n  ".join(changed))


# ---------------------------------------------------------------------------------------------- trust
def targets(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(config key, dotted path) of everything a config would import: `_target_`s and param-group `modules`."""
    if isinstance(node, dict):
        for name, value in node.items():
            child = f"{key}.{name}" if key else str(name)
            if name == "_target_" and value is not None:
                yield child, value
            elif name == "modules" and ".param_groups[" in key and isinstance(value, list):
                yield from ((f"{child}[{i}]", v) for i, v in enumerate(value))
            else:
                yield from targets(value, child)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from targets(value, f"{key}[{i}]")


def conf_targets(conf_dirs: list[Path]) -> set[str]:
    """Every dotted path the config trees in `conf_dirs` name (the user's own configs)."""
    found: set[str] = set()
    for folder in conf_dirs:
        for path in folder.rglob("*.yaml"):
            try:
                found.update(str(t) for _, t in targets(yaml.safe_load(path.read_text())))
            except (yaml.YAMLError, OSError, UnicodeDecodeError):
                continue
    return found


def _in_project(top: str, project: Path) -> bool:
    """Is the top-level package `top` one of the project's own (under `project`, not an installed library)? Found,
    not imported."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    for place in places:
        resolved = Path(place).resolve()
        if "site-packages" in resolved.parts or "dist-packages" in resolved.parts:
            return False
        if resolved.is_relative_to(project.resolve()):
            return True
    return False


def _is_project_code(target: str, project: Path) -> bool:
    """A dotted path to something defined in the framework's package (wherever it is installed) or in a package
    of the user's project (under `project`, the current directory). The package is found without importing
    anything else; only then is the object located (importing the project's own modules), and it must be defined
    there: `framework.app.resume.os.system` reaches `os.system` through a framework module and is refused."""
    top = target.split(".", 1)[0]
    if top != __name__.split(".", 1)[0] and not _in_project(top, project):
        return False
    from framework.config.instantiate import locate

    try:
        obj = locate(target, "_target_")
    except ConfigError:
        return False
    return str(getattr(obj, "__module__", None) or "").split(".", 1)[0] == top


def check_saved_targets(cfg: DictConfig, trusted: set[str], project: Path, source: str) -> None:
    """Refuse, before anything is built, a `_target_` that came from a saved config and that the user's own
    code does not name (`trusted`: the config trees and this command line; plus the framework's and `project`'s
    packages)."""
    container = OmegaConf.to_container(cfg, resolve=False)
    for key, target in targets(container):
        if isinstance(target, str) and (target in trusted or _is_project_code(target, project)):
            continue
        raise ConfigError(
            f"{key}={target!r}: {source} names a target that neither the config trees, this "
            "command line, the framework nor this project's own packages name, so it is not built "
            "(a saved config is data, not code); expected a target of your own, or "
            "trust_saved_config=true for a run you trust"
        )
