"""TensorBoard's event files in the run directory: scalars (from the metric logger), text, the HParams session and
the CUSTOM SCALARS layout. Only rank 0 writes; other ranks get a disabled instance, so no caller branches on rank.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Optional


class TensorBoardLogger:
    """Scalars and text into the run directory's event files (so `tensorboard --logdir outputs` finds them)."""

    def __init__(self, log_dir: Path, enabled: bool = True, purge_step: Optional[int] = None) -> None:
        """`purge_step`: on resume, TensorBoard discards this run's events at or after it (no duplicates).
        The event file is created with the first thing logged: a run that fails before logging anything
        leaves no event file that TensorBoard would show as an empty run."""
        self.enabled, self.log_dir, self.purge_step = enabled, log_dir, purge_step
        self._writer: Any = None

    @property
    def experiment(self) -> Any:
        """Lightning's name for the SummaryWriter (images, histograms, text); None where nothing is logged."""
        return self.writer

    @property
    def writer(self) -> Any:
        if self._writer is None and self.enabled:
            from torch.utils.tensorboard import SummaryWriter  # imported only when used: it is slow to import

            _after_earlier_files(self.log_dir)
            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10, purge_step=self.purge_step)
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.enabled:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)

    def log_hparams(self, hparams: Mapping[str, Any], metric_tags: list[str]) -> None:
        """Start this run's HParams session in its own event files (not a sub-run, as `add_hparams` would),
        so TensorBoard's HParams tab shows it beside its scalars; metric values are read from `metric_tags`."""
        if self.enabled:
            from torch.utils.tensorboard.summary import hparams as hparams_summaries

            experiment, session_start, _ = hparams_summaries(dict(hparams), {tag: 0.0 for tag in metric_tags})
            file_writer = self.writer.file_writer  # the open run's FileWriter (SummaryWriter's public attribute)
            file_writer.add_summary(experiment)
            file_writer.add_summary(session_start)

    def end_hparams_session(self) -> None:
        if self.enabled:
            from torch.utils.tensorboard.summary import hparams as hparams_summaries

            _, _, session_end = hparams_summaries({"_": 0}, {})
            self.writer.file_writer.add_summary(session_end)

    def log_custom_scalars(self, layout: Mapping[str, Any]) -> None:
        """The CUSTOM SCALARS page's charts (framework/observe/layout.py), once per run."""
        if self.enabled:
            self.writer.add_custom_scalars(dict(layout))

    def log_text(self, tag: str, text: str, step: Optional[int] = None) -> None:
        if self.enabled:
            self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer, self.enabled = None, False


def _after_earlier_files(log_dir: Path) -> None:
    """Wait, if need be, for the second after the newest event file's: TensorBoard reads a directory's event files in
    name order (`events.out.tfevents.<seconds>.<host>.<pid>...`), so a resume's file made within the same second as
    the run it resumes could sort first by its pid, and the reader would then drop the earlier file's points as
    out of order. Only a resume within a second of the earlier run's start (a fast test, an instant requeue) waits."""
    stamps = [
        int(p.name.split(".")[3]) for p in log_dir.glob("events.out.tfevents.*") if p.name.split(".")[3].isdigit()
    ]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)
