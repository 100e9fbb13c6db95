"""Lightning's Timer: stop once a run has trained `trainer.max_time` (a duration), counting the time of every
attempt of a resumed run."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from framework.callbacks.base import Callback, Trainer
from framework.config.validate import parse_duration

if TYPE_CHECKING:
    from framework.task.task import Task

log = logging.getLogger(__name__)


class Timer(Callback):
    """Lightning's Timer (what `trainer.max_time` adds): stop cleanly once training has taken `duration`. The loop
    stops at the next optimizer-step boundary, saves `last`, then validates, tests and reports as usual.

    `scope="job"` (what `trainer.max_time` uses) counts this job only, like a cluster's time limit: set it a little
    under the job's limit, and each start of the same command (a requeued or restarted job, `resume=`) gets the
    whole budget again and continues where the last one stopped. `scope="run"` (Lightning's) counts the time of
    every job of the run, so a resumed run gets only what is left. Either way the total time trained is kept in
    the checkpoint and reported."""

    SCOPES = ("job", "run")

    def __init__(self, duration: Any, scope: str = "job") -> None:
        seconds = parse_duration(duration)
        if seconds is None:
            raise ValueError(
                f"duration={duration!r}: expected DD:HH:MM:SS (e.g. 00:12:00:00) or a number of seconds > 0"
            )
        if scope not in self.SCOPES:
            raise ValueError(f"scope={scope!r}: expected one of {', '.join(self.SCOPES)}")
        self.duration = seconds
        self.scope = scope
        self.elapsed_before = 0.0  # seconds trained by the jobs this one resumes
        self._started = time.monotonic()

    def elapsed(self) -> float:
        """Seconds trained in all, across resumes."""
        return self.elapsed_before + self.job_elapsed()

    def job_elapsed(self) -> float:
        """Seconds trained by this job."""
        return time.monotonic() - self._started

    def on_fit_start(self, trainer: "Trainer", task: "Task") -> None:
        self._started = time.monotonic()
        self._check(trainer)

    def on_train_batch_end(self, trainer: "Trainer", task: "Task", outputs: Any, batch: Any, batch_idx: int) -> None:
        self._check(trainer)

    def _check(self, trainer: "Trainer") -> None:
        used = self.job_elapsed() if self.scope == "job" else self.elapsed()
        if used >= self.duration:
            where = "in this job" if self.scope == "job" else "in this run"
            trainer.request_stop(
                f"time limit: trained for {used:.0f} s {where} of trainer.max_time="
                f"{self.duration:.0f} s ({self.elapsed():.0f} s in all)"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elapsed_before = float(state["elapsed"])
