"""One pass over a split with exact metrics over every rank: validation and test share it.

The pass runs the task's step on the unwrapped (for DDP: rank 0's buffers broadcast) module under `no_grad()` and
`eval()`, over unpadded shards. It sums each step output × batch size on the device and reduces `(sums, count)`
over the ranks once, so the means are exact whatever the shards' sizes. What the task logs goes to the metric
logger's `EvalLog`; the task's epoch hooks run after the last batch, before that is computed, as in Lightning;
then its stateful metrics (`epoch_metrics`, reduced by torchmetrics). The loss it averages from what the steps
return is declared lower-is-better (framework/observe/best.py). Under FSDP a rank with fewer batches runs
empty ones, so every rank gathers the weights as often as the others.

A split with several sets (`data.val_sets`, `data.test_sets`: Lightning's several loaders) runs them in one pass, in
order, between one pair of epoch hooks: each step is given the set's dataloader_idx, each set's names end in `/<set>`
(the default set's keep theirs), and each set's means are over its own samples, reduced with the others' at once.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch
from torch import nn

from framework.callbacks import task_hooks
from framework.data.module import DataModule
from framework.loop.build import limit
from framework.observe.logged import is_metric
from framework.observe.metric_logger import MetricLogger
from framework.parallel.precision import Precision
from framework.parallel.strategy import Strategy
from framework.task.task import Task, as_step_output, swapped


def move_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def _with_index(hook: Optional[Callable[..., Any]], index: Optional[int]) -> Optional[Callable[..., Any]]:
    """A batch hook given `index` as its last argument (dataloader_idx) where not None, as Lightning calls it."""
    if hook is None or index is None:
        return hook
    return lambda *args: hook(*args, index)


def rows(batch: Any, n: int) -> Any:
    """The first `n` samples of a batch (every tensor in it cut along its first dimension)."""
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, (list, tuple)):
        return type(batch)(rows(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: rows(v, n) for k, v in batch.items()}
    return batch


class Evaluator:
    def __init__(
        self,
        *,
        task: Task,
        model_attr: str,
        model: nn.Module,
        data: DataModule,
        strategy: Strategy,
        precision: Precision,
        metric_logger: MetricLogger,
        step_fns: dict[str, Callable[[Any, int], Any]],
        limits: dict[str, Any],
        overfit: int,
    ) -> None:
        """`model`: the run's model as training runs it (evaluation runs `strategy.for_eval` of it in the task's
        place); `limits`: batches per split ("val", "test"; Lightning's limit_*_batches); `overfit`: validate on the
        first `overfit` training batches instead (trainer.overfit_batches)."""
        self.task, self.model_attr, self.model, self.data, self.strategy = task, model_attr, model, data, strategy
        self.precision, self.metric_logger, self.step_fns = precision, metric_logger, step_fns
        self.limits, self.overfit = limits, overfit
        self.device = strategy.device
        self._overfit_kept: Optional[list[Any]] = None

    def overfit_batches(self) -> list[Any]:
        """trainer.overfit_batches: the first N batches of epoch 0's order, kept, for every epoch's training and
        validation (as Lightning does; meant for a few batches)."""
        if self._overfit_kept is None:
            self._overfit_kept = list(itertools.islice(self.data.batches("train", 0), self.overfit))
        return self._overfit_kept

    @torch.no_grad()
    def run(self, split: str, step: int) -> dict[str, float]:
        """Loss, step metrics, logged values and stateful metrics of `split` ("val" or "test"), logged at `step`: of
        every set of the split (`data.sets`), each set's named `<name>/<set>` but the default set's, reduced at once."""
        method = "validation_step" if split == "val" else "test_step"
        hook = "validation" if split == "val" else "test"
        sets = self.data.sets(split)
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        self.task.eval()
        try:
            with (
                swapped(self.task, self.model_attr, self.strategy.for_eval(self.model)),
                self.metric_logger.evaluation(split) as logged,
            ):
                task_hooks.call_if_defined(self.task, f"on_{hook}_epoch_start")
                stateful: dict[str, float] = {}
                for index, (key, name) in enumerate(sets.items()):
                    # Lightning passes dataloader_idx (to the step and the batch hooks) only when there are several.
                    where, suffix = index if len(sets) > 1 else None, f"/{name}" if name else ""
                    with self.metric_logger.evaluation_set(name):
                        self._run_set(split, key, where, suffix, sums, counts)
                    if index < len(sets) - 1:  # each set's own, before the next set's batches update them
                        stateful.update(self.epoch_metrics(split, suffix))
                task_hooks.call_if_defined(self.task, f"on_{hook}_epoch_end")
                stateful.update(self.epoch_metrics(split, f"/{name}" if name else ""))  # the last set's
        finally:
            self.task.train()
        outputs, values = logged.finish(self.strategy, self.task, sums, counts)
        for name in sets.values():
            loss = f"{split}/loss/{name}" if name else f"{split}/loss"
            if loss in outputs and loss not in values:  # the loss the steps returned: ours
                self.metric_logger.best.declare_loss(loss, method)
        metrics = {**outputs, **values, **stateful}
        self.metric_logger.write(metrics, step)
        return metrics

    def _run_set(
        self,
        split: str,
        key: str,
        index: Optional[int],
        suffix: str,
        sums: dict[str, torch.Tensor],
        counts: dict[str, int],
    ) -> None:
        """One set's batches (`key`: its split in the DataModule; `index`: the dataloader_idx its steps are given, or
        None), their step outputs' batch-size-weighted sums added to `sums` as `<name><suffix>`, the set's samples to
        `counts` under the same names."""
        method = "validation_step" if split == "val" else "test_step"
        step_fn, where = self._step(method, index), f"{type(self.task).__name__}.{method}"
        overfit = bool(self.overfit) and key == "val"
        available = self.overfit if overfit else self.data.num_batches(key)
        batches = available if overfit else limit(self.limits[split], available)
        # A sharded model's forward gathers weights from every rank: a rank with fewer batches runs empty ones.
        rounds = max(self.strategy.gather_objects(batches)) if self.strategy.collective_forward else batches
        hook = "validation" if split == "val" else "test"
        batch_start, batch_end = (
            _with_index(task_hooks.bound_if_defined(self.task, f"on_{hook}_batch_{when}"), index)
            for when in ("start", "end")
        )
        names: set[str] = set()
        count, batch = 0, None
        data = self.overfit_batches() if overfit else self.data.batches(key)
        for i, batch in enumerate(itertools.islice(data, batches)):
            batch = move_to(batch, self.device)
            n = self.task.batch_size(batch)
            self.metric_logger.begin_batch(n)
            if batch_start is not None:
                batch_start(batch, i)
            with self.precision.autocast():
                returned = step_fn(batch, i)
            out = as_step_output(returned, where, training=False)
            if batch_end is not None:
                batch_end(returned, batch, i)
            if out is not None:
                for name, value in itertools.chain((("loss", out.loss),), out.metrics.items()):
                    weighted, name = value.detach().float() * n, name + suffix
                    sums[name] = sums[name] + weighted if name in sums else weighted
                    names.add(name)
            count += n
        for _ in range(rounds - batches):
            self.idle_step(step_fn, batch)
        counts.update(dict.fromkeys(names, count))

    def _step(self, method: str, index: Optional[int]) -> Callable[[Any, int], Any]:
        """The step as a callable of `(batch, batch_idx)`, given `index` as its dataloader_idx where not None."""
        step_fn = self.step_fns[method]
        if index is None:
            return step_fn
        return lambda batch, batch_idx: step_fn(batch, batch_idx, index)  # type: ignore[call-arg]

    def epoch_metrics(self, split: str, suffix: str = "") -> dict[str, float]:
        """The task's `epoch_metrics` as `<split>/<name><suffix>` (a set's `/<set>`): a value it computed, or a
        torchmetrics Metric it returned, computed here (over every rank) and reset, its `higher_is_better` its
        direction. Called after each set's batches, the last set's (the only one, mostly) after the epoch-end hook."""
        values: dict[str, float] = {}
        for name, value in self.task.epoch_metrics(split).items():
            key = f"{split}/{name}{suffix}"
            if is_metric(value):
                self.metric_logger.best.declare_metric(key, value)
                values[key] = float(value.compute())
                value.reset()
            else:
                values[key] = float(value)
        return values

    def idle_step(self, step_fn: Callable[[Any, int], Any], batch: Any) -> None:
        """A step on no samples (`batch` cut to none, or this rank's first training batch), for the collectives
        of its forward only: under FSDP every rank must gather each unit's weights as often as the others.
        What it logs is dropped; metrics see no sample."""
        empty = rows(move_to(batch if batch is not None else self.data.first_batch("train"), self.device), 0)
        with torch.no_grad(), self.precision.autocast(), self.metric_logger.discarding():
            step_fn(empty, 0)
