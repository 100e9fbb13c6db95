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
  summary's `val/*` must come from validation only;
- in the steps of a set other than the default one (`data.val_sets`, `data.test_sets`), `/<set>` is appended to the
  name (Lightning's `/dataloader_idx_N`), unless the task passes `add_dataloader_idx=False`.
The trainer's own: the window of per-batch losses (`train/loss` at logging steps, unless the task logs its own
train/loss; `train/loss_epoch`), learning rates, AMP's scale, per-epoch performance. Values stay on the device;
they are read with one host sync per logging step and one per epoch. `TaskHandle` is what a task's
`self.trainer` is: the run's position and this logger, without the trainer (no reference cycle).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from framework.core.errors import ConfigError, UserError
from framework.observe.best import Best
from framework.observe.logged import (
    OWN_LOSS,
    EvalLog,
    TrainLog,
    as_tensor,
    check_reduce_fx,
    metric_path,
    on_device,
    stage_name,
)
from framework.observe.trackers import Trackers


class MetricLogger:
    """The one place a run's numbers go through. `metrics` holds the latest value of every metric (the summary's
    and `callback_metrics`); `window` the training values between logging steps (resumable state)."""

    def __init__(
        self, *, device: torch.device, tensorboard: Any, bar: Any, run_dir: Any, accumulate: int, steps_per_epoch: int
    ) -> None:
        self.device, self.tensorboard, self.bar, self.run_dir = device, tensorboard, bar, run_dir
        self.accumulate, self.steps_per_epoch = accumulate, steps_per_epoch
        self.trackers = Trackers()  # none until the run opens the config's (start_trackers)
        self.metrics: dict[str, float] = {}
        self.best = Best(self.metrics)  # the metrics' declared directions, and best/* kept in `metrics`
        self.window = TrainLog(device)
        self.stage = "train"  # what the task's logs are taken as: train, val or test
        self._in_epoch_hook = False  # a training epoch hook is running: self.log defaults to on_epoch there
        self.eval_log: Optional[EvalLog] = None  # what the task logs in the evaluation running now
        self.set_suffix = ""  # "/<set>" while the steps of a set other than the default one run
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

    def start_trackers(self, trackers: Trackers) -> None:
        """The trackers the run opened (rank 0, once its setup is reported): from here they get every scalar."""
        self.trackers = trackers

    def loggers(self) -> list[Any]:
        """What the numbers go to now: TensorBoard's logger (when on) and the open trackers (Lightning's
        `trainer.loggers`)."""
        return [*([self.tensorboard] if self.tensorboard.enabled else []), *self.trackers.active]

    def _send(self, metrics: dict[str, float], step: int) -> None:
        """To TensorBoard and the trackers: every scalar but what the task logged with logger=False."""
        shown = {k: v for k, v in metrics.items() if k not in self.hidden}
        self.tensorboard.log_metrics(shown, step)
        if self.trackers.active:
            self.trackers.log_metrics(shown, step)

    def commit(self) -> None:
        """Everything logged so far written out, the trackers' kept points included (before a checkpoint: a run
        resumed from it logs only what came after)."""
        self.tensorboard.flush()
        self.trackers.flush(True)

    def close(self) -> None:
        self.tensorboard.close()
        self.trackers.close()

    # -------------------------------------------------------------------------------- the loop's position in it
    def begin_batch(self, samples: int) -> None:
        """A batch of `samples` is stepped: what the task logs in its step is weighted by it."""
        self.batch_n = samples

    def record_loss(self, loss: torch.Tensor) -> None:
        """A training batch's loss (detached), for train/loss at the next logging step and the epoch's mean."""
        self.window.add_loss(loss)

    @contextlib.contextmanager
    def epoch_hook(self) -> Iterator[None]:
        """A training hook outside any step runs: what the task logs in it is an epoch value, as in Lightning."""
        self._in_epoch_hook = True
        try:
            yield
        finally:
            self._in_epoch_hook = False

    @contextlib.contextmanager
    def discarding(self) -> Iterator[None]:
        """What the task logs meanwhile is dropped (an idle step, run for its collectives only)."""
        kept, self.eval_log = self.eval_log, EvalLog("idle", self.device)
        try:
            yield
        finally:
            self.eval_log = kept

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
        best: Optional[str] = None,
        add_dataloader_idx: bool = True,
    ) -> None:
        """Task.log: what each stage does with it is in this module's docstring; `best` declares the direction
        (framework/observe/best.py)."""
        fx = check_reduce_fx(name, reduce_fx) if reduce_fx != "mean" else "mean"
        tensor = as_tensor(name, value)
        if tensor is not None:
            tensor = on_device(tensor, self.device)
        name = stage_name(name, self.stage) + (self.set_suffix if add_dataloader_idx else "")
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
            self.best.declare_logged(name, value, best)
            if tensor is None:
                self.eval_log.add_metric(name, self._metric_path(value, name))
            else:
                self.eval_log.add(name, tensor, fx, weight)
            return
        self._task_train_names.add(name)
        if best is not None:
            self.best.declare_logged(name, value, best)
        on_step = (not self._in_epoch_hook) if on_step is None else on_step
        on_epoch = self._in_epoch_hook if on_epoch is None else on_epoch
        if on_step:
            self._task_step[name] = value if tensor is None else tensor
            if tensor is None and not on_epoch:  # reset at the epoch's end all the same, as Lightning does
                self._step_metrics.add(self._metric_path(value, name))
        if on_epoch:
            epoch_name = f"{name}_epoch" if on_step else name
            if tensor is None:
                self.window.add_metric(epoch_name, self._metric_path(value, name))
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

    @contextlib.contextmanager
    def evaluation_set(self, name: str) -> Iterator[None]:
        """The steps of the set `name` ("": the default set) run meanwhile: what they log is that set's."""
        assert self.eval_log is not None  # within `evaluation`
        self.eval_log.start_set(name)
        self.set_suffix = f"/{name}" if name else ""
        try:
            yield
        finally:
            self.eval_log.start_set("")
            self.set_suffix = ""

    # -------------------------------------------------------------------------------- what is written
    def write(self, metrics: dict[str, float], step: int) -> None:
        """To TensorBoard and the trackers (but what the task logged with logger=False) and the run's metrics.
        Flushed: an evaluation's metrics are in every store before the checkpoint that follows it is saved, so a
        run killed after that checkpoint lost none of them (framework/observe/trackers.py)."""
        self._send(metrics, step)
        self.commit()
        self.metrics.update(metrics)

    def flush(self, step: int, extras: dict[str, float]) -> None:
        """A logging step: the window's mean loss, `extras` (learning rates, AMP's scale), and every value given to
        log() since the last one, read in one host sync (a logged Metric is computed, over every rank); a loss that
        was not finite stops the run, naming its step."""
        window = self.window
        if not window.losses and not (self._task_step or self._logged):  # (a manual step may return no loss)
            return
        losses, stacked, names = self.step_values()
        mean, all_finite, *values = stacked.tolist()
        if not all_finite:
            self.check_finite()
        own = {} if "train/loss" in self._task_train_names or not len(losses) else {"train/loss": mean}
        metrics = {**own, **extras}
        metrics.update({k: v for k, v in self._logged.items() if not isinstance(v, torch.Tensor)})
        metrics.update(zip(names, values))
        task_names = list(self._task_step)
        self._logged.clear()
        self._task_step.clear()
        self._send(metrics, step)
        loss = {"train/loss": mean} if len(losses) else {}
        self.bar.show({**loss, **{k: v for k, v in metrics.items() if k in self.bar_names}})
        self.metrics.update({**own, **{k: metrics[k] for k in task_names}})
        window.count_losses(losses)
        window.next_window(step)

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

    def check_finite(self) -> None:
        """Stop, as a logging step does, where a loss since the last logging step is not finite: asked before a
        checkpoint is written, so that none holds what a NaN or inf loss stepped, nor replaces one written before."""
        bad = self.window.first_not_finite(self.accumulate)
        if bad is not None:
            value, step = bad
            raise UserError(
                f"train/loss became {value} at step {step} (epoch {(step - 1) // self.steps_per_epoch}); "
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
        logged = window.metrics_logged()
        for name, path in logged.items():
            metric: Any = task.get_submodule(path)  # a torchmetrics Metric
            values[name] = float(metric.compute())
            metric.reset()
        for path in self._step_metrics - set(logged.values()):
            stepped: Any = task.get_submodule(path)  # a torchmetrics Metric
            stepped.reset()
        self._step_metrics.clear()
        if values:
            self._send({**values, **extras}, step)
            self.metrics.update(values)
        return values

    def epoch_perf(
        self, step: int, samples: int, batches: int, seconds: float, data_wait: float, max_memory_mb: float
    ) -> None:
        if batches and seconds > 0:
            self._send(
                {
                    "perf/samples_per_s": samples / seconds,
                    "perf/step_ms": 1000 * seconds / batches,
                    "perf/data_wait_frac": data_wait / seconds,
                    "perf/max_memory_mb": max_memory_mb,
                },
                step,
            )
        self.tensorboard.flush()
        self.trackers.flush(False)

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
