"""Several named optimizers, manual optimization (Lightning's), and parameters of the task beside its model: each
trained by its owner, saved, restored exactly; what the loop cannot do refused in one line before the first step."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from conftest import KILLHOOK, assert_identical, final_state, on_pythonpath, one_error_line, output, read_scalars, run_cli
from torch import nn

from framework.checkpoint import open_checkpoint
from framework.task.classification import ClassificationTask

pytestmark = pytest.mark.e2e

# 20 batches per epoch; `last` every 7 steps, written before the run goes on (a SIGKILL may come right after).
GAN = ("experiment=gan", "logger.progress_bar=false", "trainer.max_epochs=2", "trainer.log_every_n_steps=5",
       "checkpoint.every_n_steps=7", "checkpoint.async_save=false")


class WithTemperature(ClassificationTask):
    """A classifier whose logits are divided by a learnable temperature held beside its model."""

    def __init__(self, model: nn.Module, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) / self.temperature

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


class TwoNets(ClassificationTask):
    """A classifier with a second net whose output is added (a second optimizer's to own)."""

    def __init__(self, model: nn.Module, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) + self.head(x.flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


class ManualTwoNets(TwoNets):
    """TwoNets stepped by hand: each optimizer on its own net's loss, clipped, with each one's schedule."""

    def __init__(self, model: nn.Module, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_model, opt_head = self.optimizers()
        for opt in (opt_model, opt_head):
            self.toggle_optimizer(opt)
            loss = nn.functional.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            self.untoggle_optimizer(opt)
        for schedule in self.lr_schedulers() or []:
            schedule.step()
        return loss


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(run_dir / "checkpoints" / "last")
    return {**checkpoint.model_state(), **checkpoint.state().get("task_parameters", {})}


def test_a_parameter_beside_the_model_is_trained_saved_and_restored(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(run, "task._target_=test_manual_optimization.WithTemperature", "trainer.max_epochs=1")
    assert proc.returncode == 0, output(proc)
    temperature = _params(run)["temperature"]
    assert temperature.shape == () and float(temperature) != 1.0  # trained: it started at exactly 1
    groups = (run / "param_groups.json").read_text()
    assert '"temperature"' in groups  # owned by the one optimizer, in its table


def test_a_gan_under_manual_optimization_trains_both_nets_and_resumes_bit_identical_after_a_sigkill(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = run_cli(whole, *GAN)
    assert proc.returncode == 0, output(proc)
    # Two optimizer steps a batch: the 20th is batch 10's, 3 batches after step 7's save, once that save (written
    # behind the loop) is on disk, however slow the machine.
    env = {"PYTHONPATH": on_pythonpath(KILLHOOK), "KILL_AT_STEP": "20", "KILL_SIGNAL": "SIGKILL",
           "KILL_WHEN_EXISTS": str(killed / "checkpoints" / "step-7")}
    proc = run_cli(killed, *GAN, env=env)
    assert proc.returncode == -signal.SIGKILL, output(proc)
    resumed = run_cli(None, f"resume={killed}")
    assert resumed.returncode == 0, output(resumed)
    assert "at step 7 " in output(resumed)
    a, b = final_state(whole), final_state(killed)
    assert any(k.startswith("state:/optimizer/generator/") for k in a)
    assert any(k.startswith("state:/optimizer/discriminator/") for k in a)
    # the task built both nets, as Lightning's does: it is its own model, and the checkpoint's weights hold both
    assert {k.split(".")[0] for k in a if not k.startswith("state:")} == {"generator", "discriminator"}
    assert not any(k.startswith("state:/task_parameters") for k in a)
    assert_identical(a, b)
    series = [read_scalars(run) for run in (whole, killed)]
    for name in ("g_loss", "d_loss"):
        assert [s for s, _ in series[0][name]] == [5, 10, 15, 20, 25, 30, 35, 40]  # one point a logging step
        assert series[1][name] == series[0][name], name


def test_both_nets_of_the_gan_are_trained_by_their_own_optimizer(tmp_path, compose):
    from framework.loop.trainer import Trainer

    trainer = Trainer(compose(*GAN, "trainer.max_epochs=1", "checkpoint.save_last=false"), tmp_path)
    task = trainer.run.task
    before = {k: v.clone() for k, v in task.state_dict().items()}
    trainer.fit()
    changed = {k.split(".")[0] for k, v in task.state_dict().items() if not torch.equal(before[k], v)}
    assert changed == {"generator", "discriminator"}
    optimizers = task.optimizers()
    assert [o.optimizer for o in optimizers] == list(trainer.run.optimizers)  # config order
    assert [g["name"] for o in optimizers for g in o.param_groups] == ["generator/default", "discriminator/default"]
    assert trainer.run.progress.step == 20  # one step a batch, however many optimizers it stepped


@pytest.mark.unit
def test_toggle_freezes_only_the_other_optimizers_parameters_and_untoggle_restores_each_as_it_was():
    """Lightning's toggle_optimizer: a parameter the toggled optimizer also owns stays trainable, one the user froze
    stays frozen after untoggle, and a second toggle before untoggle adds to the first."""
    from framework.core.errors import UserError
    from framework.loop.manual import TaskOptimizers
    from framework.optim.optimizers import Optimizers
    from framework.parallel.precision import Precision

    a, b, shared, frozen = (nn.Parameter(torch.zeros(1)) for _ in range(4))
    frozen.requires_grad_(False)
    opt_a, opt_b = torch.optim.SGD([a, shared], lr=0.1), torch.optim.SGD([b, shared, frozen], lr=0.1)
    precision = Precision("fp32", torch.device("cpu"))
    task_optimizers = TaskOptimizers(Optimizers({"a": opt_a, "b": opt_b}, False, []), precision)
    wrapped_a, wrapped_b = task_optimizers.optimizers()

    def requires_grad():
        return [p.requires_grad for p in (a, b, shared, frozen)]

    for given in (opt_a, wrapped_a):  # the optimizer or what self.optimizers() returns
        task_optimizers.toggle(given)
        assert requires_grad() == [True, False, True, False]
        task_optimizers.untoggle(given)
        assert requires_grad() == [True, True, True, False]
    task_optimizers.toggle(wrapped_b)
    assert requires_grad() == [False, True, True, False]
    task_optimizers.toggle(wrapped_a)  # a stays frozen by the first one until untoggle
    assert requires_grad() == [False, False, True, False]
    task_optimizers.untoggle(wrapped_a)
    assert requires_grad() == [True, True, True, False]
    opt_a.add_param_group({"params": [b]})  # the groups as they are at each toggle
    task_optimizers.toggle(wrapped_a)
    assert requires_grad() == [True, True, True, False]
    task_optimizers.untoggle(wrapped_a)
    with pytest.raises(UserError, match="not one of this run's"):
        task_optimizers.toggle(torch.optim.SGD([a], lr=0.1))


def test_manual_optimization_clips_steps_each_schedule_and_its_summary_holds(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(run, "task._target_=test_manual_optimization.ManualTwoNets", "trainer.max_epochs=1",
                   "scheduler=none", "~optimizer", "+optimizer.net._target_=torch.optim.SGD", "+optimizer.net.lr=0.1",
                   "+optimizer.net.owns=[model]", "+optimizer.net.scheduler._target_=torch.optim.lr_scheduler.StepLR",
                   "+optimizer.net.scheduler.step_size=1", "+optimizer.net.scheduler.gamma=0.5",
                   "+optimizer.head._target_=torch.optim.SGD", "+optimizer.head.lr=0.1", "+optimizer.head.owns=[head]",
                   "+optimizer.head.scheduler._target_=torch.optim.lr_scheduler.StepLR",
                   "+optimizer.head.scheduler.step_size=1", "+optimizer.head.scheduler.gamma=0.9")
    assert proc.returncode == 0, output(proc)
    state = open_checkpoint(run / "checkpoints" / "last").state()["optimizer"]
    steps = 20  # the task stepped each schedule once a batch
    assert state["net"]["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5 ** steps)
    assert state["head"]["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.9 ** steps)
    assert state["net/scheduler"]["last_epoch"] == state["head/scheduler"]["last_epoch"] == steps
    series = read_scalars(run)
    assert series["lr/head/default"][-1][1] == pytest.approx(0.1 * 0.9 ** steps)


NAMED = ("~optimizer", "+optimizer.net._target_=torch.optim.SGD", "+optimizer.net.lr=0.1",
         "+optimizer.net.owns=[model]", "+optimizer.head._target_=torch.optim.SGD", "+optimizer.head.lr=0.1")


@pytest.mark.parametrize("overrides, expected", [
    (("task._target_=test_manual_optimization.TwoNets", *NAMED, "+optimizer.head.owns=[head]", "scheduler=none"),
     "Error: optimizer: 2 optimizers (net, head) under automatic optimization; expected one, or "
     "`self.automatic_optimization = False` in TwoNets.__init__"),
    (("task._target_=test_manual_optimization.ManualTwoNets", *NAMED, "+optimizer.head.owns=[model]",
      "scheduler=none"),
     "Error: optimizer.head.owns: model.net.1.weight is owned by optimizer.net too"),
    (("task._target_=test_manual_optimization.ManualTwoNets", *NAMED, "+optimizer.head.owns=[tail]",
      "scheduler=none"),
     "Error: optimizer.head.owns: 'tail' is neither a submodule nor a parameter of the task; expected one of its "
     "submodules (model, head"),
    (("task._target_=test_manual_optimization.ManualTwoNets", "~optimizer", "+optimizer.net._target_=torch.optim.SGD",
      "+optimizer.net.lr=0.1", "+optimizer.net.owns=[model]", "scheduler=none"),
     "Error: optimizer: no optimizer owns head.weight, head.bias; expected every trainable parameter owned by one "
     "of optimizer.net"),
    (("task._target_=test_manual_optimization.ManualTwoNets", *NAMED, "+optimizer.head.owns=[head]",
      "scheduler=cosine"),
     "Error: scheduler._target_='torch.optim.lr_scheduler.CosineAnnealingLR': one schedule for 2 optimizers"),
    (("experiment=gan", "trainer.accumulate_grad_batches=2"),
     "Error: trainer.accumulate_grad_batches=2: GAN optimizes manually"),
    (("experiment=gan", "trainer.grad_clip_norm=1.0"), "Error: trainer.grad_clip_norm=1.0: GAN optimizes manually"),
    (("experiment=gan", "stage=lr_find"), "Error: lr_find: the run has named optimizers (generator, discriminator)"),
    (("experiment=gan", "parallel=ddp", "parallel.devices=1"),
     "Error: parallel.strategy=ddp: GAN builds its nets itself (generator, discriminator), so it is its own model"),
])
def test_what_the_loop_cannot_do_with_its_optimizers_is_one_line_before_the_first_step(tmp_path, overrides, expected):
    line = one_error_line(run_cli(tmp_path / "run", *overrides))
    assert line.startswith(expected), line


def test_a_manual_step_under_fp16_steps_through_the_grad_scaler_and_saves_it(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(run, *GAN, "precision=fp16", "trainer.max_epochs=1")
    assert proc.returncode == 0, output(proc)
    series = read_scalars(run)
    assert [s for s, _ in series["amp/scale"]] == [5, 10, 15, 20]  # the optimizers' steps went through the scaler
    saved = open_checkpoint(run / "checkpoints" / "last").state()["precision"]["scaler"]
    assert saved["scale"] == series["amp/scale"][-1][1] and saved["_growth_tracker"] == 20 * 2 % 2000


def test_the_gans_generator_exports_to_onnx_on_the_tasks_example_input_array(tmp_path, capsys):
    import onnxruntime

    from framework.stages import export

    run = tmp_path / "run"
    assert run_cli(run, *GAN, "trainer.max_epochs=1").returncode == 0
    assert export.main([str(run), "--format", "onnx"]) == 1  # the data's images are not the generator's input
    assert "Error: " in capsys.readouterr().err
    assert export.main([str(run), "--example-input-array", "--format", "onnx", "--out", str(tmp_path / "g")]) == 0
    assert "on the model's example_input_array, a float32 tensor of shape [2, 32]" in capsys.readouterr().out
    session = onnxruntime.InferenceSession(str(tmp_path / "g" / "model.onnx"))
    images = session.run(None, {session.get_inputs()[0].name: torch.randn(5, 32).numpy()})[0]
    assert images.shape == (5, 1, 8, 8) and images.min() >= -1 and images.max() <= 1  # the generator's tanh


def test_the_gan_predicts_digits_it_generates(tmp_path):
    """`python run.py predict` of a GAN: its predict_step samples one digit per input row, in the tanh's range."""
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    assert run_cli(run, *GAN, "trainer.max_epochs=1").returncode == 0
    proc = run_cli(tmp_path / "predict", "predict", f"ckpt={run}", "logger.progress_bar=false")
    assert proc.returncode == 0, output(proc)
    table = pq.read_table(tmp_path / "predict" / "predictions.parquet")
    images = torch.tensor(table.column("image").to_pylist())
    assert table.num_rows == 270 and images.shape == (270, 64)  # the test split's rows, an 8x8 digit each
    assert images.min() >= -1 and images.max() <= 1 and images.std() > 0.05
    assert "270 rows in" in proc.stdout and "rows 270" not in proc.stdout  # a count, not a metric


class HookedManual(ManualTwoNets):
    """ManualTwoNets recording Lightning's hooks around its own backward and step calls."""

    def __init__(self, model: nn.Module, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.calls: list[tuple] = []

    def on_before_backward(self, loss):
        self.calls.append(("before_backward", loss.requires_grad))

    def on_after_backward(self):
        self.calls.append(("after_backward", any(p.grad is not None for p in self.parameters())))

    def on_before_optimizer_step(self, optimizer):
        owner = "head" if any(p is self.head.weight for g in optimizer.param_groups for p in g["params"]) else "net"
        self.calls.append(("before_optimizer_step", owner))

    def on_before_zero_grad(self, optimizer):  # Lightning calls it in automatic optimization only
        self.calls.append(("before_zero_grad",))


@pytest.mark.unit
def test_a_manual_step_calls_lightnings_backward_and_optimizer_step_hooks_around_its_own_calls(compose, tmp_path):
    from framework.loop.trainer import Trainer

    cfg = compose("task._target_=test_manual_optimization.HookedManual", "trainer.max_steps=2", "scheduler=none",
                  "trainer.test=false", "trainer.limit_val_batches=1", *NAMED, "+optimizer.head.owns=[head]")
    trainer = Trainer(cfg, tmp_path)
    trainer.fit()
    one_batch = [("before_backward", True), ("after_backward", True), ("before_optimizer_step", "net"),
                 ("before_backward", True), ("after_backward", True), ("before_optimizer_step", "head")]
    assert trainer.run.task.calls == one_batch * 2

