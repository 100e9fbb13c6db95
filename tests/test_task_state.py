"""framework/checkpoint/state.py's TaskState built directly: the task's own state beside its model (torchmetrics states with
their update counts, buffers, what on_save_checkpoint adds) comes back exactly, the model's part is left to the
weights, and a saved part that does not fit is refused before anything loads. (The update count goes through
framework/core/compat.py, whose own test checks the torchmetrics version.)"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from framework.checkpoint import DamagedCheckpoint
from framework.checkpoint.state import TaskState
from framework.parallel.strategy import SingleDevice
from framework.task.task import Task

pytestmark = pytest.mark.unit
CPU = SingleDevice(torch.device("cpu"))


class Keeping(Task):
    def __init__(self) -> None:
        from torchmetrics import MaxMetric, MeanMetric

        super().__init__(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        self.mean, self.best = MeanMetric(), MaxMetric()
        self.register_buffer("seen", torch.zeros(3))
        self.loaded: dict[str, Any] = {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["note"], checkpoint["total"] = "kept", self.seen.sum()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = checkpoint


def used() -> Keeping:
    task = Keeping()
    for value in (1.0, 2.0, 6.0):
        task.mean.update(torch.tensor(value))
        task.best.update(torch.tensor(value))
    task.seen += torch.tensor([1.0, 2.0, 3.0])
    return task


def test_the_tasks_metrics_buffers_and_hook_state_come_back_exactly_with_the_update_counts():
    state = TaskState(used(), "model", CPU).state_dict()
    fresh = Keeping()
    part = TaskState(fresh, "model", CPU)
    part.check_state_dict(state, "checkpoint c: task")
    part.load_state_dict(state)
    assert fresh.mean.compute() == 3.0 and fresh.best.compute() == 6.0
    assert fresh.mean.update_count == 3  # torchmetrics' load_state_dict alone would leave 0
    assert torch.equal(fresh.seen, torch.tensor([1.0, 2.0, 3.0]))
    assert fresh.loaded == {"note": "kept", "total": torch.tensor(6.0)}


def test_the_models_own_buffers_are_left_to_the_weights():
    part = TaskState(used(), "model", CPU)
    assert set(part.metrics()) == {"mean", "best"}
    assert set(part.buffers()) == {"seen"}  # not model.1.running_mean and the rest: those are the weights'


def test_a_saved_buffer_of_another_shape_is_refused_naming_it_before_anything_loads():
    state = TaskState(used(), "model", CPU).state_dict()
    state["rank0"]["buffers"]["seen"] = torch.zeros(4)
    state["rank0"]["metrics"]["mean"]["states"]["mean_value"] = torch.tensor(99.0)
    fresh = Keeping()
    with pytest.raises(DamagedCheckpoint, match=r"^checkpoint c: task/rank0/buffers/seen"):
        TaskState(fresh, "model", CPU).check_state_dict(state, "checkpoint c: task")
    assert fresh.mean.update_count == 0 and torch.equal(fresh.seen, torch.zeros(3))


def test_a_task_state_without_rank_zero_is_refused():
    with pytest.raises(DamagedCheckpoint, match="no rank0; expected every rank's task state"):
        TaskState(Keeping(), "model", CPU).check_state_dict({"rank1": {}}, "checkpoint c: task")
