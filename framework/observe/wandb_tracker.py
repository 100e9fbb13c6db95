"""The Weights & Biases tracker (`logger=wandb`), through `wandb.init` and the `Run` it returns only: no `wandb.log`,
no global `wandb.run` (`reinit="create_new"`), console capture, git or code saving off; nothing of wandb is imported
by a run that did not choose it.

Offline by default (`logger.wandb.mode=online` sends to the server as it runs): the run's files go under the run
directory (`RUN_DIR/wandb/offline-run-*`, `wandb sync` uploads them later), so a run directory carries its W&B run
wherever it is copied, and a resume finds the killed run's files. The run's ID is kept in trackers.json, so
`resume=RUN_DIR` continues the same W&B run (`resume="allow"`; "must" needs the server). W&B cannot delete a point,
and its `resume_from`/`fork_from` rewind is done by the server, so neither works offline: a resumed run logs again
the steps after its checkpoint, and W&B keeps a step's first point (a resume is exact, so both are the same value).
None of W&B's own files is read back.

Each point is logged at the trainer's step (`Run.log(..., step=)`), so W&B's x-axis is TensorBoard's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from omegaconf import DictConfig

from framework.core import files
from framework.observe.tracked import TrackedRun, flat_values


def _settings() -> Any:
    import wandb

    # console="off": W&B would otherwise wrap this process's stdout and stderr; git and code: provenance.json has them.
    return wandb.Settings(console="off", silent=True, disable_git=True, disable_code=True, save_code=False)


def _init(kept: Mapping[str, Any], **more: Any) -> Any:
    import wandb

    return wandb.init(
        id=kept["run_id"],
        project=kept["project"],
        entity=kept.get("entity"),
        dir=kept["dir"],
        mode=kept["mode"],
        resume="allow",
        reinit="create_new",  # a Run object of its own, not wandb.run: no global state, several runs at once
        settings=_settings(),
        **more,
    )


class WandbTracker:
    name = "wandb"

    def __init__(self, run: TrackedRun, settings: DictConfig) -> None:
        where = Path(settings.dir) if settings.dir else run.run_dir
        where.mkdir(parents=True, exist_ok=True)
        kept = run.record().get("wandb", {})
        # A resumed run continues the same W&B run and logs again the steps after its checkpoint that the killed run
        # may have logged: W&B keeps the first point of a step (its server drops a step that does not increase),
        # and a resume is bit-identical, so they are the same numbers. Nothing of W&B's own files is read back.
        if not (kept.get("run_id") and kept.get("dir") == str(where)):  # a new W&B run: W&B picks its ID
            kept = {"run_id": None, "project": str(settings.project or run.name), "entity": settings.entity}
        kept = {**kept, "dir": str(where), "mode": str(settings.mode)}  # a resumed run may go online
        group = settings.group or (run.sweep_parent("wandb_sweep") or {}).get("group")
        tags = [run.run_dir.name, *map(str, settings.tags or [])]  # tags are short: the full path is in the config
        config = {"run_dir": str(run.run_dir.resolve()), **flat_values(run.config)}
        self.wb = _init(kept, name=str(settings.name or run.run_dir.name), group=group, tags=tags, config=config)
        if kept["run_id"] is None:
            run.remember("wandb", {**kept, "run_id": self.wb.id})
        self.run = run
        # One `Run.log` per step (~0.2 ms each): a step's metrics come in several calls (the train log, the LR, perf/,
        # an evaluation's), gathered here until a later step arrives or the metric logger flushes.
        self._step: Optional[int] = None
        self._row: dict[str, float] = {}
        self._save_text("composed_config.yaml", run.composed_yaml())  # files/config.yaml is W&B's own

    def _save_text(self, name: str, text: str) -> None:
        path = Path(self.wb.dir) / name
        files.write_text(path, text)
        self.wb.save(str(path), base_path=self.wb.dir, policy="now")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if step != self._step:
            self._send()
            self._step = step
        self._row.update(metrics)

    def _send(self) -> None:
        if self._row:
            row, self._row = self._row, {}
            self.wb.log(row, step=self._step)

    def flush(self, now: bool) -> None:
        """The step gathered so far goes to W&B's own process, which writes it."""
        self._send()

    def close(self) -> None:
        self._send()
        provenance = self.run.run_dir / "provenance.json"
        if provenance.is_file():  # the app writes it in the background while the run starts
            files.write_bytes(Path(self.wb.dir) / provenance.name, files.read_bytes(provenance))
            self.wb.save(str(Path(self.wb.dir) / provenance.name), base_path=self.wb.dir, policy="now")
        self.wb.finish()


def finish_run(kept: Mapping[str, Any], summary: dict[str, Any]) -> None:
    """The summary (summary.json, and the run summary's keys) and the best checkpoint's path, once the run is over:
    the same W&B run continued for them (the trainer's process may have been a spawned worker)."""
    wb = _init(kept)
    wb.summary.update({k: v for k, v in summary.items() if v is not None})
    path = Path(wb.dir) / "summary.json"
    files.write_json(path, summary)  # a NaN metric as null: JSON has no NaN
    wb.save(str(path), base_path=wb.dir, policy="now")
    wb.finish(exit_code=1 if summary.get("status") == "failed" else 0)
