"""The fit loop. Its parts do the work, each in its own module: `build` (components from config), `metric_logger`
(what is logged, and `TaskHandle`, the task's view of the run), `evaluate` (validation and test), `preflight` (the
check before training), `restore` (a checkpoint into the run), `stop` (early stops agreed by every rank), the
checkpoint policies (`checkpoint.policies`) and the state registry (`state`).

One training step, top to bottom, is in `_train_epoch`: batch -> autocast forward -> backward -> (every
`accumulate_grad_batches`) unscale/clip/step -> scheduler -> callbacks -> log -> stop? -> validate/checkpoint.
At an epoch's end, `_end_epoch`: callbacks -> epoch means -> validation -> epoch scheduler -> checkpoint.
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

from framework.checkpoint import CheckpointSaveError
from framework.checkpoint.restore import load_test_weights
from framework.config.instantiate import error_line
from framework.core.errors import ConfigError, Interrupted, UserError
from framework.core.files import write_json
from framework.core.signals import SignalWatch, watched
from framework.loop.evaluate import move_to
from framework.loop.preflight import check_first_batches
from framework.loop.run import Run
from framework.observe.profiler import build_profiler
from framework.observe.summary import print_summary
from framework.task import hooks as task_hooks
from framework.task.task import StepOutput, as_step_output

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _anomaly_as_error(enabled: bool, progress: Any, run_dir: Path) -> Iterator[None]:
    """Under trainer.detect_anomaly, the op whose backward made a NaN is one Error: line (anomaly mode has printed
    the forward's traceback that created it just before), not a traceback from inside backward."""
    try:
        yield
    except RuntimeError as err:
        if not enabled or "nan values" not in str(err):
            raise
        p = progress
        raise UserError(
            f"trainer.detect_anomaly: {error_line(err).rstrip('.')} at step {p.step + 1} (epoch "
            f"{p.epoch}, batch {p.batch_in_epoch}); the forward that made it is in the traceback printed "
            f"above; what was already written in {run_dir} is kept"
        ) from err


def _check_monitors_logged(monitors: dict[str, str], metrics: dict[str, float]) -> None:
    """The first validation round shows every metric there is (what the steps and the epoch-end hook logged):
    a monitor naming none of them is one line, before anything acts on it."""
    for key, monitor in monitors.items():
        if monitor not in metrics:
            raise ConfigError(
                f"{key}={monitor!r}: no such metric in the first validation; expected one of {', '.join(metrics)}"
            )


def _on_exception(run: Run, err: BaseException) -> None:
    """On the way out of a failed or stopped run: the callbacks hear of it, and a save still in flight is finished
    (a failure of its own is logged, not raised over the error that ends the run; when that error is a failed save
    too, the run's one error line already says so)."""
    try:
        run.callbacks.call("on_exception", run, run.task, err)
    except Exception as hook_err:  # noqa: BLE001  (the error that ends the run is the one to report)
        log.error("A callback's on_exception failed: %s: %s", type(hook_err).__name__, hook_err)
    try:
        run.checkpoints.writer.close()
    except Exception as save_err:  # noqa: BLE001
        if isinstance(err, CheckpointSaveError) and isinstance(save_err, CheckpointSaveError):
            log.debug("A later checkpoint save failed too: %s", save_err)
        else:
            log.error("A checkpoint save failed: %s: %s", type(save_err).__name__, save_err)


# The per-batch hooks, in the order the loop calls them.
_BATCH_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_train_batch_end")


def _step_name(task: Any) -> str:
    return f"{type(task).__name__}.training_step"


def _eta(run: Run) -> Optional[float]:
    """Seconds to the end of the run at this process's pace so far; None before its first step."""
    started, first_step = run._started_at
    p, total = run.progress, run.max_steps if run.max_steps > 0 else run.max_epochs * run.steps_per_epoch
    return (
        (time.perf_counter() - started) / (p.step - first_step) * max(0, total - p.step)
        if p.step > first_step
        else None
    )


def _train_log_extras(run: Run, lrs: bool = True) -> dict[str, float]:
    """What a logging step writes beside the task's values: the epoch, each group's LR (unless `lrs` is false: this
    step has its LR point already), AMP's scale."""
    extras = {"epoch": float(run.progress.epoch)}
    if lrs:
        extras.update({f"lr/{name}": g["lr"] for name, g in zip(run.param_group_names, run.optimizer.param_groups)})
    scale = run.precision.scale  # remembered at the last step: get_scale() would sync with the device
    if scale is not None:
        extras["amp/scale"] = scale
        extras["amp/skipped_steps"] = float(run.precision.skipped_steps)
    return extras


class Trainer(Run):
    """Runs fit -> validate -> test on the parts its Run built."""

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        if self.resume_from is not None:
            self._restore(self.resume_from)
        self._started_at = (time.perf_counter(), self.progress.step)
        self._val_names = check_first_batches(self.task, self.model_attr, self.evaluator, self._monitors())
        self._describe_setup()
        if self.cfg.trainer.dry_run:
            self.logger.close()
            return {}
        # Watched until fit returns: a time-limit signal that comes after the last step (while validating, saving
        # or testing) is noted and the run finishes, instead of reaching the handler from before the run
        # (submitit's would requeue a run that is complete; SIGUSR1's default would kill it).
        watch = SignalWatch(watched(self.cfg.checkpoint.signals) if self.on_signal else ())  # () watches nothing
        self.profiler = build_profiler(self.cfg.trainer, self.strategy, self.run_dir, self.model, self.progress)
        finished = False
        with (
            watch,
            self.profiler,
        ):  # trainer.profiler: the clock or the trace runs from here (framework/observe/profiler.py)
            try:
                self._start_hooks()
                anomaly = self.cfg.trainer.detect_anomaly
                with (
                    torch.autograd.set_detect_anomaly(anomaly),
                    _anomaly_as_error(anomaly, self.progress, self.run_dir),
                ):
                    while not self._finished(watch):
                        self._train_epoch(watch)
                        if self.progress.batch_in_epoch >= self.train_batches:  # a whole epoch, not a stop mid-epoch
                            self._end_epoch()
                watch.after_training = True
                summary = self._after_training(start)
                finished = True
            except BaseException as err:
                finished = isinstance(err, Interrupted)  # a signal stop is agreed by every rank: still in step
                _on_exception(self, err)
                raise
            finally:
                self.bar.close()
                self.logger.close()
                task_hooks.call_if_defined(self.task, "teardown", "fit")
                self.strategy.teardown(finished)
            if self.strategy.is_rank_zero:
                write_json(self.run_dir / "summary.json", summary)
                print_summary(summary, self.run_dir, kept=not self.fast_dev_run)
        return summary

    def _start_hooks(self) -> None:
        self._quiet_hook("on_fit_start")
        self._epoch_hook("on_train_start")
        if self._saved_task_state is not None:  # after the hooks: a reset there (as lightning-hydra-template
            self.task_state.load_state_dict(self._saved_task_state)  # does) keeps the resume exact
            self._saved_task_state = None

    def _quiet_hook(self, hook: str, *args: Any) -> None:
        """A hook Lightning allows no self.log in (on_fit_start/_end, on_train_end, on_validation_end, on_test_end)."""
        with self.metric_logger.no_logging(hook):
            self.callbacks.call(hook, self, self.task, *args)

    def _epoch_hook(self, hook: str) -> None:
        """A training hook outside any step: what the task logs in it is an epoch value, as in Lightning."""
        self.metric_logger.epoch_hook = True
        try:
            self.callbacks.call(hook, self, self.task)
        finally:
            self.metric_logger.epoch_hook = False

    def _after_training(self, start: float) -> dict[str, Any]:
        """The final validation (the summary always reports the final weights), `last`, the test, the summary."""
        # The steps since the last logging step; a run that ended with an epoch has this step's LR point from it.
        self._flush_train_log(lrs=self.progress.batch_in_epoch > 0)
        self.bar.close()
        p = self.progress
        if self.stop.reason and self.strategy.is_rank_zero:
            log.warning("Stopped at step %d (epoch %d): %s", p.step, p.epoch, self.stop.reason)
        if self.data.has("val") and p.last_val_step != p.step:
            self._validate()
        if self.checkpoints.save_last and self.checkpoints.saved_step != p.step:
            self._save(periodic=False)
        with self.profiler.phase("checkpoint"):
            self.checkpoints.writer.close()  # every checkpoint on disk before the summary names them
        self._quiet_hook("on_train_end")
        if self.cfg.trainer.test and self.data.has("test"):
            self._test()
        summary = self._summary(time.perf_counter() - start)
        self.profiler.finish(summary, self.logger, p.step)  # trainer.profiler=simple's figures, in the summary
        self.logger.log_metrics({k: v for k, v in summary.items() if k.startswith("best/")}, p.step)
        if self.hparams:
            self.logger.end_hparams_session()
        self._quiet_hook("on_fit_end")
        return summary

    def _end_epoch(self) -> None:
        """A completed epoch, in Lightning 2's order: its means (callbacks see them), validation (by epoch, or by
        step when this step is due), then on_train_epoch_end (current_epoch still this epoch's), then the epoch
        counts as complete: the epoch scheduler and the checkpoint policies (periodic, top-k, last)."""
        p = self.progress
        lrs = {
            f"lr/{name}": group["lr"]
            for name, group in zip(self.param_group_names, self.optimizer.param_groups)
            if p.step % self.log_every_n_steps
        }  # a point every epoch, unless this step's logging wrote one
        with self.profiler.phase("logging"):  # the epoch's means: a sync with the device
            train = self.metric_logger.end_epoch(self.task, p.step, lrs)
        t = self.cfg.trainer
        due = (p.epoch + 1) % t.val_every_n_epochs == 0 or (
            t.val_every_n_steps > 0 and p.step % t.val_every_n_steps == 0
        )
        val = self._validation_round() if self.data.has("val") and due and p.last_val_step != p.step else None
        self._epoch_hook("on_train_epoch_end")
        train.update(self.metric_logger.end_epoch(self.task, p.step, {}))  # what the hooks logged
        p.epoch += 1
        p.batch_in_epoch = 0
        self._report_epoch(train, val)
        if self.scheduler is not None:
            self.scheduler.after_epoch(p.epoch)
        periodic = self.checkpoints.due_periodic(p.step, completed_epochs=p.epoch)
        self._save(periodic=periodic, metrics=val)

    def _save(self, *, periodic: bool, metrics: Optional[dict[str, float]] = None) -> None:
        """A checkpoint at this step, once the trackers hold every point logged so far (MLflow keeps points for up
        to 10 s): a run resumed from it logs only what came after, so a point still kept at a kill is lost."""
        with self.profiler.phase("checkpoint"):
            if self.checkpoints.will_save(periodic=periodic, metrics=metrics):
                self.logger.flush(trackers_now=True)
            self.checkpoints.save(self.state, self.progress.step, periodic=periodic, metrics=metrics)

    def _report_epoch(self, train: dict[str, float], val: Optional[dict[str, float]]) -> None:
        self.metric_logger.report_epoch(self.progress.step, train, val, self._epoch_rate, _eta(self))

    def _finished(self, watch: Any) -> bool:
        self.stop.settle(watch)  # every rank agrees now on a request not yet agreed (the last step's, an epoch hook's)
        if self.stop.granted(self.progress):  # a requested stop (on resume: a callback's again in on_fit_start)
            return True
        if self.max_steps > 0:  # max_steps, when set, alone decides the length of the run
            return self.progress.step >= self.max_steps
        return self.progress.epoch >= self.max_epochs

    # ------------------------------------------------------------------ one epoch of training
    def _train_epoch(self, watch: Any) -> None:
        """The hot loop. Everything reached per batch is bound to a local first, and nothing in it reads the
        config, syncs with the device or allocates beyond the step itself (bench/overhead.py measures it).
        A callback hook nobody implements is not called at all."""
        p, task, logger = self.progress, self.task, self.metric_logger
        batches = self._start_epoch()
        batch_size, losses, precision = task.batch_size, logger.window.losses, self.precision
        step_fns = self.profiler.loop_fns(self.training_step, precision.backward, self._optimizer_step)
        training_step, backward, optimizer_step = step_fns  # as they are, unless trainer.profiler times them
        bar, where = self.bar if self.bar.enabled else None, _step_name(task)
        autocast = precision.autocast if precision.dtype is not None else None
        to_device = None if self.device.type == "cpu" else move_to  # batches are made on the CPU
        no_sync = self.strategy.no_sync(self.model) if self.accumulate > 1 else None
        plain = contextlib.nullcontext()
        batch_start, before_backward, after_backward, batch_end = map(self.callbacks.bound, _BATCH_HOOKS)
        accumulate, train_batches, clock = self.accumulate, self.train_batches, time.perf_counter
        epoch_start, samples, first_batch, data_wait = clock(), 0, p.batch_in_epoch, 0.0
        while True:
            waited_from = clock()
            batch = next(batches, None)
            data_wait += clock() - waited_from
            if batch is None:
                break
            if to_device is not None:
                batch = to_device(batch, self.device)
            steps_now = (
                accumulate == 1 or (p.batch_in_epoch + 1) % accumulate == 0 or p.batch_in_epoch + 1 == train_batches
            )
            n = logger.batch_n = batch_size(batch)  # what the task logs in this step is weighted by it
            if batch_start is not None:
                batch_start(self, task, batch, p.batch_in_epoch)
            with plain if no_sync is None or steps_now else no_sync():  # one all-reduce per optimizer step
                with autocast() if autocast is not None else plain:
                    out = training_step(batch, p.batch_in_epoch)
                if type(out) is not StepOutput:  # a loss tensor or a dict with "loss", as in Lightning
                    out = as_step_output(out, where, training=True)
                if before_backward is not None:
                    before_backward(self, task, out.loss)
                backward(out.loss / accumulate if accumulate > 1 else out.loss)
            if after_backward is not None:
                after_backward(self, task)
            losses.append(out.loss.detach())
            for name, value in out.metrics.items():  # a task's train metrics: train/<name>, each step and epoch
                logger.task_log(f"train/{name}", value, on_step=True, on_epoch=True)
            p.batch_in_epoch += 1
            samples += n
            if bar is not None:
                bar.update()
            if steps_now:
                optimizer_step()
            if batch_end is not None:
                batch_end(self, task, out, batch, p.batch_in_epoch - 1)
            if steps_now and self._after_step(watch):
                break
        seconds = clock() - epoch_start
        self._epoch_rate = samples / seconds if samples else self._epoch_rate
        self.profiler.add("data wait", data_wait)
        logger.epoch_perf(
            p.step, samples, p.batch_in_epoch - first_batch, seconds, data_wait, self.peak_memory.read_mb()
        )

    def _start_epoch(self) -> Iterator[Any]:
        """The epoch's start (train mode, on_train_epoch_start, the bar); returns its batches from where it stands
        (under overfit_batches, the same ones every epoch)."""
        p = self.progress
        self.peak_memory.reset()  # perf/max_memory_mb is this epoch's peak
        self.task.train()
        self._epoch_hook("on_train_epoch_start")
        max_epochs = 0 if self.max_steps > 0 else self.max_epochs
        self.bar.start_epoch(p.epoch, self.train_batches, initial=p.batch_in_epoch, max_epochs=max_epochs)
        if self.evaluator.overfit:
            return iter(itertools.islice(self.evaluator.overfit_batches(), p.batch_in_epoch, self.train_batches))
        return iter(
            itertools.islice(
                self.data.batches("train", p.epoch, start_batch=p.batch_in_epoch), self.train_batches - p.batch_in_epoch
            )
        )

    def _optimizer_step(self) -> None:
        stepped = self.precision.step(
            self.optimizer, self.params, self._clip_norm, self._clip_value, before_step=self._before_step
        )
        if self._before_zero_grad is not None:
            self._before_zero_grad(self, self.task, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        if self.scheduler is not None:
            self.scheduler.after_optimizer_step(self.progress.step, stepped)

    def _after_step(self, watch: Any) -> bool:
        """After an optimizer step: log, stop on a signal or a request, validate or save mid-epoch (at an epoch's
        end, _end_epoch does). True: this epoch ends here."""
        p, checkpoints = self.progress, self.checkpoints
        if p.step % self.log_every_n_steps == 0:
            self._flush_train_log()
        if self._agree_on_stops:
            signum = self.stop.agreed(watch)
            if signum is not None:
                self._stop_on_signal(signum, watch)
        mid_epoch, val_every = p.batch_in_epoch < self.train_batches, self._val_every
        periodic = checkpoints.every_n_steps > 0  # mid-epoch saves happen by step only
        if mid_epoch and val_every and p.step % val_every == 0:
            val = self._validation_round()
            self._save(periodic=periodic and checkpoints.due_periodic(p.step), metrics=val)
        elif mid_epoch and periodic and checkpoints.due_periodic(p.step):
            self._save(periodic=True)
        return self.stop.granted(p) or 0 < self.max_steps <= p.step

    def _flush_train_log(self, lrs: bool = True) -> None:
        with self.profiler.phase("logging"):
            self.metric_logger.flush(self.progress.step, _train_log_extras(self, lrs))

    def _stop_on_signal(self, signum: int, watch: Any) -> None:
        """Save `last` at this exact position (mid-epoch included), then end the run."""
        self.bar.close()
        self.logger.flush(trackers_now=True)  # as _save: the trackers hold what `last` resumes after
        self.checkpoints.save_now(self.state, self.progress.step, "last")
        self.checkpoints.writer.wait()
        p = self.progress
        stopped = (
            f"Stopped by {signal.Signals(signum).name} at step {p.step} (epoch {p.epoch}, batch {p.batch_in_epoch})"
        )
        self.logger.log_text("history", stopped, p.step)
        raise Interrupted(
            signum,
            f"{stopped}; saved {self.checkpoints.folder / 'last'}. Resume with: python run.py resume={self.run_dir}",
            getattr(watch, "previous", lambda _: None)(signum),
        )

    # ------------------------------------------------------------------ evaluation
    def _validate(self) -> dict[str, float]:
        self.callbacks.call("on_validation_start", self, self.task)
        with self.profiler.phase("evaluation"):
            metrics = self.evaluator.run("val", self.progress.step)
        if not self._val_checked:
            _check_monitors_logged(self._monitors(), metrics)
            self._val_checked = True
        self.metric_logger.record_best(metrics)
        self.progress.last_val_step = self.progress.step
        self.progress.validations += 1
        self._quiet_hook("on_validation_end", metrics)
        return metrics

    def _validation_round(self) -> dict[str, float]:
        """A validation during training (by epoch or by step), then the scheduler that monitors its metric."""
        val = self._validate()
        if self.scheduler is not None:
            self.scheduler.after_validation(self.progress.validations, val)
        return val

    def _test(self) -> None:
        self.tested = load_test_weights(self.cfg, self.checkpoints, self.strategy, self.module)
        self.callbacks.call("on_test_start", self, self.task)
        with self.profiler.phase("evaluation"):
            metrics = self.evaluator.run("test", self.progress.step)
        self._quiet_hook("on_test_end", metrics)
