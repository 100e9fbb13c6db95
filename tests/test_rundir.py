"""One run per directory: a new run never replaces one, a run locks its directory, a stale lock is free, and an
invocation refused at start leaves nothing behind (framework/app/rundir.py, framework/app/main.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, fingerprint, one_error_line, output, run_cli

from framework.app.rundir import LOCK_FILE, RunDirLock

pytestmark = pytest.mark.e2e

SHORT = ("trainer.max_steps=6", "trainer.limit_train_batches=3", "trainer.test=false")


def test_a_new_run_in_a_directory_that_holds_a_run_is_refused_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(run_dir, *SHORT, "checkpoint=every_epoch").returncode == 0
    before = fingerprint(run_dir)
    line = one_error_line(run_cli(run_dir, *SHORT, "optimizer.lr=0.5"))
    assert f"hydra.run.dir='{run_dir}' already holds a run" in line and f"resume={run_dir}" in line
    assert fingerprint(run_dir) == before  # checkpoints, summary, events and .hydra/ untouched, nothing added


def test_a_second_process_cannot_write_into_a_directory_a_run_holds(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(run_dir, *SHORT).returncode == 0
    before = fingerprint(run_dir)
    with RunDirLock(run_dir):  # this process plays the run that holds it
        line = one_error_line(run_cli(None, f"resume={run_dir}", "trainer.max_steps=9", fast=False, process=True))
    assert f"PID {os.getpid()}" in line and "is already running this run" in line
    assert fingerprint(run_dir) == before


def test_two_resumes_of_one_run_at_once_leave_one_history(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(run_dir, *SHORT).returncode == 0
    args = [sys.executable, str(ROOT / "run.py"), f"resume={run_dir}", "trainer.max_steps=3000",
            "trainer.limit_train_batches=1.0", "logger.progress_bar=false"]
    first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / LOCK_FILE).read_text().startswith(f"PID {first.pid}"):
            assert time.monotonic() < deadline and first.poll() is None, "the first resume never took the lock"
            time.sleep(0.05)
        second = run_cli(None, f"resume={run_dir}", "trainer.max_steps=3000", fast=False)
        assert f"PID {first.pid}" in one_error_line(second)
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)


def test_a_lock_left_by_a_killed_run_is_taken_over_while_its_forked_children_live_on(tmp_path):
    """The holder forks a child after taking the lock, as a run's DataLoader workers are forked, and is SIGKILLed; the
    child lives on (workers notice their parent's death only seconds later). A resume at once is accepted."""
    run_dir = tmp_path / "run"
    assert run_cli(run_dir, *SHORT, "checkpoint.every_n_steps=2").returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; from framework.app.rundir import RunDirLock\n"
                               f"with RunDirLock(__import__('pathlib').Path({str(run_dir)!r})):\n"
                               "    child = os.fork()\n"
                               "    if child == 0: time.sleep(600); os._exit(0)\n"
                               "    print(child, flush=True); time.sleep(600)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        holder.kill()
        holder.wait(timeout=30)
        assert (run_dir / LOCK_FILE).read_text().startswith(f"PID {holder.pid}")  # the file stays; its lock does not
        os.kill(child, 0)  # still alive
        proc = run_cli(None, f"resume={run_dir}", "trainer.max_steps=9", fast=False)
        assert proc.returncode == 0, output(proc)
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_run_refused_at_start_leaves_no_run_directory(tmp_path):
    for i, override in enumerate(("trainer.max_epochs=0", "+trainer.max_epoch=1", "model._target_=nosuch.Model")):
        run_dir = tmp_path / f"run{i}"
        one_error_line(run_cli(run_dir, override))
        assert not run_dir.exists(), override


def test_a_dry_run_writes_no_tensorboard_events(tmp_path):
    proc = run_cli(tmp_path / "run", "trainer.dry_run=true")
    assert proc.returncode == 0, output(proc)
    assert not list((tmp_path / "run").glob("events.out.tfevents*"))
