"""framework/loop/restore.py built directly: the checks of the parts whose saved form depends on the run (optimizer,
precision, callbacks) refuse a saved part that does not fit before anything is loaded, `restore` leaves nothing
half-restored, and fit's test takes the best or the final weights, surviving a damaged best."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import replace
from omegaconf import OmegaConf
from torch import nn

from framework.callbacks.base import CallbackList
from framework.callbacks.early_stopping import EarlyStopping
from framework.checkpoint import MODEL_FILE, CheckpointManager, DamagedCheckpoint, open_checkpoint, write_checkpoint
from framework.loop.restore import callbacks_check, load_test_weights, optimizer_check, precision_check, restore
from framework.checkpoint.state import Progress, TrainingState
from framework.parallel.precision import Precision
from framework.parallel.strategy import SingleDevice

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def stepped_sgd(model: nn.Module) -> torch.optim.SGD:
    """An SGD with momentum over `model` that has taken one step (it holds a momentum buffer per parameter)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, model.in_features)).sum().backward()
    optimizer.step()
    return optimizer


# ---------------------------------------------------------------------------------------------- the checks
def test_the_optimizer_check_takes_its_own_state_and_refuses_one_of_other_parameter_shapes():
    live = torch.optim.SGD(nn.Linear(3, 4).parameters(), lr=0.1, momentum=0.9)  # fresh: no state to compare with
    check = optimizer_check(live)
    check(stepped_sgd(nn.Linear(3, 4)).state_dict(), "checkpoint c: optimizer")
    with pytest.raises(DamagedCheckpoint) as err:
        check(stepped_sgd(nn.Linear(3, 2)).state_dict(), "checkpoint c: optimizer")
    assert str(err.value) == ("checkpoint c: optimizer/state/0/momentum_buffer: the checkpoint holds shape (2, 3), "
                              "expected (4, 3) as the parameter it is for")


def test_the_optimizer_check_refuses_another_optimizers_state():
    model = nn.Linear(3, 4)
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(DamagedCheckpoint, match=r"^checkpoint c: optimizer/param_groups/0"):
        optimizer_check(adam)(stepped_sgd(nn.Linear(3, 4)).state_dict(), "checkpoint c: optimizer")


def test_the_precision_check_takes_a_run_saved_without_a_grad_scaler_and_refuses_a_malformed_scaler():
    fp16 = Precision("fp16", CPU)
    check = precision_check(fp16)
    check(Precision("fp32", CPU).state_dict(), "checkpoint c: precision")  # precision= changed on resume
    check(Precision("fp16", CPU).state_dict(), "checkpoint c: precision")
    with pytest.raises(DamagedCheckpoint, match=r"^checkpoint c: precision/scaler"):
        check({"scaler": {"scale": 1.0}, "skipped_steps": 0}, "checkpoint c: precision")
    with pytest.raises(DamagedCheckpoint, match=r"^checkpoint c: precision/skipped_steps"):
        check({"scaler": {}, "skipped_steps": "3"}, "checkpoint c: precision")


def test_the_callbacks_check_refuses_a_configured_callbacks_mismatching_state_and_tolerates_the_rest(caplog):
    callbacks = CallbackList({"early_stopping": EarlyStopping(), "fresh": EarlyStopping()})
    check = callbacks_check(callbacks)
    saved = {"early_stopping": EarlyStopping().state_dict(), "gone": {"count": 1}}
    with caplog.at_level(logging.INFO, logger="framework.loop.restore"):
        check(saved, "checkpoint c: callbacks")
    assert "callbacks.fresh is new in this run: it starts fresh" in caplog.text
    assert "checkpoint c: callbacks/gone is not configured in this run; its saved state is not used" in caplog.text
    with pytest.raises(DamagedCheckpoint, match=r"^checkpoint c: callbacks/early_stopping/wait_count"):
        check({"early_stopping": {**saved["early_stopping"], "wait_count": "two"}}, "checkpoint c: callbacks")


# ---------------------------------------------------------------------------------------------- restore
def registry(model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainingState:
    state = TrainingState(lambda: model, Progress(), {}, info={"world_size": 1, "config": {}})
    state.register("optimizer", optimizer, check=optimizer_check(optimizer))
    return state


def test_a_checkpoint_whose_optimizer_does_not_fit_is_refused_before_the_weights_are_loaded(tmp_path):
    saved_model = nn.Linear(3, 4)
    state = registry(saved_model, stepped_sgd(saved_model))
    state.progress.step = 1
    write_checkpoint(tmp_path / "last", *state.collect(), durable=False)
    model = nn.Linear(3, 4)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    adam = torch.optim.Adam(model.parameters())
    cfg = OmegaConf.create({"scheduler": {}, "optimizer": {"_target_": "torch.optim.Adam"}})
    with pytest.raises(DamagedCheckpoint, match="optimizer/param_groups/0"):
        restore(open_checkpoint(tmp_path / "last"), cfg, registry(model, adam), module=model, strategy=SingleDevice(CPU),
                optimizers=adam, scheduler=None)
    assert all(torch.equal(v, fresh[k]) for k, v in model.state_dict().items())  # nothing half-restored
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = OmegaConf.create({"scheduler": {}, "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1,
                                                           "momentum": 0.9}})
    progress = registry(model, sgd)
    restore(open_checkpoint(tmp_path / "last"), cfg, progress, module=model, strategy=SingleDevice(CPU), optimizers=sgd,
            scheduler=None)
    assert all(torch.equal(v, saved_model.state_dict()[k]) for k, v in model.state_dict().items())
    assert progress.progress.step == 1 and len(sgd.state) == 2  # the momentum buffers came back


# ---------------------------------------------------------------------------------------------- fit's test weights
class Snapshot:
    """What a CheckpointManager saves: a module's weights at a step."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.step = module, 0

    def collect(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        meta = {"step": self.step, "epoch": self.step, "batch_in_epoch": 0, "world_size": 1, "metrics": {},
                "config": {}}
        return {k: v.clone() for k, v in self.module.state_dict().items()}, {}, meta


def best_kept(tmp_path: Path, module: nn.Module) -> tuple[CheckpointManager, dict[str, torch.Tensor]]:
    """A top-1 on val/acc that kept step 2 (acc 0.9) over step 1 and step 3; returns it and step 2's weights."""
    checkpoints = CheckpointManager(tmp_path / "checkpoints", monitor="val/acc", mode="max", save_top_k=1,
                                    fsync=False)
    snapshot, best = Snapshot(module), {}
    for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7)):
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(float(step))
        snapshot.step = step
        checkpoints.save(snapshot, step, periodic=False, metrics={"val/acc": acc})
        if step == 2:
            best = {k: v.clone() for k, v in module.state_dict().items()}
    checkpoints.writer.close()
    return checkpoints, best


def config(test_ckpt: Any) -> Any:
    return OmegaConf.create({"checkpoint": {"monitor": "val/acc", "save_top_k": 1},
                             "trainer": {"test_ckpt": test_ckpt, "fast_dev_run": False}})


@pytest.mark.parametrize("test_ckpt", [None, "best"])
def test_fit_tests_the_best_checkpoints_weights_by_default_and_when_asked(tmp_path, test_ckpt):
    module = nn.Linear(2, 1)
    checkpoints, best = best_kept(tmp_path, module)
    assert load_test_weights(config(test_ckpt), checkpoints, SingleDevice(CPU), module) == "best (step 2)"
    assert all(torch.equal(v, best[k]) for k, v in module.state_dict().items())


def test_fit_tests_the_final_weights_when_asked_for_last(tmp_path):
    module = nn.Linear(2, 1)
    checkpoints, _ = best_kept(tmp_path, module)
    final = {k: v.clone() for k, v in module.state_dict().items()}
    assert load_test_weights(config("last"), checkpoints, SingleDevice(CPU), module) == "last"
    assert all(torch.equal(v, final[k]) for k, v in module.state_dict().items())


def test_a_damaged_best_checkpoint_is_a_warning_and_the_final_weights_are_tested(tmp_path, caplog):
    module = nn.Linear(2, 1)
    checkpoints, _ = best_kept(tmp_path, module)
    final = {k: v.clone() for k, v in module.state_dict().items()}
    weights = checkpoints.folder / "best" / MODEL_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # still a safetensors file: only its checksum can tell
    replace(weights, bytes(data))
    with caplog.at_level(logging.WARNING, logger="framework.loop.restore"):
        assert load_test_weights(config("best"), checkpoints, SingleDevice(CPU), module) == \
            "last (the best checkpoint is damaged)"
    assert "trainer.test_ckpt=best: " in caplog.text and "testing the final weights" in caplog.text
    assert all(torch.equal(v, final[k]) for k, v in module.state_dict().items())


def test_no_best_checkpoint_tests_the_final_weights_saying_why(tmp_path):
    module = nn.Linear(2, 1)
    checkpoints = CheckpointManager(tmp_path / "checkpoints", monitor="val/acc", save_top_k=1, fsync=False)
    tested = load_test_weights(config("best"), checkpoints, SingleDevice(CPU), module)
    assert tested == "last (no best checkpoint was saved)"
