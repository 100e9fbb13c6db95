"""framework/observe/metric_logger.py built directly: what a task's self.log becomes in each stage (on_step/on_epoch
defaults and names, reduce_fx, batch-size weights, logger=False, test/ names), the loss window's non-finite stop,
and TrainLog's resumable state. TensorBoard is a real TensorBoardLogger, read back with TensorBoard's reader."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import read_scalars, view_for
from torch import nn

from framework.checkpoint.state import Progress
from framework.core.errors import ConfigError, UserError
from framework.loop.stop import Stop
from framework.observe.logged import OWN_LOSS, TrainLog, stage_name
from framework.observe.metric_logger import MetricLogger
from framework.observe.tensorboard import TensorBoardLogger
from framework.parallel.strategy import SingleDevice
from framework.task.task import Task

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


class Bar:
    """The progress bar's methods the metric logger calls, recording what it was shown."""

    enabled = False

    def __init__(self) -> None:
        self.shown: list[dict[str, float]] = []

    def show(self, metrics: dict[str, float]) -> None:
        self.shown.append(dict(metrics))


class Logging(Task):
    def __init__(self) -> None:
        super().__init__(nn.Linear(2, 2))


def make(tmp_path: Path, *, accumulate: int = 1, steps_per_epoch: int = 10) -> tuple[MetricLogger, Task]:
    """A metric logger writing to TensorBoard in tmp_path, and a task whose self.log goes to it."""
    logger = MetricLogger(device=CPU, tensorboard=TensorBoardLogger(tmp_path), bar=Bar(), run_dir=tmp_path,
                          accumulate=accumulate, steps_per_epoch=steps_per_epoch)
    task = Logging()
    logger.attach(task)
    view_for(task, logger)
    return logger, task


def step(logger: MetricLogger, loss: float = 1.0) -> None:
    """What the loop does for a training batch: its loss joins the window."""
    logger.record_loss(torch.tensor(loss))


def written(logger: MetricLogger, tmp_path: Path) -> dict[str, list[tuple[int, float]]]:
    logger.tensorboard.flush()
    return read_scalars(tmp_path)


# ---------------------------------------------------------------------------------------------- stages
def test_a_training_step_logs_on_step_and_an_epoch_hook_logs_on_epoch_by_default(tmp_path):
    logger, task = make(tmp_path)
    step(logger)
    task.log("train/in_step", 2.0)
    logger.flush(5, {})
    with logger.epoch_hook():  # on_train_epoch_end
        task.log("train/in_hook", 3.0)
    epoch = logger.end_epoch(task, 5, {})
    scalars = written(logger, tmp_path)
    assert scalars["train/in_step"] == [(5, 2.0)]  # at the logging step, not as an epoch value
    assert epoch == {"train/loss_epoch": 1.0, "train/in_hook": 3.0}  # no _epoch suffix for an epoch-only value
    assert scalars["train/in_hook"] == [(5, 3.0)]


def test_on_step_and_on_epoch_together_write_the_step_value_as_the_name_and_the_mean_as_name_epoch(tmp_path):
    logger, task = make(tmp_path)
    for value, at in ((1.0, 1), (3.0, 2)):
        step(logger)
        task.log("train/x", value, on_step=True, on_epoch=True)
        logger.flush(at, {})
    epoch = logger.end_epoch(task, 2, {})
    scalars = written(logger, tmp_path)
    assert scalars["train/x"] == [(1, 1.0), (2, 3.0)]
    assert epoch["train/x_epoch"] == 2.0 and scalars["train/x_epoch"] == [(2, 2.0)]


def test_validation_logs_are_epoch_means_whatever_on_step_says(tmp_path):
    logger, task = make(tmp_path)
    with logger.evaluation("val") as logged:
        task.log("val/x", 1.0, on_step=True, on_epoch=False)
        task.log("val/x", 3.0, on_step=True, on_epoch=False)
    _, values = logged.finish(SingleDevice(CPU), task, {}, 0)
    assert values == {"val/x": 2.0}
    step(logger)
    logger.flush(1, {})
    assert "val/x" not in written(logger, tmp_path)  # nothing of it waited for a training logging step


# ---------------------------------------------------------------------------------------------- reductions
@pytest.mark.parametrize("reduce_fx, expected", [("sum", 9.0), ("max", 5.0), ("min", 1.0), (torch.max, 5.0),
                                                 ("mean", 3.0)])
def test_reduce_fx_reduces_the_epoch_values_in_training_and_in_validation(tmp_path, reduce_fx, expected):
    logger, task = make(tmp_path)
    with logger.evaluation("val") as logged:
        for value in (1.0, 5.0, 3.0):
            task.log("val/x", value, reduce_fx=reduce_fx)
    _, values = logged.finish(SingleDevice(CPU), task, {}, 0)
    with logger.epoch_hook():
        for value in (1.0, 5.0, 3.0):
            task.log("train/x", value, reduce_fx=reduce_fx)
    assert values["val/x"] == expected
    assert logger.end_epoch(task, 1, {})["train/x"] == expected


def test_an_unknown_reduce_fx_is_one_config_error_naming_the_metric():
    logger, task = make(Path("unused"))
    with pytest.raises(ConfigError, match=r"self.log\('val/x', \.\.\., reduce_fx='median'\): expected one of mean, "
                                          r"sum, max, min"):
        task.log("val/x", 1.0, reduce_fx="median")


def test_an_epoch_mean_is_weighted_by_batch_size_given_or_the_batchs_own(tmp_path):
    logger, task = make(tmp_path)
    with logger.evaluation("val") as logged:
        task.log("val/given", 2.0, batch_size=3)
        task.log("val/given", 6.0, batch_size=1)
        logger.begin_batch(3)  # what the evaluation says for each batch: its sample count
        task.log("val/own", 2.0)
        logger.begin_batch(1)
        task.log("val/own", 6.0)
    with logger.epoch_hook():  # the same in training's epoch values
        task.log("train/given", 2.0, batch_size=3)
        task.log("train/given", 6.0, batch_size=1)
    _, values = logged.finish(SingleDevice(CPU), task, {}, 0)
    assert values == {"val/given": 3.0, "val/own": 3.0}  # (2*3 + 6*1) / 4, not 4.0, the mean of the two values
    assert logger.end_epoch(task, 1, {})["train/given"] == 3.0


# ---------------------------------------------------------------------------------------------- where it goes
def test_logger_false_keeps_a_value_out_of_tensorboard_but_in_the_metrics_and_the_bar(tmp_path):
    logger, task = make(tmp_path)
    step(logger)
    task.log("train/secret", 7.0, logger=False, prog_bar=True, on_step=True, on_epoch=True)
    task.log("train/open", 1.0)
    logger.flush(1, {})
    logger.end_epoch(task, 1, {})
    with logger.evaluation("val") as logged:
        task.log("val/secret", 2.0, logger=False)
    logger.write(logged.finish(SingleDevice(CPU), task, {}, 0)[1], 1)
    scalars = written(logger, tmp_path)
    assert "train/open" in scalars
    assert not {"train/secret", "train/secret_epoch", "val/secret"} & set(scalars)
    assert logger.metrics["train/secret"] == 7.0 and logger.metrics["val/secret"] == 2.0
    assert logger.bar.shown[-1]["train/secret"] == 7.0


def test_a_test_logs_val_names_as_test_names_and_validation_keeps_them():
    logger, task = make(Path("unused"))
    with logger.evaluation("test") as logged:
        task.log("val/acc", 1.0)
        task.log("val_loss", 2.0)
        task.log("other", 3.0)
    assert set(logged.entries) == {"test/acc", "test_loss", "other"}
    with logger.evaluation("val") as logged:
        task.log("val/acc", 1.0)
    assert set(logged.entries) == {"val/acc"}
    assert stage_name("validation/x", "test") == "validation/x"  # only the val/ and val_ prefixes are renamed


def test_a_value_of_more_than_one_number_is_one_config_error_naming_it():
    logger, task = make(Path("unused"))
    with pytest.raises(ConfigError, match=r"self.log\('train/v', <tensor of shape \(3,\)>\): expected one number"):
        task.log("train/v", torch.ones(3))


# ---------------------------------------------------------------------------------------------- the loss window
def test_a_non_finite_loss_stops_the_run_naming_the_optimizer_step_and_epoch_it_came_in(tmp_path):
    logger, _ = make(tmp_path, accumulate=2, steps_per_epoch=5)
    logger.window.first_step = 10  # the window started after step 10
    for loss in (1.0, 1.0, math.nan, 1.0):  # micro-batch 3 of the window: optimizer step 12
        step(logger, loss)
    with pytest.raises(UserError) as err:
        logger.flush(12, {})
    assert str(err.value).startswith("train/loss became nan at step 12 (epoch 2); training stopped, and what was "
                                     f"already written in {tmp_path} is kept")
    assert "train/loss" not in written(logger, tmp_path)  # nothing of that window was written


def test_a_non_finite_loss_between_logging_steps_is_caught_before_a_checkpoint(tmp_path):
    logger, _ = make(tmp_path, accumulate=1, steps_per_epoch=5)
    logger.window.first_step = 0
    for loss in (1.0, math.inf, 1.0):  # no logging step yet: a checkpoint at step 3 asks
        step(logger, loss)
    with pytest.raises(UserError, match=r"^train/loss became inf at step 2 \(epoch 0\)"):
        logger.check_finite()


def test_the_windows_mean_is_train_loss_at_logging_steps_and_its_epoch_mean_train_loss_epoch(tmp_path):
    logger, task = make(tmp_path)
    for at, losses in ((2, (1.0, 3.0)), (4, (5.0, 7.0))):
        for loss in losses:
            step(logger, loss)
        logger.flush(at, {"lr/default": 0.5})
    epoch = logger.end_epoch(task, 4, {})
    scalars = written(logger, tmp_path)
    assert scalars["train/loss"] == [(2, 2.0), (4, 6.0)]
    assert scalars["lr/default"] == [(2, 0.5), (4, 0.5)]
    assert epoch == {"train/loss_epoch": 4.0}


def test_a_task_that_logs_train_loss_itself_replaces_the_windows(tmp_path):
    logger, task = make(tmp_path)
    step(logger, 100.0)
    task.log("train/loss", 1.5)
    logger.flush(1, {})
    assert written(logger, tmp_path)["train/loss"] == [(1, 1.5)]
    assert "train/loss_epoch" not in logger.end_epoch(task, 1, {})


# ---------------------------------------------------------------------------------------------- resumable state
def test_train_log_state_round_trips_mid_window_and_mid_epoch():
    saved = TrainLog(CPU)
    saved.first_step = 6
    saved.losses.extend([torch.tensor(1.0), torch.tensor(2.0)])
    saved.add("train/x", torch.tensor(4.0), weight=3)
    saved.add("train/top", torch.tensor(9.0), weight=1, fx="max")
    state = saved.state_dict()
    TrainLog.check_state_dict(state, "checkpoint train_loss")
    loaded = TrainLog(CPU)
    loaded.load_state_dict(state)
    assert loaded.first_step == 6 and torch.equal(loaded.tensor(), torch.tensor([1.0, 2.0]))
    assert loaded.epoch_values() == saved.epoch_values() == {"train/x": 4.0, "train/top": 9.0}


def test_an_old_checkpoints_train_loss_sum_is_read_as_the_windows_own_and_reported_as_train_loss_epoch(tmp_path):
    """Checkpoints written before a task could log its own train/loss kept the window's epoch sum under that name,
    and had no epoch_fx or epoch_metrics."""
    old = {"first_step": 3, "losses": torch.tensor([2.0]), "counted": 0,
           "epoch_sums": {"train/loss": torch.tensor(6.0)}, "epoch_counts": {"train/loss": 3}}
    TrainLog.check_state_dict(old, "checkpoint train_loss")
    logger, task = make(tmp_path)
    logger.window.load_state_dict(old)
    assert OWN_LOSS in logger.window.epoch_sums and "train/loss" not in logger.window.epoch_sums
    assert logger.end_epoch(task, 4, {}) == {"train/loss_epoch": 2.0}  # (6 + 2) / (3 + 1)


# ---------------------------------------------------------------------------------------------- the task's view
def test_the_tasks_view_reports_the_runs_position_metrics_and_tensorboard(tmp_path):
    logger, task = make(tmp_path)
    progress = Progress(step=7, epoch=2)
    view_for(task, logger, progress=progress, max_epochs=3)
    logger.metrics["val/acc"] = 0.5
    assert (task.global_step, task.current_epoch, task.trainer.callback_metrics) == (7, 2, {"val/acc": 0.5})
    progress.stepped()  # the loop's own Progress, read live
    assert task.global_step == 8
    assert task.logger is logger.tensorboard
