"""Sweeps outlive their jobs: a job whose process is killed, under Hydra's basic, joblib or submitit launcher, is a
row of summary.csv marked `killed`, the jobs beside it keep their rows, the jobs not yet started still run, and the
sweep ends with its summary and a non-zero exit, without a traceback."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, TESTS, assert_identical, final_state, on_pythonpath, output, run_cli, run_env

from framework.loop.view import RunView
from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput

pytestmark = pytest.mark.e2e

QUICK = ("logger.progress_bar=false", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
         "checkpoint=none", "trainer.test=false")
WAIT_S = 120  # the bound of every wait of a job for another


def _wait_for(ready, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S} s for {what}")
        time.sleep(0.05)


class SweepPartTask(ClassificationTask):
    """At its first training step, a sweep's job plays the part $SWEEP_PARTS gives its job number (`1=SIGKILL,2=hold`):
    a signal's name: once every job numbered below it has finished (its summary.json) and every `hold` job holds,
    it sends that signal to its own process; `hold`: notes that it holds, then waits (bounded) for what never comes,
    so that it is still running when another job's process dies; `slow`: each of its steps also waits 20 ms, a job
    that lasts until a time limit stops it, on any machine, without using the CPU. A job with no part trains."""

    played = ""  # the part, once played

    def training_step(self, batch: Any) -> StepOutput:
        if isinstance(self.trainer, RunView) and not self.played:  # not pre-flight's throw-away copy
            self.played = _play()
        if self.played == "slow":
            time.sleep(0.02)
        return super().training_step(batch)


def _play() -> str:
    """This job's part, played once."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    parts = dict(item.split("=") for item in os.environ["SWEEP_PARTS"].split(","))
    part, meeting = parts.get(str(hydra.job.num), "train"), Path(os.environ["MEETING_DIR"])
    if part == "hold":
        (meeting / f"holds-{hydra.job.num}").touch()
        _wait_for(lambda: False, "the end of this job (a job held to be running when another one dies)")
    elif part in signal.Signals.__members__:
        sweep_dir = Path(hydra.sweep.dir)
        holders = [num for num, p in parts.items() if p == "hold"]
        _wait_for(lambda: all(list(sweep_dir.glob(f"{num}_*/summary.json")) for num in range(hydra.job.num)),
                  "the jobs before this one to finish")
        _wait_for(lambda: all((meeting / f"holds-{num}").exists() for num in holders), "the held jobs to start")
        os.kill(os.getpid(), signal.Signals[part])
    return part


def sweep(tmp_path: Path, *overrides: str, parts: str, pythonpath: Path = TESTS, timeout: float = 300):
    """`run.py -m` of the QUICK overrides and `overrides`, each job playing its part (SweepPartTask), once it has
    ended; and its sweep directory."""
    proc, sweep_dir = start_sweep(tmp_path, *overrides, parts=parts, pythonpath=pythonpath)
    try:
        return finished(proc, sweep_dir, timeout), sweep_dir
    finally:
        proc.kill()


def start_sweep(tmp_path: Path, *overrides: str, parts: str = "", quick: bool = True, pythonpath: Path = TESTS
                ) -> tuple[subprocess.Popen, Path]:
    """The sweep, started: its process (its output to files in `tmp_path`) and its sweep directory. `quick`: with the
    QUICK overrides and each job playing its part (SweepPartTask)."""
    sweep_dir = tmp_path / "sweep"
    (tmp_path / "meeting").mkdir()
    parted = (*QUICK, "task._target_=test_sweep_resilience.SweepPartTask") if quick else ()
    args = [sys.executable, str(ROOT / "run.py"), "-m", f"hydra.sweep.dir={sweep_dir}", *parted, *overrides]
    env = {**run_env(), "PYTHONPATH": on_pythonpath(pythonpath, TESTS), "SWEEP_PARTS": parts,
           "MEETING_DIR": str(tmp_path / "meeting")}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, text=True, stdout=(tmp_path / "out").open("w"),
                            stderr=(tmp_path / "err").open("w"))
    return proc, sweep_dir


def finished(proc: subprocess.Popen, sweep_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    """The sweep start_sweep started, once it has ended: its exit code and output."""
    proc.wait(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, (sweep_dir.parent / "out").read_text(),
                                       (sweep_dir.parent / "err").read_text())


def rows(sweep_dir: Path) -> dict[str, dict[str, str]]:
    """summary.csv's rows by their `job` cell."""
    with open(sweep_dir / "summary.csv") as f:
        return {row["job"]: row for row in csv.DictReader(f)}


def statuses(sweep_dir: Path) -> dict[str, str]:
    return {job: row["status"] for job, row in rows(sweep_dir).items()}


@pytest.mark.slow
def test_a_joblib_worker_killed_mid_sweep_costs_the_jobs_it_ran_beside_and_the_rest_still_run(tmp_path):
    """A SIGKILLed loky worker raised TerminatedWorkerError through the CLI: a traceback, exit 1, no summary.csv, and
    the other jobs' results lost. Job 1 dies once job 0 has finished and job 2 runs beside it (joblib ends every
    running job when a worker dies); job 3 has not started then and must still run."""
    proc, sweep_dir = sweep(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "data.folds=4",
                            "data.fold=0,1,2,3", parts="1=SIGKILL,2=hold")
    text = output(proc)
    assert proc.returncode == 1 and "Traceback" not in text, text
    table = rows(sweep_dir)
    assert statuses(sweep_dir) == {"0_data.fold=0": "ok", "1_data.fold=1": "killed", "2_data.fold=2": "killed",
                                   "3_data.fold=3": "ok", "mean ± std over folds": "incomplete"}, text
    assert all("SIGKILL" in table[job]["error"] for job in ("1_data.fold=1", "2_data.fold=2")), table
    assert table["mean ± std over folds"]["error"] == "fold 1 killed, fold 2 killed"
    assert table["3_data.fold=3"]["val/acc"] and table["0_data.fold=0"]["val/acc"]
    assert "Sweep summary (4 jobs" in proc.stdout and "killed" in proc.stdout


RAW_LAUNCHER = """
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher


class RawJoblibLauncher(JoblibLauncher):
    \"\"\"Hydra's joblib launcher as it is: its launch raises when a worker dies.\"\"\"
"""


@pytest.mark.slow
def test_a_launcher_that_raises_still_leaves_the_summary_and_one_error_line(tmp_path):
    """A launcher the framework does not extend (a user's own; here Hydra's joblib launcher as it is, which raises
    when a worker dies) ended the sweep in a traceback without summary.csv. The jobs that ran keep their rows; the
    jobs running when the launcher gave up are rows too, unfinished."""
    plugin = tmp_path / "plugins" / "hydra_plugins" / "raw_joblib"  # Hydra takes launchers of this namespace only
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(RAW_LAUNCHER)
    proc, sweep_dir = sweep(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                            "hydra.launcher._target_=hydra_plugins.raw_joblib.RawJoblibLauncher",
                            "optimizer.lr=0.05,0.1,0.2", parts="1=SIGKILL,2=hold", pythonpath=tmp_path / "plugins")
    text = output(proc)
    assert proc.returncode == 1 and "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and errors[0].startswith("Error: the sweep stopped early (TerminatedWorkerError: "), text
    assert str(sweep_dir / "summary.csv") in errors[0], text
    assert statuses(sweep_dir) == {"0_optimizer.lr=0.05": "ok", "1_optimizer.lr=0.1": "unfinished",
                                   "2_optimizer.lr=0.2": "unfinished"}, text


@pytest.mark.waits
@pytest.mark.slow
def test_submitits_time_limit_requeues_a_job_until_it_ends_and_a_sweep_records_jobs_killed_or_timed_out_for_good(
        tmp_path):
    """Two sweeps under submitit's real local executor with timeout_min=1, which sends SIGUSR2 about 30 s into each
    job, run at once (one wait on submitit's clock for both).

    Requeued: each job of the first sweep (36 s of sleeping steps) stops at a step, saves last, is requeued by
    submitit and continues, ending as the run never stopped.

    Two defects of Hydra's submitit launcher, in the second sweep of three jobs. It waited on its jobs in order and
    raised at the first that produced no result: a traceback, no summary.csv, and the jobs after it never
    collected; job 1 is SIGKILLed once job 0 has finished. And submitit's handler raises instead of requeueing a job
    that timed out too often (here at its first time limit, max_num_timeout=0): the job's exception reached the
    sweeper, which raised it through the CLI; job 2 runs until its time limit, saves checkpoints/last and is
    `interrupted`, saying why it was not requeued."""
    steps = 2400  # 36 s of sleeping steps: submitit signals at about 30 s
    common = ("logger.progress_bar=false", "trainer.device=cpu", "trainer.test=false", "callbacks=none",
              f"trainer.max_steps={steps}", "trainer.max_epochs=-1", "model.dropout=0.2",
              "trainer.log_every_n_steps=500", "task._target_=test_requeue.SlowTask")
    requeued = tmp_path / "requeued"
    requeued.mkdir()
    sweeps = [
        start_sweep(requeued, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=1",
                    "optimizer.lr=0.05,0.1", *common, "+task.sleep_s=0.015", quick=False),
        start_sweep(tmp_path, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=1",
                    "+hydra.launcher.max_num_timeout=0", "checkpoint=default", "callbacks=none",
                    "trainer.max_epochs=-1", "trainer.max_steps=3,4,100000", parts="1=SIGKILL,2=slow"),
    ]
    try:  # the runs never interrupted, for comparison, train in this process while the sweeps' jobs mostly sleep
        for lr in ("0.05", "0.1"):
            whole = run_cli(tmp_path / f"whole-{lr}", f"optimizer.lr={lr}", *common, "+task.sleep_s=0", fast=False)
            assert whole.returncode == 0, output(whole)
        (requeue, requeue_dir), (failures, sweep_dir) = [(finished(proc, folder, timeout=400), folder)
                                                         for proc, folder in sweeps]
    finally:
        for proc, _ in sweeps:
            proc.kill()
    assert requeue.returncode == 0, output(requeue)
    assert statuses(requeue_dir) == {"0_optimizer.lr=0.05": "ok", "1_optimizer.lr=0.1": "ok"}, output(requeue)
    for lr, job in (("0.05", "0_optimizer.lr=0.05"), ("0.1", "1_optimizer.lr=0.1")):
        log = (requeue_dir / job / "run.log").read_text()
        assert "Stopped by SIGUSR2" in log and "Requeued job" in log and "Resumed from" in log, log
        assert_identical(final_state(tmp_path / f"whole-{lr}"), final_state(requeue_dir / job))

    text = output(failures)
    assert failures.returncode == 1 and "Traceback" not in text, text
    table = rows(sweep_dir)
    assert statuses(sweep_dir) == {"0_trainer.max_steps=3": "ok", "1_trainer.max_steps=4": "killed",
                                   "2_trainer.max_steps=100000": "interrupted"}, text
    assert "has not produced any output" in table["1_trainer.max_steps=4"]["error"], table
    assert "not requeued: UncompletedJobError: Job not requeued because: timed-out too many times" in \
        table["2_trainer.max_steps=100000"]["error"], table
    assert (sweep_dir / "2_trainer.max_steps=100000" / "checkpoints" / "last").is_dir()


def test_ctrl_c_that_ends_a_job_of_the_basic_launcher_is_its_row_and_stops_the_sweep_with_its_summary(tmp_path):
    """Hydra's basic launcher runs the jobs in the sweep's own process. A KeyboardInterrupt in a job (Ctrl-C with
    checkpoint.on_signal=false, or a second stop signal) went past the job's records: "Interrupted.", exit 130, no
    summary.csv. It is the job's row, `killed`, and the sweep stops as on a first Ctrl-C, with its summary."""
    # A suite started by a shell without job control ignores SIGINT, and so would the sweep: this is about Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (conftest restores this worker's handler after)
    proc, sweep_dir = sweep(tmp_path, "checkpoint.on_signal=false", "optimizer.lr=0.05,0.1,0.2", parts="1=SIGINT")
    text = output(proc)
    assert proc.returncode == 130 and "Traceback" not in text, text
    assert statuses(sweep_dir) == {"0_optimizer.lr=0.05": "ok", "1_optimizer.lr=0.1": "killed"}, text
    assert "KeyboardInterrupt" in rows(sweep_dir)["1_optimizer.lr=0.1"]["error"]
    assert f"Sweep stopped by SIGINT: the same command with hydra.sweep.dir={sweep_dir}" in text


@pytest.mark.unit
def test_every_launcher_of_hydras_joblib_and_submitit_plugins_has_the_frameworks_that_outlives_its_jobs():
    """A sweep launches through the framework's subclass of the plugin launcher its config names (SweepSummary): each
    launcher the plugins register must have one, which runs the plugin's own launch."""
    from hydra.utils import get_class
    from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

    from hydra_plugins.htf_launchers import OUTLIVING

    assert set(OUTLIVING) == {conf._target_ for conf in (JobLibLauncherConf, LocalQueueConf, SlurmQueueConf)}
    for plugins, ours in OUTLIVING.items():
        assert ours.startswith("hydra_plugins.htf_launchers.")  # Hydra instantiates launchers of this namespace only
        # By name: Hydra's plugin scan executes the plugins' modules again, so an earlier test's scan can leave two
        # class objects of one launcher class.
        bases = [f"{base.__module__}.{base.__qualname__}" for base in get_class(ours).__bases__]
        assert bases == [plugins] and "launch" in vars(get_class(ours))
