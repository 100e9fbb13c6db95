"""DDP on CPU with real gloo process groups: gradient averaging, exact metric reduction on uneven shards,
both launch ways leaving one run directory, and a failing rank ending the job without a hang."""
from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import socket
import subprocess
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, TESTS, on_pythonpath, output, run_cli, run_env, start_ranks
from safetensors.torch import load_file, save_file

from framework.app.launch import _host_store
from framework.loop.trainer import Trainer
from framework.loop.view import RunView
from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))

if os.environ.get("RECORD_DIR"):  # which processes import this module: a spawned one must, a forked one need not
    (Path(os.environ["RECORD_DIR"]) / f"imported-{os.getpid()}").touch()


class RecordingSamples(torch.utils.data.Dataset):
    """Digits-shaped samples that note which process served them (in $RECORD_DIR). Takes the digits preset's
    keys, so that only `_target_` needs overriding."""

    def __init__(self, size: int = 96, **_digits_options: Any) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Any:
        (Path(os.environ["RECORD_DIR"]) / f"served-{os.getpid()}").touch()
        return torch.full((1, 8, 8), i / self.size), i % 10


def _ddp_worker(rank: int, world: int, port: int, cfg: Any, run_dir: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")  # served by run_ddp, as spawn does
    trainer = Trainer(cfg, run_dir)
    trainer.fit()
    if rank == 0:
        save_file(trainer.run.strategy.unwrap(trainer.run.task.model).state_dict(), str(run_dir / "weights.safetensors"))


def run_ddp(cfg: Any, run_dir: Path, world: int = 2) -> dict[str, torch.Tensor]:
    run_dir.mkdir(parents=True, exist_ok=True)
    store = _host_store(world)
    start_ranks(_ddp_worker, (world, store.port, cfg, run_dir), nprocs=world)
    return load_file(str(run_dir / "weights.safetensors"))


def job_cfg(compose, *overrides: str):
    from omegaconf import OmegaConf

    cfg = compose("logger.progress_bar=false", "trainer.test=false", *overrides)
    OmegaConf.resolve(cfg)  # spawned workers have no HydraConfig to resolve `${hydra:...}` with
    return cfg


def test_two_processes_with_batch_b_match_one_process_with_batch_2b(compose, tmp_path):
    common = ("trainer.max_steps=8", "trainer.limit_val_batches=1")
    ddp = run_ddp(job_cfg(compose, "parallel=ddp", "data.batch_size=32", *common), tmp_path / "ddp")
    single = Trainer(job_cfg(compose, "data.batch_size=64", *common), tmp_path / "single")
    single.fit()
    expected = single.run.task.model.state_dict()
    assert set(ddp) == set(expected)  # unwrapped: no `module.` prefix
    for name, value in expected.items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-5, atol=1e-6)


def test_validation_metrics_are_exact_over_uneven_shards(compose, tmp_path):
    # 271 validation images: shards of 136 and 135, in batches of 50 (uneven counts and batch sizes)
    shape = ("data.train.val_fraction=0.151", "data.eval_batch_size=50", "trainer.max_steps=5")
    weights = run_ddp(job_cfg(compose, "parallel=ddp", *shape), tmp_path / "ddp")
    reported = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    single = Trainer(job_cfg(compose, *shape), tmp_path / "single")
    assert len(single.run.data.datasets["val"]) == 271
    single.run.task.model.load_state_dict(weights)
    local = single.run.evaluator.run("val", 0)
    assert reported["val/acc"] == pytest.approx(local["val/acc"], abs=1e-7)
    assert reported["val/loss"] == pytest.approx(local["val/loss"], rel=1e-5)
    assert reported["world_size"] == 2


def test_a_second_validation_sets_metrics_are_exact_over_uneven_shards(compose, tmp_path):
    # val: 271 images; the second set (`held`, the test split at 0.1005): 181, shards of 91 and 90, batches of 50
    shape = ("data.train.val_fraction=0.151", "data.train.test_fraction=0.1005", "data.eval_batch_size=50",
             "trainer.max_steps=5", "+data.val_sets.held={_target_: framework.zoo.datasets.digits, split: test, "
             "val_fraction: ${data.train.val_fraction}, test_fraction: ${data.train.test_fraction}}")
    weights = run_ddp(job_cfg(compose, "parallel=ddp", *shape), tmp_path / "ddp")
    reported = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    single = Trainer(job_cfg(compose, *shape), tmp_path / "single")
    assert len(single.run.data.datasets["val_sets.held"]) == 181
    single.run.task.model.load_state_dict(weights)
    local = single.run.evaluator.run("val", 0)
    for name in ("val/acc", "val/acc/held"):
        assert reported[name] == pytest.approx(local[name], abs=1e-7)
    for name in ("val/loss", "val/loss/held"):
        assert reported[name] == pytest.approx(local[name], rel=1e-5)
    assert reported["val/loss/held"] != reported["val/loss"] and reported["world_size"] == 2


def _run_dirs(cwd: Path) -> list[Path]:
    return [p for p in (cwd / "outputs").glob("*/*") if p.is_dir()]


def _cli(cwd: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None):
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update(env or {})
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


QUICK = ("logger.progress_bar=false", "trainer.max_epochs=2", "trainer.limit_train_batches=4")


def test_spawned_ddp_leaves_one_run_directory(tmp_path):
    proc = _cli(tmp_path, sys.executable, str(ROOT / "run.py"), "parallel=ddp", *QUICK)
    assert proc.returncode == 0, output(proc)
    (run_dir,) = _run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 8
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert output(proc).count("Done in") == 1  # only rank 0 reports


def test_dataloader_workers_of_spawned_ddp_workers_are_forked_as_under_torchrun(tmp_path):
    """A spawned process inherits "spawn" as its default start method, so each DataLoader worker of a DDP worker
    started a new interpreter and imported torch and the dataset's module again: 3 epochs of digits with 2
    non-persistent workers took 32.6 s instead of 1.5 s. They are forked now, as under torchrun: no DataLoader
    worker imports this module again."""
    record = tmp_path / "record"
    record.mkdir()
    proc = _cli(tmp_path, sys.executable, str(ROOT / "run.py"), "parallel=ddp", *QUICK, "data.num_workers=2",
                "data.persistent_workers=false", "trainer.test=false",
                *(f"data.{split}._target_=test_parallel.RecordingSamples" for split in ("train", "val")),
                env={"RECORD_DIR": str(record), "PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 0, output(proc)
    imported = {p.name.split("-")[1] for p in record.glob("imported-*")}
    served = {p.name.split("-")[1] for p in record.glob("served-*")}
    assert len(imported) == 2, (imported, served)  # the two DDP workers, which build the datasets
    assert len(served - imported) >= 4, (imported, served)  # 2 per DDP worker, restarted every epoch
    assert not served & imported, "the batches came from the DataLoader workers"


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed next to this python")
def test_torchrun_leaves_one_run_directory(tmp_path):
    proc = _cli(tmp_path, TORCHRUN, "--standalone", "--nproc-per-node=2", str(ROOT / "run.py"), "parallel=ddp",
                *QUICK)
    assert proc.returncode == 0, output(proc)
    (run_dir,) = _run_dirs(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert not (tmp_path / ".hydra").exists() and not (tmp_path / "run.log").exists()
    assert output(proc).count("Done in") == 1


class ExplodingTask(ClassificationTask):
    """Rank 1 raises on its third training step; rank 0 is by then waiting in an all-reduce."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def training_step(self, batch: Any) -> StepOutput:
        self.calls += 1
        if self.calls == 3 and os.environ.get("RANK") == "1":
            raise RuntimeError("boom on rank 1")
        return super().training_step(batch)


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_without_a_hang(tmp_path):
    proc = run_cli(tmp_path / "run", "parallel=ddp", "parallel.timeout_s=60",
                   "task._target_=test_parallel.ExplodingTask", *QUICK, timeout=120, env={"PYTHONPATH": str(TESTS)})
    assert proc.returncode != 0
    assert output(proc).count("boom on rank 1") >= 1 and "Done in" not in output(proc)


@pytest.mark.slow
def test_a_config_error_under_ddp_is_printed_once_without_traceback(tmp_path):
    proc = run_cli(tmp_path / "run", "parallel=ddp", "+optimizer.momentm=0.9", *QUICK, timeout=120)
    assert proc.returncode == 1
    assert output(proc).count("Error:") == 1 and "momentm" in output(proc) and "Traceback" not in output(proc)


@pytest.mark.unit
def test_the_workers_store_is_served_before_they_start_so_no_other_process_can_take_its_port():
    """spawn() used to find a free port and let rank 0 bind it seconds later, once it had imported torch: a
    concurrent run, or another run's gloo connections, could take the port meanwhile. Now the parent serves the
    store on it from the start, and the workers join it as clients (every DDP test here goes through it)."""
    import torch.distributed as dist

    store = _host_store(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as rival:
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as taken:
            rival.bind(("127.0.0.1", store.port))
    assert taken.value.errno == errno.EADDRINUSE
    worker = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    worker.set("rank0/address", "here")
    assert store.get("rank0/address") == b"here"


class ProbeTask(ClassificationTask):
    """Classification that, at its first training step of the run (not pre-flight's, taken before the run watches
    for signals), writes what its process sees (the variable PROBE, its intra-op threads) to
    `probe_dir`/rank<RANK>.json, and waits `sleep_s` at every step."""

    def __init__(self, *args: Any, probe_dir: str = "", sleep_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.probe_dir, self.sleep_s = probe_dir, sleep_s

    def training_step(self, batch: Any) -> StepOutput:
        seen = Path(self.probe_dir, f"rank{os.environ.get('RANK', '0')}.json")
        if self.probe_dir and isinstance(self.trainer, RunView) and not seen.exists():
            seen.write_text(json.dumps({"probe": os.environ.get("PROBE"), "threads": torch.get_num_threads()}))
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return super().training_step(batch)


def test_workers_take_the_environment_threads_and_console_of_the_run_that_starts_them(tmp_path, monkeypatch):
    """The workers fork from a server that the first DDP run of this process started, with that moment's
    environment and stdout: a later run's workers see the later run's variables and OMP_NUM_THREADS, and print its
    summary where it is captured now."""
    for probe, threads in (("first", "1"), ("second", "2")):
        monkeypatch.setenv("PROBE", probe)
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        probes = tmp_path / probe
        probes.mkdir()
        proc = run_cli(tmp_path / f"run-{probe}", *QUICK, "parallel=ddp", "parallel.devices=2",
                       "task._target_=test_parallel.ProbeTask", f"+task.probe_dir={probes}", env={"PYTHONPATH": str(TESTS)})
        assert proc.returncode == 0, output(proc)
        assert proc.stdout.count("Done in") == 1 and f"Run directory: {tmp_path / f'run-{probe}'}" in proc.stdout
        seen = [json.loads((probes / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        assert seen == [{"probe": probe, "threads": int(threads)}] * 2, seen


def _ddp_job(tmp_path: Path, run: Path) -> subprocess.Popen:
    """`python run.py parallel=ddp` of slow steps, as a scheduler starts a job: a process group of its own."""
    args = [sys.executable, str(ROOT / "run.py"), f"hydra.run.dir={run}", "logger.progress_bar=false",
            "parallel=ddp", "parallel.devices=2", "trainer.max_epochs=-1", "trainer.max_steps=3000",
            "trainer.test=false", "task._target_=test_parallel.ProbeTask", f"+task.probe_dir={tmp_path}",
            "+task.sleep_s=0.01"]
    return subprocess.Popen(args, cwd=ROOT, env={**run_env(), "PYTHONPATH": on_pythonpath(TESTS)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _training(tmp_path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{rank}.json").exists() for rank in (0, 1)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_every_process_of_the_job_stops_a_ddp_run_once_with_last_saved(tmp_path, sig):
    """SLURM signals every process of a job step at once (the time limit's SIGTERM, `--signal=USR1`), as a
    terminal's Ctrl-C reaches its whole foreground group. Each worker has a session of its own, as torchrun's do, so
    only the parent gets it and forwards it once: before, a worker got it twice (from the kernel and its parent) and
    took the second for "abort", leaving no `last`; and the forkserver it forked from must not end either."""
    run = tmp_path / "run"
    proc = _ddp_job(tmp_path, run)
    _training(tmp_path, proc)
    os.killpg(proc.pid, getattr(signal, sig))
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + getattr(signal, sig), text
    assert text.count(f"Stopped by {sig} at step") == 1, text
    assert (run / "checkpoints" / "last" / "meta.json").is_file(), text


def test_workers_whose_parent_is_killed_save_last_and_end(tmp_path):
    """In sessions of their own, the workers no longer die with the parent's process group: when the parent ends
    first (SIGKILLed, or its terminal gone), they stop as on SIGTERM, saving `last`, instead of training on."""
    run = tmp_path / "run"
    proc = _ddp_job(tmp_path, run)
    _training(tmp_path, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    meta = run / "checkpoints" / "last" / "meta.json"
    deadline = time.monotonic() + 60
    while not meta.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert meta.is_file(), (run / "run.log").read_text()
    step = json.loads(meta.read_text())["step"]
    assert 0 < step < 3000
    assert "Received SIGTERM: finishing this step, then saving checkpoints/last" in (run / "run.log").read_text()
