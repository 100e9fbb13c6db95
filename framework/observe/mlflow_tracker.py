"""The MLflow tracker (`logger=mlflow`), through `mlflow.MlflowClient` only: no fluent API, so no global active run
and no git subprocess, and nothing of mlflow is imported by a run that did not choose it.

The store is `logger.mlflow.tracking_uri`: by default $MLFLOW_TRACKING_URI, else a SQLite database `mlflow.db` in
the folder that holds the run directory, whose artifacts go beside it (`mlartifacts/`): see `store_uri`. MLflow's
own logging goes to run.log, not the console: the run's logging config routes its loggers, which MLflow is told to
leave alone (`_client`). The run's ID is kept in the run directory (trackers.json), so `resume=RUN_DIR` continues
the same MLflow run. MLflow has no public way to delete a metric's points (mlflow/mlflow#2973), so a resumed run
does not send again the steps the killed run had already sent after the checkpoint: a resume is exact, and those
steps' values are the ones it would send; the series keeps one point per step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig

from framework.observe.tracked import TrackedRun

BATCH = 1000  # MLflow's most metrics in one log_batch (and 100 params)
FLUSH_S = 10.0  # the longest a point waits to be written (torch's SummaryWriter: flush_secs=10)


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def store_uri(settings: DictConfig, folder: Path) -> str:
    """`logger.mlflow.tracking_uri`, or when it is null (and $MLFLOW_TRACKING_URI unset) `folder`/mlflow.db, where
    `folder` holds the run directory: a single run's experiment folder (outputs/<name>/ by default, wherever
    hydra.run.dir puts it), a sweep's directory (its jobs, and their parent run). MLflow is for comparing runs, so
    the runs that sit side by side share a store; a store per run would hold one run, and one in the working
    directory (MLflow's own default) lands wherever the process started, away from the runs."""
    if settings.tracking_uri:
        return str(settings.tracking_uri)
    return f"sqlite:///{(folder / 'mlflow.db').resolve()}"


def _client(uri: str) -> Any:
    """MLflow's client, MLflow imported as a run needs it, unless the user set otherwise: offline first (MLflow 3
    reports usage unless told not to), and its loggers left to the run's logging config, which sends them to run.log
    (MLflow would give them a console handler of its own as it is imported, MLFLOW_CONFIGURE_LOGGING)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    from mlflow import MlflowClient

    database = _sqlite_path(uri)
    if database is not None:
        database.parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run: TrackedRun, settings: DictConfig) -> None:
        uri = store_uri(settings, run.run_dir.parent)
        self.client = _client(uri)
        self.sent: dict[str, int] = {}  # metric -> the last step the store holds (a resumed run's)
        # A run directory that holds an MLflow run's ID is resumed (from step 0 where no checkpoint was saved).
        kept = run.record().get("mlflow", {})
        if kept.get("run_id") and kept.get("tracking_uri") == uri:
            self.run_id = kept["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self._held_after(run.resume_step or 0)
        else:
            self.run_id = self._create(run, settings, uri)
            run.remember("mlflow", {"run_id": self.run_id, "tracking_uri": uri})
        self.client.log_text(self.run_id, run.composed_yaml(), "config.yaml")
        self.run = run
        self._points: list[Any] = []  # logged, not yet written
        self._flushed_at = time.time()

    def _create(self, run: TrackedRun, settings: DictConfig, uri: str) -> str:
        from mlflow.entities import Param

        tags = {**run.tags, **{str(k): str(v) for k, v in (settings.tags or {}).items()}}
        parent = run.sweep_parent("mlflow_parent")
        if parent and parent.get("tracking_uri") == uri:  # a multirun's job: a child run
            tags["mlflow.parentRunId"] = parent["run_id"]
            experiment_id = self.client.get_run(parent["run_id"]).info.experiment_id
        else:
            experiment_id = _experiment(self.client, str(settings.experiment_name or run.name), _sqlite_path(uri))
        created = self.client.create_run(experiment_id, run_name=str(settings.run_name or run.run_dir.name), tags=tags)
        run_id = created.info.run_id
        params = [Param(k[:250], v[:6000]) for k, v in run.params.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i : i + 100])
        return run_id

    def _held_after(self, step: int) -> None:
        """The steps after `step` that the store already holds, per metric: sent by the run that was killed."""
        run = self.client.get_run(self.run_id)
        for key in run.data.metrics:
            steps = [m.step for m in self.client.get_metric_history(self.run_id, key) if m.step > step]
            if steps:
                self.sent[key] = max(steps)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Kept until an evaluation's end, or 10 s (as TensorBoard's writer flushes): one SQLite commit takes tens
        of milliseconds, too long for every logging step, or for every epoch of a fast model."""
        from mlflow.entities import Metric

        now = time.time()
        sent, stamp = self.sent, int(now * 1000)
        self._points += [Metric(k, float(v), stamp, step) for k, v in metrics.items() if sent.get(k, -1) < step]
        if now - self._flushed_at > FLUSH_S:
            self.flush(now=True)

    def flush(self, now: bool) -> None:
        if not now and time.time() - self._flushed_at <= FLUSH_S:
            return
        points, self._points = self._points, []
        for i in range(0, len(points), BATCH):
            self.client.log_batch(self.run_id, metrics=points[i : i + BATCH])
        self._flushed_at = time.time()

    def close(self) -> None:
        self.flush(now=True)
        provenance = self.run.run_dir / "provenance.json"
        if provenance.is_file():  # the app writes it in the background while the run starts
            self.client.log_artifact(self.run_id, str(provenance))
        self.client.set_terminated(self.run_id, status="FINISHED")


def _experiment(client: Any, name: str, database: Path | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    where = (database.parent.resolve() / "mlartifacts" / name).as_uri() if database is not None else None
    return str(client.create_experiment(name, artifact_location=where))


def open_parent(sweep: TrackedRun, settings: DictConfig) -> dict[str, str]:
    """A multirun's parent run: its jobs' runs are its children (MLflow's `mlflow.parentRunId` tag). Its store is
    the one its jobs find (`store_uri`: the sweep directory holds their run directories)."""
    uri = store_uri(settings, sweep.run_dir)
    client = _client(uri)
    experiment_id = _experiment(client, str(settings.experiment_name or sweep.name), _sqlite_path(uri))
    parent = client.create_run(experiment_id, run_name=sweep.run_dir.name, tags=sweep.tags)
    return {"run_id": parent.info.run_id, "tracking_uri": uri}


def close_parent(parent: dict[str, str]) -> None:
    _client(parent["tracking_uri"]).set_terminated(parent["run_id"], status="FINISHED")


def finish_run(kept: dict[str, str], summary: dict[str, Any]) -> None:
    """The summary (summary.json) and the best checkpoint's path, once the run is over."""
    client = _client(kept["tracking_uri"])
    client.log_dict(kept["run_id"], summary, "summary.json")
    if summary.get("status") == "failed":  # a sweep's job that failed (app._failed_job): closed as FINISHED
        client.set_terminated(kept["run_id"], status="FAILED")
    if summary.get("best_checkpoint"):
        client.set_tag(kept["run_id"], "best_checkpoint", str(summary["best_checkpoint"]))
