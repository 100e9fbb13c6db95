"""framework/stages/predictions.py, Task.predict_step and DataModule.predict_batches (issue 30): every sample's row exactly
once in dataset order whatever the size modulo the world size, read back with pyarrow alone; a run killed midway and
resumed ends with the same bytes as an uninterrupted one; what Parquet cannot hold, and a folder that cannot be
written, is one UserError line; two real gloo ranks write their shares and rank 0 merges them."""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
from conftest import start_ranks
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from framework.core.errors import ConfigError, UserError
from framework.data.module import DataModule, EpochSampler
from framework.stages.predictions import PredictionWriter, merge, part_files, predict_indices
from framework.task.classification import ClassificationTask
from framework.task.task import Task, step_function

pytestmark = pytest.mark.unit
BATCH = 4


def outputs(indices: torch.Tensor) -> dict[str, Any]:
    """Columns that are a function of the sample's index, of each kind a step may return."""
    i = indices.to(torch.float32)
    return {
        "prediction": indices % 3,
        "probabilities": torch.stack([i, i + 0.5, i + 0.25], dim=1),
        "name": [f"sample-{int(k)}" for k in indices],
        "half": i.to(torch.bfloat16),
    }


def predict(out_dir: Path, total: int, world: int, *, chunk_rows: int = 8, stop_after: dict[int, int] | None = None):
    """Every rank's share written in batches of BATCH, skipping what an earlier attempt wrote; a rank in
    `stop_after` is abandoned (no close) after that many batches, as a killed process would be."""
    for rank in range(world):
        writer = PredictionWriter(out_dir, rank, world, chunk_rows=chunk_rows)
        done = writer.done()
        todo = torch.tensor([i for i in predict_indices(total, rank, world) if i not in done], dtype=torch.int64)
        for batch, start in enumerate(range(0, len(todo), BATCH)):
            if stop_after is not None and batch == stop_after.get(rank):
                abandon(writer)
                break
            writer.write(todo[start : start + BATCH], outputs(todo[start : start + BATCH]))
        else:
            writer.close()


def abandon(writer: PredictionWriter) -> None:
    """Drop a writer without closing it, as a process killed now would: the batches it holds in memory, not yet a
    part file, are lost."""
    del writer


@pytest.mark.parametrize("total", [0, 1, 7, 10, 11])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_predict_indices_give_every_index_once_in_the_evaluators_unpadded_shards(total, world):
    shares = [list(predict_indices(total, rank, world)) for rank in range(world)]
    assert sorted(i for share in shares for i in share) == list(range(total))
    for rank, share in enumerate(shares):
        assert share == sorted(share)
        assert share == EpochSampler(total, shuffle=False, rank=rank, world_size=world, pad=False).order().tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_merged_file_has_every_index_once_in_dataset_order(tmp_path, world):
    total = 23  # odd, and not a multiple of 2 or 3
    predict(tmp_path / "parts", total, world)
    dest = tmp_path / "out" / "predictions.parquet"
    assert merge(tmp_path / "parts", total, dest, row_group_rows=5) == total
    table = pq.read_table(dest)
    assert table.column_names == ["index", "prediction", "probabilities", "name", "half"]
    assert table.column("index").to_pylist() == list(range(total))
    expected = outputs(torch.arange(total))
    assert table.column("prediction").to_pylist() == expected["prediction"].tolist()
    assert table.column("probabilities").to_pylist() == expected["probabilities"].tolist()
    assert table.column("name").to_pylist() == expected["name"]
    assert table.schema.field("half").type == pa.float32()  # bfloat16, which Arrow lacks, kept exactly
    assert table.schema.field("probabilities").type.list_size == 3
    assert [pq.ParquetFile(dest).metadata.row_group(g).num_rows for g in range(5)] == [5, 5, 5, 5, 3]
    assert not (tmp_path / "parts").exists()  # the parts are removed after the merge
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["predictions.parquet"]


def rows(part: Path) -> int:
    """A part file's rows, read with pyarrow's own reader of Arrow's IPC file format."""
    return pa.ipc.open_file(pa.memory_map(str(part))).read_all().num_rows


def test_each_rank_streams_whole_batches_in_chunks_of_part_files(tmp_path):
    writer = PredictionWriter(tmp_path, 1, 2, chunk_rows=8)
    for start in range(0, 20, BATCH):
        writer.write(torch.arange(start, start + BATCH), {"y": torch.zeros(BATCH)})
    # On disk before close: each whole chunk, as soon as its rows are in.
    assert rows(part_files(tmp_path)[0]) == 8
    writer.close()
    assert [p.name for p in part_files(tmp_path)] == [f"part-r00001-00000{k}.arrow" for k in range(3)]
    assert [rows(p) for p in part_files(tmp_path)] == [8, 8, 4]  # whole batches
    assert writer.done() == set(range(20))


def test_a_killed_run_resumed_keeps_its_chunks_and_ends_with_the_same_bytes(tmp_path):
    total, world = 41, 2
    predict(tmp_path / "once", total, world)
    merge(tmp_path / "once", total, tmp_path / "once.parquet", row_group_rows=16)

    parts = tmp_path / "killed"
    predict(parts, total, world, stop_after={0: 3, 1: 1})  # rank 0: a chunk on disk, a batch lost; 1: none
    stray = parts / "part-r00000-000001.arrow.tmp"
    stray.write_bytes(b"ARROW1 half a chunk")  # the chunk rank 0 was writing when killed
    kept = PredictionWriter(parts, 0, world).done()
    assert kept and len(kept) < total and len(kept) % BATCH == 0
    predict(parts, total, world)
    assert not stray.exists()
    merge(parts, total, tmp_path / "resumed.parquet", row_group_rows=16)
    assert (tmp_path / "resumed.parquet").read_bytes() == (tmp_path / "once.parquet").read_bytes()


def write_part(out_dir: Path, rank: int, indices: list[int]) -> None:
    writer = PredictionWriter(out_dir, rank, 3)
    writer.write(torch.tensor(indices), {"y": torch.tensor(indices)})
    writer.close()


@pytest.mark.parametrize(
    "parts, message",
    [
        ([[0, 1, 2], [2, 3]], "index 2 is written 2 times"),
        ([[0, 1], [3, 4]], "index 2 is missing"),
        ([[0, 1, 2], [3, 4, 5]], "index 5 is outside 0..4"),
        ([[0, 1, 2]], "index 3 is missing"),
    ],
)
def test_a_duplicate_or_missing_index_is_named_and_nothing_is_written(tmp_path, parts, message):
    for rank, indices in enumerate(parts):
        write_part(tmp_path / "parts", rank, indices)
    with pytest.raises(RuntimeError, match=message):
        merge(tmp_path / "parts", 5, tmp_path / "p.parquet", row_group_rows=2)
    assert not list(tmp_path.glob("p.parquet*"))  # no file, no tmp
    assert len(part_files(tmp_path / "parts")) == len(parts)  # kept, to look into


def test_columns_keep_their_types(tmp_path):
    n = 3
    columns = {
        "flag": torch.tensor([True, False, True]),
        "int32": torch.arange(n, dtype=torch.int32),
        "half": torch.ones(n, dtype=torch.float16),
        "double": torch.ones(n, dtype=torch.float64),
        "mask": torch.arange(n * 6).reshape(n, 2, 3),
        "ints": [1, 2, 3],
        "floats": [0.5, 1.5, 2.5],
        "bools": [True, False, False],
    }
    writer = PredictionWriter(tmp_path / "parts", 0, 1)
    writer.write(torch.arange(n), columns)
    writer.close()
    merge(tmp_path / "parts", n, tmp_path / "p.parquet")
    table = pq.read_table(tmp_path / "p.parquet")
    types = {name: str(table.schema.field(name).type) for name in columns}
    assert types == {
        "flag": "bool",
        "int32": "int32",
        "half": "halffloat",
        "double": "double",
        "mask": "fixed_size_list<element: fixed_size_list<element: int64>[3]>[2]",
        "ints": "int64",
        "floats": "double",
        "bools": "bool",
    }
    assert table.column("mask").to_pylist() == columns["mask"].tolist()


class Opaque:
    pass


@pytest.mark.parametrize(
    "out, named, got",
    [
        ({"x": {"a": torch.zeros(2)}}, "'x'", "got a dict with keys a"),
        ({"x": Opaque()}, "'x'", "got a Opaque"),
        ({"x": torch.tensor(1.0)}, "'x'", "got a tensor of shape [] float32"),
        ({"x": torch.zeros(3)}, "'x'", "got a tensor of shape [3] float32"),
        ({"x": torch.zeros(2, 0)}, "'x'", "got a tensor of shape [2, 0] float32"),
        ({"x": torch.zeros(2, dtype=torch.complex64)}, "'x'", "complex64"),
        ({"x": ["a"]}, "'x'", "got a list of 1 str"),
        ({"x": ["a", 1]}, "'x'", "got a list of 2 int/str"),
        ({"x": [2**70, 1]}, "'x'", "got a list of 2 int"),
        ({"x": [None, None]}, "'x'", "got a list of 2 NoneType"),
        ({"index": torch.zeros(2)}, "'index'", "the sample's index is written there"),
        ({3: torch.zeros(2)}, "3", "a column name of type str"),
        (None, "predict_step returned None", "expected a dict of column name"),
        ({}, "predict_step returned a dict with keys", "expected a dict of column name"),
        ((torch.zeros(2),), "predict_step returned a tuple", "expected a dict of column name"),
    ],
)
def test_what_parquet_cannot_hold_is_one_line_naming_the_column(tmp_path, out, named, got):
    writer = PredictionWriter(tmp_path, 0, 1)
    with pytest.raises(UserError) as err:
        writer.write(torch.arange(2), out)
    message = str(err.value)
    assert "\n" not in message and named in message and got in message, message
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_column_changing_between_batches_is_one_line_naming_it(tmp_path):
    writer = PredictionWriter(tmp_path, 0, 1)
    writer.write(torch.arange(2), {"y": torch.zeros(2), "z": torch.zeros(2)})
    for out, got in [
        ({"y": torch.zeros(2, dtype=torch.float64), "z": torch.zeros(2)}, "'y': got double"),
        ({"y": torch.zeros(2)}, "'z': missing"),
        ({"y": torch.zeros(2), "z": torch.zeros(2), "w": torch.zeros(2)}, "'w': a new column"),
    ]:
        with pytest.raises(UserError, match=got) as err:
            writer.write(torch.arange(2, 4), out)
        assert "\n" not in str(err.value)


def test_a_resumed_run_with_other_columns_is_one_line(tmp_path):
    write_part(tmp_path, 0, [0, 1])
    with pytest.raises(UserError, match="'y': got double where an earlier batch"):
        PredictionWriter(tmp_path, 1, 3).write(torch.arange(2, 4), {"y": torch.zeros(2, dtype=torch.float64)})


def test_a_folder_that_cannot_be_written_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError, match=f"cannot write to {blocker / 'parts'}") as err:
        PredictionWriter(blocker / "parts", 0, 1)
    assert "\n" not in str(err.value)
    write_part(tmp_path / "parts", 0, [0, 1])
    with pytest.raises(UserError, match=f"cannot write to {blocker}") as err:
        merge(tmp_path / "parts", 2, blocker / "p.parquet")
    assert "\n" not in str(err.value)
    assert len(part_files(tmp_path / "parts")) == 1  # kept for a merge that can write


def test_a_folder_replaced_by_a_file_while_writing_is_one_line_at_close(tmp_path):
    writer = PredictionWriter(tmp_path / "parts", 0, 1)
    writer.write(torch.arange(2), {"y": torch.zeros(2)})
    shutil.rmtree(tmp_path / "parts")
    (tmp_path / "parts").write_text("")
    with pytest.raises(UserError, match=f"cannot write to {tmp_path / 'parts'}") as err:
        writer.close()
    assert "\n" not in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_read_only_folder_is_one_line_naming_it(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    writer = PredictionWriter(folder, 0, 1)
    writer.write(torch.arange(2), {"y": torch.zeros(2)})
    with pytest.raises(UserError, match=f"cannot write to {folder}"):
        writer.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_damaged_part_is_predicted_again_and_dropped_by_the_merge_with_a_warning(tmp_path, damage, caplog):
    """Parts are not fsync'd (scratch, renamed into place whole): a machine crash may leave one damaged. It is
    not counted as done, its rows are predicted again, and the merge drops it with one warning naming it."""
    total = 20
    predict(tmp_path / "once", total, 1)
    merge(tmp_path / "once", total, tmp_path / "once.parquet", row_group_rows=16)

    predict(tmp_path / "parts", total, 2)
    victim = part_files(tmp_path / "parts")[0]
    whole = victim.read_bytes()
    victim.write_bytes({"garbage": b"not arrow", "truncated": whole[: len(whole) // 2], "empty": b""}[damage])
    assert PredictionWriter(tmp_path / "parts", 0, 2).done() == set(range(total)) - set(range(0, 8 * 2, 2))
    predict(tmp_path / "parts", total, 2)  # predicts rank 0's lost chunk again
    with caplog.at_level("WARNING", logger="framework.stages.predictions"):
        merge(tmp_path / "parts", total, tmp_path / "resumed.parquet", row_group_rows=16)
    assert [r.getMessage() for r in caplog.records] == [
        f"predictions: part file {victim} cannot be read; its rows were predicted again"]
    assert (tmp_path / "resumed.parquet").read_bytes() == (tmp_path / "once.parquet").read_bytes()
    assert not (tmp_path / "parts").exists()


def test_the_default_predict_step_is_the_models_output_for_the_inputs():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    task = Task(model)
    for batch in (x, (x, torch.zeros(5)), [x]):
        out = step_function(task, "predict_step")(batch, 0)
        assert list(out) == ["output"] and torch.equal(out["output"], model(x))


def test_a_classifier_predicts_the_class_and_its_probabilities(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    with torch.inference_mode():
        out = ClassificationTask(model).eval().predict_step((x, torch.zeros(5, dtype=torch.int64)), 0)
    assert out["prediction"].dtype == torch.int64 and torch.equal(out["prediction"], model(x).argmax(1))
    assert out["probabilities"].dtype == torch.float32 and out["probabilities"].shape == (5, 3)
    assert torch.allclose(out["probabilities"].sum(1), torch.ones(5))
    writer = PredictionWriter(tmp_path, 0, 1)
    writer.write(torch.arange(5), out)
    writer.close()
    assert pa.ipc.open_file(pa.memory_map(str(part_files(tmp_path)[0]))).schema.names == ["index", "prediction", "probabilities"]


class Ported(Task):
    def predict_step(self, batch):  # Lightning's (batch) form
        return {"double": batch * 2}


class PortedWithIndex(Task):
    def predict_step(self, batch, batch_idx):
        return {"batch_idx": torch.full((len(batch),), batch_idx)}


class Wrong(Task):
    def predict_step(self, batch, batch_idx, dataloader_idx, extra):
        return {}


def test_a_lightning_predict_step_of_batch_or_batch_and_index_is_called_as_declared():
    x = torch.arange(3)
    assert torch.equal(step_function(Ported(nn.Identity()), "predict_step")(x, 7)["double"], x * 2)
    assert step_function(PortedWithIndex(nn.Identity()), "predict_step")(x, 7)["batch_idx"].tolist() == [7] * 3
    with pytest.raises(ConfigError, match=r"Wrong.predict_step\(batch, batch_idx, dataloader_idx, extra\)"):
        step_function(Wrong(nn.Identity()), "predict_step")


class Plain(Dataset):
    """Samples without `.tensors`: forces the DataLoader path."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i


@pytest.mark.parametrize("path", ["fast", "dataloader"])
def test_predict_batches_give_a_ranks_shard_with_indices_less_the_skipped(path):
    n = 23
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    dataset = TensorDataset(x, torch.arange(n)) if path == "fast" else Plain(n)
    data = DataModule(TensorDataset(torch.zeros(1)), test=dataset, batch_size=99, eval_batch_size=3)
    for source in ("test", dataset):
        batches = list(data.predict_batches(source, 1, 3, skip={1, 4, 13}))
        expected = [i for i in range(1, n, 3) if i not in {1, 4, 13}]
        assert [len(indices) for indices, _ in batches] == [3, 2]
        assert torch.cat([indices for indices, _ in batches]).tolist() == expected
        for indices, (x, y) in batches:  # each index is its own sample's
            assert indices.dtype == torch.int64 and y.tolist() == indices.tolist() == x[:, 0].long().tolist()
    assert len(list(data.predict_batches("test", 0, 1))) == 8  # no padding, no drop_last: ceil(23 / 3)
    with pytest.raises(ConfigError, match="data.val: no dataset"):
        next(data.predict_batches("val"))


def _predict_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        task = ClassificationTask(nn.Linear(2, 3)).eval()
        data = DataModule(TensorDataset(torch.randn(11, 2, generator=torch.Generator().manual_seed(1))), batch_size=2)
        writer = PredictionWriter(Path(out, "parts"), rank, world, chunk_rows=2)
        with torch.inference_mode():
            for indices, batch in data.predict_batches("train", rank, world, writer.done()):
                writer.write(indices, task.predict_step(batch))
        writer.close()
        dist.barrier()
        if rank == 0:
            merge(Path(out, "parts"), 11, Path(out, "predictions.parquet"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
@pytest.mark.distributed
def test_two_gloo_ranks_write_their_shares_and_rank_0_merges_them(tmp_path):
    start_ranks(_predict_rank, (2, _free_port(), str(tmp_path)))
    table = pq.read_table(tmp_path / "predictions.parquet")
    torch.manual_seed(0)
    model = nn.Linear(2, 3)
    x = torch.randn(11, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        scores = model(x)
    assert table.column("index").to_pylist() == list(range(11))
    assert table.column("prediction").to_pylist() == scores.argmax(1).tolist()
    probabilities = np.array(table.column("probabilities").to_pylist())
    assert np.allclose(probabilities, scores.softmax(1).numpy(), atol=1e-6)
    assert not (tmp_path / "parts").exists()
