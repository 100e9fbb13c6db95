"""Streaming runs through run.py, killed and resumed: the digest test. Every sample carries its ID (two pixels of
its PNG); a callback writes, per rank and optimizer step, the IDs of the batch it trains on. A run SIGKILLed at a
random step (a periodic save possibly still being written) and resumed with `resume=RUN_DIR` trains on exactly the
same IDs at every step, per rank, as a run never interrupted, and ends bit-identical: killed with num_workers=2 and
resumed with none (the rest of the epoch is every sample not yet consumed, each once), and under
2-rank DDP (gloo) with workers; and a 2-rank run resumed on one process consumes the rest of its epoch, every
sample not yet consumed, once."""
from __future__ import annotations

import json
import random
import re
import shutil
import signal
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    KILLHOOK,
    assert_identical,
    final_state,
    on_pythonpath,
    one_error_line,
    output,
    run_cli,
    signal_after_step,
)

from framework.zoo.shards import png, write_tar

pytestmark = pytest.mark.e2e

SIZES = [31, 30, 30, 30]  # 121: under 2 ranks one sample is left out of each epoch

RECORDER = textwrap.dedent('''
    from pathlib import Path
    from framework.callbacks.base import Callback

    class Record(Callback):
        """Appends "STEP ID ID ..." for every training batch to FOLDER/rankR.txt."""

        def __init__(self, folder):
            self.folder = Path(folder)

        def on_train_batch_start(self, trainer, task, batch, batch_idx):
            pixels = (batch[0].flatten(1)[:, :2] * 255).round().long()
            ids = (pixels[:, 0] * 256 + pixels[:, 1]).tolist()
            with open(self.folder / f"rank{trainer.global_rank}.txt", "a") as f:
                f.write(f"{trainer.global_step} {' '.join(map(str, ids))}\\n")
''')


def write_id_shards(folder: Path, prefix: str, sizes: list[int]) -> str:
    """Shards of 1x2 grey PNGs holding the sample's ID (high byte, low byte); label ID % 10."""
    folder.mkdir(parents=True, exist_ok=True)
    first = 0
    for number, size in enumerate(sizes):
        samples = [(f"{i:05d}", {"png": png(np.array([[i // 256, i % 256]], dtype=np.uint8)),
                                 "cls": str(i % 10).encode()}) for i in range(first, first + size)]
        write_tar(folder / f"{prefix}-{number:06d}.tar", samples)
        first += size
    return f"{folder}/{prefix}-{{000000..{len(sizes) - 1:06d}}}.tar"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    folder = tmp_path_factory.mktemp("shards")
    (folder / "record.py").write_text(RECORDER)
    return write_id_shards(folder, "train", SIZES), write_id_shards(folder, "val", [20]), folder


EVERY = 4  # checkpoint.every_n_steps of these runs


def overrides(shards: tuple[str, str, Path], ids: Path, *extra: str) -> tuple[str, ...]:
    train, val, _ = shards
    ids.mkdir(parents=True, exist_ok=True)
    return ("data=webdataset", f"data.train_shards='{train}'", f"data.val_shards='{val}'", "data.input_shape=[1,1,2]",
            "data.batch_size=8", "data.shuffle_buffer=16", "data.num_workers=2", "model.hidden=[8]",
            "trainer.max_epochs=2", f"checkpoint.every_n_steps={EVERY}", "checkpoint.async_save=true", "trainer.test=false",
            "data.test=null",  # no test split: else the digits' shards, written to the user's cache
            "logger.progress_bar=false", "+callbacks.ids._target_=record.Record", f"+callbacks.ids.folder={ids}",
            *extra)


def digest(ids: Path) -> dict[str, dict[int, list[int]]]:
    """Per rank, the IDs trained on at each step; a step trained again after a resume counts once (its last)."""
    found: dict[str, dict[int, list[int]]] = {}
    for path in sorted(ids.glob("rank*.txt")):
        for line in path.read_text().splitlines():
            step, *samples = map(int, line.split())
            found.setdefault(path.stem, {})[step] = samples
    return found


def run(run_dir: Path | None, args: tuple[str, ...], shards, kill_at: int | None = None):
    env = {"PYTHONPATH": on_pythonpath(shards[2], *([KILLHOOK] if kill_at else []))}
    if kill_at:
        env.update(KILL_AT_STEP=str(kill_at), KILL_SIGNAL="SIGKILL")
        if run_dir is not None:  # the newest periodic save before the kill, written behind the loop, is on disk
            # first (an older one may be gone already: checkpoint.keep_last=1 prunes it once the next is written)
            env.update(KILL_WHEN_EXISTS=str(run_dir / "checkpoints" / f"step-{kill_at // EVERY * EVERY}"))
    proc = run_cli(run_dir, *args, fast=False, env=env)
    if kill_at is None:
        assert proc.returncode == 0, output(proc)
    elif "parallel=ddp" in args:  # rank 0 was killed: its parent ends the other rank and says so
        assert proc.returncode == 1 and "terminated with signal SIGKILL" in output(proc), output(proc)
    else:
        assert proc.returncode == -signal.SIGKILL, output(proc)
    return proc


def check_epochs(steps: dict[int, list[int]], per_epoch: int, epochs: int, samples: int) -> None:
    """Each epoch's steps hold distinct IDs: all of them but fewer than `samples` - per-epoch count left out."""
    ordered = [steps[s] for s in sorted(steps)]
    assert len(ordered) == per_epoch * epochs
    for e in range(epochs):
        seen = [i for batch in ordered[e * per_epoch:(e + 1) * per_epoch] for i in batch]
        assert len(seen) == len(set(seen)) and set(seen) <= set(range(samples))


@pytest.mark.slow
def test_single_process_with_workers_killed_and_resumed_trains_on_the_same_ids_and_ends_identical(
        tmp_path, shards):
    kill_at = random.Random(31).randint(9, 29)  # of 32 steps (16 an epoch), after the first save is written
    whole = tmp_path / "whole"
    run(whole, overrides(shards, tmp_path / "ids-whole"), shards)
    steps = digest(tmp_path / "ids-whole")["rank0"]
    check_epochs(steps, 16, 2, 121)
    assert sorted(i for s in range(16) for i in steps[s]) == list(range(121))  # epoch 0: every sample once

    # Killed with two workers, resumed with none: the rest of the epoch is every sample not yet consumed, once
    # each, in the same order (the plan does not depend on the number of workers), so it ends identical.
    killed = tmp_path / "killed"
    run(killed, overrides(shards, tmp_path / "ids-killed"), shards, kill_at=kill_at)
    resumed = run(None, (f"resume={killed}", "trust_saved_config=true", "data.num_workers=0"), shards)
    assert re.search(r"Resumed from \S+ at step [1-9]", output(resumed))  # mid-run, not started again
    assert digest(tmp_path / "ids-killed") == digest(tmp_path / "ids-whole"), f"kill_at={kill_at}"
    assert_identical(final_state(whole), final_state(killed))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ddp_ranks_with_workers_killed_and_resumed_train_on_the_same_ids_and_end_identical(tmp_path, shards):
    kill_at = random.Random(32).randint(6, 14)  # of 16 steps (8 an epoch), after the first save is written
    ddp = ("parallel=ddp", "parallel.devices=2", "trainer.device=cpu")
    whole = tmp_path / "whole"
    proc = run(whole, overrides(shards, tmp_path / "ids-whole", *ddp), shards)
    assert "data.train: 1 of 121 samples are left out of each epoch" in output(proc)
    found = digest(tmp_path / "ids-whole")
    assert set(found) == {"rank0", "rank1"}
    epoch0 = [i for rank in found.values() for s in range(8) for i in rank[s]]
    assert len(epoch0) == len(set(epoch0)) == 120  # no sample on two ranks; one left out for equal steps
    for steps in found.values():
        check_epochs(steps, 8, 2, 121)

    killed = tmp_path / "killed"
    run(killed, overrides(shards, tmp_path / "ids-killed", *ddp), shards, kill_at=kill_at)
    shutil.copytree(killed, tmp_path / "moved")
    shutil.copytree(tmp_path / "ids-killed", tmp_path / "ids-moved")

    # Resumed on one process instead of two: the rest of the epoch is every sample the two ranks had not consumed,
    # each once (and, on one process, nothing left out), numbered to end where a one-process epoch ends.
    moved = run(None, (f"resume={tmp_path / 'moved'}", "trust_saved_config=true", "parallel=single",
                       f"+callbacks.ids.folder={tmp_path / 'ids-moved'}"), shards)
    at = int(re.search(r"Resumed from \S+ at step (\d+) \(epoch 0, batch (\d+)\)", output(moved)).group(1))
    lines = digest(tmp_path / "ids-moved")
    before = [i for rank in lines.values() for step, batch in rank.items() if step < at for i in batch]
    after = [i for step, batch in lines["rank0"].items() if at <= step < at + 8 for i in batch]  # 57 left: 8 batches
    assert sorted(before + after) == list(range(121)), f"kill_at={kill_at}, resumed at {at}"
    assert len(lines["rank0"]) == at + 8 + 16  # then a whole epoch of 16 batches on one process

    resumed = run(None, (f"resume={killed}", "trust_saved_config=true"), shards)
    assert re.search(r"Resumed from \S+ at step [1-9]", output(resumed))
    assert digest(tmp_path / "ids-killed") == found, f"kill_at={kill_at}"
    assert_identical(final_state(whole), final_state(killed))


def test_an_undecodable_sample_read_by_a_worker_is_one_error_line_or_skipped_and_counted(tmp_path, shards):
    folder = tmp_path / "bad"
    folder.mkdir()
    good = png(np.array([[0, 1]], dtype=np.uint8))
    write_tar(folder / "bad-000000.tar", [(f"{i:05d}", {"png": good if i != 13 else b"garbage", "cls": b"1"})
                                          for i in range(40)])
    args = overrides(shards, tmp_path / "ids", "trainer.max_epochs=1")
    args = (*args, f"data.train_shards='{folder}/bad-{{000000..000000}}.tar'", "data.shuffle=false")
    proc = run_cli(tmp_path / "fails", *args, fast=False, env={"PYTHONPATH": on_pythonpath(shards[2])}, timeout=120)
    assert f"sample key '00013' in shard {folder}/bad-000000.tar cannot be decoded" in one_error_line(proc)
    proc = run(tmp_path / "skips", (*args, "data.skip_corrupt=true"), shards)
    assert output(proc).count("cannot be decoded") == 1  # one warning
    assert json.loads((tmp_path / "skips" / "summary.json").read_text())["data_skipped"] == 1


# ---------------------------------------------------------------------------------------------- other data on resume
# Five shards of 8 samples: the run trains on the first four (4 batches of 8 an epoch) and is stopped mid-epoch; its
# resume names one more shard (5 batches an epoch) or one fewer (3).
STOPPED_AT = 6  # epoch 1, batch 2: SIGTERM saves `last` there


def train_pattern(folder: Path, last: int) -> str:
    return f"{folder}/train-{{000000..{last:06d}}}.tar"


@pytest.fixture(scope="module")
def stopped_on_four_shards(tmp_path_factory: pytest.TempPathFactory, shards) -> Path:
    """The folder of a run on shards 0-3 stopped by SIGTERM after step 6, with its shards and the IDs it trained
    on (ids/rank0.txt)."""
    folder = tmp_path_factory.mktemp("other-data")
    write_id_shards(folder, "train", [8] * 5)
    args = ("data=webdataset", f"data.train_shards='{train_pattern(folder, 3)}'", f"data.val_shards='{shards[1]}'",
            "data.test=null", "data.input_shape=[1,1,2]", "data.batch_size=8", "data.shuffle_buffer=16",
            "data.num_workers=0", "model.hidden=[8]", "trainer.max_epochs=3", "logger.progress_bar=false",
            "+callbacks.ids._target_=record.Record", f"+callbacks.ids.folder={folder / 'ids'}")
    (folder / "ids").mkdir()
    # In this process: the run catches SIGTERM (checkpoint.on_signal) and spawns no process (data.num_workers=0).
    with signal_after_step(STOPPED_AT, signal.SIGTERM):
        proc = run_cli(folder / "run", *args, fast=False, env={"PYTHONPATH": on_pythonpath(shards[2])})
    assert proc.returncode == 128 + signal.SIGTERM, output(proc)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("last, samples", [(4, 40), (2, 24)], ids=["more-shards", "fewer-shards"])
def test_a_resume_on_other_shards_is_refused_or_with_resume_on_new_data_trains_them_from_the_next_epoch(
        tmp_path, shards, stopped_on_four_shards, last, samples):
    folder = Path(shutil.copytree(stopped_on_four_shards, tmp_path / "copy"))
    run_dir, ids, env = folder / "run", folder / "ids", {"PYTHONPATH": on_pythonpath(shards[2])}
    old, new = train_pattern(stopped_on_four_shards, 3), train_pattern(stopped_on_four_shards, last)
    resume = (f"resume={run_dir}", "trust_saved_config=true", f"+callbacks.ids.folder={ids}",
              f"data.train_shards='{new}'")
    refused = run_cli(None, *resume, fast=False, env=env)
    line = one_error_line(refused)
    assert f"data.train_shards={new!r}" in line and repr(old) in line, line
    # The printed changes name what would differ: the key typed and the node that interpolates it.
    assert f"data.train.shards: {old!r} -> {new!r}" in output(refused)
    assert max(digest(ids)["rank0"]) == STOPPED_AT - 1  # nothing trained

    accepted = run(None, (*resume, "resume_on_new_data=true"), shards)
    said = [line for line in output(accepted).splitlines() if "resume_on_new_data=true" in line]
    assert len(said) == 1 and "epoch 2 starts from batch 0" in said[0], output(accepted)
    batches = -(-samples // 8)
    steps = digest(ids)["rank0"]
    after = [steps[s] for s in sorted(steps) if s >= STOPPED_AT]
    assert len(after) == batches  # the rest of epoch 1 left, one epoch (2, the last) of the new data's batches
    assert sorted(i for batch in after for i in batch) == list(range(samples))  # each sample of the new shards once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["step"], summary["epoch"], summary["epoch_batches"]) == (STOPPED_AT + batches, 3, batches)
    meta = json.loads((run_dir / "checkpoints" / "last" / "meta.json").read_text())
    assert meta["config"]["data"]["train"]["shards"] == new  # the saved config says what the run read
    assert meta["data_identity"]["train"]["samples"] == samples  # and a later resume is held to the new data
