"""framework/observe/setup_report.py on parts built directly (build_components on the default config): what a fresh run
writes before training (param_groups.json, the LR plan, the config and the layout in TensorBoard), what a resumed
one leaves alone, what a dry run prints, and the model summary every fit prints unless turned off."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import read_scalars

from framework.loop.build import build_components
from framework.observe.setup_report import describe_setup
from framework.observe.tensorboard import TensorBoardLogger
from framework.optim.schedulers import lr_plan
from framework.parallel.strategy import SingleDevice

pytestmark = pytest.mark.unit


@pytest.fixture
def built(compose, tmp_path):
    cfg = compose("scheduler=warmup_cosine", "scheduler.warmup_steps=3", "trainer.max_steps=12")
    return cfg, build_components(cfg, SingleDevice(torch.device("cpu")), tmp_path)


def test_a_fresh_run_writes_its_groups_lr_plan_and_config_for_tensorboard(built, tmp_path):
    cfg, parts = built
    tensorboard = TensorBoardLogger(tmp_path)
    describe_setup(cfg, parts, world_size=1, run_dir=tmp_path, tensorboard=tensorboard, fresh=True,
                   charts=["val/acc"], hparams={})
    tensorboard.close()
    groups = json.loads((tmp_path / "param_groups.json").read_text())
    assert [g["name"] for g in groups] == [g["name"] for g in parts.optimizers.param_groups]
    assert sum(len(g["params"]) for g in groups) == sum(len(g["params"]) for g in parts.optimizers.param_groups)
    planned = lr_plan(parts.scheduler, parts.optimizers.only, parts.steps_per_epoch)
    written = read_scalars(tmp_path)
    for name, points in planned.items():
        assert [step for step, _ in written[f"lr_plan/{name}"]] == [step for step, _ in points]
        assert [lr for _, lr in written[f"lr_plan/{name}"]] == pytest.approx([lr for _, lr in points])


def test_a_resumed_run_rewrites_its_groups_but_logs_no_second_plan(built, tmp_path):
    cfg, parts = built
    tensorboard = TensorBoardLogger(tmp_path)
    describe_setup(cfg, parts, world_size=1, run_dir=tmp_path, tensorboard=tensorboard, fresh=False,
                   charts=["val/acc"], hparams={})
    tensorboard.close()
    assert (tmp_path / "param_groups.json").is_file()
    assert not any(tag.startswith("lr_plan/") for tag in read_scalars(tmp_path))


def test_a_dry_run_prints_the_global_batch_groups_model_and_plan(built, tmp_path, caplog):
    cfg, parts = built
    cfg.trainer.dry_run = True
    with caplog.at_level(logging.INFO, logger="framework.observe.setup_report"):
        describe_setup(cfg, parts, world_size=2, run_dir=tmp_path, tensorboard=TensorBoardLogger(tmp_path, False),
                       fresh=True, charts=[], hparams={})
    batch = parts.data.batch_size
    assert (f"Global batch: {batch} per process x 2 processes x 1 accumulated = {2 * batch} samples per optimizer "
            "step") in caplog.text
    assert "Model summary:\n  | Name" in caplog.text and "LR plan of group 'default' (step: lr): 0: " in caplog.text
    assert caplog.text.rstrip().endswith("Dry run: everything built; exiting without training (trainer.dry_run=true).")


@pytest.mark.parametrize("enabled", [True, False])
def test_a_fit_shows_the_model_summary_alone_on_the_console_unless_turned_off(built, tmp_path, caplog, enabled):
    """Outside a dry run the rest of the report is for run.log only (file_only); the summary is a console record."""
    cfg, parts = built
    cfg.trainer.enable_model_summary = enabled
    with caplog.at_level(logging.INFO, logger="framework.observe.setup_report"):
        describe_setup(cfg, parts, world_size=1, run_dir=tmp_path, tensorboard=TensorBoardLogger(tmp_path, False),
                       fresh=True, charts=[], hparams={})
    messages = [record.getMessage() for record in caplog.records]
    if enabled:
        assert len(messages) == 1 and messages[0].startswith("Model summary:\n  | Name"), messages
        assert "85,002    Total params" in messages[0]
    else:
        assert messages == []
