"""What a run reports: TensorBoard event files, the trackers beside them, and the closing summary (the progress bar
is in progress.py).

Only rank 0 creates these; other ranks get disabled instances, so the trainer never branches on rank. Every scalar
the run logs goes through `TensorBoardLogger.log_metrics` (the metric logger's, the trainer's best/*), so the
trackers the config chooses (framework/observe/trackers.py: CSV, MLflow) hang there: rank 0 opens them at the run's
start (setup_report), and they get each scalar TensorBoard gets, whether or not TensorBoard itself is on.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Mapping, Optional

from framework.core import files
from framework.observe.trackers import Trackers


class TensorBoardLogger:
    """Scalars and text into the run directory's event files (so `tensorboard --logdir outputs` finds them)."""

    def __init__(self, log_dir: Path, enabled: bool = True, purge_step: Optional[int] = None) -> None:
        """`purge_step`: on resume, TensorBoard discards this run's events at or after it (no duplicates).
        The event file is created with the first thing logged: a run that fails before logging anything
        leaves no event file that TensorBoard would show as an empty run."""
        self.enabled, self.log_dir, self.purge_step = enabled, log_dir, purge_step
        self._writer: Any = None
        self.trackers = Trackers()  # none until rank 0 opens the config's (setup_report.describe_setup)

    @property
    def experiment(self) -> Any:
        """Lightning's name for the SummaryWriter (images, histograms, text); None where nothing is logged."""
        return self.writer

    @property
    def writer(self) -> Any:
        if self._writer is None and self.enabled:
            from torch.utils.tensorboard import SummaryWriter  # imported only when used: it is slow to import

            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10, purge_step=self.purge_step)
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.enabled:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
        if self.trackers.active:
            self.trackers.log_metrics(metrics, step)

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

    def flush(self, trackers_now: bool = False) -> None:
        """`trackers_now`: the trackers write what they keep (an evaluation's end), not only what is due."""
        if self._writer is not None:
            self._writer.flush()
        self.trackers.flush(trackers_now)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer, self.enabled = None, False
        self.trackers.close()


def write_json(path: Path, data: Mapping[str, Any] | list[Any]) -> None:
    """Atomic, never through a link (framework.core.files): a reader (or a crash) never sees half a file."""
    files.write_json(path, data)


# The closing summary's logger: conf/hydra/job_logging/framework.yaml (and launch.py, for spawned workers) send
# it to stdout as plain lines, as print() would, and to run.log, so the log holds what the console showed.
SUMMARY_LOGGER = "framework.summary"


def print_summary(summary: Mapping[str, Any], run_dir: Path, kept: bool = True) -> None:
    """The closing lines a user reads: final metrics, where the run is, how to look at it; or, for a run that
    keeps nothing (`kept=False`: a fast_dev_run, whose run directory the app removes), that nothing was kept."""
    metrics = {k: v for k, v in summary.items() if "/" in k and isinstance(v, (int, float))}
    shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if not math.isnan(v))
    how = f"({summary['precision']}, world size {summary['world_size']})"
    if summary.get("stage", "fit") != "fit":  # validate/test/predict of a saved run's weights
        lines = [
            f"{str(summary['stage']).capitalize()} done in {summary['seconds']:.1f} s: the {summary['weights']} of "
            f"{summary['checkpoint']} (step {summary['step']}) {how}"
        ]
    else:
        epochs = _count(summary["epoch"], "epoch")
        if summary.get("batch_in_epoch"):  # stopped mid-epoch (max_steps, a signal, a callback)
            epochs += f" and {summary['batch_in_epoch']} of {summary['epoch_batches']} batches"
        lines = [f"Done in {summary['seconds']:.1f} s: {epochs}, {_count(summary['step'], 'step')} {how}"]
    if shown:
        lines.append(f"  {shown}")
    if summary.get("predictions"):
        lines.append(f"  {summary['rows']} rows in {summary['predictions']}")
    if kept and summary.get("stage") == "predict":  # rows, not scalars: nothing for TensorBoard to show
        lines.append(f"Run directory: {run_dir}")
    elif kept:
        lines += [
            f"Run directory: {run_dir}",
            f"View it with:  tensorboard --logdir {_shell_path(run_dir)}   "
            "(its CUSTOM SCALARS tab shows loss, metrics and LR first)",
        ]
    else:
        lines.append(
            "fast_dev_run: nothing was kept (no checkpoint, no TensorBoard events, and outside a sweep, whose "
            "summary reads it, no run directory)"
        )
    if summary.get("profile"):  # trainer.profiler=simple: the time per phase ends the run
        from framework.observe.profiler import table  # (imports torch, which a summary of a failed start may not have)

        lines += table(summary["profile"], summary["world_size"])
    logger = logging.getLogger(SUMMARY_LOGGER)
    for line in lines:  # one record a line: each is a complete, prefixed line in run.log
        if logger.hasHandlers():
            logger.info(line)
        else:  # logging not configured (trainer.train called directly): still shown
            print(line)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _shell_path(path: Path) -> str:
    try:
        path = path.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    text = str(path)
    return f"'{text}'" if any(c in text for c in " =,'\"") else text
