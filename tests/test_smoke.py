import json

import pytest
from conftest import output, read_scalars, run_cli

pytestmark = pytest.mark.e2e


def test_default_run_trains_and_leaves_summary_events_and_config(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "trainer.max_epochs=3")
    assert proc.returncode == 0, output(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epoch"] == 3 and summary["world_size"] == 1 and summary["precision"] == "fp32"
    assert summary["val/acc"] > 0.8
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    scalars = read_scalars(run_dir)
    assert {"train/loss", "val/loss", "val/acc", "lr/default", "epoch", "perf/samples_per_s"} <= set(scalars)
    assert "tensorboard --logdir" in proc.stdout


def test_experiment_preset_uses_a_users_own_task(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "experiment=digits_penalty", "trainer.max_epochs=1")
    assert proc.returncode == 0, output(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"val/logit_penalty", "test/logit_penalty", "val/acc"} <= set(summary)
    assert "LogitPenaltyTask" in (run_dir / ".hydra" / "config.yaml").read_text()


def test_cfg_job_prints_the_composed_config_without_running(tmp_path):
    proc = run_cli(tmp_path / "run", "model=cnn", "--cfg", "job")
    assert proc.returncode == 0, output(proc)
    assert "framework.zoo.models.CNN" in proc.stdout and not (tmp_path / "run").exists()
