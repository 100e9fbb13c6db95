"""trainer.compile end to end: the model is compiled in place (its keys stay plain), no checkpoint holds torch.compile's
`_orig_mod.` (and one that does, old or foreign, still loads), a compiled run's checkpoint loads into an uncompiled
run and back, recompilations are counted in summary.json, a compiled run stopped midway resumes bit-identical, and
compile works under DDP, FSDP, AMP (bf16 autocast on the CPU) and activation checkpointing.

Compiling on the CPU runs inductor's C++ code generation (a C++ compiler must be on PATH): the runs here are the
smallest that prove each promise, and `slow`."""
from __future__ import annotations

import json
import logging
import shutil
from typing import Any

import pytest
import torch
from conftest import assert_identical, final_state, output, run_cli
from safetensors.torch import load_file, save_file
from torch import nn

from framework.app.stage import run_stage
from framework.checkpoint import load_weights, open_checkpoint, write_checkpoint
from framework.checkpoint.state import Progress, TrainingState
from framework.checkpoint.weights import accept_plain_keys, check_compatible
from framework.loop.trainer import Trainer
from framework.task.classification import ClassificationTask

pytestmark = pytest.mark.unit  # the compiled runs below are e2e: inductor runs the C++ compiler in a process

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("torch.compile on the CPU needs a C++ compiler (inductor)", allow_module_level=True)

TINY = ("logger.progress_bar=false", "trainer.limit_train_batches=6", "trainer.limit_val_batches=1",
        "trainer.test=false", "model.dropout=0.2")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# ---------------------------------------------------------------------------------------------- keys (no compiling)
def test_a_model_holding_a_compiled_block_saves_plain_keys_and_loads_them_back():
    """A model that compiles a block itself (torch.compile(block): keys with `_orig_mod.`, as Lightning #17415)."""
    torch.manual_seed(0)
    model = nn.Sequential(torch.compile(mlp()), nn.Linear(2, 2))  # compiled lazily: nothing runs here
    assert "0._orig_mod.0.weight" in model.state_dict()
    weights, _, _ = TrainingState(lambda: model, Progress(), {}, info={}).collect()
    assert "0.0.weight" in weights and not any("_orig_mod" in k for k in weights)

    accept_plain_keys(model)
    fresh = nn.Sequential(torch.compile(mlp()), nn.Linear(2, 2))
    accept_plain_keys(fresh)
    check_compatible(fresh, weights, "resume", strict=True)
    fresh.load_state_dict(weights)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_old_or_foreign_weights_with_orig_mod_keys_load_into_a_plain_model(tmp_path):
    torch.manual_seed(0)
    compiled = torch.compile(mlp())  # its state dict: _orig_mod.0.weight, ...
    save_file(compiled.state_dict(), tmp_path / "foreign.safetensors")
    torch.save({"state_dict": compiled.state_dict()}, tmp_path / "lightning.ckpt")
    plain = mlp()
    for path in (tmp_path / "foreign.safetensors", tmp_path / "lightning.ckpt"):
        weights = load_weights(path)
        assert set(weights) == set(plain.state_dict()), path
        plain.load_state_dict(weights)

    # A checkpoint written with them (by this framework before keys were made plain) reads back plain.
    write_checkpoint(tmp_path / "old", compiled.state_dict(), {}, {"step": 0, "epoch": 0, "batch_in_epoch": 0,
                                                                   "config": {}})
    assert set(open_checkpoint(tmp_path / "old").model_state()) == set(plain.state_dict())


# ---------------------------------------------------------------------------------------------- compiled runs
class CrashAt(ClassificationTask):
    """ClassificationTask whose training step number `crash_at` raises: a run that dies midway, in-process."""

    crash_at = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def training_step(self, batch: Any) -> Any:
        self.calls += 1
        if self.calls == self.crash_at:
            raise RuntimeError("killed midway")
        return super().training_step(batch)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_compiled_run_killed_midway_resumes_bit_identical_and_loads_uncompiled(compose, tmp_path, caplog):
    """Dropout makes the RNG matter; the kill comes after the step-4 checkpoint, which the resume starts from. Each
    run compiles afresh (torch.compiler.reset), as a process of its own would: none reuses another's graphs."""
    common = (*TINY, "task._target_=test_compile.CrashAt", "trainer.max_steps=8", "checkpoint.every_n_steps=4",
              "checkpoint.keep_last=-1", "checkpoint.save_last=true", "checkpoint.async_save=false")
    compiled = ("trainer.compile=true", *common)
    (tmp_path / "whole").mkdir()
    with caplog.at_level(logging.INFO, logger="framework.observe.compile_report"):
        torch.compiler.reset()
        summary = Trainer(compose(*compiled), tmp_path / "whole").fit()
    assert summary["compile"]["compilations"] >= 2  # the evaluation's graph (no grad) and training's
    assert summary["compile"]["recompiles"] == summary["compile"]["compilations"] - 1  # one code object: forward
    recompiled = [r.getMessage() for r in caplog.records if "trainer.compile: recompiled forward" in r.getMessage()]
    assert len(recompiled) == summary["compile"]["recompiles"]  # each one logged, with its reason

    killed_dir = tmp_path / "killed"
    killed_dir.mkdir()
    CrashAt.crash_at = 7
    torch.compiler.reset()
    try:
        with pytest.raises(RuntimeError, match="killed midway"):
            Trainer(compose(*compiled), killed_dir).fit()
    finally:
        CrashAt.crash_at = 0
    resume_from = open_checkpoint(killed_dir / "checkpoints" / "step-4")
    torch.compiler.reset()
    Trainer(compose(*compiled), killed_dir, resume_from=resume_from).fit()
    assert_identical(final_state(tmp_path / "whole"), final_state(killed_dir))
    weights = load_file(str(killed_dir / "checkpoints" / "last" / "model.safetensors"))
    assert weights and not any("_orig_mod" in k for k in weights)

    # The compiled run's checkpoint, uncompiled: resumed, and evaluated (`validate ckpt=`) to the same metrics.
    (tmp_path / "plain").mkdir()
    plain = Trainer(compose(*common), tmp_path / "plain", resume_from=open_checkpoint(tmp_path / "whole" /
                                                                                        "checkpoints" / "step-4"))
    assert not hasattr(plain.run.module, "_compiled_call_impl") or plain.run.module._compiled_call_impl is None
    assert plain.fit()["step"] == 8  # (its dropout draws eager's random numbers, not inductor's: no comparison)
    (tmp_path / "val").mkdir()
    last = open_checkpoint(tmp_path / "whole" / "checkpoints" / "last")
    val = run_stage(compose(*TINY, "stage=validate", f"ckpt={last.path}"), tmp_path / "val", last)
    assert val["val/loss"] == pytest.approx(json.loads((tmp_path / "whole" / "summary.json").read_text())["val/loss"],
                                            rel=1e-5)

    # ... and back: the uncompiled run's checkpoint starts a compiled one (init_from=).
    (tmp_path / "back").mkdir()
    torch.compiler.reset()
    back = Trainer(compose(*compiled, f"init_from={tmp_path / 'plain' / 'checkpoints' / 'last'}",
                           "trainer.max_steps=1"), tmp_path / "back")
    loaded = back.run.module.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in open_checkpoint(tmp_path / "plain" / "checkpoints" /
                                                                       "last").model_state().items())
    assert back.fit()["compile"]["compilations"] >= 1


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", [
    pytest.param(("parallel=ddp", "precision=bf16"), id="ddp-bf16"),
    pytest.param(("parallel=fsdp", "parallel.activation_checkpointing=full"), id="fsdp-activation_checkpointing"),
])
def test_compiled_runs_train_under_ddp_fsdp_amp_and_activation_checkpointing(tmp_path, strategy):
    proc = run_cli(tmp_path, *strategy, "parallel.devices=2", "trainer.compile=true", "trainer.max_epochs=1",
                   "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.test=false",
                   "checkpoint.save_last=true", env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, output(proc)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 3 and summary["compile"]["compilations"] >= 1
    keys = open_checkpoint(tmp_path / "checkpoints" / "last").model_state()
    assert keys and not any("_orig_mod" in k for k in keys)
