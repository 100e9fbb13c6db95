"""framework/observe/wandb_tracker.py: the `logger=wandb` backend beside TensorBoard, on real offline W&B runs.

Nothing reaches the network: every run is offline (the default; WANDB_MODE=offline too), its files under the test's
run directory, W&B's own settings and caches under the test's directory. What a run logged is read back from its
`.wandb` files with `tracker_wandb.history`/`records` (wandb 0.31 has no reader of its own: see that module), and
compared with TensorBoard's events. Every test that opens a W&B run is e2e: wandb.init starts W&B's service process."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from conftest import on_pythonpath, one_error_line, output, read_scalars, run_cli

from framework.config.validate import validate
from framework.core.errors import ConfigError
from framework.observe.trackers import finish
from framework.observe.wandb_tracker import history, records, run_files

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
def test_a_resume_continues_the_same_wandb_run_with_one_point_per_step(compose, tmp_path, offline):
    """Trained to step 6 with a checkpoint at each epoch, then resumed from step 3's: steps 4-6 are in the first
    run's files already, so the resumed run (the same W&B run ID, a second file) logs none of them again.

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
    assert [step for step, _ in after] == [1, 2, 3, 4, 5, 6] and after == before
    assert as_float32(after) == read_scalars(run_dir)["train/loss"]
    assert [step for step, _ in series(run_dir, "val/acc")] == [3, 6]


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


def test_choosing_wandb_without_it_installed_is_one_error_line_and_no_run_dir(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text('import sys\nsys.modules["wandb"] = None  # not installed\n')
    refused = run_cli(tmp_path / "refused", "logger=[tensorboard,wandb]",
                      env={"PYTHONPATH": on_pythonpath(tmp_path / "site")})
    line = one_error_line(refused)
    assert line.startswith("Error: logger=wandb: the wandb package is not installed"), line
    assert not (tmp_path / "refused").exists()
