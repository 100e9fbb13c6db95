"""A cluster job's tasks are its ranks: an `srun` of two tasks, or a submitit job of two tasks (Hydra's submitit
launcher), trains one run at world size 2 in one run directory; a task that fails fails the job; a strategy that
cannot use the tasks as ranks is refused in one line on every task. The derivation itself (framework/parallel/
cluster.py) from SLURM's and submitit's variables, as Lightning and submitit derive them."""
from __future__ import annotations

import csv
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    ROOT,
    TESTS,
    on_pythonpath,
    one_error_line,
    output,
    run_command_in_process,
    run_env,
    run_process,
)

from framework.parallel import cluster
from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput

pytestmark = pytest.mark.e2e

QUICK = ("logger.progress_bar=false", "trainer.max_steps=4", "trainer.limit_val_batches=1", "trainer.test=false",
         "parallel.timeout_s=60")


def _srun_task(rank: int, job_id: str, name: str = "train") -> dict[str, str]:
    """What srun gives task `rank` of a job of 2 tasks on this one node."""
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": name}


def _srun(run_dir: Path, *overrides: str) -> list[subprocess.CompletedProcess]:
    """Two `python run.py` processes started as srun starts a job's 2 tasks, both to their end (bounded)."""
    job_id = str(random.randint(1000, 9999))  # the port: 15000 + these 4 digits
    procs = [subprocess.Popen([sys.executable, str(ROOT / "run.py"), f"hydra.run.dir={run_dir}", *overrides],
                              cwd=ROOT, env={**run_env(), **_srun_task(rank, job_id)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.slow
@pytest.mark.distributed
def test_an_srun_of_two_tasks_trains_one_run_at_world_size_two_in_one_directory(tmp_path):
    """Before: each task trained alone at world size 1, and the second was refused by the first's lock."""
    done = _srun(tmp_path / "run", "parallel=ddp", "parallel.devices=1", *QUICK)
    assert [p.returncode for p in done] == [0, 0], "\n".join(map(output, done))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "ok" and summary["step"] == 4
    record = json.loads((tmp_path / "run" / "provenance.json").read_text())
    assert record["ranks_from"] == "slurm" and summary["hosts"] == [socket.gethostname()] * 2
    assert {k: record["job"][k] for k in ("launcher", "world_size", "nodes", "nodelist")} == {
        "launcher": "slurm", "world_size": 2, "nodes": "1", "nodelist": "localhost"}
    assert len(record["job"]["job_id"]) == 4 and record["job"]["job_id"].isdigit()  # _srun's
    assert output(done[0]).count("Done in") == 1 and "Done in" not in output(done[1])


def _as_task(monkeypatch: pytest.MonkeyPatch, rank: int, job_id: str) -> None:
    """This process's environment as srun's task `rank` of `job_id` (_srun_task), until the test ends: for a
    refusal at start, which `python run.py` makes through its entry point run here (run_command_in_process: the
    command line derives the ranks from these variables, and puts the environment back afterwards)."""
    for name, value in _srun_task(rank, job_id).items():
        monkeypatch.setenv(name, value)


def test_parallel_single_in_a_job_of_two_tasks_is_refused_on_every_task(tmp_path, monkeypatch):
    job_id = "4711"
    for rank in (0, 1):
        _as_task(monkeypatch, rank, job_id)
        proc = run_command_in_process([f"hydra.run.dir={tmp_path / 'run'}", *QUICK])
        line = one_error_line(proc)
        assert line.startswith("Error: parallel.strategy=single: a job of 2 tasks (slurm): each task is a rank"), line
        assert "expected parallel=ddp or parallel=fsdp, or one task per job" in line
    assert not [p for p in (tmp_path / "run").rglob("*")]  # refused at start: nothing left (rank 1's Hydra made it)


def test_several_devices_per_task_are_refused(tmp_path, monkeypatch):
    _as_task(monkeypatch, 0, "4711")
    proc = run_command_in_process([f"hydra.run.dir={tmp_path / 'run'}", "parallel=ddp", "parallel.devices=2", *QUICK])
    assert one_error_line(proc).startswith("Error: parallel.devices=2: a job of 2 tasks (slurm): each task is one "
                                           "process"), output(proc)


class RankFailingTask(ClassificationTask):
    """Raises at its first training step on the rank `fail_rank` names (-1: none)."""

    def __init__(self, *args: Any, fail_rank: int = -1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_rank = fail_rank

    def training_step(self, batch: Any) -> StepOutput:
        if os.environ.get("RANK") == str(self.fail_rank):
            raise RuntimeError(f"boom on rank {os.environ['RANK']}")
        return super().training_step(batch)


def _submitit_sweep(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None):
    sweep_dir = tmp_path / "sweep"
    proc = run_process([sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=submitit_local",
                        "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5",
                        f"hydra.sweep.dir={sweep_dir}", "parallel=ddp", "parallel.devices=1", "checkpoint=none",
                        *QUICK, *overrides], env=env, timeout=300)
    with open(sweep_dir / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return proc, sweep_dir, rows


@pytest.mark.slow
@pytest.mark.distributed
def test_a_submitit_job_of_two_tasks_trains_one_run_at_world_size_two_and_fails_when_one_task_fails(tmp_path):
    """Before: task 1 trained alone at world size 1, task 0 was refused by the lock, and summary.csv said ok. Job 0
    trains one run of both tasks; in job 1, task 1 raises at its first step: that job is failed, with task 1's
    error, never ok (one sweep of both jobs: each sweep's tasks start three processes)."""
    proc, sweep_dir, rows = _submitit_sweep(tmp_path, "task._target_=test_cluster_ranks.RankFailingTask",
                                            "+task.fail_rank=-1,1", env={"PYTHONPATH": on_pythonpath(ROOT, TESTS)})
    assert proc.returncode == 1, output(proc)
    assert [row["status"] for row in rows] == ["ok", "failed"], rows
    assert "RankFailed: rank 1: task: RankFailingTask.training_step" in rows[1]["error"], rows
    (job_dir,) = [p for p in sweep_dir.iterdir() if p.is_dir() and p.name.startswith("0")]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["hosts"] == [socket.gethostname()] * 2
    record = json.loads((job_dir / "provenance.json").read_text())
    assert record["ranks_from"] == "submitit-local"
    assert (record["job"]["launcher"], record["job"]["world_size"]) == ("submitit-local", 2)
    assert sorted(p.name for p in (job_dir / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]


# ------------------------------------------------------------------------------------------------- derivation
@pytest.mark.unit
@pytest.mark.parametrize("nodelist, first", [("host[5-9]", "host5"), ("a[01-02],b", "a01"), ("node7", "node7"),
                                             ("gpu[3]", "gpu3"), ("x[10,12-14]", "x10"), ("c1,c2", "c1")])
def test_the_master_is_the_first_host_of_the_node_list(nodelist, first):
    assert cluster.first_host(nodelist) == first


@pytest.mark.unit
def test_an_srun_tasks_ranks_and_port_are_lightnings():
    ranks = cluster.cluster_environment({**_srun_task(1, "123456")})
    assert ranks is not None and ranks.source == "slurm"
    assert ranks.torch_env() == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                 "MASTER_ADDR": "localhost", "MASTER_PORT": str(15000 + 3456)}
    given = cluster.cluster_environment({**_srun_task(0, "123456"), "MASTER_PORT": "29555"})
    assert given is not None and given.master_port == 29555  # an existing MASTER_PORT wins


@pytest.mark.unit
@pytest.mark.parametrize("change", [{"SLURM_JOB_NAME": "bash"}, {"SLURM_JOB_NAME": "interactive"},
                                    {"SLURM_NTASKS": "1"}, {"RANK": "0"}])
def test_no_ranks_for_an_interactive_shell_a_single_task_or_torchrun(change):
    assert cluster.cluster_environment({**_srun_task(0, "77"), **change}) is None


@pytest.mark.unit
def test_a_submitit_tasks_ranks_are_submitits_own(monkeypatch):
    for name, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "31337", "SUBMITIT_LOCAL_NTASKS": "2",
                        "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_NODEID": "0",
                        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    ranks = cluster.cluster_environment()
    assert ranks is not None and ranks.source == "submitit-local"
    assert (ranks.rank, ranks.local_rank, ranks.world_size, ranks.local_world_size) == (1, 1, 2, 2)
    assert ranks.master_addr == socket.gethostname()
    assert ranks.master_port == random.Random("31337").randint(20000, 60000)


@pytest.mark.unit
@pytest.mark.parametrize("env, spawned, expected", [
    ({}, 0, {"launcher": None, "world_size": 1}),
    ({}, 2, {"launcher": "spawn", "world_size": 2}),
    ({"RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "exp7", "TORCHELASTIC_RESTART_COUNT": "1"}, 0,
     {"launcher": "torchrun", "world_size": 4, "rendezvous_id": "exp7", "restart": "1"}),
    ({"RANK": "0", "WORLD_SIZE": "2", "HTF_RANKS_FROM": "slurm", "SLURM_JOB_ID": "812", "SLURM_ARRAY_JOB_ID": "800",
      "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[1-2]"}, 0,
     {"launcher": "slurm", "world_size": 2, "job_id": "812", "array_job_id": "800", "array_task_id": "3",
      "nodes": "2", "nodelist": "gpu[1-2]"}),
    ({"RANK": "0", "WORLD_SIZE": "2"}, 0, {"launcher": "env", "world_size": 2}),
], ids=["one-process", "spawn", "torchrun", "slurm-array", "by-hand"])
def test_provenance_names_the_jobs_launcher_size_and_scheduler_numbers(env, spawned, expected):
    from framework.observe.provenance import job

    assert job(env, spawned) == expected

