"""The trackers a run logs to beside TensorBoard (the `logger` group's `csv`, `mlflow` and `wandb` options): one
interface, `Tracker`, and `Trackers`, which hands every tracker what TensorBoard gets and keeps a failing one from
ending the run.

What every tracker receives: each scalar, at the step TensorBoard gets it; the flattened config as params; the
composed config (and, once the app has written it, provenance.json) as artifacts; tags naming the run directory.
Only rank 0 opens trackers (`setup_report.describe_setup` runs there only): the other ranks' `TensorBoardLogger`
holds none, so no tracker branches on rank.

A tracker is not allowed to end a run: its first error (a store that fails, a full disk, a server gone) is one
warning, and that tracker is closed and left out for the rest of the run; the others and the checkpoints go on, and
`trackers.json` in the run directory names it (the app copies it into summary.json's `loggers_failed`). The same
file keeps what a resumed run needs to continue the same tracker run (MLflow's and W&B's run IDs). The error's
traceback goes to run.log alone (the logger `framework.observe.trackers.traceback`), as do the trackers' libraries' own
records (conf/hydra/job_logging/framework.yaml's `loggers:`): the console has the warning's one line.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, cast

from omegaconf import DictConfig, OmegaConf

from framework.core import files
from framework.observe.tracked import RECORD, TrackedRun, Tracker

log = logging.getLogger(__name__)
# A failed tracker's traceback, at INFO: run.log's alone where the run's logging is configured (framework.yaml's
# `loggers:`, launch._configure_logging), and not shown by Python's default of WARNING where it is not.
traceback_log = logging.getLogger(f"{__name__}.traceback")


class CsvTracker:
    """`metrics.csv` in the run directory, one row per scalar: `step,name,value` (a new metric needs no new
    column, so the file is only ever appended to). On resume it is first rewritten up to the checkpoint's step."""

    name = "csv"

    def __init__(self, run: TrackedRun, filename: str) -> None:
        self.path = run.run_dir / filename
        kept: list[list[str]] = [["step", "name", "value"]]
        if run.resume_step is not None:
            kept += self._rows_up_to(run.resume_step)
        text = io.StringIO()
        csv.writer(text).writerows(kept)
        # A new file, renamed into place once it holds the rows kept (a crash leaves the old one or the new one),
        # then appended to: never the old inode, which a link could share.
        self._file = files.growing(self.path, text.getvalue())
        self._rows = csv.writer(self._file)

    def _rows_up_to(self, step: int) -> list[list[str]]:
        """The rows of the resumed run's file up to the checkpoint's `step` (what came after belongs to the run
        that was killed), read without following a link."""
        try:
            text = files.read_bytes(self.path).decode()
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:  # a link, not a regular file, not text: started again
            log.warning("%s: not continued (%s); it starts again from the resumed step", self.path, err)
            return []
        rows = list(csv.reader(io.StringIO(text)))[1:]
        return [row for row in rows if len(row) == 3 and row[0].isdigit() and int(row[0]) <= step]

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._rows.writerows((step, name, value) for name, value in metrics.items())

    def flush(self, now: bool) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _open_csv(run: TrackedRun, settings: DictConfig) -> Tracker:
    return CsvTracker(run, settings.filename)


def _open_mlflow(run: TrackedRun, settings: DictConfig) -> Tracker:
    from framework.observe.mlflow_tracker import MlflowTracker  # mlflow is imported only by a run that chose it

    return MlflowTracker(run, settings)


def _open_wandb(run: TrackedRun, settings: DictConfig) -> Tracker:
    from framework.observe.wandb_tracker import WandbTracker  # wandb is imported only by a run that chose it

    return WandbTracker(run, settings)


OPENERS: dict[str, Callable[[TrackedRun, DictConfig], Tracker]] = {
    "csv": _open_csv,
    "mlflow": _open_mlflow,
    "wandb": _open_wandb,
}


def _finish_mlflow(kept: dict[str, Any], summary: dict[str, Any]) -> None:
    from framework.observe.mlflow_tracker import finish_run

    finish_run(kept, summary)


def _finish_wandb(kept: dict[str, Any], summary: dict[str, Any]) -> None:
    from framework.observe.wandb_tracker import finish_run

    finish_run(kept, summary)


# The trackers that get the run's summary after it, by the run they kept in trackers.json.
FINISHERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "mlflow": _finish_mlflow,
    "wandb": _finish_wandb,
}


def finish(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """After the run, its summary written (the app, rank 0): the summary and the best checkpoint's path go to the
    tracker runs the run directory names, and the summary gets `loggers_failed`, naming the trackers that failed."""
    path = run_dir / RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    for name, finish_run in FINISHERS.items():
        kept = record.get(name)
        if not kept or name in record.get("failed", {}):
            continue
        try:
            finish_run(kept, summary)
        except Exception as err:  # noqa: BLE001  (the run is done; its tracker's last call may fail alone)
            record.setdefault("failed", {})[name] = _warn(f"logger.{name}: the summary was not logged", err)
    return {**summary, "loggers_failed": record["failed"]} if record.get("failed") else summary


def open_sweep(cfg: DictConfig, sweep_dir: Path) -> None:
    """A multirun's own tracker runs, before its jobs: MLflow's parent run, whose children the jobs' runs become;
    W&B's group, which the jobs' runs join."""
    wandb = cfg.logger.wandb
    if wandb.enabled:  # nothing to open: the group is a name, the sweep directory's unless logger.wandb.group says
        sweep_dir.mkdir(parents=True, exist_ok=True)
        sweep = TrackedRun(sweep_dir, str(cfg.get("name") or sweep_dir.name), {})
        sweep.remember("wandb_sweep", {"group": str(wandb.group or sweep_dir.name)})
    mlflow = cfg.logger.mlflow
    if mlflow.enabled:
        from framework.observe.mlflow_tracker import open_parent

        sweep_dir.mkdir(parents=True, exist_ok=True)
        run = TrackedRun(sweep_dir, str(cfg.get("name") or sweep_dir.name), {}, tags={"sweep_dir": str(sweep_dir)})
        try:
            run.remember("mlflow_parent", open_parent(run, mlflow))
        except Exception as err:  # noqa: BLE001  (the jobs run, each its own MLflow run, if this store fails)
            _warn("logger.mlflow: no parent run for this sweep", err)


def close_sweep(sweep_dir: Path) -> None:
    path = sweep_dir / RECORD
    parent = json.loads(path.read_text()).get("mlflow_parent") if path.is_file() else None
    if parent:
        from framework.observe.mlflow_tracker import close_parent

        try:
            close_parent(parent)
        except Exception as err:  # noqa: BLE001
            _warn("logger.mlflow: the sweep's parent run was not closed", err)


def _reason(err: BaseException) -> str:
    """An error in one line, by the innermost error it was raised from that says something: MLflow raises its own
    around SQLAlchemy's around sqlite3's, and its first line ("(raised as a result of Query-invoked autoflush; ...")
    is no reason; `sqlite3.OperationalError: attempt to write a readonly database` is."""
    told = err
    while err.__cause__ is not None:
        err = err.__cause__
        told = err if str(err).strip() else told
    kind = type(told)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name}: {told}".splitlines()[0][:300]


def _warn(what: str, err: BaseException, then: str = "") -> str:
    """One warning, the console's line: `what`, the error's reason, `then`; the traceback to run.log. The reason."""
    why = _reason(err)
    log.warning("%s (%s)%s; its traceback is in run.log", what, why, then)
    traceback_log.info("%s:", what, exc_info=err)
    return why


class Trackers:
    """Every tracker the config chose, behind the calls TensorBoardLogger makes; a failing one is left out."""

    def __init__(self, run: Optional[TrackedRun] = None, trackers: Optional[list[Tracker]] = None) -> None:
        self.run, self.active = run, list(trackers or [])
        self.failed: dict[str, str] = {}

    @classmethod
    def open(cls, cfg: DictConfig, run_dir: Path, resume_step: Optional[int]) -> Trackers:
        """The trackers `cfg.logger` turns on (`logger.<name>.enabled`), for a run in `run_dir`."""
        container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        run = TrackedRun(
            run_dir=run_dir,
            name=str(cfg.get("name") or run_dir.name),
            config={str(k): v for k, v in cast(dict, container).items()},
            resume_step=resume_step,
            tags={"run_dir": str(run_dir.resolve()), "run": run_dir.name},
        )
        trackers = cls(run)
        for name, opener in OPENERS.items():
            settings = cfg.logger[name]
            if not settings.enabled:
                continue
            try:
                trackers.active.append(opener(run, settings))
            except Exception as err:  # noqa: BLE001  (a tracker is not allowed to stop the run)
                trackers._failed(name, err, "could not start")
        return trackers

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for tracker in self.active:
            try:
                tracker.log_metrics(metrics, step)
            except Exception as err:  # noqa: BLE001
                self._drop(tracker, err, f"failed at step {step}")

    def flush(self, now: bool = False) -> None:
        for tracker in self.active:
            try:
                tracker.flush(now)
            except Exception as err:  # noqa: BLE001
                self._drop(tracker, err, "failed to flush")

    def close(self) -> None:
        for tracker in list(self.active):
            try:
                tracker.close()
            except Exception as err:  # noqa: BLE001
                self._drop(tracker, err, "failed to close")
        self.active.clear()

    def _drop(self, tracker: Tracker, err: Exception, what: str) -> None:
        self.active = [t for t in self.active if t is not tracker]  # a new list: a loop over the old one goes on
        self._failed(tracker.name, err, what)
        try:
            tracker.close()
        except Exception:  # noqa: BLE001  (its error is already reported)
            pass

    def _failed(self, name: str, err: Exception, what: str) -> None:
        then = "; it is off for the rest of this run, the other loggers and the checkpoints go on"
        self.failed[name] = _warn(f"logger.{name} {what}", err, then)
        if self.run is not None:
            try:
                self.run.remember("failed", self.failed)
            except OSError as write_err:  # the disk that failed the tracker may fail this too
                log.warning("could not record it in %s: %s", RECORD, write_err)
