"""Interrupts a run at a chosen optimizer step, for the resume tests; not part of the framework.

Python's `site` imports `sitecustomize` at interpreter start-up from the first sys.path entry that has
one, so a test puts this folder on PYTHONPATH for the one run it wants interrupted (and, through the
inherited environment, for that run's DDP workers: torchrun's start an interpreter each, and the framework's fork
from a forkserver that started one, so what this installs reads the rank when it acts, not when it loads). Nothing
else in the environment has a `sitecustomize` (test_resume_matrix checks), so none is shadowed. Without $KILL_AT_STEP it does nothing,
not even import torch.

With $KILL_AT_STEP=N and $KILL_SIGNAL=SIGTERM|SIGKILL, torch's global optimizer-step post hook counts the
optimizer steps actually taken and, right after the N-th, sends the signal: whatever the task, model,
optimizer or precision of the run, the interruption comes at the same point of training every time. Rank 0 (or the
one process) is signalled, or rank $KILL_RANK.
With $KILL_ONCE_FILE, only the first process to reach that step is signalled (a restarted one is not). With
$KILL_WHEN_EXISTS=PATH, the signal waits (up to 120 s) until PATH exists: a checkpoint written in the background
is on disk before the kill, however slow the machine (a test that needs something to resume from).

With $KILL_ON_OPEN=PATTERN instead, rank 0 (or the one process) SIGKILLs itself the moment it opens a file whose path
matches the fnmatch PATTERN (Python's `open` audit event: the checkpoint writer reads each file back after writing
it): a kill at an exact point of a save, on whichever thread makes it.
"""
import os
import signal


def _parent() -> int:
    """The process that started this one: a spawned worker's is multiprocessing's record of it (run.py's process);
    torchrun's agent otherwise."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else os.getppid()


def _kill_after_step(at_step: int, signum: signal.Signals) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0

    def after_optimizer_step(optimizer, args, kwargs) -> None:
        nonlocal steps
        steps += 1
        rank = os.environ.get("RANK")  # set in DDP workers only (by the spawning parent, or torchrun)
        if steps != at_step or rank not in (None, os.environ.get("KILL_RANK", "0")):
            return
        once = os.environ.get("KILL_ONCE_FILE")  # with it, only the first process to get here is signalled
        if once:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
        wait_for = os.environ.get("KILL_WHEN_EXISTS")
        if wait_for:
            import time

            deadline = time.monotonic() + 120
            while not os.path.exists(wait_for) and time.monotonic() < deadline:
                time.sleep(0.01)
        # A DDP worker's SIGTERM goes to its parent, which forwards it to every worker as it would a user's, and
        # so does a cluster's signal (USR1, USR2) to a worker `run.py` spawned: SLURM and submitit signal the job's
        # process. SIGKILL goes to this process: rank 0 dies, and the parent must end the other workers.
        spawned = rank is not None and "TORCHELASTIC_RUN_ID" not in os.environ
        to_parent = signum == signal.SIGTERM and rank is not None or signum != signal.SIGKILL and spawned
        os.kill(_parent() if to_parent else os.getpid(), signum)

    register_optimizer_step_post_hook(after_optimizer_step)


if os.environ.get("KILL_AT_STEP"):
    _kill_after_step(int(os.environ["KILL_AT_STEP"]), signal.Signals[os.environ["KILL_SIGNAL"]])


def _kill_on_open(pattern: str) -> None:
    import fnmatch
    import sys

    def audit(event: str, args: tuple) -> None:
        path = args[0] if event == "open" else None
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        # RANK read now: a DDP worker forked from a forkserver has this hook from the server, which has no rank
        if isinstance(path, str) and fnmatch.fnmatch(path, pattern) and os.environ.get("RANK") in (None, "0"):
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(audit)


if os.environ.get("KILL_ON_OPEN"):
    _kill_on_open(os.environ["KILL_ON_OPEN"])
