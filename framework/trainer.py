"""The Trainer: builds every component from the config, then runs fit -> validate -> test.

One training step, top to bottom, is in `_train_epoch`: batch -> autocast forward -> backward ->
(every `accumulate_grad_batches`) unscale/clip/step -> scheduler -> log. Everything else is a call into
the module that owns the concern; this file is the only place that knows them all.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

from framework import reproducibility
from framework.checkpoint import (Checkpoint, CheckpointManager, CheckpointSaveError, DamagedCheckpoint,
                                  check_compatible, load_weights, validate_rng_state, validate_state)
from framework.data import DataModule
from framework.errors import ConfigError, Interrupted, UserError
from framework.instantiate import build
from framework.loggers import ProgressBar, TensorBoardLogger, print_summary, write_json
from framework.model_summary import summarize
from framework.optim import (apply_changed_options, build_optimizer, build_scheduler, changed_options,
                             check_optimizer_state, describe_groups, format_groups, group_names, lr_plan)
from framework.parallel import build_strategy
from framework.precision import Precision
from framework.signals import SignalWatch
from framework.task import Task

log = logging.getLogger(__name__)

# Metrics shown in TensorBoard's HParams tab for every run (read from these scalar tags).
HPARAM_METRICS = ["val/acc", "val/loss", "best/val/acc", "best/val/loss", "test/acc", "test/loss"]


def move_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def _max_memory_mb(device: torch.device) -> float:
    """Peak memory: CUDA's max_memory_allocated on a GPU, else this process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _limit(limit: Union[int, float], available: int) -> int:
    """Lightning's limit_*_batches: an int is a count, a float a fraction of the epoch."""
    if isinstance(limit, float):
        return max(1, int(available * limit)) if available else 0
    return min(limit, available)


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: Path, resume_from: Optional[Checkpoint] = None,
                 hparams: Optional[dict[str, Any]] = None, choices: Optional[dict[str, Any]] = None) -> None:
        self.cfg, self.run_dir, self.hparams = cfg, run_dir, hparams or {}
        self.choices = choices or {}  # the config groups' options, kept in each checkpoint for resume
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
        if cfg.get("init_from"):
            weights = load_weights(Path(cfg.init_from))
            check_compatible(self.task.model, weights, f"init_from={cfg.init_from!r}", cfg.init_strict)
            self.task.model.load_state_dict(weights, strict=cfg.init_strict)
        self.optimizer, self.frozen = build_optimizer(cfg.optimizer, self.task.model)
        self.train_batches = _limit(1 if self.fast_dev_run else t.limit_train_batches, self.data.num_batches("train"))
        if self.train_batches == 0:
            raise ConfigError("data.train: the training set gives no batch (is it empty, or smaller than "
                              "data.batch_size with data.drop_last=true?)")
        self.steps_per_epoch = math.ceil(self.train_batches / self.accumulate)
        self.scheduler = build_scheduler(cfg.scheduler, self.optimizer, max_steps=self.max_steps,
                                         max_epochs=self.max_epochs, steps_per_epoch=self.steps_per_epoch)
        if self.scheduler is not None and self.scheduler.monitor is not None and not self.data.has("val"):
            raise ConfigError(f"scheduler.monitor={self.scheduler.monitor!r}: this run has no validation split "
                              "(data.val is null), so the metric never exists; expected a data.val split, or a "
                              "scheduler that monitors nothing (scheduler.monitor=null)")
        self.precision = Precision(cfg.precision.mode.value, self.device)
        self.params = [p for p in self.task.parameters() if p.requires_grad]
        if t.compile:
            self.task.model = torch.compile(self.task.model)
        self.task.model = self.strategy.wrap(self.task.model)

        rank_zero = self.strategy.is_rank_zero
        ck = cfg.checkpoint
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints", save_last=ck.save_last, every_n_steps=ck.every_n_steps,
            every_n_epochs=ck.every_n_epochs, keep_last=ck.keep_last, monitor=ck.monitor, mode=ck.mode.value,
            save_top_k=ck.save_top_k, enabled=rank_zero and not self.fast_dev_run, fsync=ck.fsync,
            async_save=ck.async_save)
        self.on_signal = ck.on_signal and not self.fast_dev_run
        self.resume_from = resume_from
        # On resume, TensorBoard drops whatever the killed run logged after its checkpoint's step.
        purge_step = resume_from.step + 1 if resume_from is not None else None
        self.logger = TensorBoardLogger(self.run_dir, enabled=rank_zero and cfg.logger.tensorboard
                                        and not self.fast_dev_run and not t.dry_run, purge_step=purge_step)
        self.bar = ProgressBar(enabled=rank_zero and cfg.logger.progress_bar)

        self.step = 0  # optimizer steps taken
        self.epoch = 0  # epochs completed
        self.batch_in_epoch = 0  # batches of the current epoch already consumed
        self.metrics: dict[str, float] = {}  # latest value of every metric, for the summary
        self._last_val_step = -1
        # Per-batch losses of the current logging window, kept on device: no host sync until a log step
        # (a list, not a preallocated tensor: appending costs no kernel launch).
        self._losses: list[torch.Tensor] = []
        self._clip_norm, self._clip_value = t.grad_clip_norm, t.grad_clip_value  # no config access per step
        self._window_first_step = 0
        self._saved_step = -1  # step of the newest checkpoint written by this process

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        if self.resume_from is not None:
            self._restore(self.resume_from)
        self._check_first_batches()
        self._describe_setup()
        if self.cfg.trainer.dry_run:
            self.logger.close()
            return {}
        watch = SignalWatch() if self.on_signal else contextlib.nullcontext()
        finished = False
        try:
            with watch:
                while not self._finished():
                    self._train_epoch(watch)
                    if self.batch_in_epoch >= self.train_batches:  # a whole epoch, not a max_steps stop
                        self.epoch += 1
                        self.batch_in_epoch = 0
                        val = None
                        if self.data.has("val") and self.epoch % self.cfg.trainer.val_every_n_epochs == 0:
                            val = self._validate()
                        self._epoch_scheduler_step(val)
                        periodic = self.checkpoints.due_periodic(self.step, completed_epochs=self.epoch)
                        self.checkpoints.save(self.step, self._write_checkpoint, periodic=periodic, metrics=val)
            self._flush_train_log()
            if self.data.has("val") and self._last_val_step != self.step:
                self._validate()  # the summary always reports the final weights
            if self.checkpoints.save_last and self._saved_step != self.step:
                self.checkpoints.save(self.step, self._write_checkpoint, periodic=False)
            self.checkpoints.writer.close()  # every checkpoint on disk before the summary names them
            if self.cfg.trainer.test and self.data.has("test"):
                self._record(self._evaluate("test"))
            summary = self._summary(time.perf_counter() - start)
            self.logger.log_metrics({k: v for k, v in summary.items() if k.startswith("best/")}, self.step)
            if self.hparams:
                self.logger.end_hparams_session()
            finished = True
        except BaseException as err:
            finished = isinstance(err, Interrupted)  # a signal stop is agreed by every rank: still in step
            self._finish_saves(err)
            raise
        finally:
            self.bar.close()
            self.logger.close()
            self.strategy.teardown(finished)
        if self.strategy.is_rank_zero:
            write_json(self.run_dir / "summary.json", summary)
            print_summary(summary, self.run_dir)
        return summary

    def _check_first_batches(self) -> None:
        """The first train and val batch through the task once, before anything is logged or trained: data of
        the wrong kind, or a model, loss, metric or monitor that does not fit it, is one line naming its key
        (Task.check_batch). On the plain module, in eval mode, without grad, and with the RNG state put back,
        so training starts exactly as it would without it and no step pays for it."""
        wrapped, rng = self.task.model, reproducibility.rng_state()
        self.task.model = self.strategy.unwrap(wrapped)
        self.task.eval()
        try:
            for split in ("train", "val"):
                batch = self.data.first_batch(split) if self.data.has(split) else None
                if batch is None:
                    continue
                with torch.no_grad(), self.precision.autocast():
                    out = self.task.check_batch(move_to(batch, self.device), split,
                                                input_shape=self.data.input_shape, num_classes=self.data.num_classes)
                if split == "val":  # a monitor naming no metric would otherwise fail after the first epoch
                    names = ["val/loss", *(f"val/{name}" for name in out.metrics)]
                    monitors = {"checkpoint.monitor": self.checkpoints.monitor if self.checkpoints.save_top_k else None,
                                "scheduler.monitor": getattr(self.scheduler, "monitor", None)}
                    for key, monitor in monitors.items():
                        if monitor is not None and monitor not in names:
                            raise ConfigError(f"{key}={monitor!r}: no such metric; expected one of {', '.join(names)}")
        finally:
            self.task.model = wrapped
            self.task.train()
            reproducibility.set_rng_state(rng)

    # ------------------------------------------------------------------ checkpoints
    def _training_state(self) -> dict[str, Any]:
        """Everything besides the weights that an exact resume needs (each component's state_dict)."""
        rng = self.strategy.gather_objects(reproducibility.rng_state())  # every rank's own RNG streams
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "precision": self.precision.state_dict(),
            "checkpoints": self.checkpoints.state_dict(),
            "loop": {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                     "last_val_step": self._last_val_step, "window_first_step": self._window_first_step,
                     "losses": self._window_losses()},
            "metrics": dict(self.metrics),
            "rng": {f"rank{rank}": state for rank, state in enumerate(rng)},
        }

    def _write_checkpoint(self, path: Optional[Path]) -> None:
        """Called on every rank (the state gathers RNG from all of them); only rank 0 gets a path."""
        state = self._training_state()
        self._saved_step = self.step
        if path is None:
            return
        meta = {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "metrics": dict(self.metrics), "world_size": self.strategy.world_size,
                "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),
                "choices": {g: o for g, o in self.choices.items() if not g.startswith("hydra")}}
        self.checkpoints.writer.write(path, self.strategy.unwrap(self.task.model).state_dict(), state, meta)

    def _finish_saves(self, ending: BaseException) -> None:
        """On the way out of a failed run: a save still in flight is an intact checkpoint once finished
        (a failure of its own is logged, not raised over the error that ends the run; when that error is a
        failed save too, the run's one error line already says so)."""
        try:
            self.checkpoints.writer.close()
        except Exception as err:  # noqa: BLE001
            if isinstance(ending, CheckpointSaveError) and isinstance(err, CheckpointSaveError):
                log.debug("A later checkpoint save failed too: %s", err)
            else:
                log.error("A checkpoint save failed: %s: %s", type(err).__name__, err)

    def _check_state(self, state: dict[str, Any], where: str, load_scheduler: bool) -> Optional[dict[str, Any]]:
        """Every part of a checkpoint's state against the live component it is for, before any is loaded, so
        a damaged or foreign checkpoint is one error and never a half-restored run. Returns this rank's RNG."""
        parts = ("optimizer", "scheduler", "precision", "checkpoints", "loop", "metrics", "rng")
        missing = [k for k in parts if k not in state] if isinstance(state, dict) else list(parts)
        if missing:
            raise DamagedCheckpoint(f"{where}: its state lacks {', '.join(missing)}; expected a checkpoint written "
                                    "by this framework")
        validate_state(state["optimizer"], self.optimizer.state_dict(), f"{where}: optimizer")
        problem = check_optimizer_state(state["optimizer"], self.optimizer, f"{where}: optimizer")
        if problem is not None:
            raise DamagedCheckpoint(problem)
        if load_scheduler:
            validate_state(state["scheduler"], self.scheduler.state_dict(), f"{where}: scheduler")
        live = self.precision.state_dict()
        validate_state(state["precision"], {**live, "scaler": live["scaler"] if state["precision"].get("scaler") else {}}
                       if isinstance(state["precision"], dict) else live, f"{where}: precision")
        CheckpointManager.check_state_dict(state["checkpoints"], f"{where}: checkpoints")
        validate_state(state["loop"], {"step": 0, "epoch": 0, "batch_in_epoch": 0, "last_val_step": -1,
                                       "window_first_step": 0, "losses": torch.zeros(0)}, f"{where}: loop")
        validate_state(state["metrics"], {}, f"{where}: metrics")
        if not isinstance(state["rng"], dict) or "rank0" not in state["rng"]:
            raise DamagedCheckpoint(f"{where}: its state has no rng/rank0; expected every rank's RNG state")
        rng = state["rng"].get(f"rank{self.strategy.rank}", state["rng"]["rank0"])
        validate_rng_state(rng, f"{where}: rng/rank{self.strategy.rank}")
        return rng

    def _restore(self, checkpoint: Checkpoint) -> None:
        model = self.strategy.unwrap(self.task.model)
        weights = checkpoint.model_state()
        check_compatible(model, weights, f"resume={str(checkpoint.path)!r}", strict=True)
        state = checkpoint.state()
        saved_cfg = checkpoint.meta["config"]
        same_schedule = (saved_cfg.get("scheduler") or {}).get("_target_") == self.cfg.scheduler.get("_target_")
        load_scheduler = same_schedule and self.scheduler is not None and bool(state.get("scheduler"))
        rng = self._check_state(state, f"checkpoint {checkpoint.path}", load_scheduler)
        model.load_state_dict(weights)
        configured = [dict(group) for group in self.optimizer.param_groups]  # from this run's config
        self.optimizer.load_state_dict(state["optimizer"])
        if not same_schedule:  # scheduler= changed on resume: the new schedule starts here, from its start
            for group, fresh in zip(self.optimizer.param_groups, configured):
                group.update({k: fresh[k] for k in ("lr", "initial_lr") if k in fresh})
        elif load_scheduler:
            self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])
        self.checkpoints.load_state_dict(state["checkpoints"])
        apply_changed_options(self.optimizer, self.scheduler if same_schedule else None, configured,
                              changed_options(saved_cfg.get("optimizer") or {}, self.cfg.optimizer))
        loop = state["loop"]
        self.step, self.epoch, self.batch_in_epoch = loop["step"], loop["epoch"], loop["batch_in_epoch"]
        self._last_val_step, self._window_first_step = loop["last_val_step"], loop["window_first_step"]
        self._losses = list(loop["losses"].to(self.device).unbind())
        self.metrics = dict(state["metrics"])
        self._saved_step = self.step
        if f"rank{self.strategy.rank}" not in state["rng"]:
            log.warning("resume: the checkpoint has no RNG state for rank %d (it ran with %d processes); "
                        "random streams restart from rank 0's", self.strategy.rank, len(state["rng"]))
        reproducibility.set_rng_state(rng)  # last: building the components above drew random numbers
        if self.strategy.is_rank_zero:
            log.info("Resumed from %s at step %d (epoch %d, batch %d)", checkpoint.path, self.step, self.epoch,
                     self.batch_in_epoch)

    def _stop_signal(self, watch: Any) -> Optional[int]:
        """The signal to stop on, agreed by every rank (all must stop after the same step)."""
        received = getattr(watch, "received", None)
        if self.strategy.world_size > 1:
            flag = torch.tensor([float(received or 0)], device=self.device)
            total = float(self.strategy.all_reduce_sum(flag))
            return int(received or signal.SIGTERM) if total > 0 else None
        return received

    def _describe_setup(self) -> None:
        """What a user checks before trusting a run: parameter groups, LR plan, config (and, in a dry run,
        the model summary). Printed and written by rank 0 only."""
        if not self.strategy.is_rank_zero:
            return
        per_device, world = self.data.batch_size, self.strategy.world_size
        log.info("Global batch: %d per process x %d process%s x %d accumulated = %d samples per optimizer step",
                 per_device, world, "es" if world > 1 else "", self.accumulate, per_device * world * self.accumulate)
        log.info("Parameter groups:\n%s", format_groups(self.optimizer, self.frozen))
        plan = lr_plan(self.scheduler, self.optimizer, self.steps_per_epoch) if self.scheduler else {}
        write_json(self.run_dir / "param_groups.json", describe_groups(self.optimizer))
        if self.step == 0:  # a resumed run already logged these
            for name, points in plan.items():
                for step, lr in points:
                    self.logger.log_metrics({f"lr_plan/{name}": lr}, step)
            self.logger.log_text("config", "```yaml\n" + OmegaConf.to_yaml(self.cfg, resolve=True) + "```")
            if self.hparams:
                self.logger.log_hparams(self.hparams, HPARAM_METRICS)
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
    def _train_epoch(self, watch: Any) -> None:
        """The hot loop. Everything reached per batch is bound to a local first, and nothing in it reads the
        config, syncs with the device or allocates beyond the step itself (bench/overhead.py measures it)."""
        self.task.train()
        self.bar.start_epoch(self.epoch, self.train_batches, initial=self.batch_in_epoch)
        batches = iter(itertools.islice(self.data.batches("train", self.epoch, start_batch=self.batch_in_epoch),
                                        self.train_batches - self.batch_in_epoch))
        training_step, batch_size, losses = self.task.training_step, self.task.batch_size, self._losses
        precision, bar, checkpoints = self.precision, self.bar if self.bar.enabled else None, self.checkpoints
        autocast = precision.autocast if precision.dtype is not None else None
        to_device = None if self.device.type == "cpu" else move_to  # batches are made on the CPU
        no_sync = self.strategy.no_sync(self.task.model) if self.accumulate > 1 else None
        plain = contextlib.nullcontext()
        accumulate, train_batches, log_every, max_steps = (self.accumulate, self.train_batches, self.log_every,
                                                           self.max_steps)
        periodic = checkpoints.every_n_steps > 0  # mid-epoch saves happen by step only
        clock = time.perf_counter
        epoch_start, samples, first_batch, data_wait = clock(), 0, self.batch_in_epoch, 0.0
        while True:
            waited_from = clock()
            batch = next(batches, None)
            data_wait += clock() - waited_from
            if batch is None:
                break
            if to_device is not None:
                batch = to_device(batch, self.device)
            steps_now = accumulate == 1 or (self.batch_in_epoch + 1) % accumulate == 0 \
                or self.batch_in_epoch + 1 == train_batches
            with (plain if no_sync is None or steps_now else no_sync()):  # one all-reduce per optimizer step
                if autocast is None:
                    loss = training_step(batch).loss
                else:
                    with autocast():
                        loss = training_step(batch).loss
                precision.backward(loss / accumulate if accumulate > 1 else loss)
            losses.append(loss.detach())
            self.batch_in_epoch += 1
            samples += batch_size(batch)
            if bar is not None:
                bar.update()
            if steps_now:
                self._optimizer_step()
                if self.step % log_every == 0:
                    self._flush_train_log()
                if self.on_signal:
                    signum = self._stop_signal(watch)
                    if signum is not None:
                        self._stop(signum)
                # Mid-epoch only: a checkpoint at an epoch's end waits until after its validation.
                if periodic and self.batch_in_epoch < train_batches and checkpoints.due_periodic(self.step):
                    checkpoints.save(self.step, self._write_checkpoint, periodic=True)
                if 0 < max_steps <= self.step:
                    break
        seconds = clock() - epoch_start
        batches_run = self.batch_in_epoch - first_batch
        if batches_run and seconds > 0:
            self.logger.log_metrics({"perf/samples_per_s": samples / seconds,
                                     "perf/step_ms": 1000 * seconds / batches_run,
                                     "perf/data_wait_frac": data_wait / seconds,
                                     "perf/max_memory_mb": _max_memory_mb(self.device)}, self.step)
        self.logger.flush()

    def _optimizer_step(self) -> None:
        stepped = self.precision.step(self.optimizer, self.params, self._clip_norm, self._clip_value)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        # The scheduler follows the optimizer, and does not advance for a step the GradScaler skipped.
        s = self.scheduler
        if stepped and s is not None and s.interval == "step" and self.step % s.frequency == 0:
            s.scheduler.step()

    def _window_losses(self) -> torch.Tensor:
        """The losses of the current logging window as one tensor (on the device; no sync)."""
        if not self._losses:
            return torch.zeros(0, device=self.device)
        return torch.stack([loss.reshape(()) for loss in self._losses]).float()  # a loss of shape [1] too

    def _flush_train_log(self) -> None:
        """Log the window's mean loss (the one host sync of the window) and stop if any loss was not finite."""
        if not self._losses:
            return
        losses = self._window_losses()
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
        self._losses.clear()  # in place: _train_epoch holds this list
        self._window_first_step = self.step

    def _stop(self, signum: int) -> None:
        """Save `last` at this exact position (mid-epoch included), then end the run."""
        self.bar.close()
        self._write_checkpoint(self.checkpoints.folder / "last" if self.checkpoints.enabled else None)
        self.checkpoints.writer.wait()
        name = signal.Signals(signum).name
        raise Interrupted(signum, f"Stopped by {name} at step {self.step} (epoch {self.epoch}, batch "
                                  f"{self.batch_in_epoch}); saved {self.checkpoints.folder / 'last'}. "
                                  f"Resume with: python run.py resume={self.run_dir}")

    # ------------------------------------------------------------------ evaluation
    def _validate(self) -> dict[str, float]:
        metrics = self._evaluate("val")
        self._record(metrics)
        for name, value in metrics.items():  # best over the run: the lowest loss, the highest of the rest
            best = self.metrics.get(f"best/{name}", value)
            self.metrics[f"best/{name}"] = min(best, value) if "loss" in name else max(best, value)
        self._last_val_step = self.step
        return metrics

    def _epoch_scheduler_step(self, val: Optional[dict[str, float]]) -> None:
        """The one place an epoch scheduler steps: once per completed epoch (every `frequency`), whether or not
        validation ran; one that monitors a metric steps only after the validation that produced it."""
        s = self.scheduler
        if s is None or s.interval != "epoch" or self.epoch % s.frequency != 0:
            return
        if s.monitor is None:
            s.scheduler.step()
        elif val is not None:
            if s.monitor not in val:
                raise ConfigError(f"scheduler.monitor={s.monitor!r}: no such metric; expected one of {', '.join(val)}")
            s.scheduler.step(val[s.monitor])

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
        best = self.checkpoints.best_path()
        summary.update(status="ok", step=self.step, epoch=self.epoch, seconds=round(seconds, 3),
                       world_size=self.strategy.world_size, precision=self.precision.name,
                       best_checkpoint=str(best) if best is not None else None)
        return summary
