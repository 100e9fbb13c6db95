"""Stopping on a signal, and asking a cluster to requeue the run.

The handler only records the signal; the training loop polls `received` after each optimizer step (all ranks
agree on it), saves `last` at that exact position and ends the run, so nothing is ever saved inside a signal
handler. A second signal aborts at once; the previous intact checkpoint is still there.

Which signals: `checkpoint.signals` (default SIGTERM, SIGINT, SIGUSR1 for SLURM's `--signal=USR1@90`,
SIGUSR2 for submitit), plus submitit's `SUBMITIT_PREEMPT_SIGNAL` when it is set. After `last` is saved, a
stop on a signal other than SIGTERM/SIGINT (those mean "stop", e.g. `scancel` or Ctrl-C) asks to be requeued
(`requeue`, per `checkpoint.requeue`: auto = under SLURM or submitit only):
- under Hydra's submitit launcher, through submitit's own handler, called once the checkpoint is on disk
  (it pickles the job for resubmission, requeues it and exits); the requeued job resumes in the same job dir;
- under plain `sbatch`, with `scontrol requeue $SLURM_JOB_ID`, once, from rank 0; the requeued job gets the same
  run directory (`outputs/<name>/slurm-<job id>`, see resume.py) and resumes from `last`.

A cluster's signal can also come while the run is still starting (composing the config, importing torch,
loading data), before the loop watches: `LATCH` holds it from `main()` on (and in a spawned worker from its
first line; the parent keeps these signals blocked while it starts the workers, so one sent meanwhile waits in
the kernel). The watch takes a held signal over: the run stops after its first step, saves and requeues as
above. A held signal the run does not watch (checkpoint.on_signal=false) takes its default action then.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Any, Iterable, Optional

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
STOP_ONLY = (signal.SIGTERM, signal.SIGINT)  # "stop": never requeued
SUBMITIT_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"
SCONTROL_TIMEOUT_S = 30


def parse(name: Any) -> Optional[signal.Signals]:
    """A signal by name (SIGUSR1, USR1) or number; None if there is no such signal."""
    text = str(name).strip().upper()
    try:
        return (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
        )
    except (KeyError, ValueError):
        return None


def watched(names: Iterable[Any]) -> list[signal.Signals]:
    """The configured signals, plus the one submitit preempts and times out with when it says so."""
    found = [s for s in (parse(n) for n in names) if s is not None]
    submitit = parse(os.environ[SUBMITIT_SIGNAL_ENV]) if os.environ.get(SUBMITIT_SIGNAL_ENV) else None
    return list(dict.fromkeys([*found, *([submitit] if submitit is not None else [])]))


def cluster_signals() -> list[signal.Signals]:
    """What a scheduler sends to end or preempt a job, each with a default action that kills the process: SIGTERM
    (scancel, the time limit), SIGUSR1 and SIGUSR2 (`--signal`, submitit), and submitit's own when it says so."""
    return watched(("SIGTERM", "SIGUSR1", "SIGUSR2"))


class StartupLatch:
    """Holds the first cluster signal that arrives before a `SignalWatch` (or a spawning parent's forwarding) takes
    over, instead of letting its default action kill a run that has not saved anything yet. A second one aborts at
    once, as it would later. Only signals whose handler is the default are held (submitit's stay submitit's)."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self._original: dict[int, Any] = {}

    def install(self) -> None:
        for sig in cluster_signals():
            if sig not in self._original and signal.getsignal(sig) is signal.SIG_DFL:
                self._original[sig] = signal.signal(sig, self._handle)

    def take_over(self, signum: int, handler: Any) -> Any:
        """Install `handler` for `signum`; return the one it had before, and before the latch if the latch had it
        (what a requeue may hand over to, and what to restore)."""
        previous = signal.signal(signum, handler)
        return self._original.get(signum, signal.SIG_DFL) if self._holds(previous) else previous

    def _holds(self, handler: Any) -> bool:
        return getattr(handler, "__self__", None) is self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.pending:  # a second signal: abort now, with the default action of this one
            self.release(deliver=False)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.pending.append(signum)

    def release(self, taken_over: Iterable[int] = (), deliver: bool = True) -> list[int]:
        """Give every held signal its handler back, except those in `taken_over` (their new owner installed its own
        already, so none is ever left at its default in between). Returns the held signals that the new owner takes
        (in `taken_over`); with `deliver`, any other is sent again, now to its original handler."""
        taken_over = set(taken_over)
        for sig, handler in self._original.items():
            if sig not in taken_over and self._holds(signal.getsignal(sig)):
                signal.signal(sig, handler)
        self._original.clear()
        pending, self.pending = self.pending, []
        if deliver:
            for sig in pending:
                if sig not in taken_over:
                    os.kill(os.getpid(), sig)
        return [sig for sig in pending if sig in taken_over]


LATCH = StartupLatch()


class SignalWatch:
    """On one of `signals`, ask the loop to stop after the current step (it saves `last` and exits); a second
    signal aborts at once. Remembers the handler each signal had before (submitit's, for one)."""

    def __init__(self, signals: Iterable[int] = STOP_ONLY) -> None:
        self.signals = list(signals)
        self.received: Optional[int] = None
        self.after_training = False  # once the last step is taken (training_over): a signal has nothing left to stop
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalWatch":
        for sig in self.signals:
            if signal.getsignal(sig) is signal.SIG_IGN:  # e.g. spawned DDP workers: the parent forwards SIGINT
                continue
            self._previous[sig] = LATCH.take_over(sig, self._handle)
        held = LATCH.release(taken_over=self._previous)  # one not watched takes its default action now
        if held:
            self.received = held[0]
            log.warning(
                "Received %s while the run was starting: taking the first step, then saving "
                "checkpoints/last (send again to abort)",
                signal.Signals(held[0]).name,
            )
        return self

    def training_over(self) -> None:
        """The last step is taken: a signal from here on finishes the run, it does not stop it."""
        self.after_training = True

    def previous(self, signum: int) -> Any:
        """The handler `signum` had before this watch, or before the start-up latch (what a requeue may hand
        over to)."""
        return self._previous.get(signum)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is not None:
            self.__exit__()
            raise KeyboardInterrupt
        self.received = signum
        if self.after_training:
            log.warning(
                "Received %s after the last step: finishing the run, which is not requeued (send again to abort)",
                signal.Signals(signum).name,
            )
        else:
            log.warning(
                "Received %s: finishing this step, then saving checkpoints/last (send again to abort)",
                signal.Signals(signum).name,
            )

    def __exit__(self, *_exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _submitit_handler(handler: Any) -> bool:
    owner = getattr(handler, "__self__", None)
    return owner is not None and type(owner).__module__.startswith("submitit")


def slurm_job_id() -> Optional[str]:
    """This SLURM job's id as `scontrol requeue` takes it (an array task's own id), or None outside SLURM."""
    return os.environ.get("SLURM_JOB_ID") or None


def requeue(signum: int, previous: Any, mode: Any) -> Optional[str]:
    """After `last` is saved on `signum`: ask to be requeued, per `mode` (checkpoint.requeue: auto, true, false).
    Returns what was done (for the log), or None. Under submitit this does not return: submitit's handler
    requeues the job and exits the process."""
    if mode is False or signum in STOP_ONLY:
        return None
    if _submitit_handler(previous):
        log.warning("Handing over to submitit to requeue the job (checkpoints/last is saved)")
        previous(signum, None)  # pickles the job for resubmission, requeues it, exits
        return "requeued by submitit"
    job = slurm_job_id()
    if job is None:
        if mode is True:
            log.warning("checkpoint.requeue=true, but this run is not a SLURM job (no SLURM_JOB_ID): not requeued")
        return None
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error("scontrol requeue %s failed (%s); the run is saved: resume it with the same command", job, err)
        return None
    if done.returncode != 0:
        log.error(
            "scontrol requeue %s failed: %s; the run is saved: resume it with the same command",
            job,
            (done.stderr or done.stdout).strip() or f"exit code {done.returncode}",
        )
        return None
    log.warning("Requeued SLURM job %s: it continues from checkpoints/last when it starts again", job)
    return f"requeued SLURM job {job}"
