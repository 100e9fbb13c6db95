"""The MLflow tracker (`logger=mlflow`), through `mlflow.MlflowClient` only: no fluent API, so no global active run
and no git subprocess, and nothing of mlflow is imported by a run that did not choose it.

The store is `logger.mlflow.tracking_uri`: by default $MLFLOW_TRACKING_URI, else a SQLite database at
outputs/mlflow.db, whose artifacts go beside it (outputs/mlartifacts). The run's ID is kept in the run directory
(trackers.json), so `resume=RUN_DIR` continues the same MLflow run. MLflow has no public way to delete a metric's
points (mlflow/mlflow#2973), so a resumed run does not send again the steps the killed run had already sent after
the checkpoint: a resume is exact, and those steps' values are the ones it would send; the series keeps one point
per step.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig

from framework.trackers import TrackedRun

BATCH = 1000  # MLflow's most metrics in one log_batch (and 100 params)


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run: TrackedRun, settings: DictConfig) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # offline first: MLflow 3 reports usage otherwise
        from mlflow import MlflowClient

        uri = str(settings.tracking_uri)
        database = _sqlite_path(uri)
        if database is not None:
            database.parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        self.sent: dict[str, int] = {}  # metric -> the last step the store holds (a resumed run's)
        kept = run.record().get("mlflow", {}) if run.resume_step is not None else {}
        if kept.get("run_id") and kept.get("tracking_uri") == uri:
            self.run_id = kept["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self._held_after(run.resume_step or 0)
        else:
            self.run_id = self._create(run, settings, database)
            run.remember("mlflow", {"run_id": self.run_id, "tracking_uri": uri})
        self.client.log_text(self.run_id, run.composed_yaml(), "config.yaml")
        self.run = run
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-writer")  # one: in order
        self._pending: list[Future[Any]] = []

    def _create(self, run: TrackedRun, settings: DictConfig, database: Path | None) -> str:
        from mlflow.entities import Param

        name = str(settings.experiment_name or run.name)
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            where = (database.parent.resolve() / "mlartifacts" / name).as_uri() if database is not None else None
            experiment_id = self.client.create_experiment(name, artifact_location=where)
        tags = {**run.tags, **{str(k): str(v) for k, v in (settings.tags or {}).items()}}
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
        """Handed to the writer thread: a SQLite commit takes tens of milliseconds, which the loop does not wait
        for. A write that failed is raised here, at the next logging step (and by close)."""
        from mlflow.entities import Metric

        self._raise_failed(wait=False)
        now = int(time.time() * 1000)
        sent = self.sent
        points = [Metric(k, float(v), now, step) for k, v in metrics.items() if sent.get(k, -1) < step]
        for i in range(0, len(points), BATCH):
            self._pending.append(self._writer.submit(self.client.log_batch, self.run_id, metrics=points[i : i + BATCH]))

    def _raise_failed(self, wait: bool) -> None:
        """The first error of the writes handed over so far (all of them, with `wait`; those done, without)."""
        pending, self._pending = self._pending, []
        for write in pending:
            if wait or write.done():
                write.result()
            else:
                self._pending.append(write)

    def flush(self) -> None:
        """An epoch's end: a write that failed is raised; the others finish on their own (close waits for them)."""
        self._raise_failed(wait=False)

    def close(self) -> None:
        try:
            self._raise_failed(wait=True)
            provenance = self.run.run_dir / "provenance.json"
            if provenance.is_file():  # the app writes it in the background while the run starts
                self.client.log_artifact(self.run_id, str(provenance))
            self.client.set_terminated(self.run_id, status="FINISHED")
        finally:
            self._writer.shutdown(wait=True, cancel_futures=True)
