"""framework/loop/preflight.py built directly: the check of the first train and val batch leaves no trace in the task
(a MaxMetric, a buffer, a counter, the RNG), turns a bad training_step return into one ConfigError, and refuses a
monitor no metric can have when no epoch-end hook could log it."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import evaluator_for, tiny_data
from torch import nn

from framework.core.errors import ConfigError
from framework.loop.preflight import check_first_batches
from framework.task.metrics import metric_state
from framework.task.task import StepOutput, Task

pytestmark = pytest.mark.unit


class Stateful(Task):
    """Keeps what a check must not touch: a best-so-far MaxMetric, a buffer and a plain counter of its steps; draws
    a random number in training (dropout would)."""

    def __init__(self) -> None:
        from torchmetrics import MaxMetric

        super().__init__(nn.Linear(1, 1))
        self.best = MaxMetric()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.calls = 0

    def training_step(self, batch: Any) -> torch.Tensor:
        self.steps += 1
        self.calls += 1
        return (self.model(batch[0]) * torch.rand(())).mean()

    def validation_step(self, batch: Any) -> StepOutput:
        self.steps += 1
        self.best.update(batch[0].max())
        self.log("val/best", self.best)
        return StepOutput(self.model(batch[0]).mean(), {"mae": batch[0].abs().mean()})


class Hooked(Stateful):
    def on_validation_epoch_end(self) -> None:
        self.log("val/late", 1.0)


def test_the_check_leaves_the_tasks_metric_buffers_counters_and_the_rng_as_they_were():
    task = Stateful()
    evaluator = evaluator_for(task, tiny_data())
    handle, before = task.trainer, metric_state(task.best)
    weights = {k: v.clone() for k, v in task.model.state_dict().items()}
    torch.manual_seed(3)
    check_first_batches(task, "model", evaluator, {})
    drawn = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(3))  # training starts with the random numbers it would have drawn
    assert metric_state(task.best) == before and task.best.update_count == 0
    assert task.steps.item() == 0 and task.calls == 0
    assert all(torch.equal(v, weights[k]) for k, v in task.model.state_dict().items())
    assert task.trainer is handle and task.training


def test_the_check_returns_the_validation_metrics_the_first_batch_showed():
    task = Hooked()
    names = check_first_batches(task, "model", evaluator_for(task, tiny_data()), {})
    assert names == ["val/loss", "val/mae", "val/best"]  # the epoch-end hook's val/late is not run by the check


class BadReturn(Task):
    def __init__(self) -> None:
        super().__init__(nn.Linear(1, 1))

    def training_step(self, batch: Any) -> Any:
        return {"logits": self.model(batch[0])}  # Lightning's dict, without its "loss"


def test_a_training_step_returning_no_loss_is_one_config_error_naming_the_step():
    task = BadReturn()
    with pytest.raises(ConfigError) as err:
        check_first_batches(task, "model", evaluator_for(task, tiny_data()), {})
    assert str(err.value) == ("task: BadReturn.training_step returned a dict with keys logits; expected the loss: a "
                              "tensor, a dict with 'loss', or a StepOutput(loss, metrics)")


def test_a_monitor_no_metric_can_have_is_refused_when_no_epoch_end_hook_could_log_it():
    task = Stateful()
    with pytest.raises(ConfigError) as err:
        check_first_batches(task, "model", evaluator_for(task, tiny_data()),
                            {"callbacks.early_stopping.monitor": "val/acc"})
    assert str(err.value) == ("callbacks.early_stopping.monitor='val/acc': no such metric; expected one of val/loss, "
                              "val/mae, val/best")
    task = Hooked()  # on_validation_epoch_end may log it: the first validation decides
    assert check_first_batches(task, "model", evaluator_for(task, tiny_data()),
                               {"callbacks.early_stopping.monitor": "val/acc"})
    task = Stateful()
    assert check_first_batches(task, "model", evaluator_for(task, tiny_data()), {"checkpoint.monitor": "val/mae"})
