"""Shared test helpers and the suite's tiers.

Tiers: every test is exactly one of `unit` (in this process, no subprocess: parts built directly, tiny runs of the
Trainer; `make test-fast`) or `e2e` (runs run.py, another process or a whole benchmark script), plus `distributed` (process groups: DDP,
FSDP, torchrun) and `slow` (over ~20 s on its own: kills and resumes, requeues, DDP/FSDP runs, the resume matrix)
where they apply. A module's `pytestmark` gives its tests' tier; a test's own `@pytest.mark.unit` or
`@pytest.mark.e2e` replaces it. A test with no tier is a collection error, so a new test cannot fall outside both,
and a unit test that starts a process fails.

Helpers: run the CLI's runs in this process through the Python API (framework.app.api), or in a process of its own
where the process is under test, and read its one error line; compose configs in-process; read
TensorBoard events and checkpoints, write small datasets in their official on-disk formats. Test modules import
them from here, never from each other."""
from __future__ import annotations

import atexit
import contextlib
import copy
import io
import logging
import hashlib
import importlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Small, quick settings for end-to-end runs; tests add their own overrides after these.
FAST = ("logger.progress_bar=false", "trainer.max_epochs=2")


def run_cli(run_dir: Path | None, *overrides: str, timeout: float = 180, env: dict[str, str] | None = None,
            fast: bool = True, process: bool = False) -> subprocess.CompletedProcess:
    """`python run.py OVERRIDES` as a user runs it, with its run directory at `run_dir` (None: let the config choose,
    as for resume=RUN_DIR), as a finished process: returncode, stdout (the closing summary) and stderr (the rest, an
    error line last). In this process: through the Python API (framework.app.api), or where the command line's own
    options are given (`-m`, `--cfg`, `-cd`) through its entry point (run_command_in_process); unless the run needs a
    process of its own: environment variables to set (a kill hook, a tracker's; not a PYTHONPATH alone, whose folders
    a run in this process imports from meanwhile), or `process=True` where the process is what the test looks at (its
    argv, Hydra's logging set-up, a lock another process holds, a signal). DDP and FSDP runs start their workers from
    here, as a Python program's would."""
    where = [f"hydra.run.dir={run_dir}"] if run_dir is not None else []
    args = [*where, *(FAST if fast else ()), *overrides]
    folders = _pythonpath_alone(env) if env is not None else []
    if process or folders is None:
        return run_process([sys.executable, str(ROOT / "run.py"), *args], env=env, timeout=timeout)
    with _importing_from(folders):
        return run_command_in_process(args) if any(arg.startswith("-") for arg in args) else run_in_process(args)


def _pythonpath_alone(env: dict[str, str]) -> list[str] | None:
    """The folders of `env`'s PYTHONPATH that this process does not import from yet, where `env` sets nothing else
    (a test's own task or callback, in tests/ or a folder it wrote); None where the run needs a process of its own:
    other variables, a folder with a `sitecustomize` (which only a new interpreter runs), or a module whose name
    this process has imported from elsewhere. OMP_NUM_THREADS=1, which this process and every run of the suite
    have (run_env), changes nothing. (Other variables this process has too, a tracker's, still take a process: the
    test may break what they configure, as the W&B tests kill wandb's service.)"""
    env = {name: value for name, value in env.items()
           if not (name == "OMP_NUM_THREADS" and os.environ.get(name) == value)}
    if not env:
        return []
    if set(env) != {"PYTHONPATH"}:
        return None
    folders = [folder for folder in env["PYTHONPATH"].split(os.pathsep) if folder and folder not in sys.path]
    modules = {path.stem for folder in folders for path in Path(folder).glob("*")
               if path.suffix == ".py" or (path / "__init__.py").exists()}
    if "sitecustomize" in modules or modules & sys.modules.keys():  # a module of that name imported already
        return None
    return folders


@contextlib.contextmanager
def _importing_from(folders: list[str]) -> Iterator[None]:
    """`folders` first on sys.path while a run imports from them, as its PYTHONPATH would put them; afterwards
    gone, with the modules imported from them (another test may write its own module of the same name)."""
    if not folders:
        yield
        return
    sys.path[:0] = folders
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for folder in folders:
            sys.path.remove(folder)
        roots = [Path(folder).resolve() for folder in folders]
        for name, module in list(sys.modules.items()):
            where = getattr(module, "__file__", None)
            if where and any(Path(where).resolve().is_relative_to(root) for root in roots):
                del sys.modules[name]


def run_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """The run through framework.app.api.run, its console captured as the command line prints it: the closing summary
    (logger framework.summary) as stdout, every other line as stderr, a mistake as its `Error: ` line and code 1.
    This process's stdout and stderr go to the same files meanwhile, which DDP workers write to (rank 0's summary
    and lines: framework/app/launch.py hands them the parent's console), so both keep the order they were written."""
    from framework.app import api
    from framework.app.launch import WorkerFailed
    from framework.core.errors import Interrupted, UserError, os_error_line

    with tempfile.TemporaryFile("a+") as out, tempfile.TemporaryFile("a+") as err, _console_to(out, err):
        summary, console = _StreamHandler(out), _StreamHandler(err)
        console.addFilter(lambda record: not record.name.startswith("framework.summary"))
        root, summary_log = logging.getLogger(), logging.getLogger("framework.summary")
        root.addHandler(console)
        summary_log.addHandler(summary)
        code = 0
        try:
            with contextlib.redirect_stdout(out):
                api.run(args)
        except Interrupted as stopped:
            err.write(f"{stopped}\n")
            code = 128 + stopped.signum
        except UserError as mistake:
            err.write(f"Error: {mistake}\n")
            code = 1
        except WorkerFailed as failed:
            err.write(f"Error: a worker process failed:\n{failed}\n")
            code = 1
        except OSError as failed:
            err.write(f"Error: {os_error_line(failed)}\n")
            code = 1
        finally:
            root.removeHandler(console)
            summary_log.removeHandler(summary)
        return subprocess.CompletedProcess(["run.py", *args], code, _read(out), _read(err))


def run_command_in_process(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python run.py ARGS` through the command line's own entry point (framework.app.cli.main) in this process, as
    an application's tests call its main: sys.argv set, the exit code from its SystemExit, stdout and stderr (file
    descriptors and Python's streams) captured, run from `cwd` (where relative paths such as Hydra's default
    `outputs/` start). For what the command line itself does, such as a sweep (`-m`) and its
    summary, where the process is not what the test looks at (a signal, a kill, the environment are). Afterwards this
    process's logging is as it was (Hydra configures the command's), and so are its environment variables (the
    command sets some for itself: HYDRA_FULL_ERROR, a cluster's ranks), sys.argv, sys.path and Hydra's global
    state."""
    from hydra.core.global_hydra import GlobalHydra

    from framework.app import cli

    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    with tempfile.TemporaryFile("a+") as out, tempfile.TemporaryFile("a+") as err, _logging_kept():
        code = 0
        sys.argv = [str(ROOT / "run.py"), *args]
        try:
            with _console_to(out, err), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                    contextlib.chdir(cwd):
                cli.main()
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            os.environ.clear()
            os.environ.update(saved_env)
            GlobalHydra.instance().clear()
        return subprocess.CompletedProcess(["run.py", *args], code, _read(out), _read(err))


def _read(stream: Any) -> str:
    """What a captured console's temporary file holds."""
    stream.flush()
    stream.seek(0)
    return stream.read()


@contextlib.contextmanager
def _logging_kept() -> Iterator[None]:
    """Every logger's handlers, level, propagation and disabled flag put back as they were (Hydra's dictConfig of a
    command's logging replaces them); loggers made meanwhile emptied."""
    manager = logging.Logger.manager
    loggers = [logging.root, *(lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    saved = {id(lg): (lg, lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in loggers}
    try:
        yield
    finally:
        for lg in [logging.root, *(lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger))]:
            if id(lg) in saved:
                _, handlers, level, propagate, disabled = saved[id(lg)]
            else:
                handlers, level, propagate, disabled = [], logging.NOTSET, True, False
            for handler in lg.handlers:
                if handler not in handlers:
                    handler.close()
            lg.handlers[:], lg.propagate, lg.disabled = handlers, propagate, disabled
            lg.setLevel(level)


@contextlib.contextmanager
def _console_to(out: Any, err: Any) -> Iterator[None]:
    """File descriptors 1 and 2 of this process on `out` and `err` (as pytest's capfd does), and back after."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, previous in zip((1, 2), saved):
            os.dup2(previous, fd)
            os.close(previous)


class _StreamHandler(logging.StreamHandler):
    """A console of the command line's: the message alone (conf/hydra/job_logging/framework.yaml's format)."""

    def __init__(self, stream: io.StringIO) -> None:
        super().__init__(stream)
        self.setFormatter(logging.Formatter("%(message)s"))


def run_export(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m framework export ARGS` from the checkout, as a finished process: in this process through the
    command's own entry point (framework.stages.export.main), its console captured, unless the test sets
    environment variables for it (a process of its own then)."""
    if env is not None:
        return run_process([sys.executable, "-m", "framework", "export", *args], env=env, timeout=120)
    from framework.stages.export import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(ROOT):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's usage errors
            code = exit.code if isinstance(exit.code, int) else 1
    return subprocess.CompletedProcess(["framework", "export", *args], code, out.getvalue(), err.getvalue())


def run_process(args: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None,
                timeout: float = 180) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True)` in run_env() updated with `env`: a real process, for
    what the process itself is under test."""
    full_env = {**run_env(), **(env or {})}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def run_env() -> dict[str, str]:
    """The environment of a test's run: this one's, less HYDRA_FULL_ERROR (a user's mistake is one line), with one
    intra-op thread per run: the suite runs two tests at once on two cores, and oversubscribed OpenMP threads spin
    (a ResNet-18 run took 37 CPU-s instead of 8). Runs compared with each other share it."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.setdefault("OMP_NUM_THREADS", "1")
    # A run that chooses logger=mlflow without a tracking_uri of its own (the resume matrix's) writes to this
    # process's scratch store, made once, not to a new mlflow.db beside each run directory (seconds to make each).
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{SCRATCH / 'mlflow.db'}")
    return env


# This pytest process's scratch folder for what runs would otherwise leave in the checkout; removed at its end.
SCRATCH = Path(tempfile.mkdtemp(prefix="htf-tests-"))
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{SCRATCH / 'mlflow.db'}")  # (the runs in this process)


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """A user's mistake as the entry point reports it: exit code 1, no traceback, and one `Error: ...` line, the
    last one printed (a run that had started logged its own lines before it). Returns that line; a test that
    also proves nothing else was printed compares it with the whole output."""
    text = output(proc)
    assert proc.returncode == 1, text
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error")]
    assert lines and errors == [lines[-1]] and errors[0].startswith("Error: "), text
    return errors[0]


@contextlib.contextmanager
def signal_after_step(at_step: int, signum: int) -> Iterator[None]:
    """This process sends itself `signum` right after its `at_step`-th optimizer step (torch's global optimizer-step
    post hook), as tests/killhook/ does in a process of its own: for a run in this process whose stop on a signal
    it catches (checkpoint.on_signal) is under test. An uncaught signal would end pytest's process: such a run stays
    in a process of its own."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0

    def after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        nonlocal steps
        steps += 1
        if steps == at_step:
            os.kill(os.getpid(), signum)

    handle = register_optimizer_step_post_hook(after_optimizer_step)
    try:
        yield
    finally:
        handle.remove()


TESTS = Path(__file__).resolve().parent
KILLHOOK = TESTS / "killhook"  # its sitecustomize.py sends $KILL_SIGNAL after optimizer step $KILL_AT_STEP


def on_pythonpath(*folders: Path) -> str:
    """A PYTHONPATH with `folders` first (a run imports a test's own classes, or the kill hook), then this one's."""
    return os.pathsep.join([*map(str, folders), *filter(None, [os.environ.get("PYTHONPATH")])])


_COMPOSED: dict[tuple[str, ...], Any] = {}  # this pytest process's composed configs, by their overrides


@pytest.fixture
def compose() -> Iterator:
    """compose(*overrides) -> the composed DictConfig, exactly as run.py would get it (Hydra's compose API)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import framework.app.main  # noqa: F401  (the resolvers conf/config.yaml uses)
    import framework.config.schema

    framework.config.schema.register()  # the schemas conf/ is composed against

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    def compose_job(*overrides: str):
        if overrides not in _COMPOSED:  # a copy of what the same overrides composed before (~10 ms against ~150)
            _COMPOSED[overrides] = hydra_compose(config_name="config", overrides=list(overrides),
                                                 return_hydra_config=True)
        cfg = copy.deepcopy(_COMPOSED[overrides])
        HydraConfig.instance().set_config(cfg)  # as Hydra does for a job: `${hydra:...}` resolves
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield compose_job


# The parallel settings a test's own spawned ranks build a strategy from: FSDP shards the LM's blocks.
RANK_PARALLEL = {"find_unused_parameters": False, "static_graph": False, "backend": None, "timeout_s": 60,
                 "shard_modules": ["torch.nn.TransformerEncoderLayer"], "reshard_after_forward": True,
                 "cpu_offload": False}


def start_ranks(worker: Any, args: tuple, nprocs: int = 2) -> None:
    """`worker(rank, *args)` in `nprocs` processes, waited for, as the framework starts its DDP workers
    (framework/app/launch.py): forked from multiprocessing's forkserver, which imports torch and the libraries once
    for every test of this pytest worker. A rank's failure is raised here (torch.multiprocessing's)."""
    import torch.multiprocessing as mp

    from framework.app.launch import PRELOAD, START_METHOD

    mp.set_forkserver_preload(list(PRELOAD))  # read as the server starts: by the first test of this pytest worker
    mp.start_processes(worker, args=args, nprocs=nprocs, start_method=START_METHOD)


def rank_queue() -> Any:
    """A queue that start_ranks' processes can put to."""
    import torch.multiprocessing as mp

    from framework.app.launch import START_METHOD

    return mp.get_context(START_METHOD).Queue()


def join_test_ranks(rank: int, port: int) -> None:
    """In a rank a test started itself (start_ranks, 2 processes): the environment torchrun would give it,
    one intra-op thread."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the run's TensorBoard event files, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def final_state(run_dir: Path) -> dict:
    """The last checkpoint's weights and optimizer, callback and task (torchmetrics states) tensors, whole (a
    sharded one's gathered): what an exact resume must reproduce bit for bit."""
    from framework.checkpoint import open_checkpoint
    from framework.checkpoint.format import flatten

    checkpoint = open_checkpoint(run_dir / "checkpoints" / "last")
    state: dict = {}
    flatten(checkpoint.state(), state)
    return {**checkpoint.model_state(),
            **{f"state:{k}": v for k, v in state.items() if k.startswith(("/optimizer", "/callbacks", "/task"))}}


def assert_identical(a: dict, b: dict) -> None:
    """The same tensor names, each bit-identical."""
    import torch

    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bit-identical: {different[:5]}"


def saved_config(run_dir: Path) -> dict:
    """The config the run's `last` checkpoint holds (what resume rebuilds the run from)."""
    return json.loads((run_dir / "checkpoints" / "last" / "meta.json").read_text())["config"]


def fingerprint(run_dir: Path) -> dict[str, str]:
    """Every file of a run (but its appended log and its lock) and its content hash."""
    from framework.app.rundir import LOCK_FILE

    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name not in ("run.log", LOCK_FILE)}


def replace(path: Path, data: bytes) -> None:
    """Rewrite a file as a new inode: checkpoints share files by hard links, and only this one is to change."""
    path.unlink()
    path.write_bytes(data)


def tiny_data(train: int = 12, val: int = 10, test: int = 10):
    """A DataModule of inputs 0..n-1 as one feature, label 0: val as they are, test +50 and train +100 (a batch
    tells its split); train in shuffled batches of 3, val and test in order in batches of 4 (4, 4, 2 for 10)."""
    import torch
    from torch.utils.data import TensorDataset

    from framework.data.module import DataModule

    def split(n: int, offset: float) -> TensorDataset:
        inputs = torch.arange(n, dtype=torch.float32).unsqueeze(1) + offset
        return TensorDataset(inputs, torch.zeros(n, dtype=torch.long))

    data = DataModule(split(train, 100.0), split(val, 0.0), split(test, 50.0), batch_size=3, eval_batch_size=4)
    data.setup(seed=0)
    return data


def view_for(task, logger, *, progress=None, stop=None, strategy=None, run_dir: Path | None = None,
             max_epochs: int = 1, max_steps: int = -1):
    """The run's view (what `task.trainer` and a callback's `trainer` are), built directly around a metric logger, set
    as the task's trainer."""
    import torch

    from framework.checkpoint.state import Progress
    from framework.loop.stop import Stop
    from framework.loop.view import RunView
    from framework.parallel.strategy import SingleDevice

    strategy = strategy or SingleDevice(torch.device("cpu"))
    model = getattr(task, "model", None) or torch.nn.Identity()
    from framework.optim.optimizers import Optimizers
    from framework.parallel.precision import Precision

    parts = types.SimpleNamespace(model=model, data=None, optimizers=Optimizers({}, single=False, frozen=[]),
                                  precision=Precision("fp32", torch.device("cpu")), scheduler=None)
    limits = types.SimpleNamespace(max_epochs=max_epochs, max_steps=max_steps, log_every_n_steps=1)
    view = RunView(parts, [], logger, progress or Progress(), stop or Stop(strategy, 0, 0), strategy, limits,
                   run_dir or Path("unused"))
    task.trainer = view
    return view


def evaluator_for(task, data, *, run_dir: Path | None = None, overfit: int = 0, val_batches: float = 1.0):
    """The run's parts around `task` on the CPU, built directly: its metric logger (TensorBoard in `run_dir`, none
    without one), the view its self.log goes through, and the Evaluator validation and test share."""
    import torch

    from framework.loop.evaluate import Evaluator
    from framework.observe.metric_logger import MetricLogger
    from framework.observe.tensorboard import TensorBoardLogger
    from framework.parallel.precision import Precision
    from framework.parallel.strategy import SingleDevice
    from framework.task.task import step_function

    cpu, strategy = torch.device("cpu"), SingleDevice(torch.device("cpu"))
    tensorboard = TensorBoardLogger(run_dir or Path("unused"), enabled=run_dir is not None)
    logger = MetricLogger(device=cpu, tensorboard=tensorboard, bar=None, run_dir=run_dir, accumulate=1,
                          steps_per_epoch=1)
    logger.attach(task)
    view_for(task, logger, strategy=strategy, run_dir=run_dir)
    step_fns = {m: step_function(task, m) for m in ("training_step", "validation_step", "test_step")}
    return Evaluator(task=task, model_attr="model", model=task.model, data=data, strategy=strategy,
                     precision=Precision("fp32", cpu), metric_logger=logger, step_fns=step_fns,
                     limits={"val": val_batches, "test": 1.0}, overfit=overfit)


def write_idx(path: Path, array: np.ndarray) -> None:
    """A uint8 idx file as MNIST ships it: big-endian magic 0x0803 (images) or 0x0801 (labels), dims, bytes."""
    assert array.dtype == np.uint8
    magic = {3: 2051, 1: 2049}[array.ndim]
    path.write_bytes(struct.pack(f">{1 + array.ndim}I", magic, *array.shape) + array.tobytes())


def make_mnist(root: Path, n_train: int = 40, n_test: int = 20) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Uncompressed idx files in <root>/MNIST/raw; returns {"train"|"test": (images, labels)} as written."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
        arrays[split] = images, labels
    return arrays


def make_cifar10(root: Path, per_batch: int = 8) -> dict[str, tuple[np.ndarray, list[int]]]:
    """The python version's pickles in <root>/cifar-10-batches-py: rows of 3072 bytes, R then G then B planes.

    The official files are Python 2 pickles whose keys load as `str` under the `encoding="latin1"` that
    torchvision uses (CIFAR's page writes b"data" because it loads them with encoding="bytes")."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        entry = {"batch_label": name, "labels": labels, "data": data,
                 "filenames": [f"{name}_{i}.png" for i in range(per_batch)]}
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
        batches[name] = data, labels
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                            "truck"], "num_cases_per_batch": per_batch, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return batches


def make_image_folder(root: Path, classes: dict[str, tuple[str, ...]], per_class: int = 3) -> None:
    """PNGs of mixed sizes and modes in <root>/<split>/<class>/, the layout torchvision's ImageFolder reads."""
    rng = np.random.default_rng(2)
    for split, names in classes.items():
        for name in names:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8)
                image = Image.fromarray(pixels)
                (image.convert("L") if i == 0 else image).save(folder / f"{i}.png")


# ---------------------------------------------------------------------------------------------- an S3 server
# A real S3 server on localhost for the tests of object storage (checkpoint.remote, shards at s3:// URLs): moto's
# server mode, as s3fs's own test suite runs it. A module using these skips itself where moto[server] or s3fs is
# missing (pip install -e '.[s3,dev]').
BUCKET = "htf-bucket"
KEY_ID, SECRET = "AKIATESTKEYID0000001", "test-secret-Zq8vR3kP9wXy"


class Moto:
    """moto's threaded server on 127.0.0.1, on a port of its own that it keeps when stopped and started again (its
    buckets and objects live in this process, so they outlive a stop)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, self.port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()


@pytest.fixture(scope="module")
def moto() -> Any:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request
    server = Moto()
    yield server
    server.stop()


@pytest.fixture
def s3(moto, monkeypatch, tmp_path) -> Any:
    """An empty bucket, credentials and the endpoint in the environment (as a user sets them), and s3fs to read with."""
    import requests
    import s3fs

    requests.post(f"{moto.endpoint}/moto-api/reset", timeout=10)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_ENDPOINT_URL": moto.endpoint, "AWS_EC2_METADATA_DISABLED": "true",
                        "XDG_CACHE_HOME": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(endpoint_url=moto.endpoint, skip_instance_cache=True, use_listings_cache=False)
    fs.mkdir(BUCKET)
    return fs


# ---------------------------------------------------------------------------------------------- tiers
TIERS = ("unit", "e2e")
MARKERS = {
    "unit": "in this process, no subprocess: parts built directly (make test-fast runs these)",
    "e2e": "runs run.py or another process (a subprocess, spawned workers, torchrun)",
    "distributed": "process groups: DDP, FSDP, torchrun (beside unit or e2e)",
    # Measured with -n 2 on 2 shared cores: a test whose slowest case (or whose module's shared run) took 24 s or more.
    "slow": "over ~20 s on its own, with the fixtures it needs (a kill and its resume, DDP/FSDP runs, requeues)",
    "waits": "mostly waits on a clock (a launcher's time limit), using little CPU: the suite starts it first",
}
# What starts a process (subprocess, os.fork: DataLoader workers, os.posix_spawn, os.system, os.exec*).
SPAWNS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec"}
_unit_test_running = {"id": ""}


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Each test leaves the stop signals' handlers as it found them: code a test runs in this process may ignore
    SIGINT (a DDP launcher's parent does), and every process started afterwards would inherit that."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                                                      signal.SIGUSR2)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    # Before the audit hook: torch's import runs `ldconfig -p` (cuda.pathfinder finding libdl), which the hook would
    # blame on whichever unit test imports torch first.
    import torch

    sys.addaudithook(_refuse_processes_in_unit_tests)
    # One intra-op thread, as run_cli gives its processes' runs: runs compared bit for bit (one in this process, its
    # resume in another) must share their thread count, since a matmul's sums are ordered by it. Under `-n 2` on two
    # cores, torch's default of one thread per core would also run four, whose OpenMP threads spin (the unit tier
    # took 69 s instead of 44 s). OMP_NUM_THREADS too: a run in this process sets its own count where it is unset.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _refuse_processes_in_unit_tests(event: str, args: tuple) -> None:
    if event in SPAWNS and _unit_test_running["id"]:
        raise RuntimeError(f"{_unit_test_running['id']} is marked unit but started a process ({event} "
                           f"{str(args[:1])[:80]}); mark it e2e")


def _tier(item: pytest.Item) -> str | None:
    """The closest node's tier mark (the test's, its class's, its module's); None when it has none, or two on one
    node."""
    for node in reversed(item.listchain()):
        found = {mark.name for mark in node.own_markers if mark.name in TIERS}
        if found:
            return found.pop() if len(found) == 1 else None
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets its one tier as its own mark, and its module's and class's tier marks are dropped, so that a
    test's own tier replaces its module's under -m, as it reads in the source."""
    tiers = {item: _tier(item) for item in items}
    untiered = [item.nodeid for item, tier in tiers.items() if tier is None]
    if untiered:
        raise pytest.UsageError(f"{len(untiered)} test(s) with no tier (or both): {', '.join(untiered[:5])}; "
                                "expected exactly one of @pytest.mark.unit (in this process, no subprocess) or "
                                "@pytest.mark.e2e (another process), on the test or its module's pytestmark")
    for node in {parent for item in items for parent in item.listchain()[:-1]}:
        node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in TIERS]
    for item, tier in tiers.items():
        item.own_markers[:] = [mark for mark in item.own_markers if mark.name not in TIERS]
        item.add_marker(tier)
    # The tests that mostly wait on a clock first: under pytest-xdist the other worker's tests fill their wait (last,
    # a submitit sweep waiting on its time limit kept one worker busy ~40 s after the other had finished). Not every
    # slow test: DDP and FSDP runs on both workers at once oversubscribe the cores (the suite took 22 s longer).
    items.sort(key=lambda item: item.get_closest_marker("waits") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A unit test (its fixtures' set-up included) that starts a process fails, naming what it started."""
    _unit_test_running["id"] = item.nodeid if item.get_closest_marker("unit") else ""
    try:
        yield
    finally:
        _unit_test_running["id"] = ""
