"""What one stage logged, kept on the device and reduced where Lightning reduces it: an evaluation's values
(`EvalLog`, reduced over every rank at its end) and training's between logging steps and over an epoch (`TrainLog`,
resumable state); and how a logged value is taken (`as_tensor`, `on_device`, a test's `val/` names as `test/`)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from framework.checkpoint import validate_state
from framework.core.errors import ConfigError
from framework.task.metrics import is_stateful
from framework.task.task import REDUCE_FX


def stage_name(name: str, stage: str) -> str:
    """`name` as logged during `stage`: in a test, `val/x` is `test/x` (and `val_x` is `test_x`)."""
    if stage == "test":
        for prefix in ("val/", "val_"):
            if name.startswith(prefix):
                return "test" + name[3:]
    return name


def check_reduce_fx(name: str, reduce_fx: Any) -> str:
    fx = getattr(reduce_fx, "__name__", reduce_fx)  # torch.mean, torch.max: by their names, as Lightning takes them
    if fx not in REDUCE_FX:
        raise ConfigError(
            f"task: self.log({name!r}, ..., reduce_fx={reduce_fx!r}): expected one of {', '.join(REDUCE_FX)}"
        )
    return str(fx)


def metric_path(task: nn.Module, metric: nn.Module, name: str) -> str:
    """Where a logged Metric lives in the task (every rank finds it there, even one that did not log it)."""
    for path, module in task.named_modules():
        if module is metric:
            return path
    raise ConfigError(
        f"task: self.log({name!r}, <{type(metric).__name__}>): the metric is not an attribute of the "
        "task; expected it assigned in __init__ (self.name = Metric(...)), as in Lightning"
    )


@dataclass
class _Entry:
    fx: str
    total: torch.Tensor  # sum of value x weight (mean), sum (sum), running max/min
    weight: float = 0.0
    set_name: str = ""  # the set whose evaluation logged it ("": the default set, or an epoch hook)


@dataclass
class EvalLog:
    """What one evaluation (validation or test) logged, reduced over every rank by `finish`. `set_name`: the set
    whose batches run now (framework/loop/evaluate.py); a name two sets log is refused (each set's own names differ
    by their suffix, but `add_dataloader_idx=False` takes the name as it is)."""

    stage: str
    device: torch.device
    entries: dict[str, _Entry] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # name -> the logged Metric's path in the task
    set_name: str = ""
    _metric_sets: dict[str, tuple[str, str]] = field(default_factory=dict)  # a Metric's path -> (name, set) logged

    def start_set(self, name: str) -> None:
        """What is logged from here on is the set `name`'s ("": the default set's, or an epoch hook's)."""
        self.set_name = name

    def add_metric(self, name: str, path: str) -> None:
        """A Metric logged (`path`: where it lives in the task), computed over every rank at the end."""
        first = self._metric_sets.setdefault(path, (name, self.set_name))
        if first[1] != self.set_name:
            raise ConfigError(
                f"task: self.log({name!r}, <Metric {path}>) in the set {self.set_name or self.stage!r}: the same "
                f"Metric was logged as {first[0]!r} in the set {first[1] or self.stage!r}, and one Metric holds one "
                "set's state; expected a Metric per set (e.g. an nn.ModuleList indexed by dataloader_idx)"
            )
        self.metrics[name] = path

    def add(self, name: str, value: torch.Tensor, fx: str, weight: int) -> None:
        value = value.to(self.device).reshape(()).float()
        entry = self.entries.get(name)
        if entry is None:
            self.entries[name] = _Entry(fx, value * weight if fx == "mean" else value, float(weight), self.set_name)
            return
        if entry.set_name != self.set_name:
            raise ConfigError(
                f"task: self.log({name!r}, ..., add_dataloader_idx=False) in the sets {entry.set_name or self.stage!r}"
                f" and {self.set_name or self.stage!r}: one name would hold both; expected a name per set, or "
                "add_dataloader_idx=True (each set's own name, docs/logging.md)"
            )
        if fx == "mean":
            entry.total = entry.total + value * weight
        elif fx == "sum":
            entry.total = entry.total + value
        else:
            entry.total = torch.maximum(entry.total, value) if fx == "max" else torch.minimum(entry.total, value)
        entry.weight += weight

    def finish(
        self, strategy: Any, task: nn.Module, extra_sums: dict[str, torch.Tensor], counts: dict[str, int]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """(the step outputs' means, what the task logged), each over every rank, in one all-reduce for the sums
        (`extra_sums`: batch-size-weighted sums of the step outputs, each over the samples `counts` gives it: its
        set's), plus one gather when a max or min was logged, plus torchmetrics' own synchronisation for each logged
        Metric (every rank computes every Metric any rank logged)."""
        gathered = strategy.gather_objects(
            (list(extra_sums), {n: e.fx for n, e in self.entries.items()}, dict(self.metrics))
        )
        names = list(dict.fromkeys(n for ranks, _, _ in gathered for n in ranks))
        logged: dict[str, str] = {}
        metrics: dict[str, str] = {}
        for _, fxs, paths in gathered:
            logged.update(fxs)
            metrics.update(paths)
        summed = [n for n, fx in logged.items() if fx in ("mean", "sum")]
        extreme = [n for n, fx in logged.items() if fx in ("max", "min")]
        zero = torch.zeros((), device=self.device)

        def total(name: str) -> torch.Tensor:
            return self.entries[name].total if name in self.entries else zero

        # One all-reduce: the outputs' sums and the logged totals, then the outputs' samples and the logged weights.
        k, m = len(names), len(summed)
        sums = [*(extra_sums.get(n, zero) for n in names), *(total(n) for n in summed)]
        weights = [float(counts.get(n, 0)) for n in names]
        weights += [self.entries[n].weight if n in self.entries else 0.0 for n in summed]
        summed_up = torch.stack(sums) if sums else zero.new_zeros(0)
        stacked = torch.cat([summed_up, torch.tensor(weights, device=self.device)])
        totals = strategy.all_reduce_sum(stacked).tolist() if len(stacked) else []  # (the same length on every rank)
        reduced, samples = totals[: k + m], totals[k + m :]
        outputs = {f"{self.stage}/{n}": (v / c if c > 0 else math.nan) for n, v, c in zip(names, reduced, samples)}
        values: dict[str, float] = {}
        for name, value, n in zip(summed, reduced[k:], samples[k:]):
            values[name] = value if logged[name] == "sum" else (value / n if n > 0 else math.nan)
        if extreme:
            local = {n: float(self.entries[n].total) for n in extreme if n in self.entries}
            for name in extreme:
                seen = [rank[name] for rank in strategy.gather_objects(local) if name in rank]
                values[name] = (max(seen) if logged[name] == "max" else min(seen)) if seen else math.nan
        for name, path in metrics.items():
            metric: Any = task.get_submodule(path)  # a torchmetrics Metric
            values[name] = float(metric.compute())
            metric.reset()
        return outputs, values


def is_metric(value: Any) -> bool:
    return isinstance(value, nn.Module) and is_stateful(value)


def as_tensor(name: str, value: Any) -> Optional[torch.Tensor]:
    """A logged number or one-element tensor as a detached tensor; None for a Metric; else one line."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"task: self.log({name!r}, <tensor of shape {tuple(value.shape)}>): expected one "
                "number (a scalar tensor, a float, or a torchmetrics Metric)"
            )
        return value.detach()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if is_metric(value):
            return None
        raise ConfigError(
            f"task: self.log({name!r}, <{type(value).__name__}>): expected one number (a scalar "
            "tensor, a float, or a torchmetrics Metric)"
        )
    return torch.tensor(float(value))


OWN_LOSS = "trainer/loss"  # the window's own epoch sum: train/loss_epoch, unless the task logs train/loss itself


class TrainLog:
    """What training logs, kept on the device between logging steps (no host sync per step):
    - `losses`: the per-batch losses since the last logging step (appending costs no kernel launch), the step
      that window started after, and how many of them an epoch's end already counted;
    - `epoch_sums`/`epoch_counts`: running sums (weighted by batch size; or a sum, max or min, `epoch_fx`) of the
      values logged as epoch values (`train/loss` among them), and `epoch_metrics`, the Metrics logged `on_epoch`
      (by their path in the task: their state is the task's, saved with it).
    All of it is saved, so a resumed run logs the same curves as one never interrupted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.losses: list[torch.Tensor] = []
        self.first_step = 0
        self.counted = 0  # leading entries of `losses` already in this epoch's (or the last epoch's) loss sum
        self.epoch_sums: dict[str, torch.Tensor] = {}
        self.epoch_counts: dict[str, float] = {}
        self.epoch_fx: dict[str, str] = {}
        self.epoch_metrics: dict[str, str] = {}

    def add_loss(self, loss: torch.Tensor) -> None:
        """A batch's loss (detached): appending costs no kernel launch."""
        self.losses.append(loss)

    def add_metric(self, name: str, path: str) -> None:
        """A Metric logged on_epoch (`path`: where it lives in the task), computed at the epoch's end."""
        self.epoch_metrics[name] = path

    def metrics_logged(self) -> dict[str, str]:
        """The Metrics logged on_epoch this epoch, by name; forgotten (the epoch is over)."""
        found = dict(self.epoch_metrics)
        self.epoch_metrics.clear()
        return found

    def next_window(self, step: int) -> None:
        """The losses up to `step` are logged: the next window starts after it."""
        self.losses.clear()
        self.first_step, self.counted = step, 0

    def first_not_finite(self, accumulate: int) -> Optional[tuple[float, int]]:
        """The window's first loss that is not finite, and the optimizer step it came in; None if all are (one
        host sync: asked at a logging step that found one, and before each checkpoint)."""
        losses = self.tensor()
        finite = torch.isfinite(losses)
        if bool(finite.all()):
            return None
        first = int((~finite).nonzero()[0])
        return losses[first].item(), self.first_step + first // accumulate + 1

    def tensor(self) -> torch.Tensor:
        if not self.losses:
            return torch.zeros(0, device=self.device)
        return torch.stack([loss.reshape(()) for loss in self.losses]).float()  # a loss of shape [1] too

    def add(self, name: str, value: torch.Tensor, weight: float, fx: str = "mean") -> None:
        value = value.to(self.device).reshape(()).float()
        known = self.epoch_sums.get(name)
        if known is None:
            self.epoch_sums[name] = value * weight if fx == "mean" else value
        elif fx in ("mean", "sum"):
            self.epoch_sums[name] = known + (value * weight if fx == "mean" else value)
        else:
            self.epoch_sums[name] = torch.maximum(known, value) if fx == "max" else torch.minimum(known, value)
        self.epoch_counts[name] = self.epoch_counts.get(name, 0) + weight
        if fx != "mean":
            self.epoch_fx[name] = fx

    def count_losses(self, losses: torch.Tensor) -> None:
        """Add the window's losses not yet counted to the epoch's `train/loss` sum (a mean over batches)."""
        if len(losses) > self.counted:
            self.add(OWN_LOSS, losses[self.counted :].mean(), len(losses) - self.counted)
        self.counted = len(losses)

    def epoch_values(self) -> dict[str, float]:
        """The epoch's values (one host sync), then cleared; the Metrics are the trainer's to compute."""
        names = list(self.epoch_sums)
        if not names:
            return {}
        sums = torch.stack([self.epoch_sums[n].reshape(()).float() for n in names]).tolist()
        values = {
            n: (total if self.epoch_fx.get(n, "mean") != "mean" else total / self.epoch_counts[n])
            for n, total in zip(names, sums)
        }
        self.epoch_sums.clear()
        self.epoch_counts.clear()
        self.epoch_fx.clear()
        return values

    def state_dict(self) -> dict[str, Any]:
        return {
            "first_step": self.first_step,
            "losses": self.tensor(),
            "counted": self.counted,
            "epoch_sums": dict(self.epoch_sums),
            "epoch_counts": dict(self.epoch_counts),
            "epoch_fx": dict(self.epoch_fx),
            "epoch_metrics": dict(self.epoch_metrics),
        }

    @staticmethod
    def check_state_dict(saved: Any, where: str) -> None:
        """Checkpoints written before `epoch_fx`/`epoch_metrics` existed lack them."""
        live = TrainLog(torch.device("cpu")).state_dict()
        if isinstance(saved, dict):
            saved = {**{k: v for k, v in live.items() if k not in saved}, **saved}
        validate_state(saved, live, where)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first_step, self.counted = state["first_step"], state["counted"]
        self.losses = list(state["losses"].to(self.device).unbind())
        # Checkpoints written before the task could log its own train/loss kept the window's sum under that name.
        renamed = {"train/loss": OWN_LOSS} if "epoch_fx" not in state else {}
        self.epoch_sums = {renamed.get(k, k): v.to(self.device) for k, v in state["epoch_sums"].items()}
        self.epoch_counts = {renamed.get(k, k): v for k, v in state["epoch_counts"].items()}
        self.epoch_fx = dict(state.get("epoch_fx", {}))  # absent from checkpoints written before it existed
        self.epoch_metrics = dict(state.get("epoch_metrics", {}))


def on_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A logged tensor, detached and whole (see _whole), on the metric logger's device: there it stacks with the
    loss at the next logging step or the epoch's end (a CPU value beside a CUDA loss would raise there). A copy
    from the CPU is non-blocking: no host sync in the step that logs it."""
    value = _whole(value.detach())
    return value if value.device == device else value.to(device, non_blocking=value.device.type == "cpu")


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor (a value computed from sharded parameters, e.g. a gradient norm under FSDP) as the whole tensor,
    on every rank (a collective: every rank logs it at the same point); any other tensor as it is. Without
    torch.distributed.tensor imported (no FSDP), no DTensor can exist, and the import is not paid for."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return value.full_tensor() if dtensor is not None and isinstance(value, dtensor.DTensor) else value
