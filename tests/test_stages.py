"""After training, LightningCLI's stages: `python run.py validate|test ckpt=...` evaluates a saved run's weights in
a run directory of its own, prints the same numbers the run's own summary holds, never touches the saved run, and
turns every bad `ckpt=` into one error line."""
from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, fingerprint, one_error_line, output, read_scalars, replace, run_cli

pytestmark = pytest.mark.e2e

TRAIN = ("logger.progress_bar=false", "trainer.max_epochs=2", "trainer.device=cpu")
QUIET = ("logger.progress_bar=false",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A default run (digits, MLP) of 2 epochs: best and last checkpoints, and its own test of `best`."""
    run_dir = tmp_path_factory.mktemp("stages") / "run"
    proc = run_cli(run_dir, *TRAIN, fast=False)
    assert proc.returncode == 0, output(proc)
    return run_dir


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("stages") / "ema"
    proc = run_cli(run_dir, *TRAIN, "callbacks=[default,ema]", "callbacks.ema.decay=0.9", fast=False)
    assert proc.returncode == 0, output(proc)
    return run_dir


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def stage(stage_name: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run.py"), stage_name, f"hydra.run.dir={run_dir}", *QUIET,
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_test_of_a_run_directory_prints_and_records_the_test_acc_the_run_tested(trained, tmp_path):
    before = fingerprint(trained)
    proc = stage("test", tmp_path / "t", f"ckpt={trained}")
    assert proc.returncode == 0, output(proc)
    got, run = summary(tmp_path / "t"), summary(trained)
    assert run["tested"].startswith("best")  # the run tested its best checkpoint, which ckpt=RUN_DIR picks too
    assert got["test/acc"] == run["test/acc"] and got["test/loss"] == run["test/loss"], (got, run)
    assert got["stage"] == "test" and got["checkpoint"] == str(trained / "checkpoints" / "best")
    assert f"test/acc {run['test/acc']:.4f}" in output(proc)
    assert read_scalars(tmp_path / "t")["test/acc"] == [(got["step"], pytest.approx(got["test/acc"]))]
    assert (tmp_path / "t" / "provenance.json").is_file()
    assert fingerprint(trained) == before  # the saved run is only read


def test_validate_of_the_last_checkpoint_gives_the_runs_final_validation(trained, tmp_path):
    proc = stage("validate", tmp_path / "v", f"ckpt={trained / 'checkpoints' / 'last'}")
    assert proc.returncode == 0, output(proc)
    got, run = summary(tmp_path / "v"), summary(trained)
    assert got["val/acc"] == run["val/acc"] and got["val/loss"] == run["val/loss"], (got, run)
    assert "test/acc" not in got


def test_a_read_only_run_is_evaluated_and_data_and_precision_may_change(trained, tmp_path):
    modes = {p: p.stat().st_mode for p in [trained, *trained.rglob("*")]}
    try:
        for path in modes:
            path.chmod(stat.S_IMODE(modes[path]) & ~0o222)
        proc = stage("test", tmp_path / "ro", f"ckpt={trained}", "data.eval_batch_size=7", "precision=bf16")
    finally:
        for path, mode in modes.items():
            path.chmod(stat.S_IMODE(mode))
    assert proc.returncode == 0, output(proc)
    got = summary(tmp_path / "ro")
    assert got["precision"] == "bf16-autocast" and abs(got["test/acc"] - summary(trained)["test/acc"]) < 0.03


def test_ddp_evaluates_every_sample_once_and_equals_one_process(trained, tmp_path):
    proc = stage("test", tmp_path / "ddp", f"ckpt={trained}", "parallel=ddp", "data.eval_batch_size=7")
    assert proc.returncode == 0, output(proc)
    got = summary(tmp_path / "ddp")
    assert got["world_size"] == 2 and got["test/acc"] == pytest.approx(summary(trained)["test/acc"], abs=1e-6)


def test_the_ema_weights_are_evaluated_where_the_runs_ema_evaluated_them(ema_run, tmp_path):
    proc = stage("test", tmp_path / "e", f"ckpt={ema_run / 'checkpoints' / 'last'}")
    assert proc.returncode == 0, output(proc)
    got, run = summary(tmp_path / "e"), summary(ema_run)
    assert got["weights"] == "EMA weights"
    assert got["test/acc"] == run["test/acc"], (got, run)


def test_a_sweep_over_checkpoints_writes_one_row_each(trained, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "test", f"hydra.sweep.dir={tmp_path / 's'}",
                           f"ckpt={trained / 'checkpoints' / 'best'},{trained / 'checkpoints' / 'last'}", *QUIET],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, output(proc)
    rows = list(csv.DictReader((tmp_path / "s" / "summary.csv").open()))
    assert len(rows) == 2 and all(row["status"] == "ok" for row in rows), rows
    assert {float(row["test/acc"]) for row in rows} <= {summary(trained)["test/acc"]}


@pytest.mark.parametrize("args, expected", [
    (("test", "ckpt=/nonexistent/run"), "Error: ckpt='/nonexistent/run': no such directory; expected a run directory"),
    (("test",), "Error: test: ckpt is not set; expected the run directory or checkpoint directory"),
    (("validate", "ckpt=RUN", "resume=RUN"), "Error: resume='RUN': expected null with validate"),
    (("ckpt=RUN",), "Error: ckpt='RUN': expected null for fit ("),
    (("test", "ckpt=RUN", "model=cnn"), "Error: model=cnn: the run used model=mlp, and its weights cannot carry over"),
    (("test", "ckpt=RUN", "data.test=null"), "Error: data.test: null, so there is nothing to test; expected"),
    (("test", "ckpt=RUN/checkpoints"), "Error: ckpt='RUN/checkpoints': neither a checkpoint (no meta.json) nor a run"),
], ids=["missing", "unset", "with-resume", "fit-with-ckpt", "other-model", "no-test-split", "not-a-run"])
def test_every_bad_ckpt_is_one_error_line_and_leaves_no_run_directory(trained, tmp_path, args, expected):
    args = tuple(a.replace("RUN", str(trained)) for a in args)
    expected = expected.replace("RUN", str(trained))
    first, rest = (args[0], args[1:]) if args[0] in ("test", "validate") else ("", args)
    command = [sys.executable, str(ROOT / "run.py"), *([first] if first else []), f"hydra.run.dir={tmp_path / 'x'}",
               *QUIET, *rest]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert one_error_line(proc).startswith(expected), output(proc)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_a_damaged_best_falls_back_to_the_newest_intact_checkpoint_and_a_damaged_named_one_is_an_error(
        trained, tmp_path):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(trained), str(copy)], check=True)
    model = copy / "checkpoints" / "best" / "model.safetensors"
    replace(model, model.read_bytes()[:-64])
    proc = stage("test", tmp_path / "fb", f"ckpt={copy}")
    assert proc.returncode == 0, output(proc)
    assert summary(tmp_path / "fb")["checkpoint"] == str(copy / "checkpoints" / "last")
    assert "its best checkpoint is damaged" in output(proc)
    proc = stage("test", tmp_path / "named", f"ckpt={copy / 'checkpoints' / 'best'}")
    assert one_error_line(proc).startswith(f"Error: ckpt='{copy / 'checkpoints' / 'best'}': "), output(proc)
