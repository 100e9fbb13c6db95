"""Randomness per rank: each rank saves and restores only its own device's CUDA RNG state (so a run resumes where
fewer GPUs are visible), and each rank's loader workers draw their own augmentation randomness while the sample
order, which the ranks share out, stays what it was."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from framework.checkpoint import DamagedCheckpoint, open_checkpoint, validate_rng_state, write_checkpoint
from framework.core import reproducibility
from framework.data.module import DataModule

pytestmark = pytest.mark.unit


def fake_cuda_state(seed: int, offset: int = 0) -> torch.Tensor:
    """A CUDA generator's state as torch returns it (Philox: a uint64 seed and an int64 offset, as 16 bytes), made
    without a GPU."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def roundtrip(state: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    write_checkpoint(tmp_path / "ckpt", {}, {"rng": state}, {"step": 1, "config": {}}, durable=False)
    return open_checkpoint(tmp_path / "ckpt").state()["rng"]


# ------------------------------------------------------------------------------------- CUDA RNG state per rank
def test_an_older_checkpoint_with_one_cuda_state_per_gpu_validates_whatever_gpus_are_visible(tmp_path):
    """A checkpoint of an 8-GPU node (one state per visible GPU, as torch.cuda.get_rng_state_all gave) resumes
    on a machine with fewer: more states than device_count() are not refused."""
    state = reproducibility.rng_state()
    state["cuda"] = [fake_cuda_state(seed) for seed in range(torch.cuda.device_count() + 8)]
    validate_rng_state(roundtrip(state, tmp_path), "rng/rank1", torch.device("cuda", 1))


def test_the_state_restored_is_the_rank_s_own_device_s_or_else_the_first(caplog):
    states = [fake_cuda_state(seed) for seed in (10, 11, 12)]
    with caplog.at_level(logging.DEBUG, logger="framework.core.reproducibility"):
        assert torch.equal(reproducibility.cuda_state_for(states, 2), states[2])
        assert torch.equal(reproducibility.cuda_state_for(states, 5), states[0])
    assert "holds 3 CUDA RNG states, none for device 5; restoring the first" in caplog.text
    own = fake_cuda_state(7)
    assert reproducibility.cuda_state_for(own, 5) is own  # what a checkpoint holds now: this rank's device's only


def test_one_cuda_state_per_process_is_what_a_checkpoint_holds_now_and_is_checked(tmp_path):
    state = reproducibility.rng_state()
    state["cuda"] = fake_cuda_state(3, 4)
    validate_rng_state(roundtrip(state, tmp_path), "rng/rank0", torch.device("cuda", 0))
    state["cuda"] = torch.zeros(16)
    with pytest.raises(DamagedCheckpoint, match=r"rng/rank0/cuda: the checkpoint holds .* 1-d uint8"):
        validate_rng_state(state, "rng/rank0")
    state["cuda"] = []
    with pytest.raises(DamagedCheckpoint, match=r"rng/rank0/cuda: the checkpoint holds .*expected a CUDA RNG state"):
        validate_rng_state(state, "rng/rank0")


# ------------------------------------------------------------------------------ loader workers' seeds per rank
class Augmented(Dataset):
    """Each sample is its index and one draw of the worker's torch RNG (as a random augmentation would make)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.rand(())


def loaders(num_workers: int, world_size: int = 2, seed: int = 5) -> list[DataModule]:
    modules = []
    for rank in range(world_size):
        dm = DataModule(Augmented(), batch_size=2, num_workers=num_workers)
        dm.setup(seed=seed, rank=rank, world_size=world_size)
        modules.append(dm)
    return modules


def test_each_rank_seeds_its_loader_workers_apart_and_rank_0_as_before():
    rank0, rank1 = loaders(num_workers=1)
    seeds = []
    for epoch in (0, 3, 3):  # the same epoch twice: a resumed epoch re-seeds as the uninterrupted one did
        first, second = (dm.batches("train", epoch).generator.initial_seed() for dm in (rank0, rank1))
        assert first == 5 + epoch  # rank 0's is seed + epoch, as it always was: one process repeats its old runs
        assert second != first
        seeds.append(second)
    assert seeds[0] != seeds[1] == seeds[2]


def test_the_ranks_share_out_the_same_epoch_order_as_before():
    """The order is the sampler's (seed + epoch, then every world_size-th sample), which all ranks must agree on;
    the workers' per-rank seeds leave it alone."""
    expected = torch.randperm(8, generator=reproducibility.generator(5 + 2)).tolist()
    for rank, dm in enumerate(loaders(num_workers=0)):
        got = [int(i) for index, _ in dm.batches("train", epoch=2) for i in index]
        assert got == expected[rank::2]


@pytest.mark.e2e  # loader worker processes
def test_the_ranks_workers_draw_different_augmentations_and_rank_0_the_ones_it_drew_before():
    rank0, rank1 = loaders(num_workers=1)
    draws = [torch.cat([aug for _, aug in dm.batches("train", epoch=1)]) for dm in (rank0, rank1)]
    assert not torch.equal(draws[0], draws[1])
    # before ranks counted, every rank's loader was seeded with seed + epoch: rank 0 still draws what it drew
    old = DataLoader(Augmented(), batch_size=2, sampler=range(4), num_workers=1, generator=reproducibility.generator(6))
    assert torch.equal(torch.cat([aug for _, aug in old]), draws[0])
    again = torch.cat([aug for _, aug in rank1.batches("train", epoch=1)])
    assert torch.equal(again, draws[1])  # and a resumed epoch draws them again
