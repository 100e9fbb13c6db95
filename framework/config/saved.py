"""The saved config, the one way it is read and merged: a resumed run's config (or an evaluated run's) is the one saved
with its checkpoint, exactly: group choices, presets, `+` keys and config files of the user's own all come back from
it, never from a fresh composition of the defaults. It is saved resolved, with a record of the nodes that were plain
references to other keys (`data.train.shards: ${data.train_shards}`), which come back as such, so that a key set on
this command line reaches the nodes made from it. This command line's overrides apply on top: a value override sets
its key; a group option other than the saved one replaces that group's node as a whole, or, for groups whose state
the checkpoint holds (model, optimizer, data), is an error. A run that saved no checkpoint is continued from the
config Hydra saved for it (`from_hydra_record`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional, cast

from omegaconf import Container, DictConfig, OmegaConf, open_dict

from framework.config.interpolation import interpolations, leaves, references
from framework.core import files
from framework.core.errors import ConfigError

log = logging.getLogger(__name__)


STATE_GROUPS = {
    "model": "its weights",
    "optimizer": "its optimizer state",
    "data": "its position in the data",
    "experiment": "a preset sets many groups at once",
}
# This invocation's own, never the saved run's.
_NOT_FROM_SAVED = ("resume", "init_from", "trust_saved_config", "resume_on_new_data", "stage", "ckpt")
MAX_RECORD_BYTES = 64 * 2**20  # a run's record larger than this is not one


# ---------------------------------------------------------------------------------------------- config
# Where what a config names moved since a checkpoint was written (the framework's modules became packages): a saved
# config naming the old path is read as naming the new one, so that runs saved by an earlier version still resume.
MOVED = {
    "framework.shards.": "framework.data.shards.",
    "framework.streaming.": "framework.data.streaming.",
    "framework.folds.": "framework.data.folds.",
    "framework.metrics.": "framework.task.metrics.",
    "framework.callbacks.": "framework.callbacks.",  # (unchanged: the package re-exports its callbacks)
}


def moved(value: Any) -> Any:
    """A saved config with every name a module path that moved, as it reads today (see MOVED)."""
    if isinstance(value, dict):
        return {k: moved(v) for k, v in value.items()}
    if isinstance(value, list):
        return [moved(v) for v in value]
    if isinstance(value, str):
        for old, new in MOVED.items():
            if value.startswith(old):
                return new + value[len(old) :]
    return value


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


def hydra_choices(run_dir: Path) -> dict[str, Optional[str]]:
    """The group choices Hydra recorded for the run in `run_dir` (`.hydra/hydra.yaml`), or {} without a readable
    record."""
    try:
        found = OmegaConf.select(
            OmegaConf.create(read_record(run_dir / ".hydra" / "hydra.yaml").decode()), "hydra.runtime.choices"
        )
    except Exception:  # noqa: BLE001  (no readable record: every group counts as unchanged)
        return {}
    return cast(dict[str, Optional[str]], OmegaConf.to_container(found)) if isinstance(found, DictConfig) else {}


def saved_choices(checkpoint: Any) -> dict[str, Optional[str]]:
    """The group choices the checkpoint's run was composed with (format 2 keeps them in meta.json; older
    checkpoints: the run directory's `.hydra/hydra.yaml`)."""
    choices = checkpoint.meta.get("choices")
    return choices if isinstance(choices, dict) else hydra_choices(checkpoint.path.parent.parent)


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
    # A checkpoint's record of the nodes written as references to other keys (framework/config/schema.py,
    # interpolations); None where it has none (saved by an older version). Hydra's record of a run keeps its `${...}` in
    # `config`.
    interpolations: Optional[dict[str, str]] = None

    def locked(self) -> dict[str, str]:
        """The groups whose option cannot change, and what of the run would not carry over."""
        if self.evaluated:
            return {g: why for g, why in STATE_GROUPS.items() if g in ("model", "experiment")}
        return STATE_GROUPS


def from_checkpoint(checkpoint: Any) -> SavedRun:
    """The saved run a resume from `checkpoint` continues: its config (values as data, its record of references)."""
    where = f"resume={str(checkpoint.path)!r}"
    saved = checkpoint.meta.get("config")
    if not isinstance(saved, dict) or not all(isinstance(k, str) for k in saved):
        raise ConfigError(
            f"{where}: the checkpoint's saved config is not a mapping of keys; expected the "
            "config written by this framework"
        )
    saved = moved(saved)
    run = SavedRun(str(checkpoint.path), checkpoint.path, as_data(saved), saved, saved_choices(checkpoint), True)
    run.interpolations = _saved_interpolations(checkpoint.meta.get("interpolations"))
    return run


def from_hydra_record(resume: str, run_dir: Path) -> SavedRun:
    """The saved run of resume=RUN_DIR for a run that saved no checkpoint: the config Hydra saved for it, which
    starts again from step 0."""
    path = run_dir / ".hydra" / "config.yaml"
    try:
        config: Any = OmegaConf.to_container(OmegaConf.create(read_record(path).decode()), resolve=False)
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
    config = moved(config)
    try:  # its `${...}` resolved as in this job (the same run directory), only to list what changes
        values: Any = OmegaConf.to_container(OmegaConf.create(config), resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001  (an unresolvable value is reported by the app's own check)
        values = config
    return SavedRun(resume, path, config, values, hydra_choices(run_dir), False)


def read_record(path: Path) -> bytes:
    """A run's record (meta.json, Hydra's YAML) as bytes: a regular file of sane size, never through a link, never
    blocking on a FIFO (framework.core.files.read_bytes); OSError or ValueError otherwise."""
    return files.read_bytes(path, limit=MAX_RECORD_BYTES)


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
