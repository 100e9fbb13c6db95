"""`python -m framework.export`: from a trained run to files that run without this framework, checked.

The exported TorchScript module, loaded with plain `torch.jit.load`, must compute what the model rebuilt from
the exported weights computes; errors are one line and exit code 1."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import ROOT, output, run_cli
from framework import export
from framework.instantiate import build

# TorchScript is deprecated upstream
pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny trained CNN (BatchNorm: eval mode matters) with checkpoints/last and checkpoints/best."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    proc = run_cli(run_dir, "model=cnn", "model.channels=[8,16]", "trainer.max_epochs=2",
                   "trainer.limit_train_batches=2", "logger.tensorboard=false")
    assert proc.returncode == 0, output(proc)
    return run_dir


def rebuilt(run_dir: Path, weights: Path) -> torch.nn.Module:
    """The model built from the run's stored config, with the exported weights: what a user would do."""
    meta = json.loads((run_dir / "checkpoints" / "last" / "meta.json").read_text())
    model = build(OmegaConf.create(meta["config"]).model, "model")
    model.load_state_dict(load_file(str(weights)))
    return model.eval()


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "framework.export", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_export_writes_torchscript_that_computes_what_the_exported_weights_do(run_dir):
    proc = export_cli(str(run_dir))
    assert proc.returncode == 0, output(proc)
    out = run_dir / "export"
    best = run_dir / "checkpoints" / "best"
    assert f"Exported {best} (step" in proc.stdout  # default: best, since the run has one
    assert f"{out / 'model.safetensors'}" in proc.stdout and f"{out / 'model.pt'}" in proc.stdout
    assert "max abs difference: weights 0 (identical), TorchScript" in proc.stdout
    exported = load_file(str(out / "model.safetensors"))
    checkpoint = load_file(str(best / "model.safetensors"))
    assert exported.keys() == checkpoint.keys() and all(torch.equal(exported[k], checkpoint[k]) for k in exported)
    scripted = torch.jit.load(str(out / "model.pt"))
    x = torch.randn(3, 1, 8, 8)  # not the batch size it was traced with
    with torch.no_grad():
        assert torch.allclose(scripted(x), rebuilt(run_dir, out / "model.safetensors")(x), rtol=1e-4, atol=1e-5)


def test_export_of_last_with_script_to_another_folder(run_dir, tmp_path, capsys):
    assert export.main([str(run_dir), "--which", "last", "--out", str(tmp_path), "--torchscript", "script"]) == 0
    assert f"Exported {run_dir / 'checkpoints' / 'last'} (step 4)" in capsys.readouterr().out
    scripted = torch.jit.load(str(tmp_path / "model.pt"))
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(scripted(x), rebuilt(run_dir, tmp_path / "model.safetensors")(x), rtol=1e-4, atol=1e-5)


def test_export_without_a_checkpoint_is_one_error_line(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    proc = export_cli(str(tmp_path))
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr, output(proc)
    assert proc.stderr.splitlines() == [f"Error: {tmp_path}: no checkpoints/last (saved: none); expected a run "
                                        "that saved one (checkpoint=default saves last and best)"]


def test_export_of_a_damaged_checkpoint_is_one_error_line(run_dir, tmp_path, capsys):
    damaged = tmp_path / "last"
    damaged.mkdir()
    for name in ("meta.json", "state.safetensors"):
        (damaged / name).write_bytes((run_dir / "checkpoints" / "last" / name).read_bytes())
    data = (run_dir / "checkpoints" / "last" / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert export.main([str(damaged)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"Error: checkpoint {damaged}: model.safetensors does not match its checksum "
                                "(damaged or truncated)"]
    assert not (damaged / "export").exists()


def test_export_of_a_language_model_traces_and_verifies_it_on_its_example_token_ids(tmp_path, capsys):
    """A model that takes token ids, not a float batch of data.input_shape: export uses its example_input_array
    (Lightning's name), and the TorchScript module computes the same logits as the rebuilt model."""
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "experiment=lm", "model.num_layers=1", "model.d_model=32", "model.block_size=16",
                   "trainer.max_steps=2", "trainer.val_every_n_steps=2", "trainer.limit_val_batches=1",
                   "checkpoint.every_n_steps=2", "logger.tensorboard=false")
    assert proc.returncode == 0, output(proc)
    assert export.main([str(run_dir), "--out", str(tmp_path / "export")]) == 0, capsys.readouterr().err
    assert "the example batch, an int64 tensor of shape [2, 16]" in capsys.readouterr().out
    model = rebuilt(run_dir, tmp_path / "export" / "model.safetensors")
    tokens = torch.randint(256, (3, 16), generator=torch.Generator().manual_seed(1))
    scripted = torch.jit.load(str(tmp_path / "export" / "model.pt"))
    with torch.no_grad():
        torch.testing.assert_close(scripted(tokens), model(tokens), rtol=1e-4, atol=1e-5)


class Positions(torch.nn.Module):
    """Makes a tensor on its input's device, as experiments/lm.py does."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Embedding(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.positions(torch.arange(tokens.shape[1], device=tokens.device)) * tokens.unsqueeze(-1)


@pytest.mark.unit
def test_a_trace_that_baked_in_the_cpu_device_is_named_in_a_warning_where_cuda_cannot_try_it(tmp_path):
    """`torch.arange(n, device=x.device)` traced on the CPU fixes the CPU, which fails on CUDA inputs (pytorch
    #145995): without CUDA to verify on, export says so in one line, with what to do; a script keeps x.device."""
    model, batch = Positions().eval(), torch.ones(2, 5)
    traced, scripted = (export.to_torchscript(model, batch, mode) for mode in ("trace", "script"))
    warning = export.fixed_device_warning(traced, tmp_path / "model.pt", "trace")
    assert warning is not None and "\n" not in warning
    assert "baked in the CPU device" in warning and "--torchscript script" in warning
    assert export.fixed_device_warning(scripted, tmp_path / "model.pt", "script") is None
