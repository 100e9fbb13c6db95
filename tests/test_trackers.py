"""framework/observe/trackers.py and framework/observe/mlflow_tracker.py: the `logger` group's backends beside TensorBoard.

Runs train in this process (as tests/test_checkpoint.py's do); what was logged is read back with each backend's own
reader: TensorBoard's EventAccumulator, the csv module, and `mlflow.MlflowClient` against a real SQLite store.
Nothing reaches the network: every MLflow store here is a SQLite file in the test's directory. A test that uses
MLflow is in the e2e tier although it trains in this process: importing mlflow runs `uname -p` (platform.processor)."""
from __future__ import annotations

import csv
import json
import logging
import logging.config
import re
import shutil
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CONF, KILLHOOK, TESTS, on_pythonpath, one_error_line, output, read_scalars, run_cli
from omegaconf import OmegaConf

from framework.callbacks.base import Callback
from framework.observe.trackers import CsvTracker, Trackers, finish, open_sweep
from framework.observe.tracked import TrackedRun

pytestmark = pytest.mark.unit

# Two epochs of 3 steps, a val/acc point each epoch and a log point each step.
SMALL = ("logger.progress_bar=false", "trainer.max_epochs=2", "trainer.limit_train_batches=3",
         "trainer.log_every_n_steps=1", "trainer.test=false")


def train(compose, run_dir: Path, *overrides: str, resume_from: Path | None = None) -> dict:
    from framework.checkpoint import open_checkpoint
    from framework.loop.trainer import Trainer

    checkpoint = open_checkpoint(resume_from) if resume_from is not None else None
    return Trainer(compose(*SMALL, *overrides), run_dir, resume_from=checkpoint).fit()


def read_csv(path: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            series.setdefault(row["name"], []).append((int(row["step"]), float(row["value"])))
    return series


def mlflow_series(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables made, once: creating them takes MLflow ~7 s, copying the file none."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(empty_store, tmp_path) -> str:
    """This test's own MLflow store (a copy of the empty one)."""
    (tmp_path / "store").mkdir()
    shutil.copy(empty_store, tmp_path / "store" / "mlflow.db")
    return f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"


def as_float32(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """TensorBoard keeps float32: the same series, as TensorBoard holds it."""
    return [(step, float(np.float32(value))) for step, value in series]


# ---------------------------------------------------------------------------------------------- config
def test_the_default_is_tensorboard_alone_and_a_list_chooses_several(compose):
    default = compose().logger
    assert default.tensorboard and not default.csv.enabled and not default.mlflow.enabled
    several = compose("logger=[tensorboard,csv,mlflow]", "logger.mlflow.tracking_uri=sqlite:///x.db").logger
    assert several.tensorboard and several.csv.filename == "metrics.csv"
    assert several.mlflow.tracking_uri == "sqlite:///x.db"
    assert compose("logger=many").logger.mlflow.enabled
    alone = compose("logger=csv").logger
    assert not alone.tensorboard and alone.csv.enabled and alone.progress_bar  # shared keys stay
    unchosen = compose("logger=tensorboard", "logger.mlflow.tracking_uri=sqlite:///x.db").logger  # no error: off
    assert unchosen.mlflow.tracking_uri == "sqlite:///x.db" and not unchosen.mlflow.enabled


# ---------------------------------------------------------------------------------------------- one run, three stores
@pytest.mark.e2e
def test_tensorboard_csv_and_mlflow_hold_the_same_series(compose, tmp_path, store):
    from mlflow import MlflowClient

    run_dir, uri = tmp_path / "run", store
    summary = train(compose, run_dir, "logger=[tensorboard,csv,mlflow]", f"logger.mlflow.tracking_uri={uri}")
    events, rows = read_scalars(run_dir), read_csv(run_dir / "metrics.csv")
    record = json.loads((run_dir / "trackers.json").read_text())
    run_id = record["mlflow"]["run_id"]
    assert "failed" not in record
    for key in ("val/acc", "val/loss", "train/loss", "lr/default", "perf/step_ms", "best/val/acc"):
        assert rows[key] == mlflow_series(uri, run_id, key) and as_float32(rows[key]) == events[key], key
    assert [step for step, _ in rows["val/acc"]] == [3, 6] and rows["val/acc"][-1][1] == summary["val/acc"]
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["optimizer.lr"] == str(compose().optimizer.lr)
    assert run.data.tags["run_dir"] == str(run_dir.resolve())
    artifacts = {a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(run_id)}
    assert "config.yaml" in artifacts


def test_csv_alone_runs_without_tensorboard_files(compose, tmp_path):
    train(compose, tmp_path, "logger=csv")
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    assert [step for step, _ in read_csv(tmp_path / "metrics.csv")["val/acc"]] == [3, 6]


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.e2e
def test_a_resume_continues_the_same_mlflow_run_with_one_point_per_step(compose, tmp_path, store):
    """Trained to step 6 with a checkpoint at each epoch, then resumed from step 3's: what was logged after step 3
    is what the killed run had sent. The MLflow run is the same one, with one point per step; metrics.csv was cut
    back to step 3 before the resumed run appended to it."""
    run_dir, uri = tmp_path / "run", store
    chosen = ("logger=[tensorboard,csv,mlflow]", f"logger.mlflow.tracking_uri={uri}",
              "checkpoint.every_n_epochs=1", "checkpoint.keep_last=-1")
    train(compose, run_dir, *chosen)
    first = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    before = mlflow_series(uri, first, "train/loss")
    train(compose, run_dir, *chosen, resume_from=run_dir / "checkpoints" / "step-3")
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"] == first
    after = mlflow_series(uri, first, "train/loss")
    assert [step for step, _ in after] == [1, 2, 3, 4, 5, 6] and after == before
    rows = read_csv(run_dir / "metrics.csv")
    assert [step for step, _ in rows["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert as_float32(rows["train/loss"]) == read_scalars(run_dir)["train/loss"]


@pytest.mark.e2e
def test_a_run_sigkilled_after_a_checkpoint_leaves_mlflow_every_point_up_to_it(tmp_path, store):
    """MLflow points are kept up to 10 s before a commit; a checkpoint is written only once the points logged up to
    it are committed. Killed at step 10 and resumed from its last checkpoint, the run re-logs only what came after
    it, and the MLflow run still holds every train/loss point TensorBoard holds, once each."""
    run_dir = tmp_path / "run"
    chosen = ("logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={store}", "logger.progress_bar=false",
              "trainer.max_steps=16", "trainer.log_every_n_steps=2", "checkpoint.every_n_steps=4",
              "trainer.test=false")
    kill = {"PYTHONPATH": on_pythonpath(KILLHOOK), "KILL_AT_STEP": "10", "KILL_SIGNAL": "SIGKILL"}
    killed = run_cli(run_dir, *chosen, env=kill)
    assert killed.returncode == -9, output(killed)
    resumed = run_cli(None, f"resume={run_dir}")
    # From step 8's checkpoint, or step 4's where the kill came while step 8's was still being written behind.
    assert resumed.returncode == 0 and re.search(r"at step [48] \(", output(resumed)), output(resumed)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    steps = [step for step, _ in mlflow_series(store, run_id, "train/loss")]
    assert steps == [step for step, _ in read_scalars(run_dir)["train/loss"]] == list(range(2, 17, 2))


def test_csv_is_cut_back_to_the_checkpoint_step_on_resume(tmp_path):
    run = TrackedRun(tmp_path, "x", {})
    fresh = CsvTracker(run, "metrics.csv")
    for step in range(1, 6):
        fresh.log_metrics({"a": step / 10, "b": step}, step)
    fresh.close()
    resumed = CsvTracker(TrackedRun(tmp_path, "x", {}, resume_step=2), "metrics.csv")
    resumed.log_metrics({"a": 0.75}, 3)
    resumed.close()
    assert read_csv(tmp_path / "metrics.csv") == {"a": [(1, 0.1), (2, 0.2), (3, 0.75)], "b": [(1, 1.0), (2, 2.0)]}


# ---------------------------------------------------------------------------------------------- failures
class Broken:
    """A backend whose store fails at its second logging call (a disk that filled, a server that went away)."""

    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log_metrics(self, metrics, step) -> None:
        self.calls += 1
        if self.calls == 2:
            raise OSError(28, "No space left on device")

    def flush(self, now: bool) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_failing_tracker_is_warned_of_once_then_left_out(tmp_path, caplog):
    caplog.set_level("INFO", logger="framework.observe.trackers.traceback")
    broken, kept = Broken(), CsvTracker(TrackedRun(tmp_path, "x", {}), "metrics.csv")
    trackers = Trackers(TrackedRun(tmp_path, "x", {}), [broken, kept])
    for step in range(1, 5):
        trackers.log_metrics({"a": float(step)}, step)
    trackers.close()
    assert broken.calls == 2  # never called again after its failure
    assert [step for step, _ in read_csv(tmp_path / "metrics.csv")["a"]] == [1, 2, 3, 4]  # the other went on
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "logger.broken failed at step 2" in warnings[0], warnings
    assert "No space left on device" in warnings[0] and "\n" not in warnings[0]
    assert not [r for r in caplog.records if r.exc_info and r.name != "framework.observe.trackers.traceback"]
    traceback = [r for r in caplog.records if r.name == "framework.observe.trackers.traceback"]  # run.log's alone (INFO)
    assert len(traceback) == 1 and isinstance(traceback[0].exc_info[1], OSError)
    assert json.loads((tmp_path / "trackers.json").read_text())["failed"] == {
        "broken": "OSError: [Errno 28] No space left on device"
    }


class WrappedStoreError(Exception):
    """As MLflow wraps SQLAlchemy's error, which wraps sqlite3's: a first line that names none of them."""


class Wrapping(Broken):
    name = "wrapping"

    def log_metrics(self, metrics, step) -> None:
        try:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        except sqlite3.OperationalError as err:
            raise WrappedStoreError("(raised as a result of Query-invoked autoflush; consider using a "
                                    "session.no_autoflush block)\n(sqlite3.OperationalError) attempt to write") from err


def test_a_failing_trackers_warning_names_the_error_its_library_wrapped(tmp_path, caplog):
    trackers = Trackers(TrackedRun(tmp_path, "x", {}), [Wrapping()])
    trackers.log_metrics({"a": 1.0}, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "(sqlite3.OperationalError: attempt to write a readonly database)" in warnings[0]
    assert trackers.failed == {"wrapping": "sqlite3.OperationalError: attempt to write a readonly database"}


@pytest.fixture
def logging_state():
    """Every logger put back after a test that configures logging as a run does: those there before as they were
    (handlers, level, propagation), those made since as new ones are; the handlers the test made closed."""
    def everyone() -> list[logging.Logger]:
        return [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger))]

    saved = {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in everyone()}
    yield
    before = {handler for handlers, *_ in saved.values() for handler in handlers}
    for handler in {handler for lg in everyone() for handler in lg.handlers} - before:  # each once: the test's own
        handler.close()
    for lg in everyone():
        handlers, level, propagate, disabled = saved.get(lg, ([], logging.NOTSET, True, False))
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def configure_as_hydra(run_dir: Path) -> None:
    """What Hydra does with conf/hydra/job_logging/framework.yaml for a run in `run_dir`."""
    settings = OmegaConf.load(CONF / "hydra" / "job_logging" / "framework.yaml")
    settings.handlers.file.filename = str(run_dir / "run.log")
    logging.config.dictConfig(OmegaConf.to_container(settings))


def configure_as_spawned_worker(run_dir: Path) -> None:
    from framework.app.launch import _configure_logging

    _configure_logging(0, run_dir)


@pytest.mark.parametrize("configure", [configure_as_hydra, configure_as_spawned_worker])
def test_the_trackers_libraries_log_to_run_log_alone(configure, tmp_path, capfd, logging_state):
    """A run's logging (Hydra's, or a spawned DDP worker's): MLflow's, SQLAlchemy's, alembic's and W&B's own records
    and a failed tracker's traceback go to run.log, not the console; SQLAlchemy's statements (INFO) nowhere."""
    configure(tmp_path)
    logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
    logging.getLogger("mlflow.store.db.utils").error("SQLAlchemy database error.")
    logging.getLogger("sqlalchemy.engine.Engine").info("INSERT INTO metrics")
    logging.getLogger("sqlalchemy.pool").warning("pool warning")
    logging.getLogger("alembic.runtime.migration").warning("alembic warning")
    logging.getLogger("wandb").warning("wandb warning")
    logging.getLogger("framework.observe.trackers.traceback").warning("Traceback of logger.x", exc_info=ValueError("x"))
    logging.getLogger("framework.observe.trackers").warning("logger.x failed at step 2")
    console = capfd.readouterr()
    for handler in logging.getLogger().handlers:
        handler.flush()
    run_log = (tmp_path / "run.log").read_text()
    assert console.out == "" and console.err == "logger.x failed at step 2\n", console
    for line in ("Creating initial MLflow database tables", "SQLAlchemy database error", "pool warning",
                 "alembic warning", "wandb warning", "Traceback of logger.x", "ValueError: x",
                 "logger.x failed at step 2"):
        assert line in run_log, (line, run_log)
    assert "INSERT INTO" not in run_log


class DeleteStore(Callback):
    """Deletes the MLflow store's database file when the first epoch ends: the store vanishes under the run."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_epoch_end(self, trainer, task) -> None:
        if trainer.current_epoch == 0:
            self.path.unlink()


@pytest.mark.e2e
def test_an_mlflow_store_deleted_mid_run_is_one_line_on_the_console_and_the_run_ends_ok(tmp_path):
    """The issue's case: `logger=[tensorboard,mlflow]`, the SQLite file deleted after the first epoch. The console
    shows the run's own lines and one warning, nothing of MLflow's, SQLAlchemy's or alembic's logging (a fresh store:
    MLflow logs making its tables); run.log holds the traceback; the run ends ok, its summary naming the tracker."""
    store, run_dir = tmp_path / "store" / "mlflow.db", tmp_path / "run"
    proc = run_cli(run_dir, "logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri=sqlite:///{store}",
                   "trainer.max_epochs=3", "trainer.limit_train_batches=3", "+callbacks.gone._target_=test_trackers.DeleteStore",
                   f"+callbacks.gone.path={store}", env={"PYTHONPATH": on_pythonpath(TESTS)},
                   process=True)  # the command line's console, with Hydra's logging set-up
    assert proc.returncode == 0, output(proc)
    lines = output(proc).replace(str(tmp_path), "TMP").splitlines()  # (the test's name has "mlflow" in it)
    theirs = [line for line in lines if re.search(r"mlflow|sql|alembic|traceback|warning|error", line, re.I)]
    assert len(theirs) == 1 and theirs[0].startswith("logger.mlflow failed"), output(proc)
    assert "off for the rest of this run" in theirs[0] and "run.log" in theirs[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["step"] == 9
    assert summary["loggers_failed"]["mlflow"].startswith("sqlite3.OperationalError: "), summary
    run_log = (run_dir / "run.log").read_text()
    assert "Traceback" in run_log and "Creating initial MLflow database tables" in run_log
    assert theirs[0] in run_log


@pytest.mark.e2e
def test_an_mlflow_store_that_cannot_be_opened_does_not_stop_the_run(compose, tmp_path, caplog):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the store's folder would be")
    run_dir = tmp_path / "run"
    summary = train(compose, run_dir, "logger=[tensorboard,mlflow]",
                    f"logger.mlflow.tracking_uri=sqlite:///{blocker / 'mlflow.db'}")
    assert summary["status"] == "ok" and (run_dir / "checkpoints").is_dir()
    assert "mlflow" in json.loads((run_dir / "trackers.json").read_text())["failed"]
    assert "mlflow" in finish(run_dir, summary)["loggers_failed"]  # what the app writes into summary.json
    assert [r.getMessage() for r in caplog.records if "logger.mlflow" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- run.py
def hiding_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a Python without mlflow installed, as a user without the `trackers` extra has, until the test
    ends: mlflow and each of its modules marked absent in sys.modules (`import mlflow`, `from mlflow.entities
    import ...` fail; `importlib.util.find_spec` finds nothing). The framework imports mlflow only where it uses it."""
    for name in ["mlflow", *(name for name in sys.modules if name.startswith("mlflow."))]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.e2e
def test_choosing_mlflow_without_it_installed_is_one_error_line_and_no_run_dir(tmp_path, monkeypatch):
    """...and a run that did not choose it never imports it (it succeeds where mlflow cannot be imported)."""
    hiding_mlflow(monkeypatch)
    refused = run_cli(tmp_path / "refused", "logger=[tensorboard,mlflow]")
    line = one_error_line(refused)
    assert line.startswith("Error: logger=mlflow: the mlflow package is not installed"), line
    assert "pip install 'hydra-torch-framework[trackers]'" in line
    assert not (tmp_path / "refused").exists()
    plain = run_cli(tmp_path / "plain", "logger=[tensorboard,csv]", "trainer.max_epochs=1",
                    "trainer.limit_train_batches=2")
    assert plain.returncode == 0, output(plain)
    assert (tmp_path / "plain" / "metrics.csv").is_file()


@pytest.mark.e2e
def test_run_py_killed_and_resumed_is_one_mlflow_run_with_one_point_per_step(tmp_path, store):
    """The issue's own commands: three backends from the command line hold the same val/acc; killed by SIGKILL
    after step 5 (its checkpoint from the epoch that ended at step 3), then `resume=RUN_DIR`: the same MLflow run
    ID, one point per step."""
    run_dir = tmp_path / "run"
    chosen = ("logger=[tensorboard,csv,mlflow]", f"logger.mlflow.tracking_uri={store}", "trainer.max_epochs=2",
              "trainer.limit_train_batches=3", "trainer.log_every_n_steps=1", "checkpoint.every_n_epochs=1",
              "checkpoint.async_save=false")  # step 3's checkpoint on disk before step 5, however loaded the machine
    kill = {"PYTHONPATH": on_pythonpath(KILLHOOK), "KILL_AT_STEP": "5", "KILL_SIGNAL": "SIGKILL",
            "MLFLOW_DISABLE_TELEMETRY": "true"}
    killed = run_cli(run_dir, *chosen, env=kill)
    assert killed.returncode != 0, output(killed)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    resumed = run_cli(None, f"resume={run_dir}")
    assert resumed.returncode == 0, output(resumed)
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"] == run_id
    loss = mlflow_series(store, run_id, "train/loss")
    assert [step for step, _ in loss] == list(range(1, 7))
    val = mlflow_series(store, run_id, "val/acc")
    assert [step for step, _ in val] == [3, 6]
    assert read_csv(run_dir / "metrics.csv")["val/acc"] == val


@pytest.mark.e2e
def test_a_multirun_is_one_mlflow_parent_run_with_a_child_per_job(tmp_path, store):
    from mlflow import MlflowClient

    sweep_dir = tmp_path / "sweep"
    proc = run_cli(None, "-m", "optimizer.lr=0.01,0.1", "logger=[tensorboard,mlflow]",
                   f"logger.mlflow.tracking_uri={store}", f"hydra.sweep.dir={sweep_dir}", "trainer.max_epochs=1",
                   "trainer.limit_train_batches=2", "logger.progress_bar=false", fast=False)
    assert proc.returncode == 0, output(proc)
    client = MlflowClient(tracking_uri=store)
    parent_id = json.loads((sweep_dir / "trackers.json").read_text())["mlflow_parent"]["run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(run.data.params["optimizer.lr"] for run in children) == ["0.01", "0.1"]
    for run in children:
        job = Path(run.data.tags["run_dir"])
        assert job.parent == sweep_dir.resolve() and run.info.status == "FINISHED"
        summary = json.loads((job / "summary.json").read_text())
        assert run.data.tags["best_checkpoint"] == summary["best_checkpoint"]
        assert run.data.metrics["val/acc"] == summary["val/acc"]
        assert "summary.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


# ---------------------------------------------------------------------------------------------- the default store
@pytest.mark.e2e
def test_mlflows_default_store_is_beside_the_run_directory_and_a_sweeps_in_its_directory(
        compose, tmp_path, empty_store, monkeypatch):
    """With no tracking URI (no $MLFLOW_TRACKING_URI either), a run's store is the folder that holds its directory,
    so runs side by side compare in one store: a single run's beside it, a sweep's jobs' in the sweep directory,
    with their parent run. Nothing is written where the process started."""
    from mlflow import MlflowClient

    from framework.observe.trackers import close_sweep

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir((tmp_path / "cwd").mkdir() or tmp_path / "cwd")
    for folder in ("runs", "sweep"):  # stores with their tables made: making them takes MLflow seconds
        (tmp_path / folder).mkdir()
        shutil.copy(empty_store, tmp_path / folder / "mlflow.db")
    chosen = ("logger=[tensorboard,mlflow]", "trainer.max_epochs=1")
    assert compose(*chosen).logger.mlflow.tracking_uri is None
    train(compose, tmp_path / "runs" / "a", *chosen)
    kept = json.loads((tmp_path / "runs" / "a" / "trackers.json").read_text())["mlflow"]
    assert kept["tracking_uri"] == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert MlflowClient(tracking_uri=kept["tracking_uri"]).get_run(kept["run_id"]).info.status == "FINISHED"
    sweep_dir = tmp_path / "sweep"
    open_sweep(compose(*chosen), sweep_dir)
    train(compose, sweep_dir / "0_job", *chosen)
    close_sweep(sweep_dir)
    uri = f"sqlite:///{sweep_dir / 'mlflow.db'}"
    parent = json.loads((sweep_dir / "trackers.json").read_text())["mlflow_parent"]
    job = json.loads((sweep_dir / "0_job" / "trackers.json").read_text())["mlflow"]
    assert parent["tracking_uri"] == job["tracking_uri"] == uri
    assert MlflowClient(tracking_uri=uri).get_run(job["run_id"]).data.tags["mlflow.parentRunId"] == parent["run_id"]
    assert not list((tmp_path / "cwd").iterdir())
