"""What a run was made from: RUN_DIR/provenance.json names the command line, the git commit (and, in
RUN_DIR/git.diff, the uncommitted changes) of the checkout it ran from, the versions of Python, torch,
CUDA/cuDNN, Hydra and the framework, the host, the devices, and the job (`job`): the launcher that started its
processes, their number, and the scheduler's job, array and restart numbers. Every rank's host is in summary.json
(`hosts`), which the run gathers once its processes have joined.

A resumed run keeps the original record and gets its own beside it: provenance-resumed-<time>.json (and
git-resumed-<time>.diff). Git is asked with a short timeout; no git binary, no checkout or a slow repository
gives nulls, never an error.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from framework.core import files
from framework.core.files import write_json

log = logging.getLogger(__name__)

FILES = ("provenance.json", "git.diff")  # a fresh run's record
DISTRIBUTION = "hydra-torch-framework"  # pyproject.toml's name
GIT_TIMEOUT_S = 3.0


def _git(cwd: Path, *args: str) -> Optional[bytes]:
    """git's stdout, or None where git is missing, fails, or takes longer than GIT_TIMEOUT_S."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0"}  # read-only, never prompts
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=GIT_TIMEOUT_S, env=env
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state(cwd: Path) -> tuple[dict[str, Any], Optional[bytes]]:
    """({commit, dirty, untracked}, the diff of tracked files against HEAD, or None when clean) of the checkout
    holding `cwd`; all None outside a git checkout. Untracked files are named, not diffed."""
    head = _git(cwd, "rev-parse", "HEAD")
    status = _git(cwd, "status", "--porcelain=v1", "-z") if head is not None else None
    if head is None or status is None:
        return {"commit": None, "dirty": None, "untracked": None}, None
    entries = [e.decode(errors="replace") for e in status.split(b"\0") if e]
    untracked = [e[3:] for e in entries if e.startswith("?? ")]
    dirty = len(untracked) < len(entries)  # a tracked file differs from HEAD
    diff = _git(cwd, "diff", "HEAD", "--binary") if dirty else None
    return {"commit": head.decode().strip(), "dirty": dirty, "untracked": untracked}, diff or None


def versions() -> dict[str, Optional[str]]:
    import hydra
    import torch

    try:
        framework_version: Optional[str] = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed: the commit says it
        framework_version = None
    cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn else None,
        "hydra": hydra.__version__,
        "framework": framework_version,
    }


def devices() -> list[str]:
    """The CUDA devices' names, or ["cpu"]."""
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ["cpu"]


# The scheduler's numbers of a job, by the names provenance.json gives them; SLURM's and torchrun's own variables.
JOB_IDS = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "nodes": "SLURM_JOB_NUM_NODES",
    "nodelist": "SLURM_JOB_NODELIST",
    "rendezvous_id": "TORCHELASTIC_RUN_ID",
    "restart": "TORCHELASTIC_RESTART_COUNT",
    "requeued": "SLURM_RESTART_COUNT",
}


def job(env: Mapping[str, str], spawned: int) -> dict[str, Any]:
    """Who started the run's processes, and how many: `launcher` torchrun, slurm / submitit-local / submitit-slurm
    (a job's tasks as its ranks: framework/parallel/cluster.py), env (RANK and WORLD_SIZE set by hand), spawn (the
    framework's own, `spawned` processes), or null (one process); with the scheduler's numbers where it has them."""
    launcher: Optional[str]
    if "WORLD_SIZE" in env and "RANK" in env:
        launcher = env.get("HTF_RANKS_FROM") or ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "env")
        processes = int(env["WORLD_SIZE"])
    else:
        launcher, processes = ("spawn", spawned) if spawned else (None, 1)
    ids = {name: env[var] for name, var in JOB_IDS.items() if var in env}
    return {"launcher": launcher, "world_size": processes, **ids}


def collect(cwd: Path, overrides: Sequence[str], spawned: int = 0) -> tuple[dict[str, Any], Optional[bytes]]:
    """The record of this process (its command line, from `cwd`, with the job's `overrides`; `spawned`: the
    processes the framework spawns for the run, 0 for none), and the git diff."""
    git, diff = git_state(cwd)
    record = {
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),  # as typed, the interpreter and its options included
        "argv": list(sys.argv),  # as the program saw it (resume= adds the saved run's group choices)
        "overrides": list(overrides),
        "cwd": str(cwd),
        "git": {**git, "diff": None},
        "versions": versions(),
        "host": socket.gethostname(),  # this process's: every rank's is summary.json's `hosts`
        "job": job(os.environ, spawned),
        # Whose tasks the ranks are, where a cluster job's tasks were made its ranks (framework/parallel/cluster.py's
        # RANKS_FROM_ENV: slurm, submitit-local, submitit-slurm); torchrun's workers and one process: null.
        "ranks_from": os.environ.get("HTF_RANKS_FROM"),
        "platform": platform.platform(),
        "devices": devices(),
        "cpu_count": os.cpu_count(),
    }
    return record, diff


def write(run_dir: Path, cwd: Path, overrides: Sequence[str], spawned: int = 0) -> Path:
    """RUN_DIR/provenance.json (+ git.diff when the checkout is dirty); for a run directory that already has
    them (a resume), provenance-resumed-<time>.json (+ git-resumed-<time>.diff). Returns the JSON's path."""
    record, diff = collect(cwd, overrides, spawned)
    suffix = ""
    if (run_dir / FILES[0]).exists():
        suffix = f"-resumed-{datetime.datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    if diff is not None:
        diff_path = run_dir / f"git{suffix}.diff"
        files.write_bytes(diff_path, diff)
        record["git"]["diff"] = diff_path.name
    path = run_dir / f"provenance{suffix}.json"
    write_json(path, record)
    return path


class BackgroundWrite:
    """`write` on a thread, so that git (`git status` of a large checkout can take seconds) never delays the first
    step; the app joins it before the job ends. A record that cannot be written is a warning, never the end of
    the run."""

    def __init__(self, run_dir: Path, cwd: Path, overrides: Sequence[str], spawned: int = 0) -> None:
        self._thread = threading.Thread(
            target=self._write, args=(run_dir, cwd, list(overrides), spawned), name="provenance", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _write(run_dir: Path, cwd: Path, overrides: list[str], spawned: int) -> None:
        try:
            write(run_dir, cwd, overrides, spawned)
        except Exception as err:  # noqa: BLE001  (e.g. a full disk: the run itself decides whether that matters)
            log.warning("Could not record the run's provenance in %s: %s: %s", run_dir, type(err).__name__, err)

    def join(self) -> None:
        self._thread.join()
