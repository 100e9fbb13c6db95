"""One home for a run's resumable state.

Every stateful piece of a run registers here once, by name, as an object with `state_dict()` and
`load_state_dict()`: the model (its weights go to `model.safetensors`; under FSDP they are DTensors, and each
rank saves its own shards), the optimizer, the scheduler, precision's GradScaler, the loop's position
(`Progress`), the checkpoint registry, the metrics, the callbacks and every rank's RNG. A checkpoint is
`TrainingState.collect()`; a resume is `check()` (every part against its live counterpart, before any is
loaded, so a checkpoint that does not fit leaves nothing half-restored) then `load()`. New resumable state is
one `register` call.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Optional, Protocol

import torch

from framework.checkpoint import DamagedCheckpoint, validate_rng_state, validate_state
from framework.checkpoint.format import plain_keys
from framework.core import reproducibility
from framework.core.errors import hook_caller
from framework.task.metrics import is_stateful, load_metric_state, metric_state

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# check(saved_part, where): raise DamagedCheckpoint unless the saved part fits the live one.
Check = Callable[[Any, str], None]


@dataclass
class Progress:
    """Where the loop is: what an exact resume continues from, and what a checkpoint's meta.json reports."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    last_val_step: int = -1  # the step of the latest validation
    validations: int = 0  # validations run (a monitored scheduler's `frequency` counts these)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])

    def check_state_dict(self, saved: Any, where: str) -> None:
        # Checkpoints written before a field existed lack it: it keeps its default.
        live = self.state_dict()
        if isinstance(saved, dict):
            saved = {**{k: v for k, v in live.items() if k not in saved}, **saved}
        validate_state(saved, live, where)

    def position(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    # The loop's moves, in the order it makes them.
    def batch_done(self) -> None:
        self.batch_in_epoch += 1

    def stepped(self) -> None:
        self.step += 1

    def validated(self) -> None:
        self.last_val_step = self.step
        self.validations += 1

    def epoch_done(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = 0

    def resume_at_batch(self, batch: int) -> None:
        """A resume mid-epoch on another number of processes: the rest of the epoch, redistributed, starts here."""
        self.batch_in_epoch = batch

    def start_next_epoch(self) -> None:
        """Leave the epoch in progress, if any, for the next one's batch 0 (a resume on new data: the rest of an
        epoch planned on the old data has no meaning on the new). The step count stays."""
        if self.batch_in_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0


class Values:
    """A dict of plain values (the run's metrics) as a stateful part; the dict object itself is kept."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.update(state)


class RngState:
    """Every rank's RNG streams (gathered to rank 0 on save; each rank restores its own on resume)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        own = reproducibility.rng_state(self.strategy.device)
        states = self.strategy.gather_objects(own)  # a collective: every rank saves
        return {f"rank{rank}": state for rank, state in enumerate(states)}

    def _own(self, state: dict[str, Any]) -> Any:
        return state.get(f"rank{self.strategy.rank}", state["rank0"])

    def check_state_dict(self, saved: Any, where: str) -> None:
        if not isinstance(saved, dict) or "rank0" not in saved:
            raise DamagedCheckpoint(f"{where}: no rank0; expected every rank's RNG state")
        validate_rng_state(self._own(saved), f"{where}/rank{self.strategy.rank}", self.strategy.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if f"rank{self.strategy.rank}" not in state:
            log.warning(
                "resume: the checkpoint has no RNG state for rank %d (it ran with %d processes); random "
                "streams restart from rank 0's",
                self.strategy.rank,
                len(state),
            )
        reproducibility.set_rng_state(self._own(state), self.strategy.device)


class TaskParameters:
    """The task's parameters outside its model (a second net, a learnable temperature), trained beside it: saved in
    every checkpoint and restored exactly (its model's are the checkpoint's weights)."""

    def __init__(self, task: torch.nn.Module, model_attr: str) -> None:
        assert model_attr, "a task that is its own model has no parameter outside it"
        self.task, self.prefix = task, model_attr + "."

    def _own(self) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in self.task.named_parameters() if not name.startswith(self.prefix)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self._own().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self._own().items():
                param.copy_(state[name])


class TaskState:
    """The task's own state beside its model, every rank's (a metric's state holds that rank's batches): the
    states of its torchmetrics Metrics (a best-so-far, an epoch mean), its buffers outside the model, and what its
    `on_save_checkpoint(checkpoint)` put in the dict it is given (tensors and plain values), which
    `on_load_checkpoint` gets back."""

    def __init__(self, task: torch.nn.Module, model_attr: str, strategy: Any) -> None:
        self.task, self.model_attr, self.strategy = task, model_attr, strategy

    def _own(self, path: str) -> bool:
        """Beside the model. A task that is its own model (`model_attr` ""): its metrics (their states are in no
        state_dict), nothing else (its buffers are the model's)."""
        return bool(path and self.model_attr) and path != self.model_attr and not path.startswith(self.model_attr + ".")

    def metrics(self) -> dict[str, torch.nn.Module]:
        return {
            path: m
            for path, m in self.task.named_modules()
            if (self._own(path) or not self.model_attr and path) and is_stateful(m)
        }

    def buffers(self) -> dict[str, torch.Tensor]:
        metrics = tuple(f"{path}." for path in self.metrics())
        return {name: b for name, b in self.task.named_buffers() if self._own(name) and not name.startswith(metrics)}

    def local(self, hooks: bool = True) -> dict[str, Any]:
        """This rank's part; `hooks=False`: without calling the task's on_save_checkpoint (a snapshot, not a save)."""
        hook: dict[str, Any] = {}
        save_hook = getattr(self.task, "on_save_checkpoint", None)
        if hooks and callable(save_hook):
            hook_caller("on_save_checkpoint", [(type(self.task).__name__, save_hook)])(hook)
        return {
            "metrics": {path: metric_state(m) for path, m in self.metrics().items()},
            "buffers": {name: b.detach().cpu() for name, b in self.buffers().items()},
            "hook": hook,
        }

    def state_dict(self) -> dict[str, Any]:
        states = self.strategy.gather_objects(self.local())  # a collective: every rank saves
        return {f"rank{rank}": state for rank, state in enumerate(states)}

    def _mine(self, state: dict[str, Any]) -> Any:
        return state.get(f"rank{self.strategy.rank}", state["rank0"])

    def check_state_dict(self, saved: Any, where: str) -> None:
        if not isinstance(saved, dict) or "rank0" not in saved:
            raise DamagedCheckpoint(f"{where}: no rank0; expected every rank's task state")
        mine, where = self._mine(saved), f"{where}/rank{self.strategy.rank}"
        validate_state(mine, {"metrics": {}, "buffers": {}, "hook": {}}, where)
        metrics, buffers = self.metrics(), self.buffers()
        for path, value in mine["metrics"].items():
            if path in metrics:
                validate_state(value, metric_state(metrics[path]), f"{where}/metrics/{path}")
        for name, value in mine["buffers"].items():
            if name in buffers:
                validate_state(value, buffers[name].detach().cpu(), f"{where}/buffers/{name}")

    def load_state_dict(self, state: dict[str, Any], hooks: bool = True) -> None:
        mine = self._mine(state)
        metrics, buffers = self.metrics(), self.buffers()
        for path, value in mine["metrics"].items():
            if path in metrics:
                load_metric_state(metrics[path], value, _device_of(metrics[path]))
        for name, value in mine["buffers"].items():
            if name in buffers:
                with torch.no_grad():
                    buffers[name].copy_(value)
        missing = [p for p in [*metrics, *buffers] if p not in mine["metrics"] and p not in mine["buffers"]]
        if missing and hooks:
            log.info("resume: the task's %s not in the checkpoint: they start fresh", ", ".join(missing))
        load_hook = getattr(self.task, "on_load_checkpoint", None)
        if hooks and callable(load_hook):
            hook_caller("on_load_checkpoint", [(type(self.task).__name__, load_hook)])(dict(mine["hook"]))


def _device_of(metric: torch.nn.Module) -> torch.device:
    """Where a metric's states live (its `device`, torchmetrics keeps it), else the CPU."""
    device = getattr(metric, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


@dataclass
class _Part:
    obj: Stateful
    check: Check
    optional: bool  # may be absent from a checkpoint (written before it existed): it then starts fresh


class TrainingState:
    """The registry. `model` is a callable returning the module whose weights are saved (the unwrapped one)."""

    def __init__(
        self, model: Callable[[], torch.nn.Module], progress: Progress, metrics: dict[str, float], info: dict[str, Any]
    ) -> None:
        self.model, self.progress, self.info = model, progress, info
        self.parts: dict[str, _Part] = {}
        self.register("loop", progress, check=progress.check_state_dict)
        self.register("metrics", Values(metrics), check=lambda saved, where: validate_state(saved, {}, where))

    def register(self, name: str, obj: Stateful, check: Optional[Check] = None, optional: bool = False) -> None:
        """`check(saved, where)` raises DamagedCheckpoint unless the saved part fits; by default the saved part
        must have the structure, dtypes and shapes of `obj.state_dict()` now (`validate_state`)."""
        if name in self.parts:
            raise ValueError(f"state part {name!r} is registered twice")

        def default(saved: Any, where: str) -> None:
            validate_state(saved, obj.state_dict(), where)

        self.parts[name] = _Part(obj, check or default, optional)

    def collect(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """(model weights, state, meta) as a checkpoint holds them. Runs on every rank: parts may gather."""
        state = {name: part.obj.state_dict() for name, part in self.parts.items()}
        meta = {**self.progress.position(), "metrics": state["metrics"], **self.info}
        return plain_keys(self.model().state_dict()), state, meta  # never torch.compile's `_orig_mod.` in a key

    def check(self, state: Any, where: str, skip: tuple[str, ...] = ()) -> None:
        """Every registered part of `state` against its live counterpart; nothing is loaded."""
        if not isinstance(state, dict):
            raise DamagedCheckpoint(f"{where}: its state is {type(state).__name__}; expected a dict of parts")
        missing = [n for n, p in self.parts.items() if n not in state and n not in skip and not p.optional]
        if missing:
            raise DamagedCheckpoint(
                f"{where}: its state lacks {', '.join(missing)}; expected a checkpoint written by this framework"
            )
        for name, part in self.parts.items():
            if name in state and name not in skip:
                part.check(state[name], f"{where}: {name}")

    def load(self, state: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
        """Load every registered part `state` holds (after `check`), in registration order."""
        for name, part in self.parts.items():
            if name in skip:
                continue
            if name in state:
                part.obj.load_state_dict(state[name])
            else:
                log.warning(
                    "resume: the checkpoint has no %s state (written before it was saved); it starts fresh", name
                )
