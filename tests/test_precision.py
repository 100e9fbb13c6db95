"""AMP on CPU: bf16 autocast trains; fp16 + GradScaler keeps unscale -> clip -> step -> update and skips
steps with inf gradients without advancing the LR schedule. CUDA-only checks skip without a GPU."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import read_scalars

from framework.loop.trainer import Trainer
from framework.parallel.precision import Precision
from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput

pytestmark = pytest.mark.unit

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def trainer(compose, tmp_path, *overrides: str) -> Trainer:
    cfg = compose("logger.progress_bar=false", "trainer.test=false", *overrides)
    return Trainer(cfg, tmp_path)


def flat_weights(t: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in t.run.strategy.unwrap(t.run.task.model).parameters()])


def test_amp_on_cpu_is_bf16_autocast_and_trains(compose, tmp_path):
    t = trainer(compose, tmp_path, "precision=amp", "trainer.max_epochs=3")
    summary = t.fit()
    assert summary["precision"] == "bf16-autocast"
    assert summary["val/acc"] > 0.8


def test_autocast_really_computes_in_the_chosen_dtype():
    for mode, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        precision = Precision(mode, torch.device("cpu"))
        with precision.autocast():
            out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        assert out.dtype == dtype
    assert Precision("fp32", torch.device("cpu")).name == "fp32"


def test_fp16_uses_a_grad_scaler_and_clips_true_gradients(compose, tmp_path):
    common = ("trainer.max_steps=1", "optimizer.momentum=0.0", "optimizer.weight_decay=0.0", "optimizer.lr=0.1",
              "data.shuffle=false", "trainer.grad_clip_norm=100")
    fp16 = trainer(compose, tmp_path / "fp16", "precision=fp16", *common)
    assert fp16.run.precision.name == "fp16-autocast+gradscaler"
    assert fp16.run.precision.scaler.get_scale() == 65536.0
    before = flat_weights(fp16)
    fp16.fit()
    update = float((flat_weights(fp16) - before).norm())
    fp32 = trainer(compose, tmp_path / "fp32", *common)
    before32 = flat_weights(fp32)
    fp32.fit()
    update32 = float((flat_weights(fp32) - before32).norm())
    # Clipping the *scaled* gradients (norm x 65536 > 100) would shrink the update ~1000-fold.
    assert update == pytest.approx(update32, rel=0.05)


class InfGradientTask(ClassificationTask):
    """Makes every gradient infinite on its second training step (the loss itself stays finite)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def training_step(self, batch: Any) -> StepOutput:
        self.calls += 1
        inputs, target = batch
        logits = self.model(inputs)
        if self.calls == 2:
            logits.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        return StepOutput(self.loss(logits, target))


def test_inf_gradient_skips_the_step_and_leaves_the_scheduler_in_place(compose, tmp_path):
    t = trainer(compose, tmp_path, "precision=fp16", "task._target_=test_precision.InfGradientTask",
                "scheduler=exponential", "scheduler.interval=step", "scheduler.gamma=0.5", "trainer.max_steps=3",
                "trainer.log_every_n_steps=1", "trainer.grad_clip_norm=1.0")
    t.fit()
    assert t.run.precision.skipped_steps == 1
    assert t.run.scheduler.scheduler.last_epoch == 2  # 3 optimizer steps, one skipped
    assert t.run.optimizers.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
    assert all(torch.isfinite(p).all() for p in t.run.task.parameters())
    scalars = read_scalars(tmp_path)
    assert [v for _, v in scalars["amp/skipped_steps"]] == [0, 1, 1]
    scales = [v for _, v in scalars["amp/scale"]]
    assert scales[1] == scales[0] / 2  # the skipped step halved the scale


@cuda
def test_fp16_on_cuda_trains(compose, tmp_path):
    summary = trainer(compose, tmp_path, "precision=fp16", "trainer.max_epochs=3").fit()
    assert summary["precision"] == "fp16-autocast+gradscaler" and summary["val/acc"] > 0.8
