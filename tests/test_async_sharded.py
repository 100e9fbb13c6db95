"""Sharded checkpoints saved in the background (parallel=fsdp with checkpoint.async_save, the default): a run SIGKILLed
in the middle of one, on the writer thread, leaves only that save's `NAME.tmp/` and resumes from the newest intact
checkpoint before it, ending bit-identical to a run never interrupted; a save in the background writes what an
inline one does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import KILLHOOK, on_pythonpath, output, run_cli
from safetensors.torch import load_file

from framework.checkpoint.format import shard_files

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.distributed]

RUN = ("parallel=fsdp", "model.hidden=[32,16]", "model.dropout=0.2", "optimizer=adamw", "trainer.max_steps=12",
       "trainer.limit_train_batches=6", "trainer.test=false", "data.batch_size=16", "checkpoint.every_n_steps=4",
       "checkpoint.keep_last=-1", "logger.progress_bar=false", "trainer.limit_val_batches=1")
ENV = {"OMP_NUM_THREADS": "1"}


def shard_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {f"{name}:{key}": value for name in shard_files(2)
            for key, value in load_file(str(checkpoint / name)).items()}


def test_a_kill_during_a_background_sharded_save_resumes_from_the_previous_checkpoint(tmp_path):
    whole = tmp_path / "whole"
    proc = run_cli(whole, *RUN, "checkpoint.async_save=false", fast=False, env=ENV)  # inline saves: the reference
    assert proc.returncode == 0, output(proc)
    killed = tmp_path / "killed"
    # Rank 0 dies as its writer thread reads back its first file of step-8 (written, not yet committed).
    pattern = f"{killed}/checkpoints/step-8.tmp/model-rank0-of2.safetensors"
    kill = {"PYTHONPATH": on_pythonpath(KILLHOOK), "KILL_ON_OPEN": pattern}
    proc = run_cli(killed, *RUN, fast=False, env={**ENV, **kill})
    assert proc.returncode != 0, output(proc)
    folder = killed / "checkpoints"
    assert (folder / "last" / "meta.json").exists() and (folder / "step-8.tmp").is_dir()
    assert not (folder / "step-8").exists() and not (folder / "step-8.tmp" / "meta.json").exists()
    resumed = run_cli(None, f"resume={killed}", fast=False, env=ENV)
    assert resumed.returncode == 0, output(resumed)
    assert "checkpoints/last at step 6 (" in output(resumed)  # the newest intact one: the epoch's end
    for name in ("step-8", "last"):  # the background saves wrote what the inline ones did, bit for bit
        ours, theirs = shard_tensors(folder / name), shard_tensors(whole / "checkpoints" / name)
        assert ours.keys() == theirs.keys()
        different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
        assert not different, f"{name} not bit-identical: {different[:5]}"
