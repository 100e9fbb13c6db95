"""What every tracker is told of the run it logs (`TrackedRun`: its directory, name, config, the step a resume continues
from, the record trackers.json keeps), the interface a tracker has (`Tracker`), and the config flattened into the
params a tracker's comparison view shows."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

from omegaconf import OmegaConf

log = logging.getLogger(__name__)
# A failed tracker's traceback, at INFO: run.log's alone where the run's logging is configured (framework.yaml's
# `loggers:`, launch._configure_logging), and not shown by Python's default of WARNING where it is not.
traceback_log = logging.getLogger(f"{__name__}.traceback")


RECORD = "trackers.json"  # in the run directory: each tracker's run ID, and which trackers failed


@dataclass
class TrackedRun:
    """What every tracker is told of the run it logs. `resume_step`: the checkpoint's step a resumed run continues
    from (None: a fresh run); what was logged after it belongs to the run that was killed."""

    run_dir: Path
    name: str  # the experiment's name (the config's `name`)
    config: dict[str, Any]  # the composed config, resolved
    resume_step: Optional[int] = None
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def params(self) -> dict[str, str]:
        return flatten(self.config)

    def composed_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.create(self.config))

    def record(self) -> dict[str, Any]:
        path = self.run_dir / RECORD
        return json.loads(path.read_text()) if path.is_file() else {}

    def sweep_parent(self, key: str) -> Optional[dict[str, str]]:
        """In a multirun, what the sweep opened for its jobs (`open_sweep`, in the sweep directory's record)."""
        path = self.run_dir.parent / RECORD
        return json.loads(path.read_text()).get(key) if path.is_file() else None

    def remember(self, key: str, value: Any) -> None:
        """One entry of trackers.json, written atomically (imported here: loggers.py imports this module)."""
        from framework.core.files import write_json

        write_json(self.run_dir / RECORD, {**self.record(), key: value})


class Tracker(Protocol):
    """One backend. Its methods may raise: `Trackers` turns an error into a warning and leaves the tracker out."""

    name: str

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def flush(self, now: bool) -> None:
        """`now`: write what is kept (after an evaluation); else only what has waited long enough (an epoch's end)."""

    def close(self) -> None: ...


def flat_values(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"optimizer": {"lr": 0.1}}` as `{"optimizer.lr": 0.1}`, each value kept as it is (W&B's tables compare
    numbers), a list or an empty mapping as JSON text."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_values(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, dict)) else value
    return flat


def flatten(config: Mapping[str, Any]) -> dict[str, str]:
    """`{"optimizer": {"lr": 0.1}}` as `{"optimizer.lr": "0.1"}`: the params a tracker's comparison view shows."""
    return {name: str(value) for name, value in flat_values(config).items()}
