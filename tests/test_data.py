"""Batch order: seeded per epoch, identical on the fast path and through DataLoader, resumable, shardable."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from framework.data.module import DataModule, EpochSampler

pytestmark = pytest.mark.unit


class Plain(Dataset):
    """The same samples as a TensorDataset, but without `.tensors`: forces the DataLoader path."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _data(n: int = 103) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n)


def _labels(batches) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def test_fast_path_and_dataloader_give_the_same_batches():
    x, y = _data()
    fast = DataModule(TensorDataset(x, y), batch_size=10)
    slow = DataModule(Plain(x, y), batch_size=10)
    for dm in (fast, slow):
        dm.setup(seed=3)
    assert type(fast._loaders["train"][1]).__name__ == "TensorBatches"
    for epoch in (0, 1):
        assert _labels(fast.batches("train", epoch)) == _labels(slow.batches("train", epoch))
    assert fast.num_batches("train") == slow.num_batches("train") == 11


def test_order_depends_on_seed_and_epoch_only():
    x, y = _data()
    a, b, c = (DataModule(TensorDataset(x, y), batch_size=10) for _ in range(3))
    a.setup(seed=1), b.setup(seed=1), c.setup(seed=2)
    torch.manual_seed(123)  # global RNG state must not matter
    first = _labels(a.batches("train", 0))
    torch.manual_seed(456)
    assert first == _labels(b.batches("train", 0))
    assert first != _labels(a.batches("train", 1))
    assert first != _labels(c.batches("train", 0))
    assert sorted(sum(first, [])) == list(range(103))


def test_resuming_at_batch_k_yields_the_rest_of_the_epoch():
    x, y = _data()
    for dataset in (TensorDataset(x, y), Plain(x, y)):
        dm = DataModule(dataset, batch_size=10, drop_last=True)
        dm.setup(seed=0)
        whole = _labels(dm.batches("train", 4))
        assert len(whole) == 10  # drop_last drops the 3 left over
        assert _labels(dm.batches("train", 4, start_batch=7)) == whole[7:]


def test_shards_cover_the_epoch_once_with_padding_for_train_and_exactly_for_eval():
    n, world = 103, 4
    train = [EpochSampler(n, shuffle=True, seed=5, rank=r, world_size=world) for r in range(world)]
    seen = [list(s) for s in train]
    assert all(len(s) == 26 for s in seen)  # ceil(103 / 4), padded so every rank steps together
    assert set(sum(seen, [])) == set(range(n))
    evals = [list(EpochSampler(n, shuffle=False, rank=r, world_size=world, pad=False)) for r in range(world)]
    assert sorted(sum(evals, [])) == list(range(n))  # no duplicates: eval metrics stay exact


def test_eval_splits_are_not_shuffled_and_use_eval_batch_size():
    x, y = _data(25)
    dm = DataModule(TensorDataset(x, y), val=TensorDataset(x, y), batch_size=4, eval_batch_size=10)
    dm.setup(seed=0)
    assert _labels(dm.batches("val")) == [list(range(10)), list(range(10, 20)), list(range(20, 25))]


@pytest.mark.e2e
def test_close_lets_persistent_workers_exit_at_once_and_the_next_epoch_starts_new_ones():
    """Left to the garbage collector (the data module sits in the trainer's reference cycles), persistent
    workers never got the exit request and were each waited for 5 s, then terminated: 20 s at the end of every
    run with 2 train and 2 val workers. DataModule.close asks them, and they exit on their own (exit code 0)."""
    x, y = _data(40)
    dm = DataModule(Plain(x, y), Plain(x, y), batch_size=10, num_workers=2, persistent_workers=True)
    dm.setup(seed=0)
    expected = {split: _labels(dm.batches(split)) for split in ("train", "val")}
    workers = [w for _, loader in dm._loaders.values() for w in loader._iterator._workers]
    assert len(workers) == 4 and all(w.is_alive() for w in workers)
    dm.close()
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    assert {split: _labels(dm.batches(split)) for split in ("train", "val")} == expected
    dm.close()
