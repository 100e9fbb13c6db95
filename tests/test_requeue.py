"""Preemption and requeue with the real engines: SLURM's signal and `scontrol requeue` (a stand-in `scontrol` on
PATH that records its arguments), Hydra's submitit launcher with submitit's real local executor, and a requeued
job continuing in the directory it had, ending bit-identical to a job never interrupted."""
from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, output, run_cli
from test_resume import assert_identical, final_state
from test_resume_matrix import KILLHOOK

QUICK = ("logger.progress_bar=false", "trainer.device=cpu", "trainer.test=false", "trainer.max_steps=60",
         "trainer.limit_train_batches=10", "checkpoint.every_n_steps=7", "model.dropout=0.2")


@pytest.fixture
def scontrol(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A stand-in `scontrol` first on PATH, recording each call's arguments; the environment of a SLURM batch job."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    job = str(uuid.uuid4().int % 10**7)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": job, "SLURM_JOB_NAME": "train",
           "SLURM_PROCID": "0"}
    return env, calls


def test_sbatch_job_signalled_saves_requeues_once_and_continues_in_its_own_directory(tmp_path, scontrol):
    env, calls = scontrol
    name = f"pytest-requeue-{env['SLURM_JOB_ID']}"
    run_dir = ROOT / "outputs" / name / f"slurm-{env['SLURM_JOB_ID']}"
    try:
        whole = run_cli(tmp_path / "whole", *QUICK, fast=False)
        assert whole.returncode == 0, output(whole)
        pythonpath = os.pathsep.join(filter(None, (str(KILLHOOK), os.environ.get("PYTHONPATH"))))
        # SLURM's --signal=USR1@90 arrives mid-epoch, after step 23.
        signalled = run_cli(None, *QUICK, f"name={name}", fast=False,
                            env={**env, "PYTHONPATH": pythonpath, "KILL_AT_STEP": "23", "KILL_SIGNAL": "SIGUSR1"})
        assert signalled.returncode == 128 + signal.SIGUSR1, output(signalled)
        assert "Stopped by SIGUSR1 at step 23" in output(signalled)
        assert calls.read_text() == f"requeue {env['SLURM_JOB_ID']}\n"  # exactly once
        assert (run_dir / "checkpoints" / "last").is_dir()
        assert "Requeued SLURM job" in (run_dir / "run.log").read_text()
        # SLURM starts the same command again, with the same job id: it continues where it stopped.
        again = run_cli(None, *QUICK, f"name={name}", fast=False, env=env)
        assert again.returncode == 0, output(again)
        assert "Resumed from" in output(again) and "at step 23 " in output(again), output(again)
        assert calls.read_text().count("requeue") == 1
        assert_identical(final_state(tmp_path / "whole"), final_state(run_dir))
        assert len(list((run_dir / ".hydra").glob("resumed-*"))) == 1
    finally:
        shutil.rmtree(ROOT / "outputs" / name, ignore_errors=True)


def test_sigterm_and_requeue_false_save_but_never_requeue(tmp_path, scontrol):
    env, calls = scontrol
    pythonpath = os.pathsep.join(filter(None, (str(KILLHOOK), os.environ.get("PYTHONPATH"))))
    for case, extra, sig in (("scancel", (), "SIGTERM"), ("off", ("checkpoint.requeue=false",), "SIGUSR1")):
        run = tmp_path / case
        proc = run_cli(run, *QUICK, *extra, fast=False,
                       env={**env, "PYTHONPATH": pythonpath, "KILL_AT_STEP": "5", "KILL_SIGNAL": sig})
        assert proc.returncode == 128 + signal.Signals[sig], output(proc)
        assert (run / "checkpoints" / "last").is_dir()
    assert not calls.exists()


def test_an_unknown_signal_name_is_one_line(tmp_path):
    proc = run_cli(tmp_path / "run", "checkpoint.signals=[SIGTERM,SIGFOO]")
    assert proc.returncode == 1
    assert "checkpoint.signals[1]='SIGFOO': expected a signal name such as SIGTERM" in output(proc), output(proc)
