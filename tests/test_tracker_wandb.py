"""framework/observe/wandb_tracker.py: the `logger=wandb` backend beside TensorBoard, on real offline W&B runs.

Nothing reaches the network: every run is offline (the default; WANDB_MODE=offline too), its files under the test's
run directory, W&B's own settings and caches under the test's directory. What a run logged is read back from its
`.wandb` files with `tracker_wandb.history`/`records` (wandb 0.31 has no reader of its own: see that module), and
compared with TensorBoard's events. Every test that opens a W&B run is e2e: wandb.init starts W&B's service process."""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from conftest import on_pythonpath, one_error_line, output, read_scalars, run_cli

from framework.config.validate import validate
from framework.core.errors import ConfigError
from framework.observe.trackers import finish

pytestmark = pytest.mark.e2e

SMALL = ("logger.progress_bar=false", "trainer.max_epochs=2", "trainer.limit_train_batches=3",
         "trainer.log_every_n_steps=1", "trainer.test=false")


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Iterator[dict[str, str]]:
    """W&B's environment for a test: offline, quiet, its settings, caches and default directory in tmp_path. A run
    trained in this process starts a W&B service here and names it in WANDB_SERVICE, which every process started
    later would inherit and use instead of its own: the service is stopped and the variable removed afterwards."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb_dir"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb_data")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield env
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    os.environ.pop("WANDB_SERVICE", None)


# ---------------------------------------------------------------------------------------------- W&B's offline files
# What an offline W&B run wrote, read back to check it: wandb 0.31 has no reader of its own `.wandb` files (the Python
# DataStore of earlier versions is gone), so this reads the transaction log's framing (LevelDB's log format, the
# header W&B puts before it) and parses each record with wandb's protocol buffers, as `wandb sync` does. The framework
# itself never reads these files.
WANDB_HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version 0
WANDB_RECORD_HEADER = struct.Struct("<IHB")  # crc32c, length, type
WANDB_BLOCK = 32 * 1024
WANDB_FULL, WANDB_LAST = 1, 4  # a whole record; the last part of one


def records(path: Path) -> Iterator[Any]:
    """Every record of a `.wandb` file, in order; a record cut short (a killed run's last) ends the file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < WANDB_HEADER.size:
        return
    assert WANDB_HEADER.unpack_from(data) == (b":W&B", 0xBEE1, 0), f"{path}: not a version 0 W&B transaction log"
    pos, parts = WANDB_HEADER.size, b""
    while pos + WANDB_RECORD_HEADER.size <= len(data):
        room = WANDB_BLOCK - pos % WANDB_BLOCK
        if room < WANDB_RECORD_HEADER.size:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = WANDB_RECORD_HEADER.unpack_from(data, pos)
        body = data[pos + WANDB_RECORD_HEADER.size: pos + WANDB_RECORD_HEADER.size + length]
        if len(body) < length:
            return
        if kind == 0:  # zeros: the rest of the block is padding
            pos += room
            continue
        pos += WANDB_RECORD_HEADER.size + length
        parts += body
        if kind in (WANDB_FULL, WANDB_LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def history(path: Path) -> Iterator[dict[str, Any]]:
    """A `.wandb` file's logged rows, each with its `_step`."""
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            yield {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}


def run_files(where: Path, run_id: str) -> list[Path]:
    """The `.wandb` files of one run under `where/wandb` (one per start: the first, each resume), oldest first.
    W&B names a start's folder `[offline-]run-<time>-<id>`, and a later start within the same second
    `...-<id>-1`, `-2`, ...: ordered by time, then that number (as text, `-1` sorts before the first start's)."""
    found = (where / "wandb").glob(f"*run-*/run-{run_id}.wandb")  # offline-run-*, run-* (online); not latest-run

    def started(path: Path) -> tuple[str, int]:
        name = path.parent.name
        again = name.rsplit(f"-{run_id}", 1)[1]  # "" for the first start of that second, "-N" after
        return name.split("run-", 1)[1].split("-", 1)[0], int(again[1:] or 0)

    return sorted((path for path in found if not path.parent.is_symlink()), key=started)


def train(compose, run_dir: Path, *overrides: str, resume_from: Path | None = None) -> dict:
    from framework.checkpoint import open_checkpoint
    from framework.loop.trainer import Trainer

    checkpoint = open_checkpoint(resume_from) if resume_from is not None else None
    return Trainer(compose(*SMALL, *overrides), run_dir, resume_from=checkpoint).fit()


def kept(run_dir: Path) -> dict:
    return json.loads((run_dir / "trackers.json").read_text())


def series(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """Every point of `key` in the W&B run's files (each start's), in the order they were written."""
    run_id = kept(run_dir)["wandb"]["run_id"]
    return [(row["_step"], row[key]) for path in run_files(run_dir, run_id) for row in history(path) if key in row]


def first_run_record(run_dir: Path):
    run_id = kept(run_dir)["wandb"]["run_id"]
    return next(r.run for r in records(run_files(run_dir, run_id)[0]) if r.WhichOneof("record_type") == "run")


def as_float32(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(step, float(np.float32(value))) for step, value in points]


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.unit
def test_wandb_is_offline_in_the_run_directory_unless_told(compose):
    chosen = compose("logger=[tensorboard,wandb]").logger.wandb
    assert chosen.enabled and chosen.mode == "offline" and chosen.dir is None and list(chosen.tags) == []
    assert not compose().logger.wandb.enabled
    assert compose("logger=many").logger.wandb.enabled


@pytest.mark.unit
def test_a_wandb_mode_that_does_not_exist_is_one_error_naming_the_key(compose):
    with pytest.raises(ConfigError, match=r"^logger.wandb.mode='offlne'.*one of offline, online"):
        validate(compose("logger=wandb", "logger.wandb.mode=offlne"))


# ---------------------------------------------------------------------------------------------- one run
def test_tensorboard_and_wandb_hold_the_same_series(compose, tmp_path, offline):
    run_dir = tmp_path / "run"
    summary = train(compose, run_dir, "logger=[tensorboard,wandb]", "logger.wandb.tags=[mine]")
    assert "failed" not in kept(run_dir)
    events = read_scalars(run_dir)
    for key in ("val/acc", "val/loss", "train/loss", "lr/default", "best/val/acc"):
        assert as_float32(series(run_dir, key)) == events[key], key
    assert [step for step, _ in series(run_dir, "val/acc")] == [3, 6]
    run = first_run_record(run_dir)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["optimizer.lr"] == compose().optimizer.lr and config["run_dir"] == str(run_dir.resolve())
    assert list(run.tags) == ["run", "mine"] and run.display_name == "run" and not run.run_group
    files = run_files(run_dir, run.run_id)[0].parent / "files"
    assert "optimizer:" in (files / "composed_config.yaml").read_text()
    # After the run, the app hands it the summary: the same W&B run, continued, holds it and the best checkpoint.
    finish(run_dir, {**summary, "status": "ok", "test/acc": float("nan")})  # a NaN: null in summary.json (JSON)
    last = run_files(run_dir, run.run_id)[-1]
    saved = json.loads((last.parent / "files" / "summary.json").read_text(), parse_constant=pytest.fail)
    assert saved["best_checkpoint"] == summary["best_checkpoint"] and saved["test/acc"] is None
    updates = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
               for r in records(last) if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    assert updates["best_checkpoint"] == summary["best_checkpoint"] and updates["val/acc"] == summary["val/acc"]


# ---------------------------------------------------------------------------------------------- resume
def test_a_resume_continues_the_same_wandb_run_whose_first_point_of_each_step_is_tensorboards(
    compose, tmp_path, offline
):
    """Trained to step 6 with a checkpoint at each epoch, then resumed from step 3's: the resumed run is the same W&B
    run (a second file) and logs steps 4-6 again, as the killed run had; W&B keeps the first point of a step (its
    server drops a step that does not increase), and they are the same numbers, since the resume is bit-identical.

    Not a SIGKILL here: W&B's service writes its `.wandb` file every 15 s (x_transaction_log_flush_interval), and
    a tiny run killed within a second of starting has nothing in it yet (docs/trackers.md)."""
    run_dir = tmp_path / "run"
    chosen = ("logger=[tensorboard,wandb]", "checkpoint.every_n_epochs=1", "checkpoint.keep_last=-1")
    train(compose, run_dir, *chosen)
    run_id = kept(run_dir)["wandb"]["run_id"]
    before = series(run_dir, "train/loss")
    train(compose, run_dir, *chosen, resume_from=run_dir / "checkpoints" / "step-3")
    assert kept(run_dir)["wandb"]["run_id"] == run_id and len(run_files(run_dir, run_id)) == 2
    after = series(run_dir, "train/loss")
    assert after[: len(before)] == before and after[len(before):] == before[3:]  # steps 4-6 again, equal
    first = dict(reversed(after))  # the first point of each step: what W&B keeps
    assert sorted(first.items()) == before and as_float32(before) == read_scalars(run_dir)["train/loss"]


# ---------------------------------------------------------------------------------------------- multirun
def test_a_multirun_is_one_wandb_group_named_for_the_sweep(tmp_path, offline):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(None, "-m", "optimizer.lr=0.01,0.1", "logger=[tensorboard,wandb]", f"hydra.sweep.dir={sweep_dir}",
                   "trainer.max_epochs=1", "trainer.limit_train_batches=2", "logger.progress_bar=false",
                   fast=False, env=offline)
    assert proc.returncode == 0, output(proc)
    jobs = sorted(p.parent for p in sweep_dir.glob("*/trackers.json"))
    assert len(jobs) == 2
    runs = [first_run_record(job) for job in jobs]
    assert {run.run_group for run in runs} == {"sweep"} and len({run.run_id for run in runs}) == 2
    lrs = sorted(json.loads(next(i.value_json for i in run.config.update if i.key == "optimizer.lr")) for run in runs)
    assert lrs == [0.01, 0.1]


# ---------------------------------------------------------------------------------------------- failures
KILLER = '''
import os, signal
from framework.callbacks.base import Callback

class KillWandbService(Callback):
    """Kills this process's W&B service (wandb-core) after optimizer step 3, as an OOM killer would."""

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.global_step != 3:
            return
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            if stat.split(") ")[1].split()[1] == str(os.getpid()) and "wandb-core" in stat:
                os.kill(int(pid), signal.SIGKILL)
                try:  # dead before the next point is logged, which then fails at once (it is this process's child)
                    os.waitpid(int(pid), 0)
                except ChildProcessError:  # wandb reaped it first
                    pass
'''


def test_a_wandb_service_killed_mid_run_is_one_warning_and_the_run_goes_on(tmp_path, offline):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "wandb_killer.py").write_text(KILLER)
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "logger=[tensorboard,csv,wandb]", "+callbacks.killer._target_=wandb_killer.KillWandbService",
                   *SMALL, env={**offline, "PYTHONPATH": on_pythonpath(tmp_path / "hook")})
    assert proc.returncode == 0, output(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and "wandb" in summary.get("loggers_failed", {}), output(proc)
    assert len([line for line in output(proc).splitlines() if "logger.wandb" in line]) == 1, output(proc)
    assert (run_dir / "checkpoints" / "best").is_dir()
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert any(row.startswith("6,val/acc,") for row in rows)  # the csv tracker went on to the end


def test_choosing_wandb_without_it_installed_is_one_error_line_and_no_run_dir(tmp_path, monkeypatch):
    # As if not installed: `import wandb` fails, importlib.util.find_spec finds nothing. The run is refused before
    # it starts, so W&B's service and environment in this process are never touched.
    monkeypatch.setitem(sys.modules, "wandb", None)
    refused = run_cli(tmp_path / "refused", "logger=[tensorboard,wandb]")
    line = one_error_line(refused)
    assert line.startswith("Error: logger=wandb: the wandb package is not installed"), line
    assert not (tmp_path / "refused").exists()
