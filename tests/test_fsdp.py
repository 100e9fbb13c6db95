"""parallel=fsdp on CPU with real gloo process groups: training matches DDP, a run killed with SIGKILL and resumed
ends bit-identical to one never interrupted, sharded checkpoints (every rank its own files) are found intact or
skipped when a shard is damaged or missing, read back on another number of processes, and gathered whole by
export. The runs' MLP has a layer of width 1, so rank 1 owns nothing of its weight and bias; validation shards
of 136 and 135 samples in batches of 45 give the ranks 4 and 3 batches (rank 1 runs an empty one).

One uninterrupted run is shared by every test (module-scoped), to keep the file quick."""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import KILLHOOK, on_pythonpath, output, run_cli
from safetensors.torch import load_file

from framework.checkpoint import DamagedCheckpoint, find_latest, open_checkpoint
from framework.checkpoint.format import shard_files
from framework.stages import export
from framework.zoo.models import MLP

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")]  # export's TorchScript

RUN = ("model.hidden=[32,1]", "model.dropout=0.2", "optimizer=adamw", "callbacks=[default,ema]",
       "trainer.max_steps=16", "trainer.limit_train_batches=8", "trainer.log_every_n_steps=4", "trainer.test=false",
       "trainer.grad_clip_norm=1.0", "data.batch_size=16", "data.train.val_fraction=0.151", "data.eval_batch_size=45",
       "checkpoint.every_n_steps=4", "checkpoint.keep_last=-1", "logger.progress_bar=false")
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The uninterrupted fsdp run (2 processes): checkpoints step-4 ... step-16, last, best."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "whole"
    proc = run_cli(run_dir, "parallel=fsdp", *RUN, fast=False, env=ENV)
    assert proc.returncode == 0, output(proc)
    return run_dir


def shard_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every rank's files, as written."""
    return {f"{name}:{key}": value for name in shard_files(2)
            for key, value in load_file(str(checkpoint / name)).items()}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sharded_checkpoint_has_every_ranks_files_and_its_layout(whole):
    last = whole / "checkpoints" / "last"
    assert sorted(p.name for p in last.iterdir()) == sorted([*shard_files(2), "meta.json"])
    meta = json.loads((last / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["shards"]["world_size"] == 2
    # Linear(32, 1): rank 0 holds its single row, rank 1 an empty shard of it.
    assert meta["shards"]["model"]["net.4.bias"] == {"shape": [1], "dim": 0, "offsets": [0, 1], "lengths": [1, 0]}
    rank1 = load_file(str(last / "model-rank1-of2.safetensors"))
    assert rank1["net.4.bias"].shape == (0,) and rank1["net.4.weight"].shape == (0, 32)
    assert meta["shards"]["state"]["/optimizer/state/0/exp_avg"]["lengths"] == [16, 16]  # Adam's state, sharded
    assert "/callbacks/ema/weights/net.1.weight" in meta["shards"]["state"]  # the EMA of the shards, too


@pytest.mark.slow
@pytest.mark.distributed
def test_the_model_summary_counts_every_shard_built_on_the_meta_device(whole):
    """The run's model was built on the meta device (parallel.meta_init) and sharded: rank 0 holds about half of
    each weight, but a DTensor's numel() is the whole parameter's, so the summary is the whole model's."""
    whole_model = sum(p.numel() for p in MLP([1, 8, 8], 10, hidden=[32, 1], dropout=0.2).parameters())
    log = (whole / "run.log").read_text()
    assert log.count("Model summary:") == 1  # rank 0's
    assert re.search(rf"^0 \| model +\| FSDPMLP +\| +{whole_model:,} \| +{whole_model:,}$", log, re.MULTILINE), log
    assert re.search(rf"^{whole_model:,} +Total params$", log, re.MULTILINE), log


@pytest.mark.slow
@pytest.mark.distributed
def test_training_under_fsdp_matches_ddp_whose_checkpoints_fsdp_refuses_in_one_line(whole, tmp_path):
    proc = run_cli(tmp_path / "ddp", "parallel=ddp", *RUN, fast=False, env=ENV)
    assert proc.returncode == 0, output(proc)
    sharded = open_checkpoint(whole / "checkpoints" / "last").model_state()
    plain = load_file(str(tmp_path / "ddp" / "checkpoints" / "last" / "model.safetensors"))
    assert sharded.keys() == plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-5, atol=1e-6)
    ours, theirs = (json.loads((d / "summary.json").read_text()) for d in (whole, tmp_path / "ddp"))
    assert ours["val/loss"] == pytest.approx(theirs["val/loss"], rel=1e-5)  # reduced over uneven shards
    assert ours["world_size"] == 2
    # DDP's checkpoints hold the whole model: FSDP does not shard them on resume (init_from can).
    resumed = run_cli(None, f"resume={tmp_path / 'ddp'}", "parallel=fsdp", "trainer.max_steps=20", fast=False, env=ENV)
    assert resumed.returncode == 1 and "Traceback" not in output(resumed), output(resumed)
    assert output(resumed).count("Error:") == 1 and "cannot be resumed with parallel=fsdp" in output(resumed)


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_then_resume_ends_bit_identical_to_the_uninterrupted_run(whole, tmp_path):
    killed_dir = tmp_path / "killed"
    # Killed at step 10, once step 8's save, written behind the loop, is on disk (on a loaded machine it may not be
    # by then, and the run would rightly resume from step 4's).
    killed = run_cli(killed_dir, "parallel=fsdp", *RUN, fast=False,
                     env={**ENV, "PYTHONPATH": on_pythonpath(KILLHOOK), "KILL_AT_STEP": "10", "KILL_SIGNAL": "SIGKILL",
                          "KILL_WHEN_EXISTS": str(killed_dir / "checkpoints" / "step-8")})
    assert killed.returncode == 1, output(killed)  # rank 0 killed; the spawning parent reports it
    if (killed_dir / "summary.json").exists():  # the surviving rank's record of the failure, never an `ok`
        assert json.loads((killed_dir / "summary.json").read_text())["status"] == "failed"
    resumed = run_cli(None, f"resume={killed_dir}", fast=False, env=ENV)
    assert resumed.returncode == 0, output(resumed)
    assert "Resumed from" in output(resumed) and "at step 8 (" in output(resumed)
    ours, theirs = shard_tensors(killed_dir / "checkpoints" / "last"), shard_tensors(whole / "checkpoints" / "last")
    assert ours.keys() == theirs.keys()
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, f"not bit-identical: {different[:5]}"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(whole, tmp_path):
    run_dir = Path(shutil.copytree(whole, tmp_path / "run"))
    proc = run_cli(None, f"resume={run_dir}", "trainer.max_steps=18", "parallel.devices=1", fast=False, env=ENV)
    assert proc.returncode == 0, output(proc)
    assert "saved by 2 processes and is resharded over 1" in output(proc)
    meta = json.loads((run_dir / "checkpoints" / "last" / "meta.json").read_text())
    assert meta["step"] == 18 and meta["world_size"] == 1 and (run_dir / "checkpoints" / "last" /
                                                                "model-rank0-of1.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_discovery_skips_a_checkpoint_with_a_damaged_or_missing_shard(whole, tmp_path, caplog):
    run_dir = Path(shutil.copytree(whole, tmp_path / "run"))  # a copy: the hard links become files of their own
    folder = run_dir / "checkpoints"
    newest = [p for p in folder.iterdir() if json.loads((p / "meta.json").read_text())["step"] == 16]
    for checkpoint in newest:  # step-16 and its copies (last, maybe best): a flipped byte in rank 1's state
        data = bytearray((checkpoint / "state-rank1-of2.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (checkpoint / "state-rank1-of2.safetensors").write_bytes(bytes(data))
    (folder / "step-12" / "model-rank1-of2.safetensors").unlink()
    (folder / "step-20.tmp").mkdir()  # what a save killed midway leaves: never a candidate
    (folder / "step-20.tmp" / "model-rank0-of2.safetensors").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING):
        found = find_latest(run_dir)
    assert found is not None and found.step == 8 and found.sharded
    assert "state-rank1-of2.safetensors does not match its checksum" in caplog.text
    assert "model-rank1-of2.safetensors is missing" in caplog.text
    assert "step-20.tmp" not in caplog.text


@pytest.mark.slow
@pytest.mark.distributed
def test_a_layout_whose_parts_do_not_tile_the_tensor_is_one_line(whole, tmp_path):
    checkpoint = Path(shutil.copytree(whole / "checkpoints" / "step-4", tmp_path / "step-4"))
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["shards"]["model"]["net.1.weight"]["offsets"] = [0, 15]
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DamagedCheckpoint, match=r"shards\.model\.net\.1\.weight has parts that overlap at 15"):
        open_checkpoint(checkpoint)


@pytest.mark.slow
@pytest.mark.distributed
def test_export_gathers_the_whole_model_from_the_shards(whole, tmp_path, capsys):
    last = whole / "checkpoints" / "last"
    assert export.main([str(last), "--out", str(tmp_path), "--raw"]) == 0, capsys.readouterr().err
    exported = load_file(str(tmp_path / "model.safetensors"))
    ranks = [load_file(str(last / f"model-rank{r}-of2.safetensors")) for r in range(2)]
    assert exported.keys() == ranks[0].keys()
    for name, value in exported.items():  # rank 0's rows, then rank 1's
        assert torch.equal(value, torch.cat([ranks[0][name], ranks[1][name]]))
    model = MLP(input_shape=[1, 8, 8], num_classes=10, hidden=[32, 1], dropout=0.2).eval()
    model.load_state_dict(exported)
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        reference = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(torch.relu(
            torch.nn.functional.linear(x.flatten(1), exported["net.1.weight"], exported["net.1.bias"])),
            exported["net.4.weight"], exported["net.4.bias"])), exported["net.7.weight"], exported["net.7.bias"])
        assert torch.equal(model(x), reference)


def test_fsdp_options_under_another_strategy_are_one_line(tmp_path):
    proc = run_cli(tmp_path / "run", "parallel.shard_modules=[torch.nn.Linear]", env=ENV)
    assert proc.returncode == 1 and "Traceback" not in output(proc)
    assert "parallel.shard_modules=['torch.nn.Linear']: expected null with parallel=single, or parallel=fsdp" in \
        output(proc)



@pytest.mark.unit
def test_the_lm_experiments_text_is_batched_by_its_collate_fn(compose):
    # (experiment=lm_fsdp's data; a DataModule with a collate_fn takes the DataLoader path)
    from framework.config.instantiate import build

    cfg = compose("experiment=lm", "data.batch_size=3")
    data = build(cfg.data, "data")
    data.setup(seed=0)
    inputs, targets = data.first_batch("train")
    assert inputs.shape == targets.shape == (3, cfg.model.block_size) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # each target is the byte after its input
    assert len(data.datasets["val"]) > 0 and data.num_batches("train") > 100
