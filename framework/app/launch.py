"""Starting the processes of `parallel=ddp` when no launcher did, and keeping torchrun's ranks in one run.

`python run.py parallel=ddp` starts one worker per device with torch.multiprocessing (loopback rendezvous
on a port the parent's store holds); the parent only waits. The workers fork from multiprocessing's forkserver, one
process that imported torch and the libraries a run needs once, instead of each importing them (~3.5 CPU-s a worker,
every device at once on a node); each takes the parent's environment and console as they are when it starts, as a
spawned one would. torch's process context watches the workers: when one fails, the others are terminated (SIGTERM,
then SIGKILL after a grace period), so a failure never hangs the job.
Under torchrun the environment is already set and nothing is spawned here; a cluster job of several tasks (`srun`,
submitit) gets it from the job's own (framework/parallel/cluster.py), each task one rank.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from framework.core.errors import ConfigError, HookError, Interrupted, TrainingFailed, UserError, os_error_line
from framework.core.runlog import STORE_LOGGERS, RunLogHandler
from framework.observe.progress import file_only
from framework.observe.summary import SUMMARY_LOGGER
from framework.parallel.cluster import export_cluster_environment, tasks_as_ranks

log = logging.getLogger(__name__)

GRACE_PERIOD_S = 10.0
# The user's mistakes a spawned worker reports by kind, raised again by the parent as the same kind (the app tells a
# hook's exception and a run that failed once it had trained from a refusal).
_KINDS: dict[str, type[UserError]] = {"hook": HookError, "training": TrainingFailed}


QUIET = ("hydra.output_subdir=null", "hydra/job_logging=quiet")  # a non-zero rank: no `.hydra/`, errors only


def rank_zero_only_overrides() -> list[str]:
    """Hydra overrides for a non-zero rank under torchrun, or of a cluster job whose tasks are its ranks (an `srun`
    of several tasks: `export_cluster_environment` first): every rank runs Hydra, and without these each would
    make its own timestamped run directory. Rank 0 makes the one directory and tells the others."""
    if os.environ.get("RANK", "0") == "0":
        return []
    if any(arg.startswith("hydra.run.dir=") for arg in sys.argv):  # fixed by the user: every rank agrees
        return list(QUIET)
    return ["hydra.run.dir=.", *QUIET]


def sweep_task_overrides() -> list[str]:
    """In a task of a submitit job: its ranks, from the job's tasks (every task runs the whole Hydra job, in the job's
    one directory); a non-zero rank's overrides, so that it writes no `.hydra/` there and logs errors only."""
    export_cluster_environment()
    return [] if os.environ.get("RANK", "0") == "0" else list(QUIET)


def check_tasks_as_ranks(parallel: DictConfig) -> None:
    """Where the ranks are a cluster job's tasks: each task is one process of a ddp or fsdp run, on one device."""
    found = tasks_as_ranks()
    if found is None:
        return
    source, tasks = found
    job = f"a job of {tasks} tasks ({source})"
    strategy = getattr(parallel.strategy, "value", parallel.strategy)
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(
            f"parallel.strategy={strategy}: {job}: each task is a rank, so parallel.strategy={strategy} would train "
            f"{tasks} unrelated runs; expected parallel=ddp or parallel=fsdp, or one task per job"
        )
    if parallel.devices not in (None, 1):
        raise ConfigError(
            f"parallel.devices={parallel.devices}: {job}: each task is one process, a rank on one device; expected "
            "parallel.devices=1 (or null), with as many tasks per node as devices (SLURM's --ntasks-per-node, "
            "hydra.launcher.tasks_per_node)"
        )


def free_port() -> int:
    """A port free now, for a test's or a benchmark's own workers; spawn() hosts its store instead (see there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_store(nprocs: int) -> Any:
    """The workers' rendezvous store, served by this process on a port the OS picks as it binds, and held until
    they end, as torchrun's agent serves its own. A port found free here and bound by rank 0 seconds later, once
    it has imported torch, could be taken meanwhile (by a concurrent run, or another one's gloo connections)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False)


def _held_while_starting() -> list[signal.Signals]:
    """Blocked in spawned workers until _worker can act on them: Ctrl-C (which they then ignore: the parent
    forwards it) and the cluster's signals."""
    from framework.core.signals import cluster_signals

    return [signal.SIGINT, *cluster_signals()]


# What the forkserver imports once, for every worker it forks (multiprocessing.set_forkserver_preload: a name that
# fails to import is skipped): the libraries a worker's run imports, torch the bulk of them, and torch._dynamo, which
# torch imports lazily as the first optimizer is built (torch/_compile.py: ~1.5 s of a worker's start). Not the
# framework (0.1 s): the server finds modules on its own sys.path (its working directory first, not the command's
# script's), so it could find another copy; a worker imports it after taking the parent's sys.path. Nothing here
# starts CUDA or a Python thread: forking the server is safe.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.utils.tensorboard",
    "hydra",
    "omegaconf",
    "safetensors",
    "pyarrow",
    "PIL.Image",
)
START_METHOD = "forkserver"


class _Console:
    """This process's stdout and stderr, for a worker to write to: a forkserver's worker inherits the server's, as
    they were when the server started (an earlier run's, for a program that runs several), where a spawned one
    inherited this process's. Sent as multiprocessing sends a Connection: the descriptors themselves."""

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        self.streams = [(fd, Connection(os.dup(fd), readable=False)) for fd in (1, 2) if _is_open(fd)]

    def take(self) -> None:
        """In the worker: write where the parent's stdout and stderr went when it started this worker."""
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, stream in self.streams:
            os.dup2(stream.fileno(), fd)
            stream.close()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # a daemon's closed stdio: the worker keeps what it has
        return False
    return True


class WorkerFailed(Exception):
    """A worker died of a bug (not a user mistake): carries its traceback text."""


def spawn(
    cfg: DictConfig,
    run_dir: Path,
    nprocs: int,
    checkpoint: Optional[Path] = None,
    hparams: Optional[dict[str, Any]] = None,
    choices: Optional[dict[str, Any]] = None,
) -> None:
    """Run the Trainer in `nprocs` fresh processes and wait; raise the first failure.

    SIGINT and SIGTERM reaching this process are forwarded to the workers as SIGTERM (they ignore SIGINT,
    so a Ctrl-C in the terminal reaches each of them exactly once); the cluster's signals that
    `checkpoint.signals` watches (SLURM's USR1, submitit's USR2) are forwarded as they came. With
    checkpoint.on_signal the workers all stop after the same step and save; a second signal aborts them. This
    process, not a worker, asks for the requeue afterwards (framework.app.main): a submitit job's handler is here."""
    import torch.multiprocessing as mp  # imported here: run.py imports this module before any config check

    from framework.core.signals import LATCH, STOP_ONLY, watched

    errors = mp.get_context(START_METHOD).SimpleQueue()
    store = _host_store(nprocs)
    workers = _start(nprocs, (nprocs, store.port, cfg, run_dir, checkpoint, hparams, choices, errors))
    received: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        for process in workers.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM if signum in STOP_ONLY else signum)

    cluster = watched(cfg.checkpoint.signals) if cfg.checkpoint.on_signal else []
    previous = {sig: LATCH.take_over(sig, forward) for sig in dict.fromkeys([*STOP_ONLY, *cluster])}
    for sig in LATCH.release(taken_over=previous):  # one that came while this process started: the workers' now
        forward(sig, None)
    try:
        while not workers.join(grace_period=GRACE_PERIOD_S):
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        if not errors.empty():
            rank, message, signum, kind = errors.get()
            if signum is not None:  # saved on a signal: the parent's own handler (submitit's) may requeue
                raise Interrupted(signum, message, previous.get(signum)) from None
            raise _KINDS.get(kind, UserError)(message if nprocs == 1 else f"[rank {rank}] {message}") from None
        if received:
            raise KeyboardInterrupt from None
        raise WorkerFailed(str(err).strip()) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del store  # served until every worker has ended


def _start(nprocs: int, args: tuple[Any, ...]) -> Any:
    """`nprocs` workers started on `args`, forked from the forkserver (started here the first time, with PRELOAD),
    each also given this process's environment and console as they are now; torch's process context for them.

    They start with `_held_while_starting` blocked (a signal mask is inherited: by the server, and by what it forks),
    so such a signal sent while a worker starts waits until _worker holds it for its training loop, instead of
    killing a worker that saved nothing; the server keeps them blocked for good (a scheduler's SIGTERM to every
    process of the job must not end the server, whose end the workers' parent would take for theirs)."""
    import torch.multiprocessing as mp

    mp.get_context(START_METHOD).set_forkserver_preload(list(PRELOAD))  # read as the server starts: once a process
    startup_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _held_while_starting())
    try:
        given = (*args, dict(os.environ), _Console(), os.getpid())
        return mp.start_processes(_worker, args=given, nprocs=nprocs, join=False, start_method=START_METHOD)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, startup_mask)


def _configure_logging(rank: int, run_dir: Path) -> None:
    """Spawned workers start without Hydra's logging: rank 0 logs like the parent would (conf/hydra/job_logging/
    framework.yaml: messages on stderr, the closing summary on stdout, both in run.log, and the loggers it sends to
    run.log alone, at its levels), others stay quiet."""
    run_log_only = {  # framework.yaml's `loggers:` but framework.summary (tests/test_trackers.py runs both)
        "framework.observe.trackers.traceback": logging.INFO,
        "mlflow": logging.INFO,
        "sqlalchemy": logging.WARNING,
        "alembic": logging.WARNING,
        "wandb": logging.INFO,
        **{name: logging.WARNING for name in STORE_LOGGERS},  # checkpoint.remote's store
    }
    root = logging.getLogger()
    root.handlers.clear()
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(console)
    summary = logging.getLogger(SUMMARY_LOGGER)
    summary.handlers.clear()
    summary.propagate = rank != 0
    if rank == 0:
        file = RunLogHandler(str(run_dir / "run.log"))
        file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(file)
        stdout = logging.StreamHandler(sys.stdout)
        stdout.setFormatter(logging.Formatter("%(message)s"))
        summary.addHandler(stdout)
        summary.addHandler(file)
        for name, level in run_log_only.items():
            quiet = logging.getLogger(name)
            quiet.handlers.clear()
            quiet.addHandler(file)
            quiet.setLevel(level)
            quiet.propagate = False
    root.setLevel(logging.INFO if rank == 0 else logging.ERROR)


def _watch_parent(pid: int) -> None:
    """In the worker: once process `pid` (its parent) has ended while it still runs (SIGKILLed, its terminal gone),
    send this process SIGTERM: the ranks stop after the same step and save `last`, instead of training on, orphans
    in sessions of their own. Watched on a daemon thread, through a pidfd where Linux has one, else polled."""
    try:
        handle: Optional[int] = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here, or the parent is gone already (then the poll sees it)
        handle = None

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:
            while _alive(pid):
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or its number now another user's process
        return False
    return True


def _worker(
    rank: int,
    world_size: int,
    port: int,
    cfg: DictConfig,
    run_dir: Path,
    checkpoint: Optional[Path],
    hparams: Optional[dict[str, Any]],
    choices: Optional[dict[str, Any]],
    errors: Any,
    environment: dict[str, str],
    console: _Console,
    parent: int,
) -> None:
    # A session of its own, as torchrun starts its workers: a signal to the job's process group (a scheduler's stop
    # or `--signal`, a terminal's Ctrl-C) reaches the parent alone, which forwards it once; a worker sent it by both
    # would take the second for "abort" and save nothing. Its parent's end no longer ends it: _watch_parent.
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent forwards Ctrl-C as SIGTERM, once
    os.environ.clear()
    os.environ.update(environment)
    console.take()
    from framework.core.signals import LATCH

    LATCH.install()  # then let in what was sent while this process started (_start blocked it): held for the loop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _held_while_starting())
    _watch_parent(parent)
    # A worker inherits the parent's default start method (multiprocessing.spawn.prepare): "spawn" where a program
    # set it, and its DataLoader workers would each start a fresh interpreter and import torch again (~1.5 s, every
    # epoch without persistent workers). Back to the platform's default, as a process torchrun started has.
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    # The parent serves the store at MASTER_ADDR:MASTER_PORT (_host_store): every rank joins it as a client, as
    # torchrun's workers join its agent's (torch.distributed.rendezvous reads the same flag).
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    _configure_logging(rank, run_dir)
    from framework.app.stage import run_stage

    try:
        run_stage(cfg, run_dir, checkpoint, hparams, choices)
    except UserError as err:  # reported once, by the parent, without a traceback (a hook's: in run.log)
        if isinstance(err, HookError):
            file_only("".join(traceback.format_exception(err)).rstrip())
        if rank == 0 or not isinstance(err, Interrupted):
            kind = next((name for name, cls in _KINDS.items() if isinstance(err, cls)), None)
            errors.put((rank, str(err), getattr(err, "signum", None), kind))
        sys.exit(1)
    except OSError as err:  # a full disk, an unwritable folder: one line by the parent, the traceback in run.log
        file_only("".join(traceback.format_exception(err)).rstrip())
        errors.put((rank, os_error_line(err), None, None))
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
