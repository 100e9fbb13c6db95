"""framework/loop/stop.py built directly: a stop request held back until trainer.min_epochs and min_steps (and then
dropped, as Lightning does), the first reason winning, and what one process agrees on alone."""
from __future__ import annotations

import logging
import signal

import pytest
import torch
from torch import nn

from framework.checkpoint.state import Progress
from framework.core.signals import SignalWatch
from framework.loop.stop import Stop
from framework.observe.metric_logger import MetricLogger
from framework.observe.tensorboard import TensorBoardLogger
from framework.parallel.strategy import SingleDevice
from conftest import view_for

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def test_the_first_reason_given_wins():
    stop = Stop(SingleDevice(CPU), min_epochs=0, min_steps=0)
    stop.request("early_stopping: val/loss did not improve")
    stop.request("trainer.should_stop was set")
    assert stop.reason == "early_stopping: val/loss did not improve"


@pytest.mark.parametrize("min_epochs, min_steps, at", [(2, 0, Progress(step=50, epoch=1)),
                                                       (0, 20, Progress(step=19, epoch=5))],
                         ids=["min_epochs", "min_steps"])
def test_a_request_before_min_epochs_or_min_steps_is_dropped_not_kept_for_later(min_epochs, min_steps, at, caplog):
    stop = Stop(SingleDevice(CPU), min_epochs=min_epochs, min_steps=min_steps)
    stop.request("early_stopping")
    with caplog.at_level(logging.INFO, logger="framework.loop.stop"):
        assert not stop.granted(at)
    assert stop.reason == ""  # dropped: the callback asks again at its next check
    assert f"early_stopping: not yet, trainer.min_epochs={min_epochs} and min_steps={min_steps}" in caplog.text
    at.step, at.epoch = max(at.step, min_steps), max(at.epoch, min_epochs)
    assert not stop.granted(at)  # the dropped request does not come back once the minimum is reached


def test_a_request_once_min_epochs_and_min_steps_are_reached_is_granted_and_keeps_its_reason():
    stop = Stop(SingleDevice(CPU), min_epochs=2, min_steps=20)
    stop.request("early_stopping")
    assert stop.granted(Progress(step=20, epoch=2))
    assert stop.reason == "early_stopping"  # for the console and summary.json
    assert not Stop(SingleDevice(CPU), 0, 0).granted(Progress())  # no request, no stop


def test_one_process_agrees_on_its_own_signal_and_keeps_its_request():
    stop = Stop(SingleDevice(CPU), min_epochs=0, min_steps=0)
    watch = SignalWatch([signal.SIGUSR1])  # not entered: no handler is installed
    assert stop.agreed(watch) is None
    watch.received = signal.SIGUSR1  # what its handler records
    stop.request("early_stopping")
    assert stop.agreed(watch) == signal.SIGUSR1
    assert stop.reason == "early_stopping"
    assert stop.agreed(object()) is None  # a loop watching nothing


def test_the_tasks_should_stop_is_a_request_held_back_like_a_callbacks(tmp_path):
    stop = Stop(SingleDevice(CPU), min_epochs=1, min_steps=0)
    logger = MetricLogger(device=CPU, tensorboard=TensorBoardLogger(tmp_path, enabled=False), bar=None,
                          run_dir=tmp_path, accumulate=1, steps_per_epoch=1)
    handle = view_for(nn.Linear(1, 1), logger, stop=stop, max_epochs=3)
    handle.should_stop = False
    assert not handle.should_stop and stop.reason == ""
    handle.should_stop = True
    assert handle.should_stop and stop.reason == "trainer.should_stop was set"
    assert not stop.granted(Progress(epoch=0)) and not handle.should_stop  # before min_epochs: dropped
