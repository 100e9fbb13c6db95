"""Exact resume: a run killed at any instant and resumed ends with the same weights, bit for bit on CPU,
as a run never interrupted. The kill comes from inside the run, at a chosen training step, so the test
is deterministic: SIGKILL (nothing can be saved; the periodic checkpoint before it is the resume point)
or SIGTERM (checkpoint.on_signal saves `last` at that exact mid-epoch position)."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import output, read_scalars, run_cli
from framework.task import ClassificationTask, StepOutput

TESTS = str(Path(__file__).parent)


class SelfSignalTask(ClassificationTask):
    """Plain classification, except that training step number $KILL_AT sends $KILL_SIGNAL to $KILL_PID
    (default: this process). Without $KILL_AT it is exactly ClassificationTask."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def training_step(self, batch: Any) -> StepOutput:
        self.calls += 1
        if str(self.calls) == os.environ.get("KILL_AT") and os.environ.get("RANK", "0") == "0":
            target = os.getppid() if os.environ.get("KILL_PID") == "parent" else os.getpid()
            os.kill(target, getattr(signal, os.environ["KILL_SIGNAL"]))
        return super().training_step(batch)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    last = run_dir / "checkpoints" / "last"
    return {**load_file(str(last / "model.safetensors")),
            **{f"state:{k}": v for k, v in load_file(str(last / "state.safetensors")).items()
               if k.startswith("/optimizer")}}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bit-identical: {different[:5]}"


def scenario(tmp_path: Path, *overrides: str, kill_at: int, kill_signal: str, kill_pid: str = "self"):
    # Dropout makes the global RNG matter: a resume that did not restore it would diverge.
    common = ("task._target_=test_resume.SelfSignalTask", "trainer.log_every_n_steps=10", "model.dropout=0.2",
              *overrides)
    env = {"PYTHONPATH": TESTS}
    whole = run_cli(tmp_path / "whole", *common, env=env)
    assert whole.returncode == 0, output(whole)
    killed_dir = tmp_path / "killed"
    killed = run_cli(killed_dir, *common, env={**env, "KILL_AT": str(kill_at), "KILL_SIGNAL": kill_signal,
                                                "KILL_PID": kill_pid})
    resumed = run_cli(None, f"resume={killed_dir}", env=env, fast=False)  # continues in killed_dir itself
    assert resumed.returncode == 0, output(resumed)
    assert_identical(final_state(tmp_path / "whole"), final_state(killed_dir))
    return whole, killed, resumed, killed_dir


def test_sigkill_after_a_periodic_checkpoint_resumes_bit_exact(tmp_path):
    whole, killed, resumed, run_dir = scenario(
        tmp_path, "trainer.max_steps=70", "checkpoint.every_n_steps=25", "checkpoint.keep_last=-1",
        kill_at=37, kill_signal="SIGKILL")
    assert killed.returncode == -signal.SIGKILL
    assert "Resumed from" in output(resumed) and "at step 25 (epoch 1, batch 5)" in output(resumed)
    assert (run_dir / "checkpoints" / "step-25").is_dir()  # keep_last=-1 keeps every periodic one
    # One TensorBoard run, no duplicated steps: what the killed run logged after step 25 was purged.
    steps = [s for s, _ in read_scalars(run_dir)["train/loss"]]
    assert steps == [10, 20, 30, 40, 50, 60, 70]
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 70


def test_sigterm_mid_epoch_with_worker_processes_saves_last_and_resumes_bit_exact(tmp_path):
    whole, killed, resumed, run_dir = scenario(
        tmp_path, "trainer.max_epochs=3", "data.num_workers=2", "data.persistent_workers=true",
        kill_at=33, kill_signal="SIGTERM")
    assert killed.returncode == 128 + signal.SIGTERM, output(killed)
    assert "Stopped by SIGTERM at step 33 (epoch 1, batch 13)" in output(killed)
    assert "Traceback" not in output(killed)


def test_ddp_sigterm_resumes_bit_exact(tmp_path):
    whole, killed, resumed, run_dir = scenario(
        tmp_path, "parallel=ddp", "trainer.max_epochs=2", kill_at=15, kill_signal="SIGTERM", kill_pid="parent")
    assert killed.returncode == 128 + signal.SIGTERM, output(killed)
    assert output(killed).count("Stopped by SIGTERM") == 1
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
