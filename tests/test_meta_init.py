"""parallel.meta_init (parallel=fsdp): the model group built with its parameters on the meta device, then each rank
given only its own rows, with exactly the values (and the RNG state after them) of a plain one-process build,
whatever the number of ranks; what cannot be replayed is built whole; init_from goes straight into the shards."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import RANK_PARALLEL, join_test_ranks, start_ranks
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torch import nn

from experiments.lm import TransformerLM
from framework.app.launch import free_port
from framework.parallel import meta_init
from framework.zoo.models import MLP

pytestmark = pytest.mark.unit

SMALL = {"block_size": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "ff_mult": 2, "dropout": 0.1}


class Custom(nn.Module):
    """Parameters made with data (randn, scaled), re-initialised in place, and an Embedding: what models do."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(3, 4) * 0.02)
        self.embed = nn.Embedding(7, 4)
        self.proj = nn.Linear(4, 5)
        nn.init.xavier_normal_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        nn.init.kaiming_normal_(self.embed.weight)
        self.proj.weight.data.mul_(0.5)  # (.data: what old code does)
        self.register_buffer("scale", torch.linspace(0, 1, 4))


@pytest.mark.parametrize("make", [lambda: TransformerLM(**SMALL), lambda: MLP([8, 8], 10, hidden=[32, 1], dropout=0.2),
                                  Custom], ids=["lm", "mlp", "custom"])
def test_every_ranks_rows_are_the_plain_builds_whatever_the_world_size(make):
    torch.manual_seed(0)
    plain = make()
    after_plain = torch.rand(4)
    expected = dict(plain.named_parameters())
    for world_size in (1, 2, 3):
        rows: dict[str, list[torch.Tensor]] = {}
        for rank in range(world_size):
            torch.manual_seed(0)
            model, recorder = meta_init.build_on_meta(make, rank, world_size)
            assert recorder is not None and all(p.is_meta for p in model.parameters())
            assert torch.equal(torch.rand(4), after_plain)  # the generator advanced as in the plain build
            for name in expected:
                rows.setdefault(name, []).append(recorder._values(recorder.by_name[name], name))
            assert torch.equal(model.get_buffer("scale"), plain.scale) if make is Custom else True
        for name, value in expected.items():
            assert torch.equal(torch.cat(rows[name]), value), (world_size, name)


def test_a_whole_rank_materialises_in_place_and_keeps_its_buffers():
    torch.manual_seed(0)
    plain = TransformerLM(**SMALL)
    torch.manual_seed(0)
    model, recorder = meta_init.build_on_meta(lambda: TransformerLM(**SMALL), 0, 1)
    recorder.materialise(model, torch.device("cpu"))
    for (name, got), want in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(got, want), name
    assert torch.equal(model.mask, plain.mask)  # a non-persistent buffer computed at construction


class Offloading:
    """What Builder asks of FSDPStrategy under cpu_offload. The compute device is the meta device here: a device
    that is not the CPU, which this machine may lack a GPU for (on CUDA, materialising the shards there made
    fully_shard's CPUOffloadPolicy refuse them at the first forward)."""

    rank, world_size = 0, 1
    device, shard_device = torch.device("meta"), torch.device("cpu")


def test_offloaded_shards_are_materialised_on_the_cpu_and_buffers_on_the_device():
    torch.manual_seed(0)
    plain = TransformerLM(**SMALL)
    torch.manual_seed(0)
    builder = meta_init.Builder(Offloading())
    model = builder.build(lambda: TransformerLM(**SMALL))
    builder.materialise(model, OmegaConf.create({"init_from": None}))
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.equal(param, plain.get_parameter(name)), name
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert "mask" in model._buffers and "mask" in model._non_persistent_buffers_set  # still a non-persistent buffer


def test_an_init_that_cannot_be_replayed_builds_the_model_whole_from_the_same_rng_state(caplog):
    def padded() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 3), nn.Embedding(5, 3, padding_idx=0))  # a row of a parameter zeroed

    def truncated() -> nn.Module:
        layer = nn.Linear(3, 3)
        nn.init.trunc_normal_(layer.weight, std=0.02)  # returns at once on a meta tensor: no draw to record
        return layer

    def orthogonal() -> nn.Module:
        layer = nn.Linear(3, 3)
        nn.init.orthogonal_(layer.weight)
        return layer

    class Assigned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            weight = torch.empty(2, 3)
            weight[:] = torch.arange(6.0).view(2, 3)
            self.weight = nn.Parameter(weight)

    for make, reason in ((padded, "fill_ on a view of a parameter"), (truncated, "code that skips meta parameters"),
                         (orthogonal, "code that skips meta parameters"), (Assigned, "an item assignment")):
        torch.manual_seed(0)
        plain = make()
        torch.manual_seed(0)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="framework.parallel.meta_init"):
            model, recorder = meta_init.build_on_meta(make, 0, 2)
        assert recorder is None and not any(p.is_meta for p in model.parameters())
        assert reason in caplog.text and "built whole on every rank" in caplog.text
        for got, want in zip(model.state_dict().values(), plain.state_dict().values()):
            assert torch.equal(got, want)


def _rank(rank: int, port: int, weights: str, out: str) -> None:
    join_test_ranks(rank, port)
    from framework.parallel.strategy import FSDPStrategy

    cfg = OmegaConf.create(RANK_PARALLEL)
    strategy = FSDPStrategy(cfg, "cpu")
    results = {}
    for init_from in (None, weights):
        torch.manual_seed(0)
        builder = meta_init.Builder(strategy)
        model = builder.build(lambda: TransformerLM(**SMALL))
        model = strategy.wrap(model)
        builder.materialise(model, OmegaConf.create({"init_from": init_from, "init_strict": True}))
        results[init_from is not None] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                                          for k, v in model.state_dict().items()}
        results["rng", init_from is not None] = torch.rand(3)
    if rank == 0:
        torch.save(results, out)
    strategy.teardown()


@pytest.mark.e2e
@pytest.mark.distributed
def test_two_fsdp_ranks_hold_the_plain_builds_weights_or_init_froms(tmp_path: Path):
    torch.manual_seed(0)
    plain = TransformerLM(**SMALL)
    after_plain = torch.rand(3)
    other = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
    save_file(other, str(tmp_path / "w.safetensors"))
    out = str(tmp_path / "out.pt")
    start_ranks(_rank, (free_port(), str(tmp_path / "w.safetensors"), out))
    results = torch.load(out)
    for name, value in plain.state_dict().items():
        assert torch.equal(results[False][name], value), name
        assert torch.equal(results[True][name], other[name]), name
    assert torch.equal(results["rng", False], after_plain)
