"""What the framework's launchers (hydra_plugins/htf_launchers) do so that a sweep outlives its jobs.

A job whose process dies (a signal, the out-of-memory killer, a lost node) writes no record of its own, and Hydra's
plugins then end the sweep: joblib's runs a batch of jobs through one `joblib.Parallel`, which, when a loky worker
dies, kills the other workers and raises; submitit's waits on its jobs in order and raises at the first without a
result, leaving the jobs after it uncollected. Each of the framework's launchers runs the plugin's own `launch` and
settles what its error left by the job directories (framework/app/sweep.py reads them for the summary):

- a job that wrote its record (summary.json, refused.json) during this launch finished: its objective is read back;
- a job whose directory was started (its `.hydra/`) but not recorded was running: its summary.json says `killed` (or
  `failed`: the job raised outside the app's own handling) with what the launcher knew, the signal where it says;
- a job that never started is launched again through the plugin (joblib), as long as the failed launch started any;
  one that cannot be (submitit's, lost before Hydra made its directory) ends the sweep once the rest are collected.

Under submitit each job is a launch of its own, so that one's error is that job's alone. The jobs settled here
return NaN, as a job the app records as failed does (app._sweep_job): a `JobReturn` with a failed status would make
Hydra's basic sweeper raise it, and Optuna's at its default max_failure_rate.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, cast

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, open_dict

from framework import __version__
from framework.app import sweep
from framework.core import files

log = logging.getLogger(__name__)

FINISHED, RUNNING, NOT_STARTED = "finished", "running", "not started"
Stamps = dict[Path, tuple[Optional[int], Optional[int]]]  # job directory -> its start's and its record's mtime_ns


@dataclass
class Job:
    overrides: list[str]
    num: int
    folder: Path
    config: DictConfig


class JobsNotStarted(RuntimeError):
    """Jobs that the launcher lost before Hydra made their directories: no summary row can say so."""


def _stamp(path: Path) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


def _job_stamps(folder: Path) -> tuple[Optional[int], Optional[int]]:
    """When the job's `.hydra/` last changed (Hydra adds to it as each start of the job begins) and its record."""
    record = sweep.record_path(folder)
    return _stamp(folder / ".hydra"), _stamp(record) if record is not None else None


def stamps(sweep_dir: Path) -> Stamps:
    """Every job directory's stamps, before a launch: what changes afterwards, the launch did."""
    if not sweep_dir.is_dir():
        return {}
    return {folder: _job_stamps(folder) for folder in sweep_dir.iterdir() if folder.is_dir()}


def progress(job: Job, before: Stamps) -> str:
    """How far the job got in the launch that started after `before`."""
    started, recorded = _job_stamps(job.folder)
    was_started, was_recorded = before.get(job.folder, (None, None))
    if recorded is not None and recorded != was_recorded:
        return FINISHED
    return RUNNING if started is not None and started != was_started else NOT_STARTED


def compose(launcher: Any, overrides: Sequence[str], num: int, job_id: Optional[str] = None) -> Job:
    """A job's config and directory, composed as the plugins compose it in the job's process (their `execute_job`
    and `__call__`, then Hydra's `run_job`). `job_id`: `hydra.job.id` where the launcher names it beforehand
    (joblib); submitit's is its cluster's, which a directory named after it cannot be found by."""
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
    with open_dict(config):
        config.hydra.job.num = num
        if job_id is not None:
            config.hydra.job.id = job_id
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)  # `${hydra:...}` in the directory's name resolves as in the job
    try:
        folder = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
    finally:
        if previous is not None:
            HydraConfig.instance().set_config(cast(DictConfig, previous))  # (typed as the schema it holds)
    return Job(list(overrides), num, folder.absolute(), config)


def _returned(value: float, overrides: Sequence[str]) -> JobReturn:
    ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
    ret.return_value = value
    return ret


def finished(job: Job) -> JobReturn:
    """What a job that recorded its end returned, read back from its record (app._run returns the monitored metric)."""
    value = sweep.job_record(job.folder).get(sweep.objective(job.config)[0])
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # a failed or interrupted job's: no metric
        return _returned(math.nan, job.overrides)
    return _returned(float(value), job.overrides)


def mark(job: Job, status: str, error: str) -> JobReturn:
    """Record, in its summary.json, how a running job was lost; it returns NaN, as a failed job does."""
    log.warning("Job %s %s: %s", job.folder.name, status, error)
    files.write_json(job.folder / "summary.json", {"status": status, "error": error, "framework_version": __version__})
    return _returned(math.nan, job.overrides)


def settle(jobs: list[Job], before: Stamps, status: str, error: str) -> dict[int, JobReturn]:
    """The returns of the jobs a failed launch finished or lost while running; the others are left out."""
    returns: dict[int, JobReturn] = {}
    for job in jobs:
        reached = progress(job, before)
        if reached == FINISHED:
            returns[job.num] = finished(job)
        elif reached == RUNNING:
            returns[job.num] = mark(job, status, error)
    return returns


def _worker_death(err: Exception) -> tuple[str, str]:
    """The status and error of the jobs a failed joblib launch was running. joblib does not say whose worker died, and
    kills the others: every job running then is marked alike. loky's message names the signal it died of."""
    from joblib.externals.loky.process_executor import TerminatedWorkerError  # (the plugin's dependency)

    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not isinstance(err, TerminatedWorkerError):
        first = lines[0] if lines else ""
        return "failed", f"ended with the sweep's joblib launch, which raised {type(err).__name__}: {first}"
    codes = next((line.rsplit(" ", 1)[-1] for line in lines if "exit codes" in line), "unknown")
    return "killed", f"its joblib worker or another died (exit codes {codes}), and joblib then ends every running job"


def outlive_joblib(
    launcher: Any, launch: Callable, job_overrides: Sequence[Sequence[str]], first: int
) -> Sequence[JobReturn]:
    """The joblib plugin's `launch` of these jobs; if it raises, the jobs it finished keep their returns, those it was
    running are marked, and those it had not started go to a new launch (this one), as long as it started any."""
    before = stamps(Path(str(launcher.config.hydra.sweep.dir)).absolute())
    try:
        return launch(job_overrides, first)
    except Exception as err:  # noqa: BLE001  (any end of joblib's Parallel: settled by the job directories)
        name = launcher.config.hydra.job.name  # job IDs as the plugin's execute_job gives them: NAME_NUMBER
        jobs = [compose(launcher, o, first + i, f"{name}_{first + i}") for i, o in enumerate(job_overrides)]
        returns = settle(jobs, before, *_worker_death(err))
        if not returns:  # no job started: a new launch would end alike
            raise
        waiting = [job for job in jobs if job.num not in returns]
        for start, end in _consecutive([job.num for job in waiting]):  # the plugin numbers a launch's jobs in a row
            named = f"{start}-{end}" if end > start else str(start)
            log.warning("Launching jobs %s, which had not started when joblib's launch ended", named)
            again = outlive_joblib(
                launcher, launch, [job.overrides for job in waiting if start <= job.num <= end], start
            )
            returns.update(zip(range(start, end + 1), again))
        return [returns[job.num] for job in jobs]


def _consecutive(numbers: list[int]) -> list[tuple[int, int]]:
    """Sorted numbers as runs of consecutive ones, each (first, last)."""
    runs: list[tuple[int, int]] = []
    for n in numbers:
        runs = [*runs[:-1], (runs[-1][0], n)] if runs and runs[-1][1] == n - 1 else [*runs, (n, n)]
    return runs


def _submitit_loss(err: Exception) -> tuple[str, str]:
    """The status and error of a job whose submitit launch raised: `killed` when it produced no result (its process
    ended by a signal, the out-of-memory killer, a lost node: submitit says which state its cluster saw)."""
    from submitit.core.utils import FailedJobError, UncompletedJobError  # (the plugin's dependency)

    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if isinstance(err, UncompletedJobError) and not isinstance(err, FailedJobError):
        return "killed", " ".join(lines[:2])  # "Job ID (task: 0) with path ... has not produced any output (state: X)"
    if isinstance(err, FailedJobError):  # "... failed during processing with trace:", "----", the traceback, "----"
        rules = [i for i, line in enumerate(lines) if set(line) == {"-"}]
        raised = lines[rules[1] - 1] if len(rules) > 1 and rules[1] - rules[0] > 1 else lines[0]
        return "failed", f"{type(err).__name__}: {raised}"
    return "failed", f"{type(err).__name__}: {lines[0] if lines else ''}"


def run_task(call: Callable[..., JobReturn], sweep_overrides: list[str], *args: Any) -> JobReturn:
    """One task of a submitit job, in its process (the plugin's `__call__`, which runs the whole Hydra job in every
    task): with several tasks, each is a rank of the job's one run (framework/app/launch.py). Hydra's `run_job`
    keeps a job's exception in its return, and the plugin hands submitit task 0's only; a non-zero rank's is raised
    here, so that submitit records that task as failed, and so the job (`job_by_job`)."""
    from framework.app.launch import sweep_task_overrides

    returned = call([*sweep_overrides, *sweep_task_overrides()], *args)
    if os.environ.get("RANK", "0") != "0" and returned.status == JobStatus.FAILED:
        returned.return_value  # raises the task's exception (JobReturn's own way of giving it)
    return returned


def tasks_per_job(launcher: Any) -> int:
    """The tasks each of the submitit launcher's jobs runs: its ranks, where there are several."""
    return int(launcher.params.get("nodes") or 1) * int(launcher.params.get("tasks_per_node") or 1)


def fail_job(job: Job, error: str) -> JobReturn:
    """A job of several tasks one of which failed (`error`, its own): failed, whatever rank 0 recorded, which is kept
    beside it (its metrics, or its own error: often only that a peer went away)."""
    record = sweep.job_record(job.folder)
    if record.get("status") == "failed" and record.get("error"):
        error = f"{error}; rank 0: {record['error']}"
    log.warning("Job %s failed: %s", job.folder.name, error)
    files.write_json(job.folder / "summary.json", {**record, "status": "failed", "error": error})
    return _returned(math.nan, job.overrides)


def _check_world_size(job: Job, tasks: int) -> Optional[JobReturn]:
    """A job of `tasks` tasks that records a run finished at another world size (its tasks did not join as one
    run's ranks): failed. None where it is not such a job."""
    record = sweep.job_record(job.folder)
    if record.get("status", "ok") != "ok" or record.get("world_size") == tasks:
        return None
    return fail_job(
        job, f"the run trained at world size {record.get('world_size')}, but the job ran {tasks} tasks (its ranks)"
    )


def job_by_job(
    launcher: Any, launch_one: Callable, job_overrides: Sequence[Sequence[str]], first: int, limit: Optional[int]
) -> list[JobReturn]:
    """Each job through a launch of its own (at most `limit` at a time), so that one that fails or dies is that job's
    error alone; the jobs lost while running are marked, and those lost before they started end the sweep. A job of
    several tasks (its ranks) is failed where any task failed or its run did not train at that world size."""
    assert launcher.config is not None
    before = stamps(Path(str(launcher.config.hydra.sweep.dir)).absolute())
    outcomes = _concurrently([partial(launch_one, [o], first + i) for i, o in enumerate(job_overrides)], limit)
    returns, lost, tasks = [], [], tasks_per_job(launcher)
    for i, (overrides, outcome) in enumerate(zip(job_overrides, outcomes)):
        if not isinstance(outcome, Exception):
            checked = _check_world_size(compose(launcher, overrides, first + i), tasks) if tasks > 1 else None
            returns.append(checked or outcome[0])
            continue
        job, (status, error) = compose(launcher, overrides, first + i), _submitit_loss(outcome)
        if tasks > 1 and progress(job, before) == FINISHED:  # rank 0 recorded its end, but another task failed
            returns.append(fail_job(job, error))
            continue
        settled = settle([job], before, status, error)
        returns.append(settled.get(job.num) or _returned(math.nan, overrides))
        if job.num not in settled:
            lost.append(f"job {job.num} ({' '.join(overrides)}): {error}")
    if lost:
        raise JobsNotStarted("; ".join(lost))
    return returns


def _concurrently(calls: list[Callable[[], Any]], limit: Optional[int]) -> list[Any]:
    """Each call's result or exception, made on at most `limit` threads. Daemon threads: a sweep stopped by Ctrl-C
    exits at once, as the plugin's own wait did, not once every cluster job has ended."""
    outcomes: list[Any] = [None] * len(calls)
    pending = iter(range(len(calls)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            try:
                outcomes[i] = calls[i]()
            except Exception as err:  # noqa: BLE001  (that job's outcome)
                outcomes[i] = err

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(len(calls), limit or len(calls)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes
