"""Multirun sweeps: one run directory per job, summary.csv and the table, HParams served by a real
TensorBoard server, failures that do not lose the other jobs, Hydra's joblib launcher, optuna and SLURM."""
from __future__ import annotations

import csv
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from conftest import CONF, output, run_cli, run_command_in_process

from framework.callbacks.base import Callback
from framework.loop.view import RunView
from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput

pytestmark = pytest.mark.e2e

QUICK = ("logger.progress_bar=false", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
         "checkpoint=none", "trainer.test=false")


def sweep(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None, timeout: float = 300):
    """`run.py -m` of the QUICK overrides and `overrides`: in this process, unless `env` needs a process of its
    own (conftest.run_cli decides)."""
    sweep_dir = tmp_path / "sweep"
    return run_cli(None, "-m", f"hydra.sweep.dir={sweep_dir}", *QUICK, *overrides, env=env, fast=False,
                   timeout=timeout), sweep_dir


def rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir())


# ------------------------------------------------------------------------------------------ TensorBoard
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tensorboard_server() -> Iterator:
    """start(logdir) -> base URL of a real `tensorboard` server on 127.0.0.1; always stopped afterwards."""
    procs: list[subprocess.Popen] = []

    def start(logdir: Path) -> str:
        port = _free_port()
        exe = str(Path(sys.executable).parent / "tensorboard")
        procs.append(subprocess.Popen([exe, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port),
                                       "--load_fast=false", "--reload_interval=0"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # bounded wait for the server to answer
            try:
                with urllib.request.urlopen(f"{url}/data/runs", timeout=2) as r:
                    if r.status == 200:
                        return url
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("tensorboard did not start within 90 s")

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def post(url: str, body: dict) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def wait_for(fetch, ok, what: str) -> Any:
    """The server loads event files in the background: ask again (bounded) until the answer is complete."""
    deadline = time.monotonic() + 60
    while True:
        value = fetch()
        if ok(value) or time.monotonic() > deadline:
            assert ok(value), f"{what}: {value}"
            return value
        time.sleep(0.5)


def test_sweep_of_three_lrs_gives_three_runs_a_summary_and_hparams_served_by_tensorboard(tmp_path,
                                                                                       tensorboard_server):
    proc, sweep_dir = sweep(tmp_path, "optimizer.lr=0.01,0.05,0.1", "data.batch_size=32")
    assert proc.returncode == 0, output(proc)
    jobs = job_dirs(sweep_dir)
    assert len(jobs) == 3 and all((j / "summary.json").is_file() for j in jobs)
    # named after the swept key only, not data.batch_size nor QUICK's overrides
    assert [j.name for j in jobs] == ["0_optimizer.lr=0.01", "1_optimizer.lr=0.05", "2_optimizer.lr=0.1"]
    table = rows(sweep_dir)
    assert len(table) == 3 and sorted(float(r["optimizer.lr"]) for r in table) == [0.01, 0.05, 0.1]
    assert all(r["status"] == "ok" and r["val/acc"] and r["best/val/acc"] and r["seconds"] for r in table)
    accs = [float(r["val/acc"]) for r in table]
    assert accs == sorted(accs, reverse=True)  # best job first
    assert "Sweep summary (3 jobs" in proc.stdout

    url = tensorboard_server(sweep_dir)
    tags = wait_for(lambda: get(f"{url}/data/plugin/scalars/tags"),
                    lambda t: len(t) == 3 and all("val/acc" in v and "train/loss" in v for v in t.values()),
                    "scalars of every job")
    assert sorted(tags) == sorted(j.name for j in jobs)
    experiment = wait_for(lambda: post(f"{url}/data/plugin/hparams/experiment", {"experimentName": ""}),
                          lambda e: any(h["name"] == "optimizer.lr" for h in e.get("hparamInfos", [])),
                          "HParams experiment")
    assert {"model", "data", "seed", "data.batch_size"} <= {h["name"] for h in experiment["hparamInfos"]}
    assert {"val/acc", "best/val/acc"} <= {m["name"]["tag"] for m in experiment["metricInfos"]}
    groups = post(f"{url}/data/plugin/hparams/session_groups", {
        "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                                  "STATUS_RUNNING"],
        "colParams": [{"hparam": "optimizer.lr"}, {"hparam": "data.batch_size"},
                      {"metric": {"tag": "val/acc", "group": ""}}],
        "startIndex": 0, "sliceSize": 100})
    lrs = sorted(g["hparams"]["optimizer.lr"] for g in groups["sessionGroups"])
    assert lrs == [0.01, 0.05, 0.1]
    # an int is a number (sortable, filterable by interval) holding exactly the int, not a string or 32.000...
    assert {g["hparams"]["data.batch_size"] for g in groups["sessionGroups"]} == {32}
    batch_info = next(h for h in experiment["hparamInfos"] if h["name"] == "data.batch_size")
    assert batch_info["type"] == "DATA_TYPE_FLOAT64"


def test_a_failing_job_does_not_lose_the_others_and_the_sweep_exits_non_zero(tmp_path):
    proc, sweep_dir = sweep(tmp_path, "optimizer.lr=0.1,1e9,0.05", "trainer.log_every_n_steps=1")
    assert proc.returncode == 1, output(proc)
    table = {r["optimizer.lr"]: r for r in rows(sweep_dir)}
    assert table["1000000000.0"]["status"] == "failed" and "nan" in table["1000000000.0"]["error"]
    assert table["0.1"]["status"] == table["0.05"]["status"] == "ok"
    assert len(job_dirs(sweep_dir)) == 3
    assert "Traceback" not in output(proc)


def test_seed_sweeps_report_mean_and_std_per_setting(tmp_path):
    proc, sweep_dir = sweep(tmp_path, "optimizer.lr=0.05,0.1", "seed=1,2")
    assert proc.returncode == 0, output(proc)
    assert "val/acc over seeds:" in proc.stdout and "optimizer.lr=0.1:" in proc.stdout and "(n=2)" in proc.stdout


class RendezvousTask(ClassificationTask):
    """Waits (bounded) at its first step until both jobs of the sweep have started: only jobs that really run at
    the same time get past it. A job's rank 0 marks it started; every rank waits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waited = False

    def training_step(self, batch: Any) -> StepOutput:
        if not self.waited:
            folder = Path(os.environ["RENDEZVOUS_DIR"])
            if self.trainer.is_global_zero:
                (folder / f"started-{os.getpid()}").touch()
            deadline = time.monotonic() + 120
            while len(list(folder.glob("started-*"))) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("the other job never started: jobs did not run in parallel")
                time.sleep(0.1)
            self.waited = True
        return super().training_step(batch)


@pytest.mark.distributed
def test_joblib_runs_two_jobs_at_once_and_they_start_dataloader_workers_and_ddp_workers(tmp_path, monkeypatch):
    """n_jobs=2: both jobs are inside training at once. A loky worker's multiprocessing default is loky's own
    context: a job's DataLoader workers died of it and its spawned DDP workers could not start. Both kinds of job,
    side by side, must train."""
    monkeypatch.setenv("RENDEZVOUS_DIR", str(tmp_path))  # the loky workers and their DDP workers inherit it
    proc, sweep_dir = sweep(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "data.num_workers=1",
                            "parallel=single,ddp", "task._target_=test_sweep.RendezvousTask",
                            env={"PYTHONPATH": str(Path(__file__).parent)})
    assert proc.returncode == 0, output(proc)
    assert len(list(tmp_path.glob("started-*"))) == 2  # two jobs, both inside training at once
    assert sorted((r["parallel"], r["status"]) for r in rows(sweep_dir)) == [("ddp", "ok"), ("single", "ok")]
    assert [json.loads((d / "summary.json").read_text())["world_size"] for d in job_dirs(sweep_dir)] == [1, 2]


EARLIER_TASKS: list[weakref.ref] = []


class CountingTask(ClassificationTask):
    """Notes, as it is built, how many tasks of the sweep's earlier jobs in this process are still alive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        with open(os.environ["ALIVE_FILE"], "a") as f:
            f.write(f"{sum(ref() is not None for ref in EARLIER_TASKS)}\n")
        EARLIER_TASKS.append(weakref.ref(self))


def test_jobs_of_a_sweep_in_one_process_free_the_last_job_the_first_included(tmp_path):
    """Hydra's basic launcher runs every job in the sweep's process. Each job's task, model and data are freed
    before the next job is built (framework/stages/fit.py), the first job's too, though it is the one that
    imports torch._dynamo and so holds the most."""
    alive = tmp_path / "alive"
    proc, _ = sweep(tmp_path, "task._target_=test_sweep.CountingTask", "optimizer.lr=0.05,0.1,0.2",
                    env={"ALIVE_FILE": str(alive), "PYTHONPATH": str(Path(__file__).parent)})
    assert proc.returncode == 0, output(proc)
    assert alive.read_text().split() == ["0", "0", "0"]


HELD_TASKS: list[weakref.ref] = []


class CycleWithTheTask(Callback):
    """Ties the run's task into a reference cycle, and makes that cycle old: it survives a full collection while
    the run holds it, so a collection of the young generations at the run's end does not free it."""

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        self.itself, self.task = self, task
        HELD_TASKS.append(weakref.ref(task))
        gc.collect()


def test_a_run_its_callback_ties_in_an_old_cycle_is_freed_when_it_returns(tmp_path):
    """A sweep's next job must not start with the last one's task, model and data still in memory, even where a
    callback holds them in a cycle that only a full collection frees (framework/stages/fit.py)."""
    del HELD_TASKS[:]
    done = run_cli(tmp_path, "+callbacks.cycle._target_=test_sweep.CycleWithTheTask")
    assert done.returncode == 0, output(done)
    assert len(HELD_TASKS) == 1 and HELD_TASKS[0]() is None


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_sweep_run_again_in_its_directory_keeps_every_jobs_records(tmp_path):
    """Each job continues in place (a requeue, or an interrupted sweep run again). Its original .hydra/ records
    stay, the new ones go to .hydra/resumed-<time>/; a job refused at start leaves the finished run's summary.json
    as it was, and the sweep reports the refusal and exits 1."""
    first, sweep_dir = sweep(tmp_path, "optimizer.lr=0.05,0.1", "seed=1", "checkpoint=default")
    assert first.returncode == 0, output(first)
    job = job_dirs(sweep_dir)[0]
    before = snapshot(job)
    longer, _ = sweep(tmp_path, "optimizer.lr=0.05,0.1", "seed=1", "checkpoint=default", "trainer.max_epochs=2")
    assert longer.returncode == 0, output(longer)
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        assert (job / ".hydra" / name).read_bytes() == before[f".hydra/{name}"]
    resumed = sorted((job / ".hydra").glob("resumed-*"))
    assert len(resumed) == 1 and "trainer.max_epochs=2" in (resumed[0] / "overrides.yaml").read_text()
    assert json.loads((job / "summary.json").read_text())["epoch"] == 2
    before = snapshot(job)
    refused, _ = sweep(tmp_path, "optimizer.lr=0.05,0.1", "seed=2", "checkpoint=default", "trainer.max_epochs=2")
    assert refused.returncode == 1, output(refused)
    assert "already holds a run, which this job would continue" in output(refused)
    assert "expected another hydra.sweep.dir" in output(refused)
    after = snapshot(job)
    assert {k: v for k, v in after.items() if k in before and k not in (".lock", "run.log")} == \
        {k: v for k, v in before.items() if k not in (".lock", "run.log")}
    assert [r["status"] for r in rows(sweep_dir)] == ["failed", "failed"]


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_a_sequential_sweep_and_the_same_command_continues_it(tmp_path, signal_name):
    """Hydra's basic launcher runs the jobs one after another in the sweep's process: Ctrl-C or scancel's SIGTERM
    stopped the running job (saved) and the sweep went on to the next one."""
    # A suite started in the background by a shell without job control (`make test &`) ignores SIGINT, and so does
    # every process it starts, as the framework then leaves it: this test is about a terminal's Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (conftest restores this worker's handler after)
    jobs = ("optimizer.lr=0.05,0.1,0.2", "checkpoint=default", "trainer.max_epochs=2")
    killhook = {"PYTHONPATH": str(Path(__file__).parent / "killhook"), "KILL_AT_STEP": "4",
                "KILL_SIGNAL": signal_name, "KILL_ONCE_FILE": str(tmp_path / "once")}
    stopped, sweep_dir = sweep(tmp_path, *jobs, env=killhook)
    assert stopped.returncode == 128 + getattr(signal, signal_name), output(stopped)
    assert [(r["optimizer.lr"], r["status"]) for r in rows(sweep_dir)] == [("0.05", "interrupted")], output(stopped)
    assert len(job_dirs(sweep_dir)) == 1 and "Traceback" not in output(stopped)
    assert f"Sweep stopped by {signal_name}: the same command with hydra.sweep.dir={sweep_dir}" in output(stopped)
    again, _ = sweep(tmp_path, *jobs)
    assert again.returncode == 0, output(again)
    assert "at step 4 (epoch 1, batch 1)" in output(again)
    assert sorted((r["optimizer.lr"], r["status"]) for r in rows(sweep_dir)) == [
        ("0.05", "ok"), ("0.1", "ok"), ("0.2", "ok")]


@pytest.mark.parametrize("named", [(), ("name='my sweep,1 it\\'s'",)], ids=["default-name", "awkward-name"])
def test_a_sweep_over_models_keeps_its_jobs_in_one_default_sweep_directory(tmp_path, named, monkeypatch):
    """The default hydra.sweep.dir is outputs/${name}/multirun/<time>, and name follows each job's model: the jobs
    of -m model=mlp,cnn went to two sweep directories, and the summary saw one job. A config composed before in
    the same process, and set as HydraConfig to resolve its `${hydra:...}` (as a notebook's may be), named the
    sweep's directory after its own choices."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    import framework.config.schema
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    framework.config.schema.register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        HydraConfig.instance().set_config(compose("config", overrides=["model=cnn"], return_hydra_config=True))
    proc = run_command_in_process(["-m", *QUICK, *named, "model=mlp,cnn"], cwd=tmp_path)  # outputs/ under tmp_path
    assert proc.returncode == 0, output(proc)
    sweeps = list(tmp_path.glob("outputs/*/multirun/*"))
    assert len(sweeps) == 1 and sweeps[0].parent.parent.name == ("my sweep,1 it's" if named else "digits_mlp"), sweeps
    assert [p.name for p in job_dirs(sweeps[0])] == ["0_model=mlp", "1_model=cnn"]
    assert sorted(r["model"] for r in rows(sweeps[0])) == ["cnn", "mlp"]


@pytest.mark.parametrize("overrides, said", [
    (("optimizer.lrr=0.1,0.2",), "optimizer.lrr=0.1,0.2: optimizer has no key 'lrr'"),
    (("model=cnnn,mlp",), "model=cnnn,mlp: no such option in group 'model'"),
    (("+trainer.max_epoch=1", "optimizer.lr=0.1,0.2"), "trainer.max_epoch=1: trainer has no key 'max_epoch'; "
                                                        "did you mean 'trainer.max_epochs'?"),
    (("optimizer.lr=0.1,0.2", "checkpoint=default", "checkpoint.remote=file:///tmp/htf-never-written/shared"),
     "checkpoint.remote='file:///tmp/htf-never-written/shared': every job of this sweep would keep its checkpoints "
     "at this one prefix")],
    ids=["swept-key", "swept-option", "lightning-key-for-every-job", "one-remote-prefix-for-every-job"])
def test_a_mistake_in_a_sweep_is_one_line_before_any_job_and_leaves_no_sweep_directory(tmp_path, overrides, said):
    """Hydra's sweeper saves multirun.yaml in a new sweep directory before it composes the first job, which finds
    a swept mistake: the directory held only that file. A `+key` the framework's groups lack, given to every job,
    failed each job alike (on SLURM, each submitted only to fail). One checkpoint.remote prefix for every job had
    each job after the first refused there, or, with jobs running at once, publishing over the others'."""
    proc, sweep_dir = sweep(tmp_path, *overrides)
    assert proc.returncode == 1 and "Traceback" not in output(proc), output(proc)
    lines = [line for line in output(proc).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {said}"), output(proc)
    assert not sweep_dir.exists()


@pytest.mark.unit
def test_a_damaged_job_record_is_a_failed_row_not_a_lost_summary(tmp_path, capsys):
    """summary.json cut short or not an object, or a damaged overrides.yaml (foreign or damaged files), stopped
    the whole sweep summary."""
    from omegaconf import OmegaConf

    from framework.app.sweep import report

    records = {"0_lr=0.1": b'{"val/acc": 0.5, "status": "ok"}', "1_lr=0.2": b'{"val/acc": 0.', "2_lr=0.3": b"[1, 2]",
               "3_lr=0.4": b"\xff\xfe\x00garbage"}
    for name, content in records.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / "summary.json").write_bytes(content)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_bytes(b"- lr=0." + name[-1].encode() + b"\n")
    (tmp_path / "3_lr=0.4" / ".hydra" / "overrides.yaml").write_bytes(b"- [unclosed\n\xff")  # damaged too
    assert report(OmegaConf.create({"checkpoint": {"monitor": "val/acc", "mode": "max"}}), tmp_path) is True
    table = rows(tmp_path)
    assert [(r["job"], r["status"]) for r in table] == [("0_lr=0.1", "ok"), ("1_lr=0.2", "failed"),
                                                        ("2_lr=0.3", "failed"), ("3_lr=0.4", "failed")]
    assert all(f"{tmp_path / r['job'] / 'summary.json'}: " in r["error"] for r in table[1:])
    assert "expected a JSON object" in table[2]["error"]
    assert [r["lr"] for r in table] == ["0.1", "0.2", "0.3", ""]
    assert "Sweep summary (4 jobs" in capsys.readouterr().out


@pytest.mark.unit
def test_a_null_in_a_jobs_summary_is_an_empty_cell_in_the_table_and_the_csv(tmp_path, capsys):
    """lr_find with no suggestion records `"suggested_lr": null`: no value, shown as none, never as "None"."""
    from omegaconf import OmegaConf

    from framework.app.sweep import report

    for i, value in enumerate(("null", "0.01")):
        (tmp_path / f"{i}_lr=0.{i}" / ".hydra").mkdir(parents=True)
        (tmp_path / f"{i}_lr=0.{i}" / "summary.json").write_text(f'{{"status": "ok", "lr/suggested": {value}}}')
        (tmp_path / f"{i}_lr=0.{i}" / ".hydra" / "overrides.yaml").write_text(f"- lr=0.{i}\n")
    report(OmegaConf.create({"checkpoint": {"monitor": "lr/suggested", "mode": "min"}}), tmp_path)
    printed = capsys.readouterr().out
    assert "None" not in printed and "0.0100" in printed
    assert sorted(r["lr/suggested"] for r in rows(tmp_path)) == ["", "0.01"]


@pytest.mark.unit
def test_a_metric_only_some_jobs_recorded_is_a_column_with_empty_cells_for_the_others(tmp_path, capsys):
    """A metric is any number in summary.json but the run's own fields (step, epoch, seconds...), whatever its name
    (a ported LightningModule logs `val_acc`); the objective leads, the rest follow by group."""
    from omegaconf import OmegaConf

    from framework.app.sweep import report

    records = {"0_lr=0.1": {"val/loss": 0.5, "val/acc_best": 0.75, "val_acc": 0.7, "train/loss": 0.4, "step": 3,
                            "epoch": 1, "seconds": 1.5, "world_size": 1, "status": "ok"},
               "1_lr=0.2": {"val/loss": 0.25, "best/val/loss": 0.25, "test/acc": 0.5, "step": 3, "seconds": 2.0,
                            "status": "ok"}}
    for name, record in records.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / "summary.json").write_text(json.dumps(record))
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(f"- lr={name[-3:]}\n")
    assert report(OmegaConf.create({"checkpoint": {"monitor": "val/loss", "mode": "min"}}), tmp_path) is False
    with open(tmp_path / "summary.csv") as f:
        assert next(csv.reader(f)) == ["job", "lr", "val/loss", "val/acc_best", "best/val/loss", "test/acc",
                                       "train/loss", "val_acc", "status", "seconds", "error"]
    table = {r["job"]: r for r in rows(tmp_path)}
    assert table["0_lr=0.1"]["val/acc_best"] == "0.75" and table["1_lr=0.2"]["val/acc_best"] == ""
    assert table["0_lr=0.1"]["test/acc"] == "" and table["1_lr=0.2"]["test/acc"] == "0.5"
    printed = capsys.readouterr().out.splitlines()
    assert printed[2].split() == ["job", "lr", "val/loss", "val/acc_best", "best/val/loss", "test/acc", "status",
                                  "seconds"]
    assert printed[3].split() == ["1_lr=0.2", "0.2", "0.2500", "0.2500", "0.5000", "ok", "2.0000"]  # no val/acc_best


def test_a_sweep_whose_remote_names_the_job_keeps_each_jobs_checkpoints_at_its_own_prefix(tmp_path):
    from framework.checkpoint.upload import manifests
    from framework.core.stores import open_store

    remote = f"file://{tmp_path / 'remote'}"
    proc, sweep_dir = sweep(tmp_path, "optimizer.lr=0.05,0.1", "checkpoint=default",
                            f"checkpoint.remote='{remote}/${{hydra:job.num}}'")
    assert proc.returncode == 0 and "Sweep summary (2 jobs" in proc.stdout, output(proc)
    assert [row["status"] for row in rows(sweep_dir)] == ["ok", "ok"]
    for num, job in enumerate(job_dirs(sweep_dir)):
        published = manifests(open_store("checkpoint.remote", f"{remote}/{num}", {}))
        local = {p.name for p in (job / "checkpoints").iterdir() if p.is_dir() and not p.is_symlink()}
        assert published and set(published) <= local, (published, local)


def test_a_dry_run_sweep_builds_every_job_and_succeeds(tmp_path):
    proc, sweep_dir = sweep(tmp_path, "optimizer.lr=0.05,0.1", "trainer.dry_run=true")
    assert proc.returncode == 0, output(proc)
    assert [r["status"] for r in rows(sweep_dir)] == ["dry run", "dry run"]
    assert output(proc).count("Dry run: everything built") == 2


def test_a_sweep_from_a_checkpoint_records_each_new_jobs_overrides(tmp_path):
    """-m resume=RUN_DIR optimizer.lr=a,b: new runs from the checkpoint, each in its own job directory, whose
    .hydra/ is its own (the table's swept column comes from it); RUN_DIR itself is untouched."""
    trained = tmp_path / "trained"
    proc = run_cli(trained, *QUICK, "checkpoint=default", fast=False)
    assert proc.returncode == 0, output(proc)
    before = snapshot(trained)
    proc, sweep_dir = sweep(tmp_path, f"resume={trained}", "optimizer.lr=0.05,0.1",
                            "trainer.max_epochs=2")
    assert proc.returncode == 0, output(proc)
    assert all((job / ".hydra" / "overrides.yaml").is_file() for job in job_dirs(sweep_dir))
    assert sorted(r["optimizer.lr"] for r in rows(sweep_dir)) == ["0.05", "0.1"]
    assert snapshot(trained) == before


class DeterminismTask(ClassificationTask):
    """Notes, as each job's first step is taken, whether torch's deterministic algorithms are on."""

    def training_step(self, batch: Any) -> StepOutput:
        if isinstance(self.trainer, RunView):  # not the pre-flight check's throw-away copy
            with open(os.environ["DETERMINISM_FILE"], "a") as f:
                f.write(f"{torch.are_deterministic_algorithms_enabled()}\n")
        return super().training_step(batch)


def test_a_jobs_deterministic_mode_does_not_outlive_it_in_the_sweeps_process(tmp_path):
    """The basic launcher runs every job in one process: trainer.deterministic=true stayed on for the next jobs."""
    noted = tmp_path / "noted"
    proc, _ = sweep(tmp_path, "task._target_=test_sweep.DeterminismTask", "trainer.deterministic=true,false",
                    "trainer.limit_train_batches=1", env={"DETERMINISM_FILE": str(noted),
                                                          "PYTHONPATH": str(Path(__file__).parent)})
    assert proc.returncode == 0, output(proc)
    assert noted.read_text().split() == ["True", "False"]


def test_optuna_preset_searches_lr_and_weight_decay(tmp_path):
    proc, sweep_dir = sweep(tmp_path, "experiment=optuna_lr_wd", "hydra.sweeper.n_trials=2")
    assert proc.returncode == 0, output(proc)
    table = rows(sweep_dir)
    assert len(table) == 2 and all(r["optimizer.lr"] and r["optimizer.weight_decay"] for r in table)
    best = re.search(r"Best value: (\S+)", output(proc))
    assert best and float(best.group(1)) == pytest.approx(max(float(r["val/acc"]) for r in table), abs=1e-4)


class BestAccTask(ClassificationTask):
    """Logs a metric of its own through `self.log`, as a ported LightningModule does: the running maximum of its
    validation batches' accuracy, `val/acc_best`."""

    best = 0.0

    def validation_step(self, batch: Any) -> StepOutput:
        out = super().validation_step(batch)
        self.best = max(self.best, float(out.metrics["acc"]))
        self.log("val/acc_best", self.best)
        return out


METRIC_GROUPS = ("val", "best", "test", "train")


def metric_order(metrics: set[str], objective: str) -> list[str]:
    """The objective first, then val/*, best/*, test/*, train/*, then any other, by name within each."""
    def group(name: str) -> int:
        prefix = name.split("/", 1)[0]
        return METRIC_GROUPS.index(prefix) if "/" in name and prefix in METRIC_GROUPS else len(METRIC_GROUPS)
    return [objective, *sorted(metrics - {objective}, key=lambda m: (group(m), m))]


def printed_table(proc: subprocess.CompletedProcess, jobs: int) -> list[dict[str, str]]:
    """The sweep's console table, each cell cut at its column's header (cells may be empty)."""
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Sweep summary (")) + 1
    header, body = lines[start], lines[start + 1:start + 1 + jobs]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    spans = list(zip(starts, starts[1:] + [None]))
    return [{header[a:b].strip(): line[a:b].strip() for a, b in spans} for line in body]


def check_against_jobs(proc: subprocess.CompletedProcess, sweep_dir: Path, swept: dict[str, Any],
                       objective: str) -> None:
    """summary.csv and the printed table against each job's own records: every swept key (its value read from the
    job's composed config, by `swept[key]`), every metric of any job's summary.json, each cell its job's value."""
    from omegaconf import OmegaConf

    jobs = {j.name: (json.loads((j / "summary.json").read_text()), OmegaConf.load(j / ".hydra" / "config.yaml"))
            for j in job_dirs(sweep_dir)}
    metrics = metric_order(set().union(*({k for k in s if "/" in k} for s, _ in jobs.values())), objective)
    assert "val/acc_best" in metrics and "best/val/acc" in metrics and "train/loss_epoch" in metrics

    def check_row(row: dict[str, str], columns: list[str], number) -> None:
        summary, cfg = jobs[row["job"]]
        for key, read in swept.items():
            assert read(row[key]) == OmegaConf.select(cfg, key), (key, row)
        for name in columns:
            assert row[name] == (number(summary[name]) if name in summary else ""), (name, row)

    with open(sweep_dir / "summary.csv") as f:
        header = next(csv.reader(f))
    assert set(header[1:1 + len(swept)]) == set(swept)
    assert header == ["job", *header[1:1 + len(swept)], *metrics, "status", "seconds", "error"]
    for row in rows(sweep_dir):
        check_row(row, metrics, repr)  # the exact value: csv writes a float's repr

    table = printed_table(proc, len(jobs))
    shown = [m for m in metrics if m == objective or m.split("/", 1)[0] in ("val", "best", "test")]
    assert list(table[0]) == ["job", *header[1:1 + len(swept)], *shown, "status", "seconds"], proc.stdout
    assert sorted(r["job"] for r in table) == sorted(jobs)
    for row in table:
        assert row[objective], proc.stdout
        check_row(row, shown, lambda value: f"{value:.4f}")
    values = [float(r[objective]) for r in table]
    assert values == sorted(values, reverse=True)  # best job first


def test_a_grid_over_batch_size_and_lr_shows_every_swept_key_and_every_logged_metric(tmp_path):
    """The table and summary.csv showed a fixed list of metrics: what a task logged itself (val/acc_best) and
    train/loss_epoch were in no column, and the printed table left out best/*."""
    proc, sweep_dir = sweep(tmp_path, "data.batch_size=32,64", "optimizer.lr=0.05,0.1",
                            "task._target_=test_sweep.BestAccTask", "trainer.limit_train_batches=2",
                            env={"PYTHONPATH": str(Path(__file__).parent)})
    assert proc.returncode == 0, output(proc)
    assert len(job_dirs(sweep_dir)) == 4
    check_against_jobs(proc, sweep_dir, {"data.batch_size": int, "optimizer.lr": float}, "val/acc")


def test_an_optuna_sweep_shows_its_objective_when_a_task_logs_it_and_a_swept_key_drawn_alike(tmp_path):
    """checkpoint.monitor=val/acc_best (logged by the task): the table ranked by an empty column and summary.csv had
    none. data.batch_size=32,64, swept, drew 64 in both trials of this seed (Optuna 2.10): its column was dropped,
    as the table showed only keys whose values differed between the jobs."""
    proc, sweep_dir = sweep(tmp_path, "experiment=optuna_lr_wd", "hydra.sweeper.n_trials=2",
                            "hydra.sweeper.sampler.seed=1", "data.batch_size=32,64",
                            "task._target_=test_sweep.BestAccTask", "trainer.limit_train_batches=2",
                            "checkpoint.monitor=val/acc_best", "checkpoint.mode=max",
                            env={"PYTHONPATH": str(Path(__file__).parent)})
    assert proc.returncode == 0, output(proc)
    assert len(job_dirs(sweep_dir)) == 2
    check_against_jobs(proc, sweep_dir, {"optimizer.lr": float, "optimizer.weight_decay": float,
                                         "data.batch_size": int}, "val/acc_best")


@pytest.mark.parametrize("overrides", [("hydra/sweeper=optuna", "optimizer.lr=interval(0.01,0.1)"),
                                       ("experiment=optuna_lr_wd", "checkpoint.monitor=val/loss", "checkpoint.mode=min")],
                         ids=["optunas-own-minimize-of-val-acc", "maximize-of-val-loss"])
def test_an_optuna_sweep_that_would_seek_the_worst_run_is_refused_before_any_job(tmp_path, overrides):
    """Each job returns checkpoint.monitor (val/acc unless set): Optuna left at its own direction, minimize,
    searched for the worst run and called it the best."""
    proc, sweep_dir = sweep(tmp_path, *overrides, "hydra.sweeper.n_trials=1")
    assert proc.returncode == 1, output(proc)
    assert "Traceback" not in output(proc) and output(proc).count("Error:") == 1, output(proc)
    wanted = "minimize" if "checkpoint.mode=min" in overrides else "maximize"
    assert f"; expected hydra.sweeper.direction={wanted}\n" in proc.stderr, output(proc)
    assert not sweep_dir.exists()


def test_slurm_launcher_preset_composes(tmp_path):
    proc = run_cli(None, "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra", fast=False)
    assert proc.returncode == 0, output(proc)
    assert "SlurmLauncher" in proc.stdout and "partition: gpu" in proc.stdout


@pytest.mark.distributed
def test_ddp_inside_a_multirun_job(tmp_path):
    proc, sweep_dir = sweep(tmp_path, "parallel=ddp", "optimizer.lr=0.05,0.1")
    assert proc.returncode == 0, output(proc)
    assert [json.loads((j / "summary.json").read_text())["world_size"] for j in job_dirs(sweep_dir)] == [2, 2]
