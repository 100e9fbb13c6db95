"""Checkpoints: what each save policy keeps, atomic writes, damaged and mismatched checkpoints, init_from, the
pickle-free format and the three resume modes.

Where the command line matters (resume discovery, run directories, the one-line errors) a real `run.py` runs in
a subprocess; policies and file-level behaviour run in-process, which is much faster. One small finished run
(`base`) is shared; tests that change a run work on a copy of it.
"""
from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import weakref
import zlib
from pathlib import Path

import pytest
import torch
from conftest import one_error_line, output, read_scalars, replace, run_cli
from safetensors.torch import load_file

from framework.app.resume import find_checkpoint
from framework.checkpoint import (
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointManager,
    CheckpointWriter,
    DamagedCheckpoint,
    UnreadableCheckpoint,
    check_compatible,
    find_latest,
    load_weights,
    open_checkpoint,
    write_checkpoint,
)
from framework.config.instantiate import build
from framework.core.errors import ConfigError

pytestmark = pytest.mark.unit

SMALL = ("trainer.max_epochs=3", "trainer.limit_train_batches=2")  # 3 epochs of 2 steps: steps 2, 4, 6


# ---------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, str]:
    """A finished run (default policy plus a step-N per epoch, all kept) and its console output. It runs with
    resume=auto on a fresh directory, so its output is also the "starts fresh" half of the resume=auto test."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    proc = run_cli(run_dir, "resume=auto", *SMALL, "checkpoint.every_n_epochs=1", "checkpoint.keep_last=-1",
                   "logger.tensorboard=false")  # resumed copies inherit it: no TensorBoard start-up cost
    assert proc.returncode == 0, output(proc)
    return run_dir, output(proc)


def copy_run(base: tuple[Path, str], tmp_path: Path) -> Path:
    return Path(shutil.copytree(base[0], tmp_path / "run"))


def names(run_dir: Path) -> set[str]:
    return {p.name for p in (run_dir / "checkpoints").iterdir()}


def step_of(path: Path) -> int:
    return open_checkpoint(path).step


def train(compose, run_dir: Path, *overrides: str) -> dict:
    """Train in this process, exactly as run.py would (the summary is written to run_dir/summary.json too)."""
    from framework.loop.trainer import Trainer

    cfg = compose("logger.progress_bar=false", *overrides)
    return Trainer(cfg, run_dir).fit()


def truncate_model(ck: Path) -> None:
    data = (ck / MODEL_FILE).read_bytes()
    replace(ck / MODEL_FILE, data[: len(data) // 2])


def flip_a_byte(ck: Path) -> None:  # same size, still a valid safetensors file: only the checksum can tell
    data = bytearray((ck / MODEL_FILE).read_bytes())
    data[-1] ^= 0xFF
    replace(ck / MODEL_FILE, bytes(data))


def drop_checksums(ck: Path) -> None:
    meta = json.loads((ck / META_FILE).read_text())
    del meta["checksums"]
    replace(ck / META_FILE, json.dumps(meta).encode())


DAMAGE = {  # kind -> (how, the file the message must name)
    "truncated model.safetensors": (truncate_model, MODEL_FILE),
    "missing state.safetensors": (lambda ck: (ck / STATE_FILE).unlink(), STATE_FILE),
    "bad JSON in meta.json": (lambda ck: replace(ck / META_FILE, (ck / META_FILE).read_bytes()[:-20]), META_FILE),
    "checksum mismatch": (flip_a_byte, MODEL_FILE),
    "meta.json without checksums": (drop_checksums, META_FILE),
}


# ---------------------------------------------------------------------------------------------- 1. policies
def test_default_policy_keeps_last_and_best_by_val_acc(compose, tmp_path):
    summary = train(compose, tmp_path, *SMALL)
    val_acc = read_scalars(tmp_path)["val/acc"]  # (step, value) after each epoch
    best_step, best_acc = max(val_acc, key=lambda sv: sv[1])  # the first of equal values: an equal one is no gain
    assert len({v for _, v in val_acc}) > 1  # otherwise "best" would prove nothing
    assert names(tmp_path) == {"last", "best", f"step-{best_step}"}
    assert step_of(tmp_path / "checkpoints" / "last") == 6
    assert summary["best_checkpoint"] == str(tmp_path / "checkpoints" / "best")
    best = open_checkpoint(tmp_path / "checkpoints" / "best").meta
    assert best["step"] == best_step
    assert best["metrics"]["val/acc"] == pytest.approx(best_acc)
    assert summary["best/val/acc"] == pytest.approx(best_acc)


def test_every_epoch_policy_keeps_a_step_checkpoint_per_epoch(compose, tmp_path):
    summary = train(compose, tmp_path, *SMALL, "checkpoint=every_epoch")
    assert names(tmp_path) == {"last", "step-2", "step-4", "step-6"}
    assert [open_checkpoint(tmp_path / "checkpoints" / f"step-{n}").meta["epoch"] for n in (2, 4, 6)] == [1, 2, 3]
    assert summary["best_checkpoint"] is None


def test_best_k_policy_keeps_the_3_lowest_val_loss_and_best_is_the_min(compose, tmp_path):
    summary = train(compose, tmp_path, "trainer.max_epochs=5", "trainer.limit_train_batches=1", "checkpoint=best_k")
    val_loss = sorted(read_scalars(tmp_path)["val/loss"], key=lambda sv: sv[1])  # 5 epochs of 1 step
    assert len(val_loss) == 5
    assert names(tmp_path) == {"last", "best", *(f"step-{s}" for s, _ in val_loss[:3])}
    assert step_of(tmp_path / "checkpoints" / "best") == val_loss[0][0]
    assert summary["best_checkpoint"] == str(tmp_path / "checkpoints" / "best")


def test_best_k_selection_with_a_metric_that_goes_up_and_down(tmp_path):
    """The same policy without training, on a metric chosen so that the 3 best are not the 3 newest."""
    manager = CheckpointManager(tmp_path, save_last=True, monitor="val/loss", mode="min", save_top_k=3)
    for step, loss in enumerate([0.5, 0.2, 0.9, 0.1, 0.3, 0.4], start=1):
        manager.save(Snapshot(step), step, periodic=False, metrics={"val/loss": loss})
    assert {p.name for p in tmp_path.iterdir()} == {"last", "best", "step-2", "step-4", "step-5"}
    assert step_of(tmp_path / "best") == 4 and step_of(tmp_path / "last") == 6


def test_every_n_steps_with_keep_last_2_keeps_exactly_the_2_newest_periodic(compose, tmp_path):
    # 3 epochs of 3 steps: periodic saves at steps 2, 4, 8 (mid-epoch) and 6 (an epoch's end); best by val/acc.
    train(compose, tmp_path, "trainer.max_epochs=3", "trainer.limit_train_batches=3",
          "checkpoint.every_n_steps=2", "checkpoint.keep_last=2")
    best_step = step_of(tmp_path / "checkpoints" / "best")
    assert best_step in (3, 6, 9)  # the best is chosen after validation, at an epoch's end
    # The best's own step-N is kept by the top-k policy, whatever keep_last says.
    assert names(tmp_path) == {"last", "best", "step-6", "step-8", f"step-{best_step}"}


def test_checkpoint_none_writes_no_checkpoints_dir(compose, tmp_path):
    summary = train(compose, tmp_path, *SMALL, "checkpoint=none")
    assert (tmp_path / "summary.json").is_file()
    assert not (tmp_path / "checkpoints").exists()
    assert summary["best_checkpoint"] is None


# ---------------------------------------------------------------------------------------------- 2. atomicity
class Snapshot:
    """A fixed checkpoint content, as the trainer's TrainingState.collect() gives one."""

    def __init__(self, step: int) -> None:
        self.step = step

    def collect(self):
        return ({"w": torch.full((3,), float(self.step))}, {"opt": {"m": torch.ones(2) * self.step}},
                {"step": self.step, "config": {}})


def small_checkpoint(path: Path, step: int) -> None:
    write_checkpoint(path, {"w": torch.full((3,), float(step))}, {"opt": {"m": torch.ones(2) * step}},
                     {"step": step, "config": {}})


def crash_on_rename_of_tmp(monkeypatch) -> None:
    """Make the rename that moves a finished NAME.tmp into place fail, as a crash at that instant would."""
    rename = os.rename

    def failing(src, dst):
        if str(src).endswith(".tmp"):
            raise OSError("simulated crash")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)


def test_a_save_that_crashes_half_way_leaves_the_previous_checkpoint_loadable(tmp_path, caplog):
    last = tmp_path / "checkpoints" / "last"
    small_checkpoint(last, 1)
    with pytest.raises(TypeError, match="holds a object"):
        write_checkpoint(last, {"w": torch.zeros(3)}, {"bad": object()}, {"step": 2, "config": {}})
    assert (tmp_path / "checkpoints" / "last.tmp").is_dir()  # the half-written save is still there
    # A finished save that was never renamed into place is a leftover too, however new and complete.
    small_checkpoint(tmp_path / "checkpoints" / "step-9", 9)
    os.rename(tmp_path / "checkpoints" / "step-9", tmp_path / "checkpoints" / "step-9.tmp")
    with caplog.at_level(logging.WARNING):
        found = find_latest(tmp_path)
    assert found is not None and found.path == last and found.step == 1
    assert torch.equal(found.model_state()["w"], torch.full((3,), 1.0))
    assert "Skipping" not in caplog.text  # leftovers are ignored, not reported as damaged


def test_a_crash_between_the_two_renames_leaves_last_old_which_find_latest_finds(tmp_path, monkeypatch):
    last = tmp_path / "checkpoints" / "last"
    small_checkpoint(last, 1)
    crash_on_rename_of_tmp(monkeypatch)
    with pytest.raises(OSError, match="simulated crash"):
        small_checkpoint(last, 2)  # last -> last.old done, last.tmp -> last not
    assert not last.exists()
    found = find_latest(tmp_path)
    assert found is not None and found.path.name == "last.old" and found.step == 1
    monkeypatch.undo()
    small_checkpoint(last, 3)  # the next save puts last back in place and clears the leftovers
    assert names(tmp_path) == {"last"} and step_of(last) == 3


def test_a_second_crash_while_only_last_old_exists_still_leaves_it(tmp_path, monkeypatch):
    """After a crash between the renames the run resumes from last.old; if its next save of `last` crashes
    too, last.old must still be there (it is the only intact copy)."""
    last = tmp_path / "checkpoints" / "last"
    small_checkpoint(last, 1)
    os.rename(last, last.with_name("last.old"))
    crash_on_rename_of_tmp(monkeypatch)
    with pytest.raises(OSError, match="simulated crash"):
        small_checkpoint(last, 2)
    found = find_latest(tmp_path)
    assert found is not None and found.step == 1


def test_checkpoint_fsync_false_writes_the_same_files(tmp_path):
    """checkpoint.fsync=false only skips the flushes: the bytes on disk are the same, and it loads."""
    model, state = {"w": torch.arange(6.0).reshape(2, 3)}, {"opt": {"m": torch.ones(4)}, "n": 3}
    write_checkpoint(tmp_path / "durable", model, state, {"step": 5, "config": {}}, durable=True)
    write_checkpoint(tmp_path / "fast", model, state, {"step": 5, "config": {}}, durable=False)
    for name in (MODEL_FILE, STATE_FILE, META_FILE):
        assert (tmp_path / "durable" / name).read_bytes() == (tmp_path / "fast" / name).read_bytes()
    loaded = open_checkpoint(tmp_path / "fast")
    weights = loaded.model_state()
    assert torch.equal(weights["w"], model["w"]) and loaded.state()["n"] == 3
    weights["w"].add_(1)  # loaded tensors map the file copy-on-write: changing one leaves the file as it was
    assert torch.equal(open_checkpoint(tmp_path / "fast").model_state()["w"], model["w"])


def set_meta(ck: Path, **changes) -> None:
    meta = json.loads((ck / META_FILE).read_text())
    replace(ck / META_FILE, json.dumps({**meta, **changes}).encode())


def test_a_background_save_writes_the_state_as_it_was_when_save_returned(tmp_path):
    """async_save copies the state before returning: training may change the tensors at once."""
    writer = CheckpointWriter(background=True)
    weights, momentum = torch.arange(6.0), torch.ones(4)
    writer.write(tmp_path / "a", {"w": weights}, {"opt": {"m": momentum}, "n": 1}, {"step": 1, "config": {}})
    weights.add_(100), momentum.mul_(7)  # as the next optimizer steps do, while the files are being written
    first = {key: buffer.data_ptr() for key, buffer in writer._staging.items()}
    assert not set(first.values()) & {weights.data_ptr(), momentum.data_ptr()}  # copies, not the live tensors
    writer.write(tmp_path / "b", {"w": weights}, {"opt": {"m": momentum}, "n": 2}, {"step": 2, "config": {}})
    writer.wait()
    a, b = open_checkpoint(tmp_path / "a"), open_checkpoint(tmp_path / "b")
    assert torch.equal(a.model_state()["w"], torch.arange(6.0)) and torch.equal(a.state()["opt"]["m"], torch.ones(4))
    assert torch.equal(b.model_state()["w"], weights) and torch.equal(b.state()["opt"]["m"], momentum)
    assert (a.step, b.step) == (1, 2) and not list(tmp_path.glob("*.tmp"))
    # The second save reused the first one's host buffers: no allocation per save.
    assert {key: buffer.data_ptr() for key, buffer in writer._staging.items()} == first
    writer.close()  # the end of fit: the thread and the buffers are freed
    assert not writer._staging and writer._thread is None


def test_the_staging_buffer_holds_exactly_the_state_and_close_lets_it_go(tmp_path):
    """One buffer of the state's bytes (each tensor's place 64-byte aligned), not a power of two of them (what
    torch's caching host allocator would pin, for good); dropped by close(), as a pinned one is then unpinned."""
    writer = CheckpointWriter(background=True)
    state = {"w": torch.ones(1000), "b": torch.ones(3, dtype=torch.float16)}  # 4000 + 6 bytes
    writer.write(tmp_path / "a", state, {"n": 1}, {"step": 1, "config": {}})
    writer.wait()
    assert writer._buffer is not None and writer._buffer.numel() == 4032 + 64
    buffer = weakref.ref(writer._buffer)
    writer.close()
    gc.collect()
    assert buffer() is None and not writer._staging
    assert torch.equal(open_checkpoint(tmp_path / "a").model_state()["w"], state["w"])


def test_a_background_save_that_fails_raises_at_the_next_wait_and_keeps_the_previous_one(tmp_path):
    writer = CheckpointWriter(background=True)
    writer.write(tmp_path / "last", {"w": torch.zeros(3)}, {}, {"step": 1, "config": {}})
    (tmp_path / "file").write_text("not a folder")
    writer.write(tmp_path / "file" / "last", {"w": torch.ones(3)}, {}, {"step": 2, "config": {}})
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # an error is raised once
    assert open_checkpoint(tmp_path / "last").step == 1


def test_a_failed_background_save_prunes_nothing(tmp_path, monkeypatch):
    """The pruning queued after a save assumes it succeeded: after a failure it must not run, or the older
    periodic checkpoint (the only one left with keep_last=1) would go."""
    manager = CheckpointManager(tmp_path, every_n_steps=1, keep_last=1, async_save=True)

    manager.save(Snapshot(1), 1, periodic=True)
    manager.writer.wait()
    crash_on_rename_of_tmp(monkeypatch)  # the save of step 2 cannot move its folder into place
    manager.save(Snapshot(2), 2, periodic=True)
    with pytest.raises(OSError):
        manager.writer.wait()
    assert open_checkpoint(tmp_path / "step-1").step == 1


def test_a_save_after_a_failed_one_is_still_written_then_the_failure_raised(tmp_path):
    """A signal's save of `last` must not be lost because an earlier background save failed."""
    writer = CheckpointWriter(background=True)
    (tmp_path / "file").write_text("not a folder")
    writer.write(tmp_path / "file" / "step-1", {"w": torch.zeros(3)}, {}, {"step": 1, "config": {}})
    with pytest.raises(OSError):
        writer.write(tmp_path / "last", {"w": torch.ones(3)}, {}, {"step": 2, "config": {}})
    writer.wait()
    assert open_checkpoint(tmp_path / "last").step == 2


@pytest.mark.parametrize("background", [False, True], ids=["inline", "async"])
def test_tied_weights_are_saved_and_restored_tied(tmp_path, background):
    """safetensors refuses tensors sharing memory: an embedding tied to the output layer is stored twice."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    writer = CheckpointWriter(background=background)
    writer.write(tmp_path / "last", model.state_dict(), {}, {"step": 1, "config": {}})
    writer.wait()
    restored = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    restored[1].weight = restored[0].weight
    restored.load_state_dict(open_checkpoint(tmp_path / "last").model_state())
    assert torch.equal(restored[0].weight, model[0].weight) and restored[1].weight is restored[0].weight


def test_async_save_writes_the_same_checkpoints_as_an_inline_save(compose, tmp_path):
    train(compose, tmp_path / "async", *SMALL, "checkpoint.every_n_steps=1", "checkpoint.keep_last=-1")
    train(compose, tmp_path / "inline", *SMALL, "checkpoint.every_n_steps=1", "checkpoint.keep_last=-1",
          "checkpoint.async_save=false")
    assert names(tmp_path / "async") == names(tmp_path / "inline") == {"last", "best", *(f"step-{s}" for s in range(1, 7))}
    for name in names(tmp_path / "async"):
        for file in (MODEL_FILE, STATE_FILE):
            async_file, inline_file = (tmp_path / run / "checkpoints" / name / file for run in ("async", "inline"))
            assert async_file.read_bytes() == inline_file.read_bytes(), (name, file)


def test_a_format_1_checkpoint_with_crc32_checksums_still_loads(tmp_path):
    small_checkpoint(tmp_path / "checkpoints" / "last", 7)
    last = tmp_path / "checkpoints" / "last"
    set_meta(last, format_version=1, checksums={name: zlib.crc32((last / name).read_bytes())
                                                for name in (MODEL_FILE, STATE_FILE)})
    found = find_latest(tmp_path)
    assert found is not None and found.step == 7 and found.meta["format_version"] == 1
    assert torch.equal(found.model_state()["w"], torch.full((3,), 7.0))
    flip_a_byte(last)  # and its CRC-32 still catches damage
    with pytest.raises(DamagedCheckpoint, match="does not match its checksum"):
        open_checkpoint(last)


def test_a_checkpoint_of_a_newer_format_stops_discovery_instead_of_being_skipped(tmp_path):
    """resume=auto must not start over on top of checkpoints it cannot read: its first saves would prune them."""
    small_checkpoint(tmp_path / "checkpoints" / "step-5", 5)
    small_checkpoint(tmp_path / "checkpoints" / "last", 9)
    set_meta(tmp_path / "checkpoints" / "last", format_version=99)
    with pytest.raises(UnreadableCheckpoint, match="format version 99 comes from a newer version"):
        find_latest(tmp_path)


def test_a_file_replaced_after_it_was_verified_is_verified_again(tmp_path):
    last = tmp_path / "last"
    small_checkpoint(last, 3)
    opened = open_checkpoint(last)
    flip_a_byte(last)  # e.g. a run still writing replaced it between discovery and loading
    with pytest.raises(DamagedCheckpoint, match="does not match its checksum"):
        opened.model_state()


# ---------------------------------------------------------------------------------------------- 3. damage
@pytest.mark.e2e
@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_run_dir_skips_a_damaged_checkpoint_with_a_warning_naming_it(base, tmp_path, caplog, kind):
    run_dir = copy_run(base, tmp_path)
    last = run_dir / "checkpoints" / "last"
    damage, file = DAMAGE[kind]
    damage(last)
    newest_intact = max(step_of(p) for p in (run_dir / "checkpoints").iterdir() if p.name != "last")
    with caplog.at_level(logging.WARNING):
        found = find_checkpoint(str(run_dir), run_dir)
    assert found.path.name != "last" and found.step == newest_intact
    assert f"Skipping a damaged checkpoint: checkpoint {last}: {file}" in caplog.text


@pytest.mark.e2e
@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_named_explicitly_is_one_clear_error(base, tmp_path, kind):
    run_dir = copy_run(base, tmp_path)
    last = run_dir / "checkpoints" / "last"
    damage, file = DAMAGE[kind]
    damage(last)
    with pytest.raises(ConfigError, match=f"resume='{last}': checkpoint {last}: {file}"):
        find_checkpoint(str(last), tmp_path / "new")


@pytest.mark.e2e
def test_cli_resume_run_dir_with_a_damaged_last_resumes_from_the_newest_intact(base, tmp_path):
    run_dir = copy_run(base, tmp_path)
    folder = run_dir / "checkpoints"
    for path in folder.iterdir():  # keep no intact copy of the newest step: resume must go back to step 4
        if path.name != "last" and step_of(path) == 6:
            shutil.rmtree(path)
    truncate_model(folder / "last")
    proc = run_cli(None, f"resume={run_dir}", fast=False)
    assert proc.returncode == 0, output(proc)
    assert f"Skipping a damaged checkpoint: checkpoint {folder / 'last'}: {MODEL_FILE}" in output(proc)
    assert "at step 4 (epoch 2, batch 0)" in output(proc) and "Resumed from" in output(proc)
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 6
    assert step_of(folder / "last") == 6  # the damaged last was replaced by an intact one


@pytest.mark.e2e
def test_cli_resume_of_a_damaged_checkpoint_named_explicitly_is_one_error_line(base, tmp_path):
    run_dir = copy_run(base, tmp_path)
    flip_a_byte(run_dir / "checkpoints" / "last")
    line = one_error_line(run_cli(tmp_path / "new", f"resume={run_dir / 'checkpoints' / 'last'}"))
    assert f"checkpoint {run_dir / 'checkpoints' / 'last'}: {MODEL_FILE} does not match its checksum" in line


# ---------------------------------------------------------------------------------------------- 4. mismatch
@pytest.mark.e2e
def test_cli_resume_with_another_model_option_is_one_error_naming_the_group(base, tmp_path):
    line = one_error_line(run_cli(tmp_path / "new", f"resume={base[0] / 'checkpoints' / 'last'}", "model=cnn"))
    assert "model=cnn: the run used model=mlp, and its weights cannot carry over" in line
    assert not (tmp_path / "new").exists()  # refused before it started: no run directory left behind


@pytest.mark.e2e
def test_cli_resume_with_a_model_value_that_changes_the_weights_is_one_error_listing_the_keys(base, tmp_path):
    line = one_error_line(run_cli(tmp_path / "new", f"resume={base[0] / 'checkpoints' / 'last'}",
                                  "model.hidden=[32]"))
    assert "its weights do not fit this model" in line
    assert "shape mismatch net.1.weight (256, 64) vs (32, 64)" in line


@pytest.mark.e2e
def test_init_from_a_checkpoint_of_another_model_is_one_error_listing_the_keys(compose, base, tmp_path):
    from framework.loop.trainer import Trainer

    keys = r"\(missing features\.0\.weight, .*; unexpected net\.1\.bias, net\.1\.weight, net\.3\.bias \.\.\.\)"
    with pytest.raises(ConfigError, match=r"init_from=.*: its weights do not fit this model " + keys):
        Trainer(compose("model=cnn", f"init_from={base[0] / 'checkpoints' / 'last'}"), tmp_path)


def test_a_shape_mismatch_names_the_key_and_both_shapes(compose):
    model = build(compose("model.hidden=[128,128]").model, "model")
    saved = build(compose().model, "model").state_dict()
    with pytest.raises(ConfigError, match=r"shape mismatch net\.1\.weight \(256, 64\) vs \(128, 64\)"):
        check_compatible(model, saved, "init_from='x'", strict=False)  # even lenient loading refuses it


# ---------------------------------------------------------------------------------------------- 5. init_from
def initial_weights(compose, tmp_path: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """The weights a run starts training from."""
    from framework.loop.trainer import Trainer

    trainer = Trainer(compose("logger.tensorboard=false", *overrides), tmp_path / "run")
    return trainer.run.strategy.unwrap(trainer.run.task.model).state_dict()


def other_model(compose) -> torch.nn.Module:
    torch.manual_seed(1234)  # not the run's seed: its weights differ from the run's own initial weights
    return build(compose().model, "model")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("wrap", [False, True], ids=["plain state dict", "DataParallel module. prefix"])
def test_init_from_a_torch_save_file_sets_the_initial_weights(compose, tmp_path, wrap):
    model = other_model(compose)
    saved = (torch.nn.DataParallel(model) if wrap else model).state_dict()
    assert all(k.startswith("module.") for k in saved) == wrap
    torch.save(saved, tmp_path / "weights.pt")
    weights = model.state_dict()
    assert not torch.equal(initial_weights(compose, tmp_path)["net.1.weight"], weights["net.1.weight"])
    assert_same(initial_weights(compose, tmp_path, f"init_from={tmp_path / 'weights.pt'}"), weights)


def test_init_strict_false_tolerates_a_missing_head(compose, tmp_path):
    weights = other_model(compose).state_dict()
    head = next(reversed(weights)).rsplit(".", 1)[0] + "."  # the last layer, e.g. "net.5."
    body = {k: v for k, v in weights.items() if not k.startswith(head)}
    torch.save(body, tmp_path / "body.pt")
    with pytest.raises(ConfigError, match=f"missing {head}weight, {head}bias"):
        initial_weights(compose, tmp_path, f"init_from={tmp_path / 'body.pt'}")
    got = initial_weights(compose, tmp_path, f"init_from={tmp_path / 'body.pt'}", "init_strict=false")
    fresh = initial_weights(compose, tmp_path)
    assert_same({k: v for k, v in got.items() if k in body}, body)
    assert_same({k: v for k, v in got.items() if k not in body}, {k: v for k, v in fresh.items() if k not in body})


@pytest.mark.parametrize("name, content", [("absent.safetensors", None), ("garbage.safetensors", b"not a file"),
                                           ("garbage.pt", b"not a file")])
def test_init_from_an_unreadable_file_is_a_config_error(tmp_path, name, content):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=f"init_from='{tmp_path / name}': "):
        load_weights(tmp_path / name)


# ---------------------------------------------------------------------------------------------- 6. no pickle
@pytest.mark.e2e
def test_no_checkpoint_file_is_a_pickle(base):
    files = [p for p in (base[0] / "checkpoints").rglob("*") if p.is_file()]
    assert {p.name for p in files} == {MODEL_FILE, STATE_FILE, META_FILE}
    assert len(files) == 3 * len(names(base[0]))
    for path in files:
        head = path.read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", f"{path} looks like a pickle or a torch.save zip"
        if path.name == META_FILE:
            assert isinstance(json.loads(path.read_text()), dict)
        else:
            assert load_file(str(path))  # safetensors' own loader reads it


# ---------------------------------------------------------------------------------------------- 7. resume modes
@pytest.mark.e2e
def test_resume_auto_starts_fresh_then_resumes_in_place(base, tmp_path):
    first_dir, first = base
    assert f"resume=auto: no checkpoint in {first_dir}; starting fresh" in first and "Resumed" not in first
    run_dir = copy_run(base, tmp_path)  # the same fixed hydra.run.dir, run again with resume=auto
    proc = run_cli(run_dir, "resume=auto", "trainer.max_epochs=4")
    assert proc.returncode == 0, output(proc)
    assert f"Resumed from {run_dir / 'checkpoints' / 'last'} at step 6 (epoch 3, batch 0)" in output(proc)
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 8


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_resume_checkpoint_dir_starts_a_new_run_directory_from_its_state(base, tmp_path):
    source = base[0] / "checkpoints" / "step-4"
    before = digest(base[0])
    new_dir = tmp_path / "new"
    proc = run_cli(new_dir, f"resume={source}", "logger.progress_bar=false", fast=False)
    assert proc.returncode == 0, output(proc)
    assert f"Resumed from {source} at step 4 (epoch 2, batch 0)" in output(proc)
    assert json.loads((new_dir / "summary.json").read_text())["step"] == 6  # max_epochs=3 from the saved config
    assert step_of(new_dir / "checkpoints" / "last") == 6
    assert (new_dir / ".hydra" / "config.yaml").is_file()  # a run directory of its own
    assert digest(base[0]) == before  # the original run is untouched


@pytest.mark.e2e
def test_resume_run_dir_applies_overrides_and_lists_them(base, tmp_path):
    run_dir = copy_run(base, tmp_path)
    proc = run_cli(None, f"resume={run_dir}", "trainer.max_epochs=5", fast=False)  # no run dir: it continues there
    assert proc.returncode == 0, output(proc)
    assert "Resuming with a changed config (from this command line):\n  trainer.max_epochs: 3 -> 5\n" in output(proc)
    assert f"Resumed from {run_dir / 'checkpoints' / 'last'} at step 6" in output(proc)
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 10
    assert list((run_dir / ".hydra").glob("resumed-*/config.yaml"))  # this invocation's config, beside the original
