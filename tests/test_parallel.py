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
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, output, start_ranks
from safetensors.torch import load_file, save_file

from framework.app.launch import _host_store
from framework.loop.trainer import Trainer
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
    proc = _cli(tmp_path, sys.executable, str(ROOT / "run.py"), "parallel=ddp", "parallel.timeout_s=60",
                "task._target_=test_parallel.ExplodingTask", *QUICK, timeout=120,
                env={"PYTHONPATH": str(Path(__file__).parent)})
    assert proc.returncode != 0
    assert output(proc).count("boom on rank 1") >= 1 and "Done in" not in output(proc)


@pytest.mark.slow
def test_a_config_error_under_ddp_is_printed_once_without_traceback(tmp_path):
    proc = _cli(tmp_path, sys.executable, str(ROOT / "run.py"), "parallel=ddp", "+optimizer.momentm=0.9", *QUICK,
                timeout=120)
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
