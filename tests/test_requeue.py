"""Preemption and requeue with the real engines: SLURM's signal and `scontrol requeue` (a stand-in `scontrol` on
PATH that records its arguments), torchrun's restarts, and a requeued job continuing in the directory it had, ending
bit-identical to a job never interrupted. (Hydra's submitit launcher requeueing on submitit's real local executor:
test_sweep_resilience.py, beside the sweep whose jobs its time limit ends for good.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import KILLHOOK, ROOT, TESTS, assert_identical, final_state, on_pythonpath, output, run_cli

from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput

pytestmark = pytest.mark.e2e

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


def in_the_job(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process in a SLURM job's environment (the scontrol fixture's), for a run of the job started here."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["single", pytest.param("ddp", marks=pytest.mark.distributed)])
def test_sbatch_job_signalled_saves_requeues_once_and_continues_in_its_own_directory(tmp_path, scontrol, parallel,
                                                                                      monkeypatch):
    """ddp: the job's process is `run.py`, which spawned 2 workers; SLURM signals it, it forwards the signal,
    both workers stop after the same step and save, and the parent (not each worker) requeues the job."""
    env, calls = scontrol
    name = f"pytest-requeue-{env['SLURM_JOB_ID']}"
    run_dir = ROOT / "outputs" / name / f"slurm-{env['SLURM_JOB_ID']}"
    quick = (*QUICK, f"parallel={parallel}", *(("trainer.max_steps=40",) if parallel == "ddp" else ()))
    try:
        whole = run_cli(tmp_path / "whole", *quick, fast=False)
        assert whole.returncode == 0, output(whole)
        pythonpath = on_pythonpath(KILLHOOK)
        # SLURM's --signal=USR1@90 arrives mid-epoch, after step 23, at the job's process.
        signalled = run_cli(None, *quick, f"name={name}", fast=False,
                            env={**env, "PYTHONPATH": pythonpath, "KILL_AT_STEP": "23", "KILL_SIGNAL": "SIGUSR1"})
        assert signalled.returncode == 128 + signal.SIGUSR1, output(signalled)
        # Forwarded by the parent, the signal reaches the workers a step or two later; they agree on one.
        stopped = re.search(r"Stopped by SIGUSR1 at step (\d+) ", output(signalled))
        assert stopped and (stopped.group(1) == "23" or parallel == "ddp"), output(signalled)
        assert calls.read_text() == f"requeue {env['SLURM_JOB_ID']}\n"  # exactly once
        assert (run_dir / "checkpoints" / "last").is_dir()
        assert "Requeued SLURM job" in (run_dir / "run.log").read_text()
        # SLURM starts the same command again, with the same job id: it continues where it stopped (in this
        # process, given the job's environment: the signal and the requeue were the other process's).
        in_the_job(monkeypatch, env)
        again = run_cli(None, *quick, f"name={name}", fast=False)
        assert again.returncode == 0, output(again)
        assert "Resumed from" in output(again) and f"at step {stopped.group(1)} " in output(again), output(again)
        assert calls.read_text().count("requeue") == 1
        assert_identical(final_state(tmp_path / "whole"), final_state(run_dir))
        assert len(list((run_dir / ".hydra").glob("resumed-*"))) == 1
    finally:
        shutil.rmtree(ROOT / "outputs" / name, ignore_errors=True)


def test_sigterm_and_requeue_false_save_but_never_requeue(tmp_path, scontrol):
    env, calls = scontrol
    pythonpath = on_pythonpath(KILLHOOK)
    for case, extra, sig in (("scancel", (), "SIGTERM"), ("off", ("checkpoint.requeue=false",), "SIGUSR1")):
        run = tmp_path / case
        proc = run_cli(run, *QUICK, *extra, fast=False,
                       env={**env, "PYTHONPATH": pythonpath, "KILL_AT_STEP": "5", "KILL_SIGNAL": sig})
        assert proc.returncode == 128 + signal.Signals[sig], output(proc)
        assert (run / "checkpoints" / "last").is_dir()
    assert not calls.exists()


class SignalWhileTestingTask(ClassificationTask):
    """Classification that sends $SIGNAL_IN_TEST to itself at its first test batch: after the last step, as
    SLURM's time-limit warning can come while a finished run validates, saves or tests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent = False

    def test_step(self, batch: Any) -> StepOutput:
        if not self.sent and os.environ.get("SIGNAL_IN_TEST"):
            self.sent = True
            os.kill(os.getpid(), signal.Signals[os.environ["SIGNAL_IN_TEST"]])
        return super().test_step(batch)


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_a_signal_after_the_last_step_lets_the_complete_run_finish_without_a_requeue(tmp_path, scontrol, sig):
    """Before, the watch ended with the last step: SIGUSR1's default action killed the finished run in its test
    loop, and under submitit its handler requeued a run that was complete."""
    env, calls = scontrol
    run = tmp_path / "run"
    proc = run_cli(run, *QUICK, "trainer.test=true", "task._target_=test_requeue.SignalWhileTestingTask",
                   fast=False, env={**env, "PYTHONPATH": on_pythonpath(TESTS), "SIGNAL_IN_TEST": sig})
    assert proc.returncode == 0, output(proc)
    assert f"Received {sig} after the last step: finishing the run" in output(proc), output(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 60 and "test/acc" in summary, summary
    assert not calls.exists()


def _start(run_dir: Path, *overrides: str, env: dict[str, str]) -> subprocess.Popen:
    """`python run.py` as run_cli runs it, without waiting."""
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update(OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _children(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def _started_workers(pid: int) -> int:
    """How many DDP workers `pid` has started: the children of its multiprocessing forkserver."""
    count = 0
    for child in _children(pid):
        try:
            if "forkserver" in Path(f"/proc/{child}/cmdline").read_text():
                count += len(_children(int(child)))
        except OSError:
            pass
    return count


def _signal_while_starting(proc: subprocess.Popen, ready: Any, signals: list[signal.Signals]) -> str:
    """Send `signals` to the job's process as soon as `ready()` (a moment well before the first step), then
    return everything it printed."""
    deadline = time.monotonic() + 120
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, proc.communicate()[0]  # still starting: no step taken yet
    for sig in signals:
        os.kill(proc.pid, sig)
        time.sleep(0.05)
    return proc.communicate(timeout=180)[0]


@pytest.mark.parametrize("moment", ["composing", pytest.param("ddp-workers-importing",
                                                              marks=[pytest.mark.distributed, pytest.mark.slow])])
def test_a_cluster_signal_while_the_run_starts_is_held_then_saved_requeued_and_resumed(tmp_path, scontrol, moment,
                                                                                        monkeypatch):
    """SLURM's USR1 (or scancel's TERM) can come before the training loop watches: while Hydra composes, torch
    is imported or spawned DDP workers start. Before, its default action killed the job (exit -10: no checkpoint,
    no requeue, the allocation lost). Now it is held: the run takes its first step, saves `last`, requeues once,
    and the requeued job continues from step 1 to the end."""
    env, calls = scontrol
    run = tmp_path / "run"
    quick = (*QUICK, "trainer.max_steps=12", *(("parallel=ddp", "parallel.devices=2") if "ddp" in moment else ()))
    proc = _start(run, *quick, env=env)
    ready = ((lambda: (run / ".hydra" / "config.yaml").is_file()) if moment == "composing" else
             (lambda: _started_workers(proc.pid) == 2))
    text = _signal_while_starting(proc, ready, [signal.SIGUSR1])
    assert proc.returncode == 128 + signal.SIGUSR1, text
    assert "Received SIGUSR1 while the run was starting" in text, text
    assert "Stopped by SIGUSR1 at step 1 " in text, text
    assert calls.read_text() == f"requeue {env['SLURM_JOB_ID']}\n"
    in_the_job(monkeypatch, env)  # the requeued job, in this process
    again = run_cli(None, *quick, f"resume={run}", fast=False)
    assert again.returncode == 0, output(again)
    assert "at step 1 " in output(again) and json.loads((run / "summary.json").read_text())["step"] == 12
    assert calls.read_text().count("requeue") == 1


def test_a_held_signal_the_run_does_not_watch_and_a_second_one_take_their_default_action(tmp_path, scontrol):
    """The latch never swallows a signal: with checkpoint.on_signal=false SIGTERM ends the run as it always did
    (once the config says so), and a second USR1 while starting aborts at once. Neither saves nor requeues."""
    env, calls = scontrol
    for case, extra, sent, died_of in (("off", ("checkpoint.on_signal=false",), [signal.SIGTERM], signal.SIGTERM),
                                       ("twice", (), [signal.SIGUSR1, signal.SIGUSR1], signal.SIGUSR1)):
        run = tmp_path / case
        proc = _start(run, *QUICK, *extra, env=env)
        text = _signal_while_starting(proc, (run / ".hydra" / "config.yaml").is_file, sent)
        assert proc.returncode == -died_of, text
        assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir()), text
    assert not calls.exists()


def test_an_unknown_signal_name_is_one_line(tmp_path):
    proc = run_cli(tmp_path / "run", "checkpoint.signals=[SIGTERM,SIGFOO]")
    assert proc.returncode == 1
    assert "checkpoint.signals[1]='SIGFOO': expected a signal name such as SIGTERM" in output(proc), output(proc)


class SlowTask(ClassificationTask):
    """Classification whose every training step also waits `sleep_s`: a job that lasts as long as the test needs,
    on any machine, without using the CPU. The numbers are those of ClassificationTask, whatever `sleep_s`."""

    def __init__(self, *args: Any, sleep_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sleep_s = sleep_s

    def training_step(self, batch: Any) -> StepOutput:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return super().training_step(batch)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A resumed attempt (a requeued job) runs at full speed: it finishes within one more time limit however
        loaded the machine is (submitit gives up on a job that times out too often)."""
        self.sleep_s = 0.0


@pytest.mark.slow
def test_a_time_budget_shorter_than_the_job_stops_cleanly_and_the_same_command_finishes_identical(tmp_path):
    """trainer.max_time is this job's budget: each start of the same command stops cleanly when its budget is
    spent, saving last, and the next start continues; the run ends as if it had never stopped."""
    run = tmp_path / "run"
    common = (*QUICK, "trainer.max_steps=100", "task._target_=test_requeue.SlowTask", "callbacks=none")
    env = {"PYTHONPATH": on_pythonpath(TESTS)}
    whole = run_cli(tmp_path / "whole", *common, fast=False, env=env)
    assert whole.returncode == 0, output(whole)
    command = (*common, "+task.sleep_s=0.03", "trainer.max_time=1.5", f"hydra.run.dir={run}", "resume=auto")
    steps = []
    for _ in range(10):  # 100 steps of at least 30 ms: 2 or more starts of 1.5 s
        proc = run_cli(None, *command, fast=False, env=env)
        assert proc.returncode == 0, output(proc)
        summary = json.loads((run / "summary.json").read_text())
        steps.append(summary["step"])
        if summary["step"] == 100:
            break
        assert summary["stopped"].startswith("time limit: trained for "), summary
    assert len(steps) >= 2 and steps == sorted(set(steps)) and steps[-1] == 100, steps
    assert_identical(final_state(tmp_path / "whole"), final_state(run))


TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
TORCHRUN_RUN = ("parallel=ddp", "resume=auto", *QUICK, "trainer.max_steps=40")
KILL_AFTER_17 = {"PYTHONPATH": on_pythonpath(KILLHOOK), "KILL_AT_STEP": "17", "KILL_SIGNAL": "SIGKILL"}


def _torchrun_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@pytest.fixture(scope="module")
def torchrun_whole(tmp_path_factory) -> Path:
    """An uninterrupted run of 2 DDP ranks, started by the framework's own launcher (from this process): what a run
    killed and restarted under torchrun must end as: the same ranks train the same run under either launcher, which
    the tests below show as well."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "whole"
    whole = run_cli(run_dir, *TORCHRUN_RUN, "parallel.devices=2", fast=False)
    assert whole.returncode == 0, output(whole)
    return run_dir


def _resumed_at_the_newest_checkpoint(out: str) -> None:
    # The newest checkpoint written whole: step 14's, or step 10's (epoch end) where SIGKILL, three steps later, came
    # while the background writer was still on step 14's. Either way the run must end as the uninterrupted one did.
    resumed = re.search(r"Resumed from \S+ at step (\d+) ", out)
    assert resumed and resumed.group(1) in ("10", "14"), out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(TORCHRUN is None, reason="needs torchrun")
def test_torchrun_restarts_a_killed_worker_group_and_the_run_ends_identical(tmp_path, torchrun_whole):
    """torchrun --max-restarts=1: rank 0 is SIGKILLed after step 17; torchrun restarts both workers, which take
    resume=auto in the fixed run directory and continue from the newest checkpoint."""
    restarted = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", str(ROOT / "run.py"),
                                f"hydra.run.dir={tmp_path / 'killed'}", *TORCHRUN_RUN], cwd=ROOT, capture_output=True,
                               text=True, timeout=180,
                               env=_torchrun_env(**KILL_AFTER_17, KILL_ONCE_FILE=str(tmp_path / "once")))
    assert restarted.returncode == 0, output(restarted)
    assert (tmp_path / "once").exists()  # the kill happened
    _resumed_at_the_newest_checkpoint(output(restarted))
    assert_identical(final_state(torchrun_whole), final_state(tmp_path / "killed"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(TORCHRUN is None, reason="needs torchrun")
def test_two_torchrun_nodes_restart_after_one_nodes_worker_is_killed_and_end_identical(tmp_path, torchrun_whole):
    """Two torchrun agents as two nodes of one job on loopback (c10d rendezvous, one worker each, --max-restarts=1):
    node 1's worker (rank 1) is SIGKILLed after step 17 mid-epoch; its agent restarts it, the other agent restarts
    its own on the membership change, both resume=auto from the newest checkpoint rank 0 picked, and the run ends
    bit-identical to the uninterrupted one. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch's own workaround for
    restarts across nodes (pytorch/pytorch#135712; docs/parallelism.md says so)."""
    from framework.app.launch import free_port

    endpoint, job, run_dir = f"127.0.0.1:{free_port()}", f"two-nodes-{uuid.uuid4().hex[:8]}", tmp_path / "run"
    env = _torchrun_env(**KILL_AFTER_17, KILL_RANK="1", KILL_ONCE_FILE=str(tmp_path / "once"),
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    logs = [tmp_path / f"node{i}.log" for i in range(2)]  # files, not pipes: one node must never block on its own
    nodes = [subprocess.Popen([TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                               f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}",
                               "--max-restarts=1", "--monitor-interval=1", "--local-addr=127.0.0.1",
                               str(ROOT / "run.py"), f"hydra.run.dir={run_dir}", *TORCHRUN_RUN],
                              cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
             for log in logs]
    try:
        for node in nodes:
            node.wait(timeout=300)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    outs = [log.read_text() for log in logs]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outs)
    assert (tmp_path / "once").exists()  # the kill happened
    _resumed_at_the_newest_checkpoint("\n".join(outs))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 40
    record = json.loads(sorted(run_dir.glob("provenance-resumed-*.json"))[-1].read_text())
    assert record["job"]["launcher"] == "torchrun" and record["job"]["world_size"] == 2
    assert_identical(final_state(torchrun_whole), final_state(run_dir))


@pytest.mark.unit
def test_submitits_requeue_exit_is_told_from_a_jobs_own_sys_exit(monkeypatch):
    """A sweep job records a job's own SystemExit as failed and goes on; the SystemExit of submitit's requeue
    (its handler got a signal after the run's watch had ended) must reach submitit, which then requeues."""
    from submitit.local.local import LocalJobEnvironment

    from framework.app.main import _submitit_requeue

    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "7")
    with pytest.raises(SystemExit) as requeued:
        LocalJobEnvironment()._requeue(1)
    with pytest.raises(SystemExit) as own:
        sys.exit(3)
    assert (_submitit_requeue(requeued.value), _submitit_requeue(own.value)) == (True, False)
