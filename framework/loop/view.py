"""What a callback's `trainer` and a task's `self.trainer` are during a run: Lightning's names for where the run is
and what it holds (`global_step`, `current_epoch`, `callback_metrics`, `is_global_zero`, `logger`, `model`, ...),
`log` and `request_stop` to act on it, and `log_from_task` behind `Task.log`.

It holds the parts it answers from, never the Trainer nor the task: the task keeps it as `self.trainer`, so nothing of
the run refers back to the task, and a finished run is freed without a collection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from framework.checkpoint.state import Progress
from framework.data.module import DataModule
from framework.loop.manual import TaskOptimizers
from framework.loop.stop import Stop
from framework.observe.metric_logger import MetricLogger
from framework.parallel.strategy import Strategy


class RunView:
    """Lightning's Trainer names over a run's parts. `model` is the task's model as the loop runs it (wrapped by
    DDP/DP; `trainer.compile` compiles it in place), `module` the model itself, unwrapped: what is saved, exported and
    averaged."""

    def __init__(
        self,
        parts: Any,
        param_group_names: list[str],
        metric_logger: MetricLogger,
        progress: Progress,
        stop: Stop,
        strategy: Strategy,
        limits: Any,
        run_dir: Path,
    ) -> None:
        """`parts`: the run's components (framework/loop/build.py): its model, data and optimizer are named here;
        `limits`: its lengths (framework/loop/run.py)."""
        self._metrics, self._progress, self._stop, self._strategy = metric_logger, progress, stop, strategy
        self.model, self.datamodule, self.scheduler = parts.model, parts.data, parts.scheduler
        self.optimizers = list(parts.optimizers)  # Lightning's trainer.optimizers: the torch optimizers
        self.task_optimizers = TaskOptimizers(parts.optimizers, parts.precision)  # what Task.optimizers() reaches
        self.param_group_names, self.logger, self.run_dir = param_group_names, metric_logger.tensorboard, run_dir
        self.max_epochs, self.max_steps = limits.max_epochs, limits.max_steps
        self.log_every_n_steps = limits.log_every_n_steps
        self.log_from_task = metric_logger.task_log  # Task.log

    # ------------------------------------------------------------------ where the run is
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
    def is_global_zero(self) -> bool:
        return self._strategy.is_rank_zero

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def global_rank(self) -> int:
        return self._strategy.rank

    # ------------------------------------------------------------------ what it holds
    @property
    def data(self) -> DataModule:
        """The DataModule (Lightning's `trainer.datamodule`, also by that name)."""
        return self.datamodule

    @property
    def loggers(self) -> list[Any]:
        """Lightning's list of loggers: TensorBoard's (its SummaryWriter is `.experiment`) when it is on, then the
        open trackers (CSV, MLflow, W&B; rank 0's, once the run has reported its setup)."""
        return self._metrics.loggers()

    @property
    def module(self) -> nn.Module:
        return self._strategy.unwrap(self.model)

    # ------------------------------------------------------------------ acting on it
    @property
    def should_stop(self) -> bool:
        return bool(self._stop.reason)

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        """Lightning's `trainer.should_stop = True` (a callback's or the task's): request_stop without a reason."""
        if value:
            self._stop.request("trainer.should_stop was set")

    @property
    def stop_reason(self) -> str:
        return self._stop.reason

    def request_stop(self, reason: str) -> None:
        """Stop at the next optimizer-step boundary (every rank at the same one, once trainer.min_epochs and
        min_steps are reached); `reason` goes to the console and summary.json. The first reason given wins."""
        self._stop.request(reason)

    def log(self, name: str, value: Union[float, torch.Tensor]) -> None:
        """A scalar for TensorBoard at the next logging step (a tensor is read then, with the loss: no sync)."""
        self._metrics.log(name, value)
