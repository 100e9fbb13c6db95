"""The metric logger: everything a run logs, kept per stage and reduced where Lightning reduces it, then written to
TensorBoard, the progress bar and the run's metrics (what the summary and callbacks see).

What a task logs with `self.log`:
- in a training step (`on_step`, the default there): the latest value, written at the next logging step; a
  torchmetrics `Metric` is computed then (its value over the epoch so far);
- as an epoch value (`on_epoch`; the default in training epoch hooks, and always in validation and test): the
  epoch's mean weighted by batch size (or its sum, max or min: `reduce_fx`), over every rank in evaluation; a
  `Metric` is computed over every rank (by torchmetrics) and reset at the epoch's end, after the task's epoch-end
  hook, as Lightning does;
- in a test, a `val/` (or `val_`) name is logged as `test/`: Task.test_step runs validation_step by default, and a
  summary's `val/*` must come from validation only.
The trainer's own: the window of per-batch losses (`train/loss` at logging steps, unless the task logs its own
train/loss; `train/loss_epoch`), learning rates, AMP's scale, per-epoch performance. Values stay on the device;
they are read with one host sync per logging step and one per epoch. `TaskHandle` is what a task's
`self.trainer` is: the run's position and this logger, without the trainer (no reference cycle).
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from framework.checkpoint import validate_state
from framework.core.errors import ConfigError, UserError
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


@dataclass
class EvalLog:
    """What one evaluation (validation or test) logged, reduced over every rank by `finish`."""

    stage: str
    device: torch.device
    entries: dict[str, _Entry] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # name -> the logged Metric's path in the task

    def add(self, name: str, value: torch.Tensor, fx: str, weight: int) -> None:
        value = value.to(self.device).reshape(()).float()
        entry = self.entries.get(name)
        if entry is None:
            self.entries[name] = _Entry(fx, value * weight if fx == "mean" else value, float(weight))
            return
        if fx == "mean":
            entry.total = entry.total + value * weight
        elif fx == "sum":
            entry.total = entry.total + value
        else:
            entry.total = torch.maximum(entry.total, value) if fx == "max" else torch.minimum(entry.total, value)
        entry.weight += weight

    def finish(
        self, strategy: Any, task: nn.Module, extra_sums: dict[str, torch.Tensor], count: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        """(the step outputs' means, what the task logged), each over every rank, in one all-reduce for the sums
        (`extra_sums`: batch-size-weighted sums of the step outputs, over `count` samples), plus one gather when a
        max or min was logged, plus torchmetrics' own synchronisation for each logged Metric (every rank computes
        every Metric any rank logged)."""
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

        def weight(name: str) -> torch.Tensor:
            return torch.tensor(self.entries[name].weight if name in self.entries else 0.0, device=self.device)

        stacked = torch.stack(
            [
                *(extra_sums.get(n, zero) for n in names),
                torch.tensor(float(count), device=self.device),
                *(total(n) for n in summed),
                *(weight(n) for n in summed),
            ]
        )
        totals = strategy.all_reduce_sum(stacked).tolist()
        samples = totals[len(names)]
        outputs = {
            f"{self.stage}/{n}": (v / samples if samples > 0 else math.nan) for n, v in zip(names, totals[: len(names)])
        }
        k, rest = len(summed), totals[len(names) + 1 :]
        values: dict[str, float] = {}
        for name, value, n in zip(summed, rest[:k], rest[k:]):
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
        self.losses[:] = list(state["losses"].to(self.device).unbind())  # in place: the loop holds this list
        # Checkpoints written before the task could log its own train/loss kept the window's sum under that name.
        renamed = {"train/loss": OWN_LOSS} if "epoch_fx" not in state else {}
        self.epoch_sums = {renamed.get(k, k): v.to(self.device) for k, v in state["epoch_sums"].items()}
        self.epoch_counts = {renamed.get(k, k): v for k, v in state["epoch_counts"].items()}
        self.epoch_fx = dict(state.get("epoch_fx", {}))  # absent from checkpoints written before it existed
        self.epoch_metrics = dict(state.get("epoch_metrics", {}))


class MetricLogger:
    """The one place a run's numbers go through. `metrics` holds the latest value of every metric (the summary's
    and `callback_metrics`); `window` the training values between logging steps (resumable state)."""

    def __init__(
        self, *, device: torch.device, tensorboard: Any, bar: Any, run_dir: Any, accumulate: int, steps_per_epoch: int
    ) -> None:
        self.device, self.tensorboard, self.bar, self.run_dir = device, tensorboard, bar, run_dir
        self.accumulate, self.steps_per_epoch = accumulate, steps_per_epoch
        self.metrics: dict[str, float] = {}
        self.window = TrainLog(device)
        self.stage = "train"  # what the task's logs are taken as: train, val or test
        self.epoch_hook = False  # a training epoch hook is running: self.log defaults to on_epoch there
        self.eval_log: Optional[EvalLog] = None  # what the task logs in the evaluation running now
        self.batch_n = 1  # samples in the batch being stepped: the weight of what the task logs
        self.forbidden = ""  # the hook running now where self.log is refused (on_validation_end, ...)
        self._task: Optional[Callable[[], Optional[nn.Module]]] = None  # a weak reference: the task holds us
        self._paths: dict[int, str] = {}  # a logged Metric's path in the task, found once
        self._logged: dict[str, Any] = {}  # values given to Trainer.log(), written at the next logging step
        self._task_step: dict[str, Any] = {}  # the task's on_step values (or Metrics) for the next logging step
        self._task_train_names: set[str] = set()  # what the task logs in training (its train/loss replaces ours)
        self._step_metrics: set[str] = set()  # Metrics logged on_step only (their paths): reset at the epoch's end
        self.bar_names: set[str] = set()  # what the task asked to see in the progress bar
        self.hidden: set[str] = set()  # what the task logged with logger=False: not written to TensorBoard

    def attach(self, task: nn.Module) -> None:
        self._task = weakref.ref(task)

    def _metric_path(self, metric: nn.Module, name: str) -> str:
        path = self._paths.get(id(metric))
        if path is None:
            task = self._task() if self._task is not None else None
            path = self._paths[id(metric)] = metric_path(task, metric, name) if task is not None else ""
        return path

    # -------------------------------------------------------------------------------- what is logged
    def log(self, name: str, value: Any) -> None:
        """Trainer.log (callbacks): a scalar for the next logging step (a tensor is read then, with the loss)."""
        self._logged[name] = on_device(value, self.device) if isinstance(value, torch.Tensor) else value

    def task_log(
        self,
        name: str,
        value: Any,
        *,
        on_step: Optional[bool] = None,
        on_epoch: Optional[bool] = None,
        prog_bar: bool = False,
        logger: bool = True,
        reduce_fx: Any = "mean",
        batch_size: Optional[int] = None,
    ) -> None:
        """Task.log: what each stage does with it is in this module's docstring."""
        fx = check_reduce_fx(name, reduce_fx) if reduce_fx != "mean" else "mean"
        tensor = as_tensor(name, value)
        if tensor is not None:
            tensor = on_device(tensor, self.device)
        name = stage_name(name, self.stage)
        if self.forbidden:
            raise ConfigError(
                f"task: self.log({name!r}, ...) in {self.forbidden}: Lightning does not allow it there "
                "either; expected it in a step or an epoch hook (on_validation_epoch_end, "
                "on_train_epoch_end)"
            )
        if prog_bar:
            self.bar_names.add(name)
        if not logger:
            self.hidden.update((name, f"{name}_epoch"))
        weight = batch_size if batch_size is not None else self.batch_n
        if self.eval_log is not None:
            if tensor is None:
                self.eval_log.metrics[name] = self._metric_path(value, name)
            else:
                self.eval_log.add(name, tensor, fx, weight)
            return
        self._task_train_names.add(name)
        on_step = (not self.epoch_hook) if on_step is None else on_step
        on_epoch = self.epoch_hook if on_epoch is None else on_epoch
        if on_step:
            self._task_step[name] = value if tensor is None else tensor
            if tensor is None and not on_epoch:  # reset at the epoch's end all the same, as Lightning does
                self._step_metrics.add(self._metric_path(value, name))
        if on_epoch:
            epoch_name = f"{name}_epoch" if on_step else name
            if tensor is None:
                self.window.epoch_metrics[epoch_name] = self._metric_path(value, name)
            else:
                self.window.add(epoch_name, tensor, weight, fx)

    @contextlib.contextmanager
    def no_logging(self, hook: str) -> Iterator[None]:
        """During `hook` (one Lightning allows no self.log in), what the task logs is refused."""
        self.forbidden = hook
        try:
            yield
        finally:
            self.forbidden = ""

    @contextlib.contextmanager
    def evaluation(self, split: str) -> Iterator[EvalLog]:
        """What the task logs meanwhile is part of this evaluation of `split`."""
        self.stage, self.eval_log = split, EvalLog(split, self.device)
        try:
            yield self.eval_log
        finally:
            self.stage, self.eval_log, self.batch_n = "train", None, 1

    # -------------------------------------------------------------------------------- what is written
    def write(self, metrics: dict[str, float], step: int) -> None:
        """To TensorBoard and the trackers (but what the task logged with logger=False) and the run's metrics.
        Flushed: an evaluation's metrics are in every store before the checkpoint that follows it is saved, so a
        run killed after that checkpoint lost none of them (framework/observe/trackers.py)."""
        self.tensorboard.log_metrics({k: v for k, v in metrics.items() if k not in self.hidden}, step)
        self.tensorboard.flush(trackers_now=True)
        self.metrics.update(metrics)

    def flush(self, step: int, extras: dict[str, float]) -> None:
        """A logging step: the window's mean loss, `extras` (learning rates, AMP's scale), and every value given to
        log() since the last one, read in one host sync (a logged Metric is computed, over every rank); a loss that
        was not finite stops the run, naming its step."""
        window = self.window
        if not window.losses:
            return
        losses, stacked, names = self.step_values()
        mean, all_finite, *values = stacked.tolist()
        if not all_finite:
            self._not_finite(losses, torch.isfinite(losses))
        own = {} if "train/loss" in self._task_train_names else {"train/loss": mean}  # the task's own wins
        metrics = {**own, **extras}
        metrics.update({k: v for k, v in self._logged.items() if not isinstance(v, torch.Tensor)})
        metrics.update(zip(names, values))
        task_names = list(self._task_step)
        self._logged.clear()
        self._task_step.clear()
        self.tensorboard.log_metrics({k: v for k, v in metrics.items() if k not in self.hidden}, step)
        self.bar.show({"train/loss": mean, **{k: v for k, v in metrics.items() if k in self.bar_names}})
        self.metrics.update({**own, **{k: metrics[k] for k in task_names}})
        window.count_losses(losses)
        window.losses.clear()  # in place: the loop holds this list
        window.first_step, window.counted = step, 0

    def step_values(self) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """What a logging step reads, on the device: the window's losses, and stacked, their mean, whether all were
        finite, then each tensor given to log() or the task's on_step self.log since the last logging step (a
        logged Metric computed now, over every rank), whose names come third. Everything logged in training was
        put on the logger's device when it was logged, so this one stack meets no other device."""
        losses = self.window.tensor()
        logged = {name: v for name, v in self._logged.items() if isinstance(v, torch.Tensor)}
        logged.update({k: (v.compute() if not isinstance(v, torch.Tensor) else v) for k, v in self._task_step.items()})
        stacked = torch.stack(
            [losses.mean(), torch.isfinite(losses).all().float(), *(v.reshape(()).float() for v in logged.values())]
        )
        return losses, stacked, list(logged)

    def _not_finite(self, losses: torch.Tensor, finite: torch.Tensor) -> None:
        first = int((~finite).nonzero()[0])
        bad_step = self.window.first_step + first // self.accumulate + 1
        epoch = (bad_step - 1) // self.steps_per_epoch
        raise UserError(
            f"train/loss became {losses[first].item()} at step {bad_step} (epoch {epoch}); "
            f"training stopped, and what was already written in {self.run_dir} is kept. "
            "Expected a finite loss: try a lower optimizer.lr or set trainer.grad_clip_norm"
        )

    def end_epoch(self, task: nn.Module, step: int, extras: dict[str, float]) -> dict[str, float]:
        """The epoch's values of train/loss (as train/loss_epoch) and of what the task logged `on_epoch` (one host
        sync); the Metrics it logged are computed over every rank, then reset. `extras` (the LR) are written too."""
        window = self.window
        window.count_losses(window.tensor())
        values = window.epoch_values()
        own = values.pop(OWN_LOSS, None)
        if own is not None and "train/loss" not in self._task_train_names:
            values["train/loss_epoch"] = own
        for name, path in window.epoch_metrics.items():
            metric: Any = task.get_submodule(path)  # a torchmetrics Metric
            values[name] = float(metric.compute())
            metric.reset()
        for path in self._step_metrics - set(window.epoch_metrics.values()):
            stepped: Any = task.get_submodule(path)  # a torchmetrics Metric
            stepped.reset()
        window.epoch_metrics.clear()
        self._step_metrics.clear()
        if values:
            self.tensorboard.log_metrics({**{k: v for k, v in values.items() if k not in self.hidden}, **extras}, step)
            self.metrics.update(values)
        return values

    def record_best(self, val: dict[str, float]) -> None:
        """best/<name> over the run: the lowest loss or perplexity, the highest of the rest."""
        for name, value in val.items():
            best = self.metrics.get(f"best/{name}", value)
            lower = "loss" in name or "ppl" in name or "perplexity" in name
            self.metrics[f"best/{name}"] = min(best, value) if lower else max(best, value)

    def epoch_perf(
        self, step: int, samples: int, batches: int, seconds: float, data_wait: float, max_memory_mb: float
    ) -> None:
        if batches and seconds > 0:
            self.tensorboard.log_metrics(
                {
                    "perf/samples_per_s": samples / seconds,
                    "perf/step_ms": 1000 * seconds / batches,
                    "perf/data_wait_frac": data_wait / seconds,
                    "perf/max_memory_mb": max_memory_mb,
                },
                step,
            )
        self.tensorboard.flush()

    def report_epoch(
        self,
        step: int,
        train: dict[str, float],
        val: Optional[dict[str, float]],
        samples_per_s: float,
        eta: Optional[float],
    ) -> None:
        """The epoch's line (piped output) or the bar's closing state (a terminal)."""
        if not self.bar.enabled:
            return
        shown = {**{k: v for k, v in train.items() if k == "train/loss_epoch" or k in self.bar_names}, **(val or {})}
        self.bar.end_epoch(
            step, {("train/loss" if k == "train/loss_epoch" else k): v for k, v in shown.items()}, samples_per_s, eta
        )


class TaskHandle:
    """What a task's `self.trainer` is during a run: Lightning's names for where the run is (`global_step`,
    `current_epoch`, `is_global_zero`, `callback_metrics`, `max_epochs`, `max_steps`, `logger`), `log_from_task`
    for `self.log`, and `should_stop` to end the run as Lightning's `self.trainer.should_stop = True` does. It
    knows the logger, the loop's position and the stop, never the trainer: no reference cycle."""

    def __init__(
        self,
        metric_logger: MetricLogger,
        progress: Any,
        stop: Any,
        *,
        is_global_zero: bool,
        world_size: int,
        max_epochs: int,
        max_steps: int,
    ) -> None:
        self._metrics, self._progress, self._stop = metric_logger, progress, stop
        self.is_global_zero, self.world_size = is_global_zero, world_size
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.log_from_task = metric_logger.task_log

    @property
    def logger(self) -> Any:
        return self._metrics.tensorboard

    @property
    def global_step(self) -> int:
        return self._progress.step

    @property
    def current_epoch(self) -> int:
        return self._progress.epoch

    @property
    def callback_metrics(self) -> dict[str, float]:
        return self._metrics.metrics

    @property
    def should_stop(self) -> bool:
        return bool(self._stop.reason)

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        if value:
            self._stop.request("the task set trainer.should_stop")


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
