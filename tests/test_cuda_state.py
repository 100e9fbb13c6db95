"""What a run keeps of and makes from CUDA state: each rank's RNG state (one device's, restorable where fewer GPUs are
visible), the checkpoint writer's pinned staging buffer (exactly the state's bytes, unpinned at close), and a
TorchScript export verified on CUDA inputs. Skipped without CUDA."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from framework.checkpoint import CheckpointWriter, open_checkpoint, validate_rng_state
from framework.core import reproducibility
from framework.core.errors import UserError
from framework.stages import export

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# ---------------------------------------------------------------------------------------------- RNG state per rank
def test_a_rank_saves_its_own_device_s_cuda_rng_state_only():
    torch.cuda.init()
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    state = reproducibility.rng_state(device)
    assert isinstance(state["cuda"], torch.Tensor)
    assert torch.equal(state["cuda"], torch.cuda.get_rng_state(device.index))


def test_an_older_checkpoint_of_more_gpus_than_visible_is_validated_and_restores_the_device_s_state():
    """One state per GPU of an 8-GPU node (torch.cuda.get_rng_state_all), resumed where fewer are visible."""
    torch.cuda.init()
    device = torch.device("cuda", 0)
    states = [torch.Generator("cuda").manual_seed(100 + i).get_state() for i in range(torch.cuda.device_count() + 7)]
    state = reproducibility.rng_state(device)
    state["cuda"] = states
    validate_rng_state(state, "rng/rank0", device)
    reproducibility.set_rng_state(state, device)
    assert torch.equal(torch.cuda.get_rng_state(0), states[0])
    expected = torch.rand(4, device=device, generator=torch.Generator("cuda").manual_seed(100))
    assert torch.equal(torch.rand(4, device=device), expected)


# ------------------------------------------------------------------------------------ pinned checkpoint staging
def test_the_staging_buffer_pins_exactly_the_state_and_unpins_it_at_close(tmp_path: Path):
    """Not torch.empty(pin_memory=True): the caching host allocator would pin the next power of two (32 MiB for
    this 17 MiB state) and keep it after close()."""
    weights = torch.randn(17 * 2**20 // 4, device="cuda")
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    writer = CheckpointWriter(background=True)
    writer.write(tmp_path / "a", {"w": weights}, {"n": 1}, {"step": 1, "config": {}})
    writer.wait()
    (staged,) = [view for view in writer._staging.values() if view.numel() == weights.numel()]
    assert staged.is_pinned() and writer._buffer is not None and writer._buffer.numel() == 17 * 2**20
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    writer.close()
    assert not staged.is_pinned()  # the view still maps the buffer; its pages are pageable again
    assert torch.equal(open_checkpoint(tmp_path / "a").model_state()["w"], weights.cpu())


# --------------------------------------------------------------------------------------------- export on CUDA
class Positions(torch.nn.Module):
    """Makes a tensor on its input's device, as experiments/lm.py does: a trace records that device."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Embedding(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.positions(torch.arange(tokens.shape[1], device=tokens.device)) * tokens.unsqueeze(-1)


def test_a_trace_that_baked_in_the_cpu_is_refused_on_cuda_in_one_line(tmp_path: Path):
    model, batch = Positions().eval(), torch.ones(2, 5)
    export.to_torchscript(model, batch, "trace").save(str(tmp_path / "model.pt"))
    with pytest.raises(UserError, match=r"baked in the CPU device.*--torchscript script") as err:
        export.verify_on_cuda(tmp_path / "model.pt", model, batch, "trace")
    assert "\n" not in str(err.value)


def test_a_scripted_export_is_verified_on_cuda(tmp_path: Path):
    model, batch = Positions().eval(), torch.ones(2, 5)
    export.to_torchscript(model, batch, "script").save(str(tmp_path / "model.pt"))
    assert export.verify_on_cuda(tmp_path / "model.pt", model, batch, "script") < 1e-5
