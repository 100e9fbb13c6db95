"""A callback of our own, as a user writes one: a class here and a yaml file in conf/callbacks/.

    python run.py callbacks=[default,metric_history]

`MetricHistory` keeps every validation's metrics and writes them, after each validation, to
RUN_DIR/metric_history.json: a table of the run's validations for a notebook or a report. Its history is part
of the checkpoint (state_dict), so a killed and resumed run writes the same file as one never interrupted.
"""
from __future__ import annotations

from typing import Any

from framework.callbacks.base import Callback
from framework.core.files import write_json


class MetricHistory(Callback):
    def __init__(self, filename: str = "metric_history.json") -> None:
        self.filename = filename
        self.history: list[dict[str, float]] = []

    def on_validation_end(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        self.history.append({"step": trainer.global_step, "epoch": trainer.current_epoch, **metrics})
        if trainer.is_global_zero:  # every rank keeps the history; one writes it
            write_json(trainer.run_dir / self.filename, {"validations": self.history})

    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(row) for row in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [dict(row) for row in state["history"]]
