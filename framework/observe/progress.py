"""The console progress of a run, for a person at a terminal and for a log file.

- At a terminal (stderr is a TTY): one tqdm bar per epoch that stays when the epoch ends, with the train loss
  and samples/s as it runs and the epoch's validation metrics when it ends, as Lightning shows them.
- Anywhere else (a pipe, CI, a SLURM log): no bar and no carriage returns. One plain line per epoch, with the
  epoch, step, losses, validation metrics, samples/s and ETA, and for long epochs one line every
  `every_s` seconds in between.
Either way the epoch lines go to run.log too (`file_only` for a terminal, where the bar already shows them).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Mapping, Optional

from framework.core.runlog import file_handlers

log = logging.getLogger(__name__)


def file_only(message: str, logger: logging.Logger = log, level: int = logging.INFO) -> None:
    """A record for the log files (run.log) but not the console: what the console shows another way."""
    record = logger.makeRecord(logger.name, level, __file__, 0, message, (), None)
    for handler in file_handlers():
        handler.handle(record)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _metrics(metrics: Mapping[str, float]) -> str:
    return "  ".join(f"{name} {value:.4g}" for name, value in metrics.items())


class ProgressBar:
    """`interactive`: None decides by whether stderr is a terminal."""

    def __init__(self, enabled: bool = True, interactive: Optional[bool] = None, every_s: float = 30.0) -> None:
        self.enabled = enabled
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.every_s = every_s
        self.bar: Any = None
        self.shown: dict[str, float] = {}
        self.epoch = self.total = self.done = 0
        self.max_epochs = 0
        self._last_line = self._started = 0.0

    def start_epoch(self, epoch: int, total: int, initial: int = 0, max_epochs: int = 0) -> None:
        if not self.enabled:
            return
        self.epoch, self.total, self.done, self.max_epochs = epoch, total, initial, max_epochs
        self.shown = {}
        self._started = self._last_line = time.monotonic()
        if self.interactive:
            from tqdm import tqdm

            self.close()
            self.bar = tqdm(
                total=total, initial=initial, desc=self._epoch_name(), dynamic_ncols=True, leave=True, file=sys.stderr
            )

    def _epoch_name(self) -> str:
        return f"epoch {self.epoch}" + (f"/{self.max_epochs - 1}" if self.max_epochs > 0 else "")

    def update(self) -> None:
        """One batch done (the loop calls this only when the bar is enabled)."""
        if self.bar is not None:
            self.bar.update()
            return
        self.done += 1
        now = time.monotonic()
        if now - self._last_line >= self.every_s:  # a long epoch: a line every every_s seconds
            self._last_line = now
            log.info("%s  batch %d/%d  %s", self._epoch_name(), self.done, self.total, _metrics(self.shown))

    def show(self, metrics: Mapping[str, float]) -> None:
        """The latest train values (at logging steps: they cost no sync of their own)."""
        if not self.enabled:
            return
        self.shown.update(metrics)
        if self.bar is not None:
            self.bar.set_postfix({_short(k): f"{v:.4g}" for k, v in self.shown.items()}, refresh=False)

    def end_epoch(self, step: int, metrics: Mapping[str, float], samples_per_s: float, eta_s: Optional[float]) -> None:
        """The epoch's line: its metrics (train means, validation), speed and the time left."""
        if not self.enabled:
            return
        rate = f"{samples_per_s:,.0f} samples/s"
        eta = f"ETA {_duration(eta_s)}" if eta_s is not None else ""
        line = "  ".join(part for part in (f"{self._epoch_name()}  step {step}", _metrics(metrics), rate, eta) if part)
        if self.bar is not None:
            self.bar.set_postfix(
                {**{_short(k): f"{v:.4g}" for k, v in metrics.items()}, "samples/s": f"{samples_per_s:,.0f}"},
                refresh=True,
            )
            self.close()
            file_only(line)
        else:
            log.info("%s", line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _short(name: str) -> str:
    return name.split("/", 1)[-1] if name.startswith("train/") else name
