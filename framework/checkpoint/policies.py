"""Save policies: when to save (`last`, periodic `step-N`, the top-k by a metric as `best`) and which
checkpoints to keep. For a sharded run (`shards`: the ranks saving together) every rank writes its own files of
each checkpoint (framework/checkpoint/sharded.py); links and pruning are still rank 0's."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from framework.checkpoint.format import DamagedCheckpoint, _is_number, _shown
from framework.checkpoint.mirror import RemoteMirror
from framework.checkpoint.save import link_checkpoint
from framework.checkpoint.sharded import Shards, link_sharded
from framework.checkpoint.validation import _mismatch
from framework.checkpoint.writer import CheckpointWriter
from framework.core.errors import ConfigError


class Snapshot(Protocol):
    """What a checkpoint is made of: `collect()` -> (model weights, training state, meta), as
    framework.checkpoint.state.TrainingState gives them."""

    def collect(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]: ...


@dataclass
class CheckpointManager:
    """Decides when to save and what to keep: `last`, periodic `step-N`, the top-k by a metric (`best`)."""

    folder: Path
    save_last: bool = False
    every_n_steps: int = 0
    every_n_epochs: int = 0
    keep_last: int = 1
    monitor: Optional[str] = None
    mode: str = "max"
    save_top_k: int = 0
    enabled: bool = True  # False on non-zero ranks and in fast_dev_run: decisions still made, nothing written
    fsync: bool = True  # flush to disk (see write_checkpoint's `durable`)
    async_save: bool = False  # write on a background thread (see CheckpointWriter)
    periodic: list[str] = field(default_factory=list)  # names, oldest first
    top_k: list[tuple[float, str]] = field(default_factory=list)  # (metric, name), best first
    shards: Optional[Shards] = None  # a sharded run's ranks: each writes its shards (sharded.py)
    remote: Optional[RemoteMirror] = None  # checkpoint.remote: the kept checkpoints uploaded after each save (rank 0)

    def __post_init__(self) -> None:
        self.writer = CheckpointWriter(durable=self.fsync, background=self.async_save)
        # A sharded save in the background agrees over a process group of its own (every rank makes it here, once).
        self.background_ranks = self.shards.background_ranks() if self.shards is not None and self.async_save else None
        self.saved_step = -1  # the step of the newest checkpoint this process saved (or resumed from)

    def _link(self, src: Path, dst: Path) -> None:
        if self.shards is None:
            self.writer.call(link_checkpoint, src, dst, self.fsync)
        else:
            self.writer.call(link_sharded, src, dst, self.shards.world_size, self.fsync)

    @property
    def active(self) -> bool:
        return self.save_last or self.every_n_steps > 0 or self.every_n_epochs > 0 or self.save_top_k != 0

    def due_periodic(self, step: int, completed_epochs: Optional[int] = None) -> bool:
        """Is a periodic checkpoint due? `completed_epochs` is given only at the end of an epoch."""
        by_step = self.every_n_steps > 0 and step % self.every_n_steps == 0
        by_epoch = (
            completed_epochs is not None and self.every_n_epochs > 0 and completed_epochs % self.every_n_epochs == 0
        )
        return by_step or by_epoch

    def improves(self, metrics: Optional[dict[str, float]]) -> bool:
        if metrics is None or self.save_top_k == 0 or self.monitor is None:
            return False
        if self.monitor not in metrics:
            raise ConfigError(
                f"checkpoint.monitor={self.monitor!r}: no such metric; expected one of {', '.join(metrics)}"
            )
        if self.save_top_k < 0 or len(self.top_k) < self.save_top_k:
            return True
        worst = self.top_k[-1][0]
        value = metrics[self.monitor]
        return value > worst if self.mode == "max" else value < worst

    def will_save(self, *, periodic: bool, metrics: Optional[dict[str, float]] = None) -> bool:
        """Whether `save` with these arguments writes a checkpoint (the caller first makes what the checkpoint
        resumes from durable elsewhere: the trackers' kept points)."""
        return periodic or self.improves(metrics) or self.save_last

    def save(self, state: Snapshot, step: int, *, periodic: bool, metrics: Optional[dict[str, float]] = None) -> None:
        """Write once (as `step-N` when a policy keeps it, else as `last`) and link the other names to it.

        Called on every rank with the same arguments: the registry is kept everywhere so every rank makes
        the same decisions, and `state.collect()` runs everywhere (it may gather from all ranks), but files
        are written and deleted by the enabled rank only. The writer gets the collected state; the links and
        the pruning are queued after it. Nothing calls back into the caller."""
        top = self.improves(metrics)
        keep = periodic or top
        if not (keep or self.save_last):
            return
        name = f"step-{step}"
        target = self.folder / (name if keep else "last")
        # The registry is updated before collecting, so the checkpoint's own state already lists it.
        if periodic:
            self.periodic.append(name)
        if top:
            assert metrics is not None and self.monitor is not None  # improves() is False without them
            self.top_k.append((metrics[self.monitor], name))
            self.top_k.sort(key=lambda item: item[0], reverse=self.mode == "max")
            if self.save_top_k > 0:
                del self.top_k[self.save_top_k :]
        if self.keep_last >= 0 and len(self.periodic) > self.keep_last:
            self.periodic = self.periodic[len(self.periodic) - self.keep_last :] if self.keep_last else []
        self._write(state, step, target)
        if not self.enabled:
            return
        if keep and self.save_last:
            self._link(target, self.folder / "last")
        if top and self.top_k[0][1] == name:
            self._link(target, self.folder / "best")
        self.writer.call(self._prune, self._kept())
        self._mirror()

    def resumed_at(self, step: int) -> None:
        """The run resumed from a checkpoint of `step`: `last` of this step is on disk already."""
        self.saved_step = step

    def save_now(self, state: Snapshot, step: int, name: str = "last") -> None:
        """Save as `name` whatever the policies say (a signal's stop: this exact position). Every rank calls it."""
        self._write(state, step, self.folder / name)
        if self.enabled:
            self._mirror()

    def close(self) -> None:
        """Every save on disk (the writer closed), then on the remote (checkpoint.remote)."""
        try:
            self.writer.close()
        finally:
            if self.remote is not None:
                self.remote.close()

    def _kept(self) -> set[str]:
        return set(self.periodic) | {name for _, name in self.top_k}

    def _mirror(self) -> None:
        """Once the save queued last (and its links and pruning) is on disk, bring the remote up to date with it."""
        if self.remote is not None:
            self.writer.call(self.remote.request, self._kept())

    def _write(self, state: Snapshot, step: int, target: Path) -> None:
        model_state, training_state, meta = state.collect()
        self.saved_step = step
        if self.shards is not None:  # every rank, together (only rank 0 is `enabled`)
            self.writer.write_sharded(target, model_state, training_state, meta, self.shards, self.background_ranks)
        elif self.enabled:
            self.writer.write(target, model_state, training_state, meta)

    def _prune(self, kept: set[str]) -> None:
        """Delete `step-N` folders that no policy keeps any more."""
        for path in self.folder.glob("step-*"):  # never through a link: only folders this run wrote
            if (
                path.is_dir()
                and not path.is_symlink()
                and not path.name.endswith((".tmp", ".old"))
                and path.name not in kept
            ):
                shutil.rmtree(path, ignore_errors=True)

    def best_path(self) -> Optional[Path]:
        return self.folder / "best" if self.top_k else None

    def state_dict(self) -> dict[str, Any]:
        return {"periodic": list(self.periodic), "top_k": [[v, n] for v, n in self.top_k]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state, "checkpoint state checkpoints")
        self.periodic = list(state.get("periodic", []))
        self.top_k = [(float(v), str(n)) for v, n in state.get("top_k", [])]

    @staticmethod
    def check_state_dict(state: Any, where: str) -> None:
        """Raise DamagedCheckpoint (naming `where`/periodic or `where`/top_k/i) unless `state` is what
        state_dict() returns; for checking a checkpoint before anything is loaded."""
        if not isinstance(state, dict):
            raise _mismatch(where, state, {"periodic": [], "top_k": []})
        periodic, top_k = state.get("periodic", []), state.get("top_k", [])
        if not isinstance(periodic, list) or not all(isinstance(name, str) for name in periodic):
            raise DamagedCheckpoint(
                f"{where}/periodic: the checkpoint holds {_shown(periodic)} that is not a list "
                "of checkpoint names; expected names such as step-500"
            )
        if not isinstance(top_k, list):
            raise DamagedCheckpoint(
                f"{where}/top_k: the checkpoint holds {_shown(top_k)}; expected a list of "
                "[metric value, checkpoint name]"
            )
        for i, item in enumerate(top_k):
            if not (
                isinstance(item, (list, tuple)) and len(item) == 2 and _is_number(item[0]) and isinstance(item[1], str)
            ):
                raise DamagedCheckpoint(
                    f"{where}/top_k/{i}: the checkpoint holds {_shown(item)}; expected [metric value, checkpoint name]"
                )
