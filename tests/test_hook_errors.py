"""An exception in a hook of the user's code (a callback's, the task's Lightning hooks), at any point of a run, is
one `Error:` line naming `Class.hook`, never a traceback on the console: the traceback is in run.log, summary.json
says `status: failed`, and the same command, once the hook is fixed, starts the run again in its place (the failed
attempt's files kept in failed-1/) or, where the attempt saved a checkpoint, is told the resume= that continues it
(framework/core/errors.py `hook_caller`, framework/callbacks/base.py, framework/callbacks/task_hooks.py,
framework/app/main.py, framework/app/rundir.py). And Lightning's `self.loggers` and `trainer.datamodule`."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TESTS, on_pythonpath, one_error_line, output, run_cli

from framework.callbacks.base import Callback, CallbackList
from framework.callbacks.task_hooks import call_if_defined
from framework.core.errors import HookError, Interrupted, UserError
from framework.data.module import DataModule
from framework.loop.trainer import Trainer
from framework.observe.tensorboard import TensorBoardLogger
from framework.observe.trackers import CsvTracker
from framework.task.classification import ClassificationTask

pytestmark = pytest.mark.e2e

FIXED = "HOOK_ERRORS_FIXED"  # the test's stand-in for fixing the hook's code: the command stays the same


def broken() -> bool:
    return os.environ.get(FIXED) != "1"


class BrokenEpochEnd(Callback):
    """The issue's mistake: a name Lightning's Trainer has and this run's does not."""

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if broken():
            trainer.datamodul  # noqa: B018


class BrokenOnRankZero(Callback):
    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if trainer.is_global_zero:  # the other rank waits in the next collective until the parent ends it
            raise ValueError("rank 0 only")


class BrokenSetup(Callback):
    def setup(self, trainer: Any, task: Any) -> None:
        if broken():
            raise KeyError("vocab")


class BrokenFitEnd(Callback):
    def on_fit_end(self, trainer: Any, task: Any) -> None:
        if broken():
            raise ValueError("cannot upload the report")


class BrokenValidationEnd(ClassificationTask):
    def on_validation_epoch_end(self) -> None:
        if broken():
            raise ZeroDivisionError("division by zero")


class BrokenTestEnd(ClassificationTask):
    def on_test_epoch_end(self) -> None:
        if broken():
            raise RuntimeError("no such metric")


class CrashingStep(ClassificationTask):
    """Not a hook: a crash in training_step (at its third batch: the first is checked before training, and a
    failure there is one line of its own) keeps its traceback on the console, and is recorded as failed too."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if broken() and batch_idx == 2:
            raise RuntimeError("shapes do not match")
        return super().training_step(batch, batch_idx)


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def add(name: str, target: str) -> str:
    return f"+callbacks.{name}={{_target_: test_hook_errors.{target}}}"


# Each case: the command's own overrides, and the start of its error line.
CASES = {
    "callback on_train_epoch_end": (
        (add("broken", "BrokenEpochEnd"),),
        "BrokenEpochEnd.on_train_epoch_end raised AttributeError: 'RunView' object has no attribute 'datamodul'",
    ),
    "task on_validation_epoch_end": (
        ("task._target_=test_hook_errors.BrokenValidationEnd",),
        "BrokenValidationEnd.on_validation_epoch_end raised ZeroDivisionError: division by zero",
    ),
    "callback setup": ((add("broken", "BrokenSetup"),), "BrokenSetup.setup raised KeyError: 'vocab'"),
}


def failed(proc: Any, run_dir: Path, names: str, where: str = "") -> str:
    """The checks every failed hook passes: one line naming it, the traceback in run.log, summary.json failed.
    `where`: what the line says before the names (a spawned worker's rank)."""
    line = one_error_line(proc)  # exit code 1, no traceback, the Error: line last
    assert line.startswith(f"Error: {where}{names}"), line
    assert f"its traceback is in {run_dir / 'run.log'}" in line, line
    log = (run_dir / "run.log").read_text()
    assert "Traceback (most recent call last)" in log and f"HookError: {names}" in log, log
    assert "The above exception was the direct cause" in log  # the hook's own exception, with its frames
    record = summary(run_dir)
    assert record["status"] == "failed" and record["error"].startswith(f"{where}{names}"), record
    return line


@pytest.mark.parametrize("case", CASES)
def test_a_hook_that_raises_is_one_error_line_and_the_same_command_starts_again(tmp_path, monkeypatch, case):
    overrides, names = CASES[case]
    run_dir = tmp_path / "run"
    own = (*overrides, "trainer.limit_train_batches=3")
    line = failed(run_cli(run_dir, *own), run_dir, names)
    assert "once it is fixed, the same command starts the run again" in line, line
    assert not (run_dir / "checkpoints" / "last").exists()  # it failed before its first checkpoint
    monkeypatch.setenv(FIXED, "1")
    again = run_cli(run_dir, *own)
    assert again.returncode == 0, output(again)
    assert "failed before its first checkpoint" in output(again) and "failed-1" in output(again)
    assert summary(run_dir)["status"] == "ok" and summary(run_dir)["epoch"] == 2
    aside = run_dir / "failed-1"  # the failed attempt, whole: nothing of it lost, nothing of it in the new run
    assert summary(aside)["status"] == "failed" and (aside / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    log = (run_dir / "run.log").read_text()  # continued: the failed attempt's traceback, then the new run
    assert log.index(f"HookError: {names}") < log.index("failed before its first checkpoint")


def test_the_command_line_prints_no_traceback_for_a_hook_that_raises(tmp_path, monkeypatch):
    overrides, names = CASES["callback setup"]
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": on_pythonpath(TESTS)}  # the callback is this module's
    proc = run_cli(run_dir, *overrides, env=env, process=True)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    failed(proc, run_dir, names)
    monkeypatch.setenv(FIXED, "1")  # the fixed run: not what this test looks at, here
    again = run_cli(run_dir, *overrides)
    assert again.returncode == 0, output(again)
    assert summary(run_dir)["status"] == "ok"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_hook_that_raises_in_a_spawned_ddp_worker_is_one_line_with_its_traceback_in_run_log(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "parallel=ddp", add("broken", "BrokenOnRankZero"), "trainer.limit_train_batches=3",
                   env={"PYTHONPATH": on_pythonpath(TESTS)})
    failed(proc, run_dir, "BrokenOnRankZero.on_train_epoch_end raised ValueError: rank 0 only", where="[rank 0] ")


def test_a_hook_that_raises_after_a_checkpoint_names_the_resume_that_continues_the_run(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    own = (add("broken", "BrokenFitEnd"), "trainer.limit_train_batches=3")
    line = failed(run_cli(run_dir, *own), run_dir, "BrokenFitEnd.on_fit_end raised ValueError: cannot upload")
    assert f"once it is fixed, resume={run_dir} continues the run from its newest checkpoint" in line, line
    monkeypatch.setenv(FIXED, "1")
    refused = one_error_line(run_cli(run_dir, *own))  # a new run never replaces one that saved a checkpoint
    assert "holds a run that failed (BrokenFitEnd.on_fit_end raised ValueError" in refused, refused
    suggested = re.search(r"expected (resume=\S+) to continue it", refused)
    assert suggested and suggested.group(1) == f"resume={run_dir}", refused
    resumed = run_cli(None, suggested.group(1), fast=False)
    assert resumed.returncode == 0, output(resumed)
    assert summary(run_dir)["status"] == "ok" and summary(run_dir)["epoch"] == 2
    assert not (run_dir / "failed-1").exists()  # continued, not started again


def test_resume_auto_continues_a_run_a_hook_failed_after_its_checkpoint(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    own = ("resume=auto", add("broken", "BrokenFitEnd"), "trainer.limit_train_batches=3")
    one_error_line(run_cli(run_dir, *own))
    monkeypatch.setenv(FIXED, "1")
    again = run_cli(run_dir, *own)  # the same command
    assert again.returncode == 0, output(again)
    assert "Resumed from" in output(again)
    assert summary(run_dir)["status"] == "ok" and summary(run_dir)["step"] == 6


def test_a_crash_outside_the_hooks_is_recorded_as_failed_and_the_same_command_starts_again(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    own = ("task._target_=test_hook_errors.CrashingStep", "trainer.limit_train_batches=3")
    with pytest.raises(RuntimeError, match="shapes do not match"):  # a bug's traceback, as before
        run_cli(run_dir, *own)
    assert summary(run_dir)["status"] == "failed" and "RuntimeError: shapes do not match" in summary(run_dir)["error"]
    assert "Traceback (most recent call last)" in (run_dir / "run.log").read_text()
    monkeypatch.setenv(FIXED, "1")
    again = run_cli(run_dir, *own)
    assert again.returncode == 0, output(again)
    assert summary(run_dir / "failed-1")["status"] == "failed" and summary(run_dir)["status"] == "ok"


def test_a_hook_that_raises_in_a_test_stage_is_one_line_and_the_same_command_runs_it_again(tmp_path, monkeypatch):
    trained = tmp_path / "trained"
    fit = run_cli(trained, "task._target_=test_hook_errors.BrokenTestEnd", "trainer.max_epochs=1",
                  "trainer.limit_train_batches=3", "trainer.test=false")
    assert fit.returncode == 0, output(fit)
    tested = tmp_path / "tested"
    failed(run_cli(tested, "test", f"ckpt={trained}", fast=False), tested,
           "BrokenTestEnd.on_test_epoch_end raised RuntimeError: no such metric")
    monkeypatch.setenv(FIXED, "1")
    again = run_cli(tested, "test", f"ckpt={trained}", fast=False)
    assert again.returncode == 0, output(again)
    assert summary(tested)["status"] == "ok" and summary(tested / "failed-1")["status"] == "failed"


# ---------------------------------------------------------------------------------------------- the seam
class Stops(Callback):
    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        raise Interrupted(15, "stopped by SIGTERM")


class Refuses(Callback):
    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        raise UserError("monitor: expected val/acc")


class CtrlC(Callback):
    def on_before_zero_grad(self, trainer: Any, task: Any, optimizer: Any) -> None:
        raise KeyboardInterrupt


class Fine(Callback):
    def on_before_zero_grad(self, trainer: Any, task: Any, optimizer: Any) -> None: ...


class Breaks(Callback):
    def on_before_zero_grad(self, trainer: Any, task: Any, optimizer: Any) -> None:
        raise IndexError("list index out of range")


@pytest.mark.unit
def test_a_hooks_exception_becomes_a_hook_error_naming_its_class_with_the_exception_as_cause():
    hooks = CallbackList({"fine": Fine(), "breaks": Breaks()})
    with pytest.raises(HookError, match=r"^Breaks\.on_before_zero_grad raised IndexError: list index") as raised:
        hooks.bound("on_before_zero_grad")(None, None, None)  # the per-step caller the loop holds
    assert isinstance(raised.value.__cause__, IndexError)
    with pytest.raises(HookError, match=r"^BrokenValidationEnd\.on_validation_epoch_end raised ZeroDivision"):
        call_if_defined(BrokenValidationEnd.__new__(BrokenValidationEnd), "on_validation_epoch_end")


@pytest.mark.unit
@pytest.mark.parametrize(("callback", "hook", "passes"), [
    (Stops(), "on_train_epoch_end", Interrupted),
    (Refuses(), "on_train_epoch_end", UserError),
    (CtrlC(), "on_before_zero_grad", KeyboardInterrupt),
])
def test_a_stop_a_framework_error_and_ctrl_c_raised_in_a_hook_pass_through_unchanged(callback, hook, passes):
    hooks = CallbackList({"cb": callback})
    with pytest.raises(passes) as raised:
        hooks.call(hook, None, None, *([None] if hook == "on_before_zero_grad" else []))
    assert type(raised.value) is passes


# ---------------------------------------------------------------------------------------------- Lightning's names
class SeesLoggers(ClassificationTask):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[list[type]] = []

    def on_train_epoch_end(self) -> None:
        self.seen.append([type(logger) for logger in self.loggers])


class SeesDataModule(Callback):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        self.seen.append(trainer.datamodule)


@pytest.mark.unit
def test_self_loggers_and_trainer_datamodule_are_lightnings(compose, tmp_path):
    cfg = compose("logger.progress_bar=false", "trainer.test=false", "trainer.max_epochs=1",
                  "trainer.limit_train_batches=2", "checkpoint=none", "logger=[tensorboard,csv]",
                  "task._target_=test_hook_errors.SeesLoggers",
                  "+callbacks.data._target_=test_hook_errors.SeesDataModule")
    trainer = Trainer(cfg, tmp_path)
    task, callback = trainer.run.task, dict(trainer.run.callbacks)["data"]
    trainer.fit()
    assert task.seen == [[TensorBoardLogger, CsvTracker]]
    assert len(callback.seen) == 1 and callback.seen[0] is trainer.run.data and isinstance(callback.seen[0], DataModule)
    assert ClassificationTask(torch.nn.Linear(2, 2)).loggers == []  # outside a run


class LossGoesNaN(ClassificationTask):
    """ClassificationTask whose loss is NaN from its training step number `nan_at` on: a run that diverges."""

    nan_at = 6

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def training_step(self, batch: Any) -> Any:
        self.calls += 1
        out = super().training_step(batch)
        return out.loss * float("nan") if self.calls >= self.nan_at else out.loss


@pytest.mark.parametrize(("saved", "ddp"), [(True, False), (False, False),
                                           pytest.param(True, True, marks=pytest.mark.slow)],
                         ids=["after-a-checkpoint", "before-any-checkpoint", "ddp-after-a-checkpoint"])
def test_a_loss_gone_nan_mid_run_is_a_failed_run_whose_line_names_the_command_that_goes_on(tmp_path, saved, ddp):
    """A user's mistake found once the run had trained (not a hook's exception, not a crash) fails the run as a
    crash does: its directory and checkpoints kept, summary.json `failed` with the error, and the line naming the
    command that continues it once fixed (docs/checkpoints.md, "After a run failed"); under spawned DDP too, where
    the parent raises again what a worker reports."""
    run_dir = tmp_path / "run"
    every = "checkpoint.every_n_steps=3" if saved else "checkpoint.every_n_steps=100"
    parallel = ("parallel=ddp", "parallel.devices=2") if ddp else ()
    proc = run_cli(run_dir, "task._target_=test_hook_errors.LossGoesNaN", "trainer.max_steps=20", every,
                   "trainer.log_every_n_steps=100", *parallel, fast=False,
                   env={"PYTHONPATH": on_pythonpath(TESTS)} if ddp else None)
    line = one_error_line(proc)
    assert re.match(r"Error: (\[rank \d\] )?train/loss became nan at step 6 \(epoch 0\); training stopped", line), line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "train/loss became nan at step 6" in summary["error"], summary
    assert "once it is fixed" not in summary["error"]
    if saved:
        assert line.endswith(f"once it is fixed, resume={run_dir} continues the run from its newest checkpoint"), line
        saved_steps = {ckpt.name: json.loads((ckpt / "meta.json").read_text())["step"]
                       for ckpt in (run_dir / "checkpoints").iterdir()}
        assert saved_steps == {"last": 3, "step-3": 3}, saved_steps  # nothing saved after the loss went NaN
        resumed = run_cli(None, f"resume={run_dir}", "task._target_=framework.task.classification.ClassificationTask",
                          "trainer.max_steps=8", fast=False)
        assert resumed.returncode == 0 and "Resumed from" in output(resumed), output(resumed)
    else:
        assert line.endswith("once it is fixed, the same command starts the run again"), line
        assert not list(run_dir.glob("checkpoints/*"))
