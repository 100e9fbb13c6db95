"""The fit loop, on a Run built by framework/loop/run.py. Each concern is a call into its own part: the optimizer step
(`step`), validation and test (`validation`), the hooks (`hooks`), the metric logger, the checkpoint policies, the
stop every rank agrees on (`stop`), the summary (`summary`).

One training step, top to bottom, is in `_train_epoch`: batch -> autocast forward -> backward -> (every
`accumulate_grad_batches`) unscale/clip/step -> scheduler -> callbacks -> log -> stop? -> validate/checkpoint.
At an epoch's end, `_end_epoch`: its means -> validation -> on_train_epoch_end -> epoch scheduler -> checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from omegaconf import DictConfig

from framework.callbacks import task_hooks
from framework.checkpoint import Checkpoint, CheckpointSaveError
from framework.config.instantiate import error_line
from framework.core.errors import HookError, Interrupted, TrainingFailed, UserError
from framework.core.files import write_json
from framework.core.signals import SignalWatch, watched
from framework.loop.evaluate import move_to
from framework.loop.hooks import Hooks
from framework.loop.preflight import check_first_batches
from framework.loop.run import Run, agree_on_stops, assemble, monitors, report_setup, restore_into
from framework.loop.step import OptimizerStep, batch_fns
from framework.loop.summary import fit_summary
from framework.loop.validation import Validation
from framework.observe.profiler import build_profiler
from framework.observe.summary import print_summary
from framework.task.task import swapped

log = logging.getLogger(__name__)


class Trainer:
    """Runs fit -> validate -> test on a built Run (`run`), and holds the parts that do each job."""

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: Path,
        resume_from: Optional[Checkpoint] = None,
        hparams: Optional[dict[str, Any]] = None,
        choices: Optional[dict[str, Any]] = None,
    ) -> None:
        self.run = run = assemble(cfg, run_dir, resume_from, hparams, choices)
        self.hooks = Hooks(run.callbacks, run.view, run.task, run.metric_logger)
        if not run.task.automatic_optimization:  # the hooks a manual step's own calls reach (loop/manual.py)
            run.view.task_optimizers.with_hooks(
                *map(self.hooks.bound, ("on_before_backward", "on_after_backward", "on_before_optimizer_step"))
            )
        self.optimizer_step = OptimizerStep(run, self.hooks)
        self.profiler: Any = None  # built when fit starts (the clock or the trace runs from there)
        self.validation: Any = None
        self.agree_on_stops = agree_on_stops(run)
        self._saved_task_state: Any = None  # a resume's task state, loaded once the task's start hooks ran
        self._started_at, self._epoch_rate = (time.perf_counter(), 0), 0.0  # for the ETA; samples/s of the last epoch

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        run, start = self.run, time.perf_counter()
        if run.resume_from is not None:
            self._saved_task_state = restore_into(run, run.resume_from)
        self._started_at = (time.perf_counter(), run.progress.step)
        splits = ("train", "val") if run.limits.validates else ("train",)
        val_names = check_first_batches(run.task, run.model_attr, run.evaluator, monitors(run), splits)
        report_setup(run, charts=[*monitors(run).values(), *val_names])
        if run.cfg.trainer.dry_run:
            run.metric_logger.close()
            return {}
        # Watched until fit returns: a time-limit signal that comes after the last step (while validating, saving
        # or testing) is noted and the run finishes, instead of reaching the handler from before the run
        # (submitit's would requeue a run that is complete; SIGUSR1's default would kill it).
        watch = SignalWatch(watched(run.cfg.checkpoint.signals) if run.limits.on_signal else ())  # () watches nothing
        self.profiler = build_profiler(run.cfg.trainer, run.strategy, run.run_dir, run.model, run.progress)
        self.validation = Validation(run, self.hooks, self.profiler)
        finished = False
        # The model as training runs it in the task's place (DDP's wrapper), the task's own put back at the end.
        with watch, self.profiler, swapped(run.task, run.model_attr, run.model):  # (the profiler's clock starts)
            try:
                self._start_hooks()
                anomaly = run.cfg.trainer.detect_anomaly
                with torch.autograd.set_detect_anomaly(anomaly), _anomaly_as_error(anomaly, run):
                    while not self._finished(watch):
                        self._train_epoch(watch)
                        if run.progress.batch_in_epoch >= run.train_batches:  # a whole epoch, not a stop mid-epoch
                            self._end_epoch()
                watch.training_over()
                summary = self._after_training(start)
                finished = True
            except BaseException as err:
                finished = isinstance(err, Interrupted)  # a signal stop is agreed by every rank: still in step
                self._on_exception(err)
                raise
            finally:
                run.bar.close()
                run.metric_logger.close()
                task_hooks.call_if_defined(run.task, "teardown", "fit")
                run.strategy.teardown(finished)
            if run.strategy.is_rank_zero:
                write_json(run.run_dir / "summary.json", summary)
                print_summary(summary, run.run_dir, kept=not run.limits.fast_dev_run)
        return summary

    def failed_after_training(self, err: BaseException) -> bool:
        """Is `err`, which ended fit, a user's mistake (not a hook's exception, not a signal) found after this attempt
        took a step: a run that failed, not a refusal (framework/stages/fit.py)."""
        mistake = isinstance(err, UserError) and not isinstance(err, (HookError, Interrupted, TrainingFailed))
        return mistake and self.run.progress.step > self._started_at[1]

    def _start_hooks(self) -> None:
        self.hooks.quiet("on_fit_start")
        self.hooks.epoch("on_train_start")
        if self._saved_task_state is not None:  # after the hooks: a reset there (as lightning-hydra-template
            self.run.task_state.load_state_dict(self._saved_task_state)  # does) keeps the resume exact
            self._saved_task_state = None

    def _after_training(self, start: float) -> dict[str, Any]:
        """The final validation (the summary always reports the final weights), `last`, the test, the summary."""
        run, p = self.run, self.run.progress
        # The steps since the last logging step; a run that ended with an epoch has this step's LR point from it.
        self._flush_train_log(lrs=p.batch_in_epoch > 0)
        run.bar.close()
        if run.stop.reason and run.strategy.is_rank_zero:
            log.warning("Stopped at step %d (epoch %d): %s", p.step, p.epoch, run.stop.reason)
        if run.limits.validates and p.last_val_step != p.step:
            self.validation.validate()
        if run.checkpoints.save_last and run.checkpoints.saved_step != p.step:
            self._save(periodic=False)
        with self.profiler.phase("checkpoint"):
            run.checkpoints.close()  # every checkpoint on disk (and remote) before the summary names them
        self.hooks.quiet("on_train_end")
        if run.limits.tests:
            self.validation.test()
        summary = fit_summary(run, time.perf_counter() - start, self.validation.tested)
        self.profiler.finish(summary, run.tensorboard, p.step)  # trainer.profiler=simple's figures, in the summary
        run.metric_logger.write({k: v for k, v in summary.items() if k.startswith("best/")}, p.step)
        if run.hparams:
            run.tensorboard.end_hparams_session()
        self.hooks.quiet("on_fit_end")
        return summary

    def _end_epoch(self) -> None:
        """A completed epoch, in Lightning 2's order: its means (callbacks see them), validation (by epoch, or by
        step when this step is due), then on_train_epoch_end (current_epoch still this epoch's), then the epoch
        counts as complete: the epoch scheduler and the checkpoint policies (periodic, top-k, last)."""
        run, p, limits = self.run, self.run.progress, self.run.limits
        # A point every epoch, unless this step's logging wrote one.
        lrs = self.optimizer_step.lrs(run.param_group_names) if p.step % limits.log_every_n_steps else {}
        with self.profiler.phase("logging"):  # the epoch's means: a sync with the device
            train = run.metric_logger.end_epoch(run.task, p.step, lrs)
        due = (p.epoch + 1) % limits.val_every_n_epochs == 0 or (
            limits.val_every_n_steps > 0 and p.step % limits.val_every_n_steps == 0
        )
        val = self.validation.round() if run.limits.validates and due and p.last_val_step != p.step else None
        self.hooks.epoch("on_train_epoch_end")
        train.update(run.metric_logger.end_epoch(run.task, p.step, {}))  # what the hooks logged
        p.epoch_done()
        run.metric_logger.report_epoch(p.step, train, val, self._epoch_rate, self._eta())
        if run.scheduler is not None:
            run.scheduler.after_epoch(p.epoch)
        self._save(periodic=run.checkpoints.due_periodic(p.step, completed_epochs=p.epoch), metrics=val)

    def _save(self, *, periodic: bool, metrics: Optional[dict[str, float]] = None) -> None:
        """A checkpoint at this step, once the trackers hold every point logged so far (MLflow keeps points for up
        to 10 s): a run resumed from it logs only what came after, so a point still kept at a kill is lost."""
        run = self.run
        with self.profiler.phase("checkpoint"):
            if run.checkpoints.will_save(periodic=periodic, metrics=metrics):
                run.metric_logger.check_finite()  # a loss gone NaN since the last logging step saves nothing
                run.metric_logger.commit()
            run.checkpoints.save(run.state, run.progress.step, periodic=periodic, metrics=metrics)

    def _finished(self, watch: Any) -> bool:
        run = self.run
        run.stop.settle(watch)  # every rank agrees now on a request not yet agreed (the last step's, an epoch hook's)
        if run.stop.granted(run.progress):  # a requested stop (on resume: a callback's again in on_fit_start)
            return True
        if run.limits.max_steps > 0:  # max_steps, when set, alone decides the length of the run
            return run.progress.step >= run.limits.max_steps
        return run.progress.epoch >= run.limits.max_epochs

    # ------------------------------------------------------------------ one epoch of training
    def _train_epoch(self, watch: Any) -> None:
        """The hot loop. Everything reached per batch is bound to a local first, and nothing in it reads the
        config, syncs with the device or allocates beyond the step itself (bench/overhead.py measures it).
        A callback hook nobody implements is not called at all."""
        run = self.run
        p, task, logger, limits = run.progress, run.task, run.metric_logger, run.limits
        batches = self._start_epoch()
        batch_size, begin_batch, record_loss = task.batch_size, logger.begin_batch, logger.record_loss
        forward_backward, optimizer_step = batch_fns(run, self.hooks, self.profiler, self.optimizer_step)
        bar = run.bar if run.bar.enabled else None
        to_device = None if run.device.type == "cpu" else move_to  # batches are made on the CPU
        batch_start, batch_end = self.hooks.bound("on_train_batch_start"), self.hooks.bound("on_train_batch_end")
        accumulate, train_batches, clock = limits.accumulate, run.train_batches, time.perf_counter
        epoch_start, samples, first_batch, data_wait = clock(), 0, p.batch_in_epoch, 0.0
        while True:
            waited_from = clock()
            batch = next(batches, None)
            data_wait += clock() - waited_from
            if batch is None:
                break
            if to_device is not None:
                batch = to_device(batch, run.device)
            i = p.batch_in_epoch
            steps_now = accumulate == 1 or (i + 1) % accumulate == 0 or i + 1 == train_batches
            n = batch_size(batch)
            begin_batch(n)  # what the task logs in this step is weighted by it
            if batch_start is not None:
                batch_start(batch, i)
            out = forward_backward(batch, i, steps_now)
            if out is not None:  # (a manual step may return no loss)
                record_loss(out.loss.detach())
                for name, value in out.metrics.items():  # a task's train metrics: train/<name>, each step and epoch
                    logger.task_log(f"train/{name}", value, on_step=True, on_epoch=True)
            p.batch_done()
            samples += n
            if bar is not None:
                bar.update()
            if steps_now:
                optimizer_step()
            if batch_end is not None:
                batch_end(out, batch, i)
            if steps_now and self._after_step(watch):
                break
        self._pass_done(samples, p.batch_in_epoch - first_batch, clock() - epoch_start, data_wait)

    def _pass_done(self, samples: int, batches: int, seconds: float, data_wait: float) -> None:
        """The epoch's pass over its batches (a stop may end it early) in figures: samples/s for the bar and the ETA,
        the data wait for the profiler, perf/* for TensorBoard."""
        run = self.run
        self._epoch_rate = samples / seconds if samples else self._epoch_rate
        self.profiler.add("data wait", data_wait)
        memory = run.peak_memory.read_mb()
        run.metric_logger.epoch_perf(run.progress.step, samples, batches, seconds, data_wait, memory)

    def _start_epoch(self) -> Iterator[Any]:
        """The epoch's start (train mode, on_train_epoch_start, the bar); returns its batches from where it stands
        (under overfit_batches, the same ones every epoch)."""
        run, p = self.run, self.run.progress
        run.peak_memory.reset()  # perf/max_memory_mb is this epoch's peak
        run.task.train()
        self.hooks.epoch("on_train_epoch_start")
        max_epochs = 0 if run.limits.max_steps > 0 else run.limits.max_epochs
        run.bar.start_epoch(p.epoch, run.train_batches, initial=p.batch_in_epoch, max_epochs=max_epochs)
        if run.evaluator.overfit:
            return iter(itertools.islice(run.evaluator.overfit_batches(), p.batch_in_epoch, run.train_batches))
        batches = run.data.batches("train", p.epoch, start_batch=p.batch_in_epoch)
        return iter(itertools.islice(batches, run.train_batches - p.batch_in_epoch))

    def _after_step(self, watch: Any) -> bool:
        """After an optimizer step: log, stop on a signal or a request, validate or save mid-epoch (at an epoch's
        end, _end_epoch does). True: this epoch ends here."""
        run, p, checkpoints = self.run, self.run.progress, self.run.checkpoints
        if p.step % run.limits.log_every_n_steps == 0:
            self._flush_train_log()
        if self.agree_on_stops:
            signum = run.stop.agreed(watch)
            if signum is not None:
                self._stop_on_signal(signum, watch)
        mid_epoch, val_every = p.batch_in_epoch < run.train_batches, run.limits.val_every_n_steps
        periodic = checkpoints.every_n_steps > 0  # mid-epoch saves happen by step only
        if mid_epoch and val_every and p.step % val_every == 0:
            val = self.validation.round()
            self._save(periodic=periodic and checkpoints.due_periodic(p.step), metrics=val)
        elif mid_epoch and periodic and checkpoints.due_periodic(p.step):
            self._save(periodic=True)
        return run.stop.granted(p) or 0 < run.limits.max_steps <= p.step

    def _flush_train_log(self, lrs: bool = True) -> None:
        run = self.run
        with self.profiler.phase("logging"):
            extras = self.optimizer_step.extras(run.param_group_names, run.progress.epoch, lrs)
            run.metric_logger.flush(run.progress.step, extras)

    def _stop_on_signal(self, signum: int, watch: Any) -> None:
        """Save `last` at this exact position (mid-epoch included), then end the run."""
        run, p = self.run, self.run.progress
        run.bar.close()
        run.metric_logger.commit()  # as _save: the trackers hold what `last` resumes after
        run.checkpoints.save_now(run.state, p.step, "last")
        run.checkpoints.writer.wait()
        stopped = (
            f"Stopped by {signal.Signals(signum).name} at step {p.step} (epoch {p.epoch}, batch {p.batch_in_epoch})"
        )
        run.tensorboard.log_text("history", stopped, p.step)
        raise Interrupted(
            signum,
            f"{stopped}; saved {run.checkpoints.folder / 'last'}. Resume with: python run.py resume={run.run_dir}",
            watch.previous(signum),
        )

    def _eta(self) -> Optional[float]:
        """Seconds to the end of the run at this process's pace so far; None before its first step."""
        run, (started, first_step) = self.run, self._started_at
        p, limits = run.progress, run.limits
        total = limits.max_steps if limits.max_steps > 0 else limits.max_epochs * run.steps_per_epoch
        if p.step <= first_step:
            return None
        return (time.perf_counter() - started) / (p.step - first_step) * max(0, total - p.step)

    def _on_exception(self, err: BaseException) -> None:
        """On the way out of a failed or stopped run: the callbacks hear of it, and a save still in flight is finished
        (a failure of its own is logged, not raised over the error that ends the run; when that error is a failed
        save too, the run's one error line already says so)."""
        try:
            self.hooks.call("on_exception", err)
        except Exception as hook_err:  # noqa: BLE001  (the error that ends the run is the one to report)
            log.error("%s (the run ends on the error before it)", hook_err)  # a HookError names Class.on_exception
        try:
            self.run.checkpoints.close()
        except Exception as save_err:  # noqa: BLE001
            if isinstance(err, CheckpointSaveError) and isinstance(save_err, CheckpointSaveError):
                log.debug("A later checkpoint save failed too: %s", save_err)
            else:
                log.error("A checkpoint save failed: %s: %s", type(save_err).__name__, save_err)


@contextlib.contextmanager
def _anomaly_as_error(enabled: bool, run: Run) -> Iterator[None]:
    """Under trainer.detect_anomaly, the op whose backward made a NaN is one Error: line (anomaly mode has printed
    the forward's traceback that created it just before), not a traceback from inside backward."""
    try:
        yield
    except RuntimeError as err:
        if not enabled or "nan values" not in str(err):
            raise
        p = run.progress
        raise UserError(
            f"trainer.detect_anomaly: {error_line(err).rstrip('.')} at step {p.step + 1} (epoch "
            f"{p.epoch}, batch {p.batch_in_epoch}); the forward that made it is in the traceback printed "
            f"above; what was already written in {run.run_dir} is kept"
        ) from err
