"""Callbacks: the `callbacks` group, Lightning's hooks, the built-ins (early stopping, EMA, time limit, gradient
norms), a user's own callback from experiments/, and validation by steps that they all act on."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import output, read_scalars, run_cli, run_export
from safetensors.torch import load_file

from framework.callbacks.base import Callback, CallbackList
from framework.callbacks.early_stopping import EarlyStopping
from framework.checkpoint import open_checkpoint
from framework.loop.trainer import Trainer

pytestmark = pytest.mark.unit

QUIET = ("logger.progress_bar=false", "trainer.test=false")


def make(compose, run_dir: Path, *overrides: str) -> Trainer:
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(compose(*QUIET, *overrides), run_dir)


class Recorder(Callback):
    """Records every hook call (name, step) and, per optimizer step, the weights it produced."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.weights: list[list[torch.Tensor]] = []

    def _record(self, hook: str, trainer: Any) -> None:
        self.calls.append((hook, trainer.global_step))

    def setup(self, trainer, task): self._record("setup", trainer)
    def on_fit_start(self, trainer, task): self._record("on_fit_start", trainer)
    def on_train_epoch_start(self, trainer, task): self._record("on_train_epoch_start", trainer)
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx): self._record("on_train_batch_end", trainer)
    def on_before_optimizer_step(self, trainer, task, optimizer): self._record("on_before_optimizer_step", trainer)

    def on_before_zero_grad(self, trainer, task, optimizer):
        self._record("on_before_zero_grad", trainer)
        self.weights.append([p.detach().clone() for p in trainer.module.state_dict().values()])

    def on_train_epoch_end(self, trainer, task): self._record("on_train_epoch_end", trainer)
    def on_validation_start(self, trainer, task): self._record("on_validation_start", trainer)
    def on_validation_end(self, trainer, task, metrics): self._record("on_validation_end", trainer)
    def on_test_start(self, trainer, task): self._record("on_test_start", trainer)
    def on_test_end(self, trainer, task, metrics): self._record("on_test_end", trainer)
    def on_fit_end(self, trainer, task): self._record("on_fit_end", trainer)


def test_hooks_run_in_lightnings_order_with_the_step_they_follow(compose, tmp_path):
    trainer = make(compose, tmp_path, "callbacks=none", "+callbacks.rec._target_=test_callbacks.Recorder",
                   "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.accumulate_grad_batches=2",
                   "trainer.test=true", "checkpoint=none")
    recorder = dict(trainer.run.callbacks)["rec"]
    trainer.fit()
    assert recorder.calls == [
        ("setup", 0), ("on_fit_start", 0), ("on_train_epoch_start", 0),
        ("on_train_batch_end", 0),  # a micro-batch: no optimizer step yet
        ("on_before_optimizer_step", 0), ("on_before_zero_grad", 0), ("on_train_batch_end", 1),
        ("on_validation_start", 1), ("on_validation_end", 1),
        ("on_train_epoch_end", 1),  # after the epoch's validation, as in Lightning 2
        ("on_test_start", 1), ("on_test_end", 1), ("on_fit_end", 1)]


def test_a_hook_no_callback_implements_is_never_called():
    class OnlyEpochs(Callback):
        def on_train_epoch_end(self, trainer, task) -> None: ...

    hooks = CallbackList({"a": OnlyEpochs(), "b": EarlyStopping()})
    for hook in ("on_train_batch_end", "on_before_optimizer_step", "on_before_zero_grad"):
        assert hooks.bound(hook) is None  # the loop skips the call altogether
    assert len(hooks.hooks["on_train_epoch_end"]) == 1 and len(hooks.hooks["on_validation_end"]) == 1


def test_callbacks_group_presets_compose_and_can_be_switched_off_or_added(compose):
    assert set(compose().callbacks) == {"early_stopping", "grad_norm"}
    assert set(compose("callbacks=none").callbacks) == set()
    assert set(compose("callbacks=[default,ema]").callbacks) == {"early_stopping", "grad_norm", "ema"}
    assert compose("callbacks.early_stopping=null").callbacks.early_stopping is None
    added = compose("+callbacks.mine={_target_: experiments.callbacks.MetricHistory}").callbacks
    assert added.mine._target_ == "experiments.callbacks.MetricHistory"


@pytest.mark.e2e
@pytest.mark.parametrize(("override", "expected"), [
    ("+callbacks.mine=3", "callbacks.mine=3: expected a node with a _target_"),
    ("+callbacks.mine={_target_: torch.nn.Linear, in_features: 2, out_features: 2}",
     "callbacks.mine._target_='torch.nn.Linear' built a Linear; expected a framework.callbacks.base.Callback subclass"),
    ("callbacks.early_stopping.patience=0", "callbacks.early_stopping"),
    ("callbacks.early_stopping.monitor=val/nope", "callbacks.early_stopping.monitor='val/nope': no such metric"),
    ("data.val=null", "callbacks.early_stopping.monitor='val/loss': this run has no validation split"),
    ("trainer.max_time=soon", "trainer.max_time='soon': expected a duration DD:HH:MM:SS"),
    ("trainer.val_every_n_steps=-1", "trainer.val_every_n_steps=-1: expected >= 0"),
])
def test_a_bad_callback_setting_is_one_line_naming_its_key(tmp_path, override, expected):
    proc = run_cli(tmp_path / "run", override, "checkpoint=none")
    assert proc.returncode != 0
    assert expected in output(proc), output(proc)
    assert "Traceback" not in output(proc), output(proc)


@pytest.mark.e2e
def test_lightning_names_point_to_ours(tmp_path):
    proc = run_cli(tmp_path / "run", "+trainer.val_check_interval=5")
    assert "did you mean 'trainer.val_every_n_steps'" in output(proc), output(proc)


# ---------------------------------------------------------------------------------------------- early stopping
@pytest.mark.e2e
def test_early_stopping_stops_on_val_loss_and_says_why(tmp_path):
    # The command, made certain to stall: no improvement can exceed min_delta=10.
    proc = run_cli(tmp_path / "run", "callbacks=default", "trainer.max_epochs=300",
                   "callbacks.early_stopping.min_delta=10", "callbacks.early_stopping.patience=2")
    assert proc.returncode == 0, output(proc)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # The first validation is the best; two more without an improvement of 10 stop the run after epoch 3.
    assert summary["epoch"] == 3 and summary["step"] == 3 * 20
    assert summary["stopped"].startswith("early stopping: val/loss did not improve by more than 10 for 2 "
                                         "validations (best "), summary["stopped"]
    assert f"Stopped at step 60 (epoch 3): {summary['stopped']}" in output(proc)
    assert open_checkpoint(tmp_path / "run" / "checkpoints" / "last").step == 60
    # Resumed, the run it stopped stays stopped: nothing more is trained.
    again = run_cli(None, f"resume={tmp_path / 'run'}", fast=False)
    assert again.returncode == 0, output(again)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 60


def test_early_stopping_threshold_and_max_mode(compose, tmp_path):
    trainer = make(compose, tmp_path, "callbacks.early_stopping.monitor=val/acc", "callbacks.early_stopping.mode=max",
                   "callbacks.early_stopping.stopping_threshold=0.5", "trainer.max_epochs=50", "checkpoint=none")
    summary = trainer.fit()
    assert summary["stopped"].startswith("early stopping: val/acc = ") and "reached stopping_threshold 0.5" in \
        summary["stopped"]
    assert summary["val/acc"] >= 0.5 and summary["epoch"] < 50


def test_early_stopping_counts_validations_by_step_too(compose, tmp_path):
    trainer = make(compose, tmp_path, "trainer.val_every_n_steps=5", "callbacks.early_stopping.min_delta=10",
                   "callbacks.early_stopping.patience=2", "trainer.max_epochs=5", "checkpoint=none")
    summary = trainer.fit()
    assert summary["step"] == 15 and summary["epoch"] == 0  # mid-epoch: validations at steps 5, 10, 15


# ---------------------------------------------------------------------------------------------- EMA
def test_ema_follows_the_formula_and_leaves_the_raw_weights_bit_identical(compose, tmp_path):
    common = ("trainer.max_steps=7", "trainer.val_every_n_steps=3", "checkpoint=none", "callbacks=none")
    plain = make(compose, tmp_path / "plain", *common)
    plain.fit()
    with_ema = make(compose, tmp_path / "ema", *common, "+callbacks.ema={_target_: framework.callbacks.EMA, "
                    "decay: 0.9, warmup: true}", "+callbacks.rec._target_=test_callbacks.Recorder")
    ema, recorder = with_ema.run.callbacks.callbacks["ema"], with_ema.run.callbacks.callbacks["rec"]
    initial = [t.detach().clone() for t in with_ema.run.module.state_dict().values()]
    summary = with_ema.fit()
    # Validation swapped the average in and the raw weights back: training is untouched by it.
    for name, value in plain.run.module.state_dict().items():
        assert torch.equal(with_ema.run.module.state_dict()[name], value), name
    expected = initial
    for n, weights in enumerate(recorder.weights, start=1):
        decay = min(0.9, (1 + n) / (10 + n))
        expected = [e + (w - e) * (1 - decay) for e, w in zip(expected, weights)]
    for e, got in zip(expected, ema.weights.values()):
        torch.testing.assert_close(got, e, rtol=1e-6, atol=1e-7)
    assert ema.updates == 7
    # val/* measured the averaged weights: different from the plain run's.
    assert summary["val/loss"] != plain.run.metric_logger.metrics["val/loss"]


@pytest.mark.e2e
def test_ema_weights_are_in_the_pickle_free_checkpoint_and_export_uses_them(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(run, "callbacks=[default,ema]", "callbacks.ema.decay=0.5", "trainer.max_epochs=1")
    assert proc.returncode == 0, output(proc)
    state = load_file(str(run / "checkpoints" / "last" / "state.safetensors"))
    averaged = {k.split("/weights/", 1)[1]: v for k, v in state.items() if k.startswith("/callbacks/ema/weights/")}
    raw = load_file(str(run / "checkpoints" / "last" / "model.safetensors"))
    assert set(averaged) == set(raw) and any(not torch.equal(averaged[k], raw[k]) for k in raw)
    exported = run_export(str(run), "--which", "last")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "EMA" in exported.stdout + exported.stderr
    weights = load_file(str(run / "export" / "model.safetensors"))
    for name, value in averaged.items():
        assert torch.equal(weights[name], value), name


# ---------------------------------------------------------------------------------------------- time limit
@pytest.mark.e2e
def test_a_run_scoped_timer_stops_cleanly_saves_last_and_a_resume_gets_the_budget_left(tmp_path):
    """Lightning's Timer as a callback, scope=run: the budget counts every job of the run (trainer.max_time counts
    one job: tests/test_requeue.py)."""
    run = tmp_path / "run"
    timer = "+callbacks.timer={_target_:framework.callbacks.timer.Timer,duration:2,scope:run}"
    proc = run_cli(run, timer, "trainer.max_epochs=100000", "callbacks=none")
    assert proc.returncode == 0, output(proc)
    first = json.loads((run / "summary.json").read_text())
    assert first["stopped"].startswith("time limit: trained for "), first
    assert open_checkpoint(run / "checkpoints" / "last").step == first["step"] > 0
    state = open_checkpoint(run / "checkpoints" / "last").state()
    used = state["callbacks"]["timer"]["elapsed"]
    assert 2.0 <= used < 30
    # The same budget: already spent, nothing more is trained.
    same = run_cli(None, f"resume={run}", fast=False)
    assert same.returncode == 0, output(same)
    assert json.loads((run / "summary.json").read_text())["step"] == first["step"]
    # A larger budget: training goes on for what is left of it.
    more = run_cli(None, f"resume={run}", "+callbacks.timer.duration=4", fast=False)  # a key the run added
    assert more.returncode == 0, output(more)
    last = json.loads((run / "summary.json").read_text())
    assert last["step"] > first["step"] and last["stopped"].startswith("time limit")
    assert 4.0 <= open_checkpoint(run / "checkpoints" / "last").state()["callbacks"]["timer"]["elapsed"] < 40


# ---------------------------------------------------------------------------------------------- gradient norms
def test_grad_norms_are_logged_per_group_and_in_total_at_log_steps(compose, tmp_path):
    trainer = make(compose, tmp_path, "trainer.max_steps=12", "trainer.log_every_n_steps=4", "checkpoint=none",
                   "callbacks=grad_norm")
    trainer.fit()
    scalars = read_scalars(tmp_path)
    groups = [f"grad_norm/{name}" for name in trainer.run.param_group_names]
    assert len(groups) == 2  # the default optimizer: decay and no_decay groups
    for tag in [*groups, "grad_norm/total"]:
        assert [step for step, _ in scalars[tag]] == [4, 8, 12], tag
    for i in range(3):
        total = scalars["grad_norm/total"][i][1]
        assert total > 0 and math.isclose(total, math.sqrt(sum(scalars[g][i][1] ** 2 for g in groups)), rel_tol=1e-5)


def test_grad_norm_is_measured_before_clipping(compose, tmp_path):
    trainer = make(compose, tmp_path, "trainer.max_steps=2", "trainer.log_every_n_steps=1", "checkpoint=none",
                   "callbacks=grad_norm", "trainer.grad_clip_norm=0.001")
    trainer.fit()
    assert all(value > 0.001 for _, value in read_scalars(tmp_path)["grad_norm/total"])


# ---------------------------------------------------------------------------------------------- validation by steps
def test_val_every_n_steps_validates_mid_epoch_and_top_k_and_plateau_act_on_it(compose, tmp_path):
    trainer = make(compose, tmp_path, "trainer.val_every_n_steps=7", "trainer.max_epochs=2", "checkpoint=best_k",
                   "scheduler=plateau", "scheduler.patience=0", "scheduler.threshold=0.9", "callbacks=none", "trainer.log_every_n_steps=1")
    trainer.fit()
    scalars = read_scalars(tmp_path)
    # 20 steps per epoch: by step at 7, 14, (21), 28, 35; by epoch at 20 and 40.
    assert [step for step, _ in scalars["val/loss"]] == [7, 14, 20, 21, 28, 35, 40]
    assert trainer.run.progress.validations == 7
    kept = {name for _, name in trainer.run.checkpoints.top_k}
    assert kept <= {f"step-{s}" for s in (7, 14, 20, 21, 28, 35, 40)} and kept
    lrs = [lr for _, lr in scalars["lr/default"]]
    assert lrs[0] == pytest.approx(0.1) and min(lrs) < 0.09  # the plateau scheduler stepped on these validations


# ---------------------------------------------------------------------------------------------- a user's callback
@pytest.mark.e2e
def test_a_callback_from_experiments_with_its_yaml_file(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(run, "callbacks=[default,metric_history]", "trainer.max_epochs=2", "trainer.val_every_n_steps=15")
    assert proc.returncode == 0, output(proc)
    history = json.loads((run / "metric_history.json").read_text())["validations"]
    # An epoch's own validation sees current_epoch still that epoch's (Lightning 2's order)
    assert [(row["step"], row["epoch"]) for row in history] == [(15, 0), (20, 0), (30, 1), (40, 1)]
    assert all({"val/loss", "val/acc"} <= set(row) for row in history)
