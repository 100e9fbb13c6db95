"""The Trainer: builds every component from the config, then runs fit -> validate -> test.

One training step, top to bottom, is in `_train_epoch`: batch -> autocast forward -> backward ->
(every `accumulate_grad_batches`) unscale/clip/step -> scheduler -> log. Everything else is a call into
the module that owns the concern; this file is the only place that knows them all.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

from framework import reproducibility
from framework.data import DataModule
from framework.errors import ConfigError, UserError
from framework.instantiate import build
from framework.loggers import ProgressBar, TensorBoardLogger, print_summary, write_json
from framework.model_summary import summarize
from framework.optim import build_optimizer, build_scheduler, describe_groups, format_groups, group_names, lr_plan
from framework.parallel import build_strategy
from framework.precision import Precision
from framework.task import Task

log = logging.getLogger(__name__)


def move_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def _limit(limit: Union[int, float], available: int) -> int:
    """Lightning's limit_*_batches: an int is a count, a float a fraction of the epoch."""
    if isinstance(limit, float):
        return max(1, int(available * limit)) if available else 0
    return min(limit, available)


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        t = cfg.trainer
        self.fast_dev_run = t.fast_dev_run
        self.max_steps = 1 if self.fast_dev_run else t.max_steps
        self.max_epochs = 1 if self.fast_dev_run else t.max_epochs
        self.accumulate = t.accumulate_grad_batches
        self.log_every = t.log_every_n_steps

        reproducibility.set_deterministic(t.deterministic)
        reproducibility.seed_everything(cfg.seed)
        self.strategy = build_strategy(cfg.parallel, t.device)
        self.device = self.strategy.device
        # Under torchrun only rank 0 made a run directory (see app.py); every rank uses that one.
        self.run_dir = Path(self.strategy.broadcast_object(str(run_dir)))

        self.data = build(cfg.data, "data")
        if not isinstance(self.data, DataModule):
            raise ConfigError(f"data._target_={cfg.data._target_!r}: expected a framework.data.DataModule "
                              f"(or subclass), got {type(self.data).__name__}")
        self.data.setup(seed=cfg.seed, rank=self.strategy.rank, world_size=self.strategy.world_size)

        model = build(cfg.model, "model")
        self.task: Task = build(cfg.task, "task", partial=True, provided=("model",))(model=model)
        if not isinstance(self.task, Task):
            raise ConfigError(f"task._target_={cfg.task._target_!r}: expected a framework.task.Task subclass")
        self.task.to(self.device)
        self.optimizer, self.frozen = build_optimizer(cfg.optimizer, self.task.model)
        self.train_batches = _limit(1 if self.fast_dev_run else t.limit_train_batches, self.data.num_batches("train"))
        if self.train_batches == 0:
            raise ConfigError("data.train: the training set gives no batch (is it empty, or smaller than "
                              "data.batch_size with data.drop_last=true?)")
        self.steps_per_epoch = math.ceil(self.train_batches / self.accumulate)
        self.scheduler = build_scheduler(cfg.scheduler, self.optimizer, max_steps=self.max_steps,
                                         max_epochs=self.max_epochs, steps_per_epoch=self.steps_per_epoch)
        self.precision = Precision(cfg.precision.mode.value, self.device)
        self.params = [p for p in self.task.parameters() if p.requires_grad]
        if t.compile:
            self.task.model = torch.compile(self.task.model)
        self.task.model = self.strategy.wrap(self.task.model)

        rank_zero = self.strategy.is_rank_zero
        self.logger = TensorBoardLogger(self.run_dir, enabled=rank_zero and cfg.logger.tensorboard
                                        and not self.fast_dev_run)
        self.bar = ProgressBar(enabled=rank_zero and cfg.logger.progress_bar)

        self.step = 0  # optimizer steps taken
        self.epoch = 0  # epochs completed
        self.batch_in_epoch = 0  # batches of the current epoch already consumed
        self.metrics: dict[str, float] = {}  # latest value of every metric, for the summary
        self._last_val_step = -1
        # Per-batch losses of the current logging window, kept on device: no host sync until a log step.
        self._losses = torch.zeros(self.log_every * self.accumulate + self.accumulate, device=self.device)
        self._n_losses = 0
        self._window_first_step = 0

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        self._describe_setup()
        if self.cfg.trainer.dry_run:
            self.logger.close()
            return {}
        try:
            while not self._finished():
                self._train_epoch()
                if self.batch_in_epoch >= self.train_batches:  # a whole epoch, not a max_steps stop
                    self.epoch += 1
                    self.batch_in_epoch = 0
                    if self.data.has("val") and self.epoch % self.cfg.trainer.val_every_n_epochs == 0:
                        self._validate()
            self._flush_train_log()
            if self.data.has("val") and self._last_val_step != self.step:
                self._validate()  # the summary always reports the final weights
            if self.cfg.trainer.test and self.data.has("test"):
                self._record(self._evaluate("test"))
            summary = self._summary(time.perf_counter() - start)
        finally:
            self.bar.close()
            self.logger.close()
            self.strategy.teardown()
        if self.strategy.is_rank_zero:
            write_json(self.run_dir / "summary.json", summary)
            print_summary(summary, self.run_dir)
        return summary

    def _describe_setup(self) -> None:
        """What a user checks before trusting a run: parameter groups, LR plan, config (and, in a dry run,
        the model summary). Printed and written by rank 0 only."""
        if not self.strategy.is_rank_zero:
            return
        per_device, world = self.data.batch_size, self.strategy.world_size
        log.info("Global batch: %d per process x %d process%s x %d accumulated = %d samples per optimizer step",
                 per_device, world, "es" if world > 1 else "", self.accumulate, per_device * world * self.accumulate)
        log.info("Parameter groups:\n%s", format_groups(self.optimizer, self.frozen))
        write_json(self.run_dir / "param_groups.json", describe_groups(self.optimizer))
        plan = lr_plan(self.scheduler, self.optimizer, self.steps_per_epoch) if self.scheduler else {}
        for name, points in plan.items():
            for step, lr in points:
                self.logger.log_metrics({f"lr_plan/{name}": lr}, step)
        self.logger.log_text("config", "```yaml\n" + OmegaConf.to_yaml(self.cfg, resolve=True) + "```")
        if self.cfg.trainer.dry_run:
            batch = move_to(next(iter(self.data.batches("train"))), self.device)
            model = self.strategy.unwrap(self.task.model)
            log.info("Model:\n%s", summarize(model, lambda: self.task.validation_step(batch)))
            for name, points in plan.items():
                shown = [points[round(i * (len(points) - 1) / 10)] for i in range(11)]
                log.info("LR plan of group '%s' (step: lr): %s", name,
                         ", ".join(f"{step}: {lr:.4g}" for step, lr in shown))
            log.info("Dry run: everything built; exiting without training (trainer.dry_run=true).")

    def _finished(self) -> bool:
        if self.max_steps > 0:  # max_steps, when set, alone decides the length of the run
            return self.step >= self.max_steps
        return self.epoch >= self.max_epochs

    # ------------------------------------------------------------------ one epoch of training
    def _train_epoch(self) -> None:
        self.task.train()
        self.bar.start_epoch(self.epoch, self.train_batches, initial=self.batch_in_epoch)
        batches = self.data.batches("train", self.epoch, start_batch=self.batch_in_epoch)
        epoch_start, samples, first_batch = time.perf_counter(), 0, self.batch_in_epoch
        for batch in itertools.islice(batches, self.train_batches - self.batch_in_epoch):
            batch = move_to(batch, self.device)
            with self.precision.autocast():
                out = self.task.training_step(batch)
            self.precision.backward(out.loss / self.accumulate)
            self._losses[self._n_losses] = out.loss.detach()
            self._n_losses += 1
            self.batch_in_epoch += 1
            samples += self.task.batch_size(batch)
            self.bar.update()
            if self.batch_in_epoch % self.accumulate == 0 or self.batch_in_epoch == self.train_batches:
                self._optimizer_step()
                if self.step % self.log_every == 0:
                    self._flush_train_log()
                if self.max_steps > 0 and self.step >= self.max_steps:
                    break
        seconds = time.perf_counter() - epoch_start
        batches_run = self.batch_in_epoch - first_batch
        if batches_run and seconds > 0:
            self.logger.log_metrics({"perf/samples_per_s": samples / seconds,
                                     "perf/step_ms": 1000 * seconds / batches_run}, self.step)
        self.logger.flush()

    def _optimizer_step(self) -> None:
        t = self.cfg.trainer
        stepped = self.precision.step(self.optimizer, self.params, t.grad_clip_norm, t.grad_clip_value)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        # The scheduler follows the optimizer, and does not advance for a step the GradScaler skipped.
        s = self.scheduler
        if stepped and s is not None and s.interval == "step" and self.step % s.frequency == 0:
            s.scheduler.step()

    def _flush_train_log(self) -> None:
        """Log the window's mean loss (the one host sync of the window) and stop if any loss was not finite."""
        if self._n_losses == 0:
            return
        losses = self._losses[: self._n_losses]
        finite = torch.isfinite(losses)
        mean, all_finite = torch.stack([losses.mean(), finite.all().float()]).tolist()
        if not all_finite:
            first = int((~finite).nonzero()[0])
            bad_step = self._window_first_step + first // self.accumulate + 1
            epoch = (bad_step - 1) // self.steps_per_epoch
            raise UserError(f"train/loss became {losses[first].item()} at step {bad_step} (epoch {epoch}); "
                            f"training stopped, and what was already written in {self.run_dir} is kept. "
                            "Expected a finite loss: try a lower optimizer.lr or set trainer.grad_clip_norm")
        metrics = {"train/loss": mean, "epoch": float(self.epoch)}
        for name, group in zip(group_names(self.optimizer), self.optimizer.param_groups):
            metrics[f"lr/{name}"] = group["lr"]
        if self.precision.scaler is not None:
            metrics["amp/scale"] = self.precision.scaler.get_scale()
            metrics["amp/skipped_steps"] = float(self.precision.skipped_steps)
        self.logger.log_metrics(metrics, self.step)
        self.bar.show({"train/loss": mean})
        self._record({"train/loss": mean})
        self._n_losses, self._window_first_step = 0, self.step

    # ------------------------------------------------------------------ evaluation
    def _validate(self) -> None:
        metrics = self._evaluate("val")
        self._record(metrics)
        self._last_val_step = self.step
        s = self.scheduler
        if s is not None and s.interval == "epoch" and self.epoch % s.frequency == 0:
            if s.monitor is None:
                s.scheduler.step()
            elif s.monitor not in metrics:
                raise ConfigError(f"scheduler.monitor={s.monitor!r}: no such metric; expected one of "
                                  f"{', '.join(metrics)}")
            else:
                s.scheduler.step(metrics[s.monitor])

    @torch.no_grad()
    def _evaluate(self, split: str) -> dict[str, float]:
        """Average loss and metrics over `split`, weighted by batch size and reduced over all ranks."""
        t = self.cfg.trainer
        limit = 1 if self.fast_dev_run else (t.limit_val_batches if split == "val" else t.limit_test_batches)
        step_fn = self.task.validation_step if split == "val" else self.task.test_step
        wrapped = self.task.model
        self.task.model = self.strategy.for_eval(wrapped)
        self.task.eval()
        sums: dict[str, torch.Tensor] = {}
        count = 0
        for batch in itertools.islice(self.data.batches(split), _limit(limit, self.data.num_batches(split))):
            batch = move_to(batch, self.device)
            with self.precision.autocast():
                out = step_fn(batch)
            n = self.task.batch_size(batch)
            for name, value in itertools.chain((("loss", out.loss),), out.metrics.items()):
                weighted = value.detach().float() * n
                sums[name] = sums[name] + weighted if name in sums else weighted
            count += n
        self.task.train()
        self.task.model = wrapped
        # A rank whose shard gave no batch knows no metric names: agree on them before reducing.
        names = list(dict.fromkeys(n for ranks in self.strategy.gather_objects(list(sums)) for n in ranks))
        zero = torch.zeros((), device=self.device)
        totals = torch.stack([*(sums.get(n, zero) for n in names), torch.tensor(float(count), device=self.device)])
        totals = self.strategy.all_reduce_sum(totals)
        values = (totals[:-1] / totals[-1]).tolist() if totals[-1] > 0 else [math.nan] * len(names)
        metrics = {f"{split}/{name}": value for name, value in zip(names, values)}
        self.logger.log_metrics(metrics, self.step)
        return metrics

    # ------------------------------------------------------------------ results
    def _record(self, metrics: dict[str, float]) -> None:
        self.metrics.update(metrics)

    def _summary(self, seconds: float) -> dict[str, Any]:
        summary: dict[str, Any] = dict(self.metrics)
        summary.update(step=self.step, epoch=self.epoch, seconds=round(seconds, 3),
                       world_size=self.strategy.world_size, precision=self.precision.name,
                       best_checkpoint=None)
        return summary
