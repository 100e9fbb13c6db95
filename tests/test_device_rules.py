"""Where logged values live (issue 29, item 3): everything logged during training goes onto the metric logger's
device, so that it stacks with the loss at a logging step and at the epoch's end. On a GPU a CPU value meeting the
CUDA loss raised a device mismatch; here the logger's device is `meta`, which makes the same mismatch observable on
a CPU-only machine (torch.stack of a meta and a CPU tensor raises as CUDA and CPU do)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from framework.checkpoint.state import Progress
from framework.loop.stop import Stop
from framework.observe.metric_logger import MetricLogger
from framework.observe.tensorboard import TensorBoardLogger
from framework.parallel.strategy import SingleDevice
from framework.task.task import Task
from conftest import view_for

pytestmark = pytest.mark.unit
META = torch.device("meta")


def meta_logger(tmp_path: Path) -> tuple[MetricLogger, Task]:
    """A metric logger on `meta`, with a task whose self.log goes to it, and one loss in its window."""
    logger = MetricLogger(device=META, tensorboard=TensorBoardLogger(tmp_path, enabled=False), bar=None,
                          run_dir=tmp_path, accumulate=1, steps_per_epoch=10)
    task = Task(nn.Linear(2, 2))
    logger.attach(task)
    view_for(task, logger, strategy=SingleDevice(META))
    logger.record_loss(torch.zeros((), device=META))  # the loop's loss, on the device
    return logger, task


def test_a_number_or_cpu_tensor_logged_in_training_is_read_with_the_loss_on_the_loggers_device(tmp_path):
    logger, task = meta_logger(tmp_path)
    task.log("train/float", 0.5)  # the task's self.log, on_step
    task.log("train/cpu", torch.tensor(2.0))
    task.log("train/epoch_float", 1.5, on_step=False, on_epoch=True)
    task.log("train/epoch_cpu", torch.tensor(3.0), on_step=False, on_epoch=True)
    logger.log("callback/cpu", torch.tensor(4.0))  # Trainer.log / Run.log from a callback
    logger.log("callback/float", 5.0)
    _, step, names = logger.step_values()  # what a logging step reads, in its one host sync
    assert names == ["callback/cpu", "train/float", "train/cpu"]  # a callback's float is written as it is
    assert step.device == META and step.shape == (2 + len(names),)  # loss mean, all finite, then those
    epoch = torch.stack([value.reshape(()) for value in logger.window.epoch_sums.values()])  # what epoch end reads
    assert epoch.device == META
