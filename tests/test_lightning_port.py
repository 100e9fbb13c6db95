"""lightning-hydra-template's MNISTLitModule, ported by changing its imports, base class and optimizer
(experiments/lit_mnist.py, conf/experiment/lit_mnist.yaml), trains on digits with every number its summary
prints equal to the TensorBoard series it came from, and resumes bit-identical after a kill, the torchmetrics
states it keeps across epochs (MaxMetric best-so-far, MeanMetric epoch means) included."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import KILLHOOK, assert_identical, final_state, on_pythonpath, output, read_scalars, run_cli

pytestmark = pytest.mark.e2e

# 20 batches of 64 per epoch; a periodic checkpoint every 7 steps, saved inline (a SIGKILL may come right after).
PORT = ("experiment=lit_mnist", "logger.progress_bar=false", "trainer.max_epochs=4", "trainer.log_every_n_steps=5",
        "checkpoint.every_n_steps=7", "checkpoint.keep_last=-1", "checkpoint.async_save=false")


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("port") / "whole"
    proc = run_cli(run_dir, *PORT, fast=False)
    assert proc.returncode == 0, output(proc)
    return run_dir


def test_the_summary_of_a_ported_lightning_module_is_what_tensorboard_holds(whole):
    summary = json.loads((whole / "summary.json").read_text())
    series = read_scalars(whole)
    last_validation = max(step for step, _ in series["val/acc"])
    for name in ("val/acc", "val/loss", "val/acc_best", "train/acc", "train/loss"):
        assert summary[name] == pytest.approx(series[name][-1][1], rel=1e-6), name
    for name in ("test/acc", "test/loss"):  # test_step's own names, never val/
        assert summary[name] == pytest.approx(series[name][-1][1], rel=1e-6), name
    assert last_validation == summary["step"]
    # The MaxMetric's best-so-far is the maximum of the validation accuracy series: no training batch (the
    # pre-flight check) and no sanity-check value ever reached it.
    assert summary["val/acc_best"] == pytest.approx(max(v for _, v in series["val/acc"]), rel=1e-6)
    assert [v for _, v in series["val/acc_best"]] == sorted(v for _, v in series["val/acc_best"])
    # One train/loss series, the task's epoch mean (the trainer's own window mean steps aside for it).
    assert [step for step, _ in series["train/loss"]] == [20, 40, 60, 80]
    assert summary["tested"].startswith("best (step ")  # checkpoint.monitor=val/acc_best keeps a best: tested
    assert summary["best_checkpoint"].endswith("best")


def test_a_ported_lightning_module_killed_mid_epoch_resumes_bit_identical(whole, tmp_path):
    killed = tmp_path / "killed"
    env = {"PYTHONPATH": on_pythonpath(KILLHOOK),  # mid second epoch, 3 steps after step 28's save, once that save
           "KILL_AT_STEP": "31", "KILL_SIGNAL": "SIGKILL",  # (written behind the loop) is on disk, however slow the
           "KILL_WHEN_EXISTS": str(killed / "checkpoints" / "step-28")}  # machine
    proc = run_cli(killed, *PORT, fast=False, env=env)
    assert proc.returncode == -signal.SIGKILL, output(proc)
    resumed = run_cli(None, f"resume={killed}", fast=False)
    assert resumed.returncode == 0, output(resumed)
    assert "Resumed from" in output(resumed) and "at step 28 " in output(resumed)
    a, b = final_state(whole), final_state(killed)
    assert any(k.startswith("state:/task/") for k in a), "the task's metric states are saved"
    assert_identical(a, b)
    metrics = ("val/acc", "val/loss", "val/acc_best", "train/acc", "train/loss", "test/acc", "test/loss")
    ends = [json.loads((run / "summary.json").read_text()) for run in (whole, killed)]
    assert {m: ends[1][m] for m in metrics} == {m: ends[0][m] for m in metrics}
    series = [read_scalars(run) for run in (whole, killed)]
    assert series[1]["val/acc_best"] == series[0]["val/acc_best"]
    assert series[1]["train/acc"] == series[0]["train/acc"]
