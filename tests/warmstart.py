"""`python run.py ...` as a real process, without paying the interpreter's imports again for every run.

Most of a small test run's time is start-up: importing torch, Hydra and torch._dynamo (which torch.optim's first
optimizer imports) takes ~3 CPU-s of the ~4 a 30-step run costs. A suite that starts a few hundred runs on 2 cores
spends minutes there. So each pytest worker keeps one *warm* process that has imported what `run.py` imports and
nothing more (no config composed, no run started), and forks it for each run: the child is a real process of its
own (its own pid, its signals, its exit status, its stdout and stderr as pipes), which sets the run's environment
and working directory, then executes run.py as `__main__` and exits as `python run.py` does after its imports:
the interpreter joins the run's threads, runs its atexit hooks (logging's, multiprocessing's, torch's, the run's
own) and flushes stdout and stderr, with the same exit status.

One step of a real exit is left out: the final collection and the teardown of every module, which decrements
the reference count of every object the warm process imported and so copies nearly all of its pages into the
child: 0.3 of the 0.4 CPU-s an empty script costs, 0.3 of a 30-step run's 0.9. The warm process registers, before
anything else, the atexit hook that runs last; in a run's process it flushes the streams and ends the process
with the run's status (os._exit). What only that teardown would show (a `__del__` that prints or fails at exit)
needs a fresh interpreter: tests of start-up and exit (test_package, the entry points) start one, and
HTF_TESTS_COLD=1 sends every run there. A run ended by Ctrl-C (KeyboardInterrupt) exits the whole way, as Python
then ends itself by SIGINT.

What a fork cannot give, `cold_only` sends to a fresh interpreter instead: anything that changes what the
interpreter does *at start-up* (PYTHON* variables, the hash seed, the OpenMP or CUDA environment torch reads when
it is imported). A `sitecustomize` on the run's PYTHONPATH (the kill hook) is imported by the child before run.py,
as `site` would at start-up; the warm process itself is started without one. Tests of start-up itself
(test_package, the entry points) always start fresh interpreters. `python -m MODULE` is forked too, and run as -m
runs it (runpy.run_module). The processes a run spawns (parallel=ddp's and fsdp's workers, ~2 CPU-s of imports
each) are forked from the warm process as well, through a stand-in (_as_spawned); they exit the whole way.

Protocol (a Unix socket): the client sends one JSON line {argv, env, cwd, ignored} with its stdout and stderr pipes'
write ends attached (SCM_RIGHTS), and reads back two lines: the child's pid, then its wait status (a spawned
process's stand-in sends every descriptor it inherited, their numbers and its signal mask, and may be told `cold`).
The warm process forks a reaper per run, which forks the run and waits for it, so the warm process never has
threads; the reaper kills the run if its client goes first.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Optional

# What run.py's process imports before its job starts, and the big imports its run makes (torch.optim's first
# optimizer imports torch._dynamo; TensorBoard's writer, the checkpoint reader).
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "torch.utils.tensorboard", "torch.distributed",
           "hydra", "omegaconf", "numpy", "framework.app.cli", "framework.app.main", "framework.loop.trainer")
# Read by the interpreter or by torch when they start, so a fork cannot honour a change to them.
STARTUP_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "PYTHONHASHSEED",
               "PYTHONSTARTUP", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONOPTIMIZE",
               "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONMALLOC", "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC",
               "PYTHONDEVMODE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONHOME", "PYTHONEXECUTABLE")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
SPAWNED_EXECUTABLE = "spawned"  # in the warm process's folder, beside its socket


class WarmStarter:
    """A warm process for one pytest worker; `run` is `subprocess.run([python, script, *args], ...)`."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.folder = tempfile.mkdtemp(prefix="warmstart-")
        self.address = os.path.join(self.folder, "socket")
        log = os.path.join(self.folder, "log")  # a file, not a pipe nobody reads once it has started
        # What a run's multiprocessing starts instead of the interpreter for a spawned process (see _as_spawned).
        spawned = os.path.join(self.folder, SPAWNED_EXECUTABLE)
        with open(spawned, "w") as script:
            script.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S -E {shlex.quote(__file__)} --spawned '
                         f'{shlex.quote(self.address)} {shlex.quote(sys.executable)} "$@"\n')
        os.chmod(spawned, 0o755)
        with open(log, "wb") as errors:
            self.process = subprocess.Popen([sys.executable, __file__, self.address], env=self.env,
                                            stdin=subprocess.DEVNULL, stdout=errors, stderr=errors)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.address):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the warm process did not start: {Path(log).read_text()}")
            time.sleep(0.05)

    def cold_only(self, env: Mapping[str, str]) -> bool:
        """True when this environment changes what the interpreter or torch do when they start, or asks for a fresh
        interpreter (HTF_TESTS_COLD=1: every run as `python run.py` would start, to compare or to debug)."""
        return env.get("HTF_TESTS_COLD") == "1" or any(env.get(key) != self.env.get(key) for key in STARTUP_ENV)

    def run(self, args: list[str], *, cwd: Path, env: Mapping[str, str], timeout: float
            ) -> subprocess.CompletedProcess:
        if self.cold_only(env) or self.process.poll() is not None:
            return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=dict(env))
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.address)
            # Which stop signals this process ignores now: a fresh interpreter started from here inherits that
            # (and the framework leaves an ignored SIGINT alone), whatever the warm process inherited at its start.
            ignored = [int(s) for s in STOP_SIGNALS if signal.getsignal(s) is signal.SIG_IGN]
            request = json.dumps({"argv": args[1:], "env": dict(env), "cwd": str(cwd), "ignored": ignored}).encode()
            request += b"\n"
            socket.send_fds(conn, [request], [out_write, err_write])
        finally:
            os.close(out_write)
            os.close(err_write)
        with conn, conn.makefile("rb") as reply:
            pid = int(reply.readline())
            deadline = time.monotonic() + timeout
            stdout, stderr = _read_both(out_read, err_read, deadline)
            conn.settimeout(max(deadline - time.monotonic(), 1))
            try:
                if stdout is None or stderr is None:  # its pipes still open at the deadline
                    raise TimeoutError
                status = int(reply.readline())
            except (TimeoutError, ValueError):
                os.kill(pid, signal.SIGKILL)  # as subprocess.run does on its timeout
                raise subprocess.TimeoutExpired(args, timeout, stdout, stderr) from None
        return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(status), stdout, stderr)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)


def _read_both(out_fd: int, err_fd: int, deadline: float) -> tuple[Optional[str], Optional[str]]:
    """Both pipes read to their end (as Popen.communicate does), or (None, None) past the deadline; both descriptors
    are closed either way."""
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                for fd in chunks:
                    os.close(fd)
                return None, None
            for key, _ in selector.select(left):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
                    os.close(key.fd)
    return tuple(b"".join(chunks[fd]).decode(errors="replace") for fd in (out_fd, err_fd))  # type: ignore


# ------------------------------------------------------------------------------------------- the warm process
# A run's exit status, set in its own process once run.py has ended (not for Ctrl-C): see the module's docstring.
_EXIT_STATUS: list[int] = []
_ADDRESS: list[str] = []  # the warm process's socket


def _exit_without_teardown() -> None:
    """The atexit hook registered first, so run last: after the run's threads were joined and every other hook
    ran, flush the streams as the interpreter would and end the process with the run's status."""
    if not _EXIT_STATUS:
        return
    status = _EXIT_STATUS[0]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = 120  # the interpreter's own status when its final flush fails
    os._exit(status)


def _serve(address: str) -> None:
    import gc
    import importlib
    import threading

    atexit.register(_exit_without_teardown)  # before any import registers one of its own: so it runs last
    _ADDRESS.append(address)
    # As `python run.py` has it: the script's folder (the repository) first, where `framework` is.
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    for name in PRELOAD:
        importlib.import_module(name)
    # A fork copies only the thread that forks: nothing may run beside it (Python's threads, or native ones such as
    # an OpenMP pool, which /proc lists).
    native = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threading.active_count() != 1 or native != 1:
        raise RuntimeError(f"threads after the imports: {threading.enumerate()}, {native} native")
    # Everything imported so far is moved out of the collector's reach, as Python's gc docs advise before fork()
    # without exec(): otherwise each run's exit (the interpreter's final collections and teardown) writes to every
    # object the imports made, copying their pages one by one: 1.8 s of every run, against 0.4 s frozen.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(8)
    os.rename(address + ".tmp", address)  # the client waits for the name: it appears once we listen
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    started_with = {key: os.environ.get(key) for key in STARTUP_ENV}
    while True:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 256)
        request = json.loads(message)
        if "fds" in request and any(request["env"].get(k) != v for k, v in started_with.items()):
            conn.sendall(b"cold\n")  # a spawned process this warm one cannot stand for: it starts fresh
        elif os.fork() == 0:  # the reaper
            listener.close()
            pid = os.fork()
            if pid == 0:
                conn.close()
                (_become_spawned if "fds" in request else _become_run)(request, fds)
                return  # only reached by the run's own process, which returns into here to exit
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            conn.sendall(f"{_wait_for(pid, conn)}\n".encode())
            os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)
        while True:  # reap the reapers that are done
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def _take_over(request: dict) -> None:
    """The client's stop signals (as a fresh interpreter started by it would have them: those it ignores ignored),
    environment and working directory."""
    for sig in STOP_SIGNALS:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if int(sig) in request["ignored"] else default)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])


def _sitecustomize(extra: list[str]) -> None:
    """What `site` does at start-up: import the first `sitecustomize` on the path (a test's kill hook, say)."""
    import importlib.util

    found = next((Path(folder, "sitecustomize.py") for folder in extra if Path(folder, "sitecustomize.py").exists()),
                 None)
    if found is not None:
        spec = importlib.util.spec_from_file_location("sitecustomize", found)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


def _fresh_streams() -> None:
    """Fresh text streams over descriptors 0, 1 and 2, as the interpreter makes them at start-up: with
    PYTHONUNBUFFERED (in the run's environment, now this process's), stdout and stderr write through."""
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), errors="backslashreplace",
                                      write_through=True)
    else:
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.stdin = open(0, "r", closefd=False)


def _wait_for(pid: int, conn: socket.socket) -> int:
    """The run's wait status. Should its client go first (a spawned process's stand-in SIGKILLed by its parent's
    process context), the run is killed, as that process would have been."""
    pidfd = os.pidfd_open(pid)
    with selectors.DefaultSelector() as selector:
        selector.register(pidfd, selectors.EVENT_READ)  # readable once the run has ended
        selector.register(conn, selectors.EVENT_READ)  # readable only once the client has closed its end
        if all(key.fileobj is conn for key, _ in selector.select()):
            os.kill(pid, signal.SIGKILL)
    os.close(pidfd)
    return os.waitpid(pid, 0)[1]


def _become_run(request: dict, fds: list[int]) -> None:
    """In the forked child: the run's standard streams, environment, working directory, path, argv and
    sitecustomize, then run.py as `__main__`; its SystemExit (or none) ends this interpreter as it would end
    `python run.py`."""
    import multiprocessing.spawn
    import runpy

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    _take_over(request)
    argv = request["argv"]
    as_module = argv[1] if argv[0] == "-m" else None  # `python -m MODULE ...`: the working directory heads the path
    script = None if as_module else os.path.abspath(argv[0])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if as_module else os.path.dirname(script)  # type: ignore[arg-type]
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in extra and p != first]]
    sys.argv[:] = argv[1:] if as_module else argv  # run_module puts the module's file in argv[0], as -m does
    sys.orig_argv[:] = [sys.executable, *request["argv"]]  # the command line `python run.py ...` would have had
    _sitecustomize(extra)
    _fresh_streams()
    # The processes this run spawns (torch.multiprocessing's DDP workers) are forked from here too (_as_spawned).
    multiprocessing.spawn.set_executable(os.path.join(os.path.dirname(_ADDRESS[0]), SPAWNED_EXECUTABLE))
    try:
        if as_module:
            # A fresh `python -m framework export` imports its package, then runs the module as __main__ only: a copy
            # the warm process imported would make runpy warn of "unpredictable behaviour", which no real run prints.
            sys.modules.pop(as_module, None)
            runpy.run_module(as_module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:  # raised on: the interpreter prints a code that is not a number, as for `python`
        code = stop.code
        _EXIT_STATUS.append(0 if code is None else code if isinstance(code, int) else 1)
        raise
    except KeyboardInterrupt:
        raise  # the interpreter ends the process by SIGINT itself, after its whole exit
    except BaseException:
        _EXIT_STATUS.append(1)  # its traceback is printed by the interpreter, as for `python run.py`
        raise
    else:
        _EXIT_STATUS.append(0)


# ---------------------------------------------------------------------------------- spawned processes of a run
# multiprocessing's spawn start method (torch.multiprocessing's, for parallel=ddp and fsdp) starts
# `python -c "from multiprocessing.spawn import spawn_main; spawn_main(...)" --multiprocessing-fork`, handing over
# the descriptors it names. A run forked from the warm process has that executable set to a script beside the
# socket, which runs _as_spawned: a stand-in that hands its descriptors, environment and signal mask to the warm
# process, which forks the real process from itself (each one skips ~2 CPU-s of imports), then forwards every stop
# signal to it and ends as it ended. Should the stand-in be SIGKILLed, the warm process kills the real one.
def _as_spawned(address: str, python: str, args: list[str]) -> None:
    inherited = sorted(int(name) for name in os.listdir("/proc/self/fd"))
    inherited = [fd for fd in inherited if _is_open(fd)]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    # Before `-c`: the interpreter flags multiprocessing copies from the run's interpreter (-B where
    # PYTHONDONTWRITEBYTECODE is set, -W, -X): the warm process's own, which the run was forked from.
    if "-c" not in args or args.index("-c") + 1 >= len(args):
        os.execv(python, [python, *args])
    args = args[args.index("-c") :]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
    except OSError:  # the warm process has ended
        os.execv(python, [python, *args])
    ignored = [int(s) for s in STOP_SIGNALS if signal.getsignal(s) is signal.SIG_IGN]
    request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "ignored": ignored, "fds": inherited,
               "mask": [int(s) for s in mask]}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], inherited)
    with conn.makefile("rb") as reply:
        first = reply.readline()
        if first == b"cold\n":
            os.execv(python, [python, *args])
        for fd in inherited:
            if fd > 2:  # the pipes multiprocessing watches: held by the real process alone
                os.close(fd)
        pid = int(first)
        forwarded = [s for s in STOP_SIGNALS if int(s) not in ignored]
        for sig in forwarded:
            signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)  # what came while it started: forwarded now
        status = int(reply.readline())
    if os.WIFSIGNALED(status):  # ended by a signal: so is its stand-in
        died_of = os.WTERMSIG(status)
        if died_of not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(died_of, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [died_of])
        os.kill(os.getpid(), died_of)
    os._exit(os.waitstatus_to_exitcode(status))


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it has just ended: its status is on its way
        pass


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _become_spawned(request: dict, fds: list[int]) -> None:
    """In the forked child: the stand-in's descriptors at their own numbers, its signal mask, environment and
    working directory, then `python -c PROGRAM`'s path, argv and __main__, and the program. Its exit is the whole
    interpreter's (a DDP worker's process group ends there)."""
    import fcntl
    import types

    above = max([*request["fds"], *fds]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]  # out of the way of the numbers they go to
    for fd in fds:
        os.close(fd)
    for old, number in zip(moved, request["fds"]):
        os.dup2(old, number)
        os.close(old)
    _take_over(request)
    signal.pthread_sigmask(signal.SIG_SETMASK, [signal.Signals(s) for s in request["mask"]])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ["", *extra, *[p for p in sys.path[1:] if p not in extra]]
    program, *rest = request["argv"][1:]
    sys.argv[:] = ["-c", *rest]
    sys.orig_argv[:] = [sys.executable, *request["argv"]]
    _sitecustomize(extra)
    _fresh_streams()
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(program, "<string>", "exec"), main.__dict__)


if __name__ == "__main__":
    if sys.argv[1] == "--spawned":
        _as_spawned(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        _serve(sys.argv[1])
