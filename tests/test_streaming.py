"""Streaming splits in this process: the planned order (every sample once per epoch over ranks, shuffled by
(seed, epoch) only), resuming at any batch, plain iterables scanned, WebDataset shards written with tarfile, and bad
input as one ConfigError naming the shard and sample key. Worker processes: test_streaming_e2e.py."""
from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_error_line, output, run_process
from torch.utils.data import IterableDataset

from framework.checkpoint.state import Progress
from framework.core.errors import ConfigError
from framework.data.module import DataModule
from framework.data.shards import TarShards, TokenShards, tar_shards
from framework.data.streaming import StreamState, epoch_order, expand_braces, rank_block
from framework.zoo.shards import png, write_tar

pytestmark = pytest.mark.unit


def id_shards(folder: Path, sizes: list[int], prefix: str = "train") -> str:
    """Shards of 1x1 PNGs whose label is the sample's ID (0, 1, ... in storage order); returns the pattern."""
    folder.mkdir(parents=True, exist_ok=True)
    image, first = png(np.zeros((1, 1), dtype=np.uint8)), 0
    for number, size in enumerate(sizes):
        ids = range(first, first + size)
        write_tar(folder / f"{prefix}-{number:06d}.tar",
                  ((f"k{i:05d}", {"png": image, "cls": str(i).encode()}) for i in ids))
        first += size
    return f"{folder}/{prefix}-{{000000..{len(sizes) - 1:06d}}}.tar"


def ids(batches) -> list[int]:
    return [int(i) for batch in batches for i in batch[1]]


class Counting(IterableDataset):
    """A plain stream with no len() and no shards: (x, id) for id in 0..n-1."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), i


def module(train, val=None, **options) -> DataModule:
    return DataModule(train, val, **{"batch_size": 4, "shuffle_buffer": 5, **options})


def test_brace_patterns_expand_like_webdataset():
    assert expand_braces("d/train-{000008..000011}.tar") == [f"d/train-{i:06d}.tar" for i in range(8, 12)]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_each_epoch_is_a_permutation_set_by_seed_and_epoch_only():
    sizes = [7, 3, 11, 5]
    a, b = epoch_order(sizes, 1, 0, True, 4), epoch_order(sizes, 1, 0, True, 4)
    assert torch.equal(a, b) and sorted(a.tolist()) == list(range(26))
    assert not torch.equal(a, epoch_order(sizes, 1, 1, True, 4))
    assert not torch.equal(a, epoch_order(sizes, 2, 0, True, 4))
    assert epoch_order(sizes, 1, 0, False, 4).tolist() == list(range(26))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_share_an_epoch_without_overlap_equal_in_training_and_whole_in_evaluation(tmp_path, world):
    pattern = id_shards(tmp_path, [7, 3, 11, 5])  # 26 samples
    seen: dict[str, list[int]] = {"train": [], "val": []}
    steps = set()
    for rank in range(world):
        data = module(tar_shards(pattern), tar_shards(pattern))
        data.setup(seed=3, rank=rank, world_size=world)
        steps.add(data.num_batches("train"))
        seen["train"] += ids(data.batches("train", epoch=2))
        seen["val"] += ids(data.batches("val"))
    assert len(steps) == 1  # equal steps: DDP never waits at an epoch's end
    assert len(set(seen["train"])) == len(seen["train"]) == 26 - 26 % world  # once each; fewer than `world` out
    assert sorted(seen["val"]) == list(range(26))  # evaluation: every sample exactly once
    assert rank_block(26, world - 1, world, equal=False)[1] == 26


def test_a_resume_at_batch_k_continues_with_the_samples_not_yet_consumed(tmp_path):
    data = module(tar_shards(id_shards(tmp_path, [9, 9, 9])), batch_size=5)
    data.setup(seed=0)
    whole = ids(data.batches("train", epoch=1))
    assert sorted(whole) == list(range(27))
    for k in (1, 3, 5):
        assert ids(data.batches("train", epoch=1, start_batch=k)) == whole[5 * k:]


def test_a_plain_iterable_is_counted_scanned_and_resumed_like_shards():
    data = module(Counting(23), Counting(10), batch_size=3)
    data.setup(seed=5, rank=1, world_size=2)  # 11 samples a rank, the 23rd left out
    whole = ids(data.batches("train", epoch=0))
    assert len(whole) == 11 and len(set(whole)) == 11
    assert ids(data.batches("train", epoch=0, start_batch=2)) == whole[6:]  # a scan started again, then skipped
    assert ids(data.batches("train", epoch=0)) == whole  # the same stream read twice
    other = module(Counting(23), batch_size=3)
    other.setup(seed=5, rank=0, world_size=2)
    assert not set(ids(other.batches("train", epoch=0))) & set(whole)
    assert ids(data.batches("val")) == list(range(5, 10))


def test_a_stream_shorter_than_its_plan_is_one_error():
    data = module(Counting(12))
    data.setup(seed=0)
    data.streams["train"].dataset.n = 6  # the stream shrank after the run started
    with pytest.raises(ConfigError, match=r"data.train: Counting ended after 6 samples; expected at least"):
        list(data.batches("train"))


def test_a_resume_refuses_other_data_and_a_scanned_stream_on_another_world_size_mid_epoch(tmp_path):
    data = module(tar_shards(id_shards(tmp_path, [8, 8])))
    data.setup(seed=0)
    state = StreamState(data.streams, Progress(batch_in_epoch=3))
    saved = state.state_dict()
    state.check_state_dict(saved, "checkpoint c: data")
    with pytest.raises(ConfigError, match="data.train: 16 samples now, 15 when checkpoint c was saved"):
        state.check_state_dict({"train": {**saved["train"], "samples": 15}}, "checkpoint c: data")
    scanned = module(Counting(16))
    scanned.setup(seed=0)
    state = StreamState(scanned.streams, Progress())
    with pytest.raises(ConfigError, match="saved mid-epoch on 2 processes, this run has 1, and Counting is read by"):
        state.check_state_dict({"train": {**saved["train"], "world_size": 2}}, "checkpoint c: data")
    state.check_state_dict({"train": {**saved["train"], "world_size": 2, "batch_in_epoch": 0}}, "c: data")


def test_shards_rewritten_under_the_same_names_are_other_data_to_a_resume(tmp_path):
    """The data's identity holds each shard file's samples and bytes: the same pattern and config over rewritten
    files is refused, naming the split, both counts and the first shard that differs; resume_on_new_data takes it."""
    from framework.data.module import check_data

    def identity() -> dict:
        data = module(tar_shards(pattern))
        data.setup(seed=0)
        return {split: {**found, "config": {"data.train_shards": pattern}} for split, found in data.identity().items()}

    pattern = id_shards(tmp_path, [8, 8])
    recorded = identity()
    assert check_data(identity(), recorded, accept=False, where="c").changed == {}
    id_shards(tmp_path, [8, 9])
    with pytest.raises(ConfigError, match=r"^data.train: then 16 samples in 2 shards, now 17 samples in 2 shards, "
                                          r"from the same config \(first difference: .*train-000001.tar: 9 samples"):
        check_data(identity(), recorded, accept=False, where="c")
    taken = check_data(identity(), recorded, accept=True, where="c")
    assert set(taken.changed) == {"train"} and taken.record["train"]["samples"] == 17


def consume(pattern: str, world: int, saved: dict | None, batches: int | None, epoch: int = 1):
    """Each rank of `world` resumed from `saved` (None: the epoch's start), consuming `batches` batches of `epoch`
    (None: to its end): (ids consumed, the state saved after, the loop's batch each rank stopped at)."""
    seen, states, stops = [], [], set()
    for rank in range(world):
        data = module(tar_shards(pattern), batch_size=3)
        data.setup(seed=7, rank=rank, world_size=world)
        progress = Progress(epoch=epoch)
        state = StreamState(data.streams, progress)
        if saved is not None:
            progress.load_state_dict({"epoch": epoch, "batch_in_epoch": saved["train"]["batch_in_epoch"]})
            state.check_state_dict(saved, "c: data")
            state.load_state_dict(saved)
        start = progress.batch_in_epoch
        got = list(data.batches("train", epoch, start))
        got = got if batches is None else got[:batches]
        seen += ids(got)
        progress.batch_in_epoch = start + len(got)
        stops.add(progress.batch_in_epoch)
        states.append(state.state_dict())
    assert len(stops) == 1  # every rank at the same batch
    return seen, states[0], stops.pop()


def test_a_resume_mid_epoch_on_other_numbers_of_processes_consumes_the_rest_of_the_epoch_each_sample_once(tmp_path):
    pattern = id_shards(tmp_path, [10, 9, 12, 9])  # 40 samples
    first, saved, stop = consume(pattern, 2, None, 2)  # 2 ranks (7 batches an epoch), 2 batches of 3 each
    assert (len(first), stop) == (12, 2)
    second, saved, stop = consume(pattern, 3, saved, 1)  # 3 ranks (5 batches an epoch): the rest, 28, is 3 x 9
    assert (len(second), stop) == (9, 3)  # (and 1 left out), 3 batches a rank from batch 2; one of them consumed
    again, _, stop = consume(pattern, 3, saved, None)  # the same 3 ranks resumed: the rest of their plan
    assert (len(again), stop) == (18, 5)
    third, _, stop = consume(pattern, 1, saved, None)  # or one process (14 batches an epoch): 19 left, 7 batches
    assert (len(third), stop) == (19, 14)
    whole = first + second + third
    assert len(whole) == len(set(whole)) == 40  # the rest of the epoch was every sample not yet consumed, once
    assert set(again) < set(third)  # the same rest, but for the one 3 ranks had left out


def labelled(folder: Path, files: dict[str, bytes]) -> str:
    image = png(np.zeros((2, 2), dtype=np.uint8))
    write_tar(folder / "s-000000.tar", [("a", {"png": image, "cls": b"1"})])
    write_tar(folder / "s-000001.tar", [(k.split(".")[0], {k.split(".")[1]: v}) for k, v in files.items()])
    return f"{folder}/s-{{000000..000001}}.tar"


def test_bad_shards_are_one_error_naming_the_shard_and_sample_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train_shards='.*/none-\{0..3\}.tar': matches no file \(4 names"):
        TarShards(f"{tmp_path}/none-{{0..3}}.tar", key="data.train_shards")
    pattern = labelled(tmp_path, {"b.png": png(np.zeros((2, 2), dtype=np.uint8))})
    with pytest.raises(ConfigError, match=r"sample key 'b' in shard .*s-000001.tar has no .cls label"):
        TarShards(pattern)
    with pytest.raises(ConfigError, match=r"shard .*s-000002.tar does not exist \(1 of the 3 shards"):
        TarShards(pattern.replace("000001", "000002"))
    shard = tmp_path / "s-000000.tar"
    whole = shard.read_bytes()
    for cut in (700, 1024, 1540, 2048 + 256):  # after data, at a header, in data, in the end blocks
        shard.write_bytes(whole[:cut])
        with pytest.raises(ConfigError, match=r"shard .*s-000000.tar is truncated or not a tar file"):
            TarShards(pattern, skip_corrupt=True)
    shard.write_bytes(b"garbage" * 100)
    with pytest.raises(ConfigError, match="s-000000.tar is truncated or not a tar file"):
        TarShards(pattern)


def test_skip_corrupt_skips_each_bad_sample_with_a_warning_and_counts_it(tmp_path, caplog):
    pattern = labelled(tmp_path, {"c.png": b"not a png", "c.cls": b"2"})
    data = module(tar_shards(pattern), shuffle=False)  # the index is fine: the image is read with its batch
    data.setup(seed=0)
    with pytest.raises(ConfigError, match=r"sample key 'c' in shard .*s-000001.tar cannot be decoded"):
        list(data.batches("train"))
    pattern = labelled(tmp_path, {"b.png": png(np.zeros((2, 2), dtype=np.uint8)), "c.png": b"not a png",
                                  "c.cls": b"2"})
    data = module(tar_shards(pattern, skip_corrupt=True), skip_corrupt=True, shuffle=False)
    data.setup(seed=0)
    for epoch in (0, 1):  # one warning and one count per bad sample, however often it is met
        assert [b[1].tolist() for b in data.batches("train", epoch)] == [[1]]
    assert data.skipped() == (1, {"train": {1}})  # 'b' when indexed (left out); 'c', read at position 1
    assert sum("skipped (data.skip_corrupt=true)" in r.getMessage() for r in caplog.records) == 2


def test_shards_give_images_and_labels_in_storage_order_on_their_own(tmp_path):
    pattern = id_shards(tmp_path, [2, 3])
    samples = list(TarShards(pattern))
    assert [label for _, label in samples] == [0, 1, 2, 3, 4]
    assert samples[0][0].shape == (1, 1, 1) and samples[0][0].dtype == torch.float32
    with tarfile.open(tmp_path / "train-000000.tar") as tar:  # what was written is WebDataset's layout
        assert tar.getnames() == ["k00000.png", "k00000.cls", "k00001.png", "k00001.cls"]
    assert io.BytesIO(tar_shards(None) or b"").read() == b""  # a split without shards is off
    array = io.BytesIO()
    np.save(array, np.arange(6, dtype=np.float32).reshape(2, 3))
    write_tar(tmp_path / "n-000000.tar", [("a", {"npy": array.getvalue(), "cls": b"4"})])
    x, label = next(iter(TarShards(f"{tmp_path}/n-{{000000..000000}}.tar")))  # an array comes as it was saved
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]] and x.dtype == torch.float32 and label == 4


def test_a_token_stream_is_windows_within_members_written_once_from_the_stdlib(tmp_path):
    from experiments.lm import stdlib_bytes
    from experiments.lm_stream import stdlib_token_shards

    write_tar(tmp_path / "t-000000.tar", [("a", {"bin": bytes(range(10))}), ("b", {"bin": bytes(range(20, 27))})])
    tokens = TokenShards(f"{tmp_path}/t-{{000000..000000}}.tar", block_size=3)
    assert [w.tolist() for w in tokens] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9], [20, 21, 22, 23],
                                            [23, 24, 25, 26]]
    val = stdlib_token_shards(str(tmp_path), "val", block_size=64, shard_bytes=1 << 16)
    written = sorted(p.name for p in (tmp_path / "stdlib_shards").iterdir())
    again = stdlib_token_shards(str(tmp_path), "val", block_size=64, shard_bytes=1 << 16)
    assert sorted(p.name for p in (tmp_path / "stdlib_shards").iterdir()) == written and len(again) == len(val)
    data = stdlib_bytes()
    first = next(iter(val))
    assert bytes(first.tolist()) == data[int(len(data) * 0.95):][:65]


def test_the_webdataset_preset_composes_and_a_shuffle_buffer_below_one_is_refused(compose):
    from framework.config.validate import validate

    cfg = compose("data=webdataset", "data.train_shards='d/train-{000000..000009}.tar'")
    assert cfg.data.train.shards == "d/train-{000000..000009}.tar" and cfg.data.val.shards is None
    validate(cfg)
    with pytest.raises(ConfigError, match=r"data.shuffle_buffer=0.*>= 1"):
        validate(compose("data=webdataset", "data.train_shards=x", "data.shuffle_buffer=0"))


SHARDS = ("data.train_shards='d/train-{000000..000009}.tar'", "data.val_shards='d/val-{000000..000001}.tar'",
          "data.test_shards='d/test-{000000..000001}.tar'")


def test_a_webdataset_run_given_every_shard_needs_no_data_root(compose, tmp_path, monkeypatch):
    """data.root is where the digits' shards go when a split has none: given every split's shards, it is never read,
    so neither the preset's default nor a folder that does not exist is refused; a split without shards still
    reads it, and a typo there is refused before anything is written."""
    from framework.app.main import check_paths

    monkeypatch.chdir(tmp_path)  # no outputs/ here
    check_paths(compose("data=webdataset", *SHARDS))
    check_paths(compose("data=webdataset", *SHARDS, "data.root=/nonexistent"))
    check_paths(compose("data=webdataset", *SHARDS[:2], "data.test=null", "data.root=/nonexistent"))
    with pytest.raises(ConfigError, match=r"^data.root='/nonexistent': no such directory"):
        check_paths(compose("data=webdataset", *SHARDS[:2], "data.root=/nonexistent"))


def test_the_webdataset_presets_digits_shards_are_written_once_to_the_users_cache(compose, tmp_path, monkeypatch):
    """With no shards and no data.root, the digits' shards go to $XDG_CACHE_HOME/hydra-torch-framework (else
    ~/.cache/...), written once for every run of every checkout, never under the working directory."""
    from hydra.utils import instantiate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir((tmp_path / "cwd").mkdir() or tmp_path / "cwd")
    cfg = compose("data=webdataset")
    val = instantiate(cfg.data.val)
    folder = tmp_path / "cache" / "hydra-torch-framework" / "digits_shards"
    written = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    assert "counts.json" in written and "val-000000.tar" in written and not any(".writing" in n for n in written)
    labels = [label for _, label in val]
    assert len(labels) == len(instantiate(cfg.data.val)) and sorted(set(labels)) == list(range(10))
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == written  # read, not written again
    assert not list((tmp_path / "cwd").iterdir())


@pytest.mark.e2e
def test_the_shard_writer_ends_a_mistake_in_one_error_line(tmp_path, capsys):
    """python -m framework.zoo.shards DIR: no DIR, or a DIR it cannot write (a file in its way), is one `Error:` line
    naming what to fix, no traceback (its entry point, here); a DIR it can write gets the shards and the line that
    trains on them (the command itself)."""
    from framework.zoo import shards as writer

    def mistake(*args: str) -> str:
        code = writer.main(list(args))
        printed = capsys.readouterr()
        return one_error_line(subprocess.CompletedProcess(args, code, printed.out, printed.err))

    assert "expected one argument, the folder to write the shards into" in mistake()
    (tmp_path / "file").write_text("in the way")
    line = mistake(str(tmp_path / "file" / "shards"))
    assert str(tmp_path / "file") in line and "expected a folder" in line, line
    written = run_process([sys.executable, "-m", "framework.zoo.shards", str(tmp_path / "ok")])
    assert written.returncode == 0 and "python run.py data=webdataset" in written.stdout, output(written)
    assert (tmp_path / "ok" / "train-000000.tar").is_file() and not list((tmp_path / "ok").glob("*.tmp"))


def test_predict_over_a_stream_is_refused_in_one_line():
    data = module(Counting(5))
    data.setup(seed=0)
    with pytest.raises(ConfigError, match="data.train: Counting is a stream; predict writes rows by dataset index"):
        next(data.predict_batches("train"))
