"""Stateful metrics (torchmetrics) are computed over the whole split, every rank included, and equal
scikit-learn's on the same predictions, where a mean of batch values does not; the example task logs its
misclassified images as TensorBoard reads them."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import output, run_cli
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

from framework.core.errors import ConfigError
from framework.task.classification import ClassificationTask
from framework.task.metrics import Accuracy
from framework.zoo.datasets import digits

pytestmark = pytest.mark.unit

CLASSES = 10


def f1(logits: torch.Tensor, target: torch.Tensor) -> float:
    from sklearn.metrics import f1_score  # a second to import: paid by the tests that use it

    return f1_score(target.numpy(), logits.argmax(1).numpy(), average="macro", labels=range(CLASSES),
                    zero_division=0)


def auroc(logits: torch.Tensor, target: torch.Tensor) -> float:
    from sklearn.metrics import roc_auc_score

    return roc_auc_score(target.numpy(), logits.double().softmax(1).numpy(), multi_class="ovr",
                         labels=range(CLASSES))


def batch_mean(metric, logits: torch.Tensor, target: torch.Tensor, batch_size: int) -> float:
    """What the trainer does with a batch metric: the mean of its batch values weighted by batch size."""
    values = [(metric(x, y), len(y)) for x, y in zip(logits.split(batch_size), target.split(batch_size))]
    return sum(v * n for v, n in values) / len(target)


def make_task() -> ClassificationTask:
    torch.manual_seed(0)
    metrics = {"acc": Accuracy(), "f1": MulticlassF1Score(num_classes=CLASSES, average="macro"),
               "auroc": MulticlassAUROC(num_classes=CLASSES, average="macro")}
    return ClassificationTask(nn.Linear(16, CLASSES), metrics=metrics)


@pytest.mark.filterwarnings("ignore:No positive samples")  # AUROC of a class absent from a small split
def test_stateful_metrics_span_every_batch_then_reset_and_val_never_mixes_with_test():
    task = make_task()
    x, y = torch.randn(100, 16), torch.randint(0, CLASSES, (100,))
    batches = list(zip(x.split(32), y.split(32)))  # 32, 32, 32, 4: uneven
    outs = [task.validation_step(batch) for batch in batches]
    assert all(set(out.metrics) == {"acc"} for out in outs)  # batch metrics only; the others come at epoch end
    task.test_step((x[:10], y[:10]))
    logits = task.model(x).detach()
    got = task.epoch_metrics("val")
    assert set(got) == {"f1", "auroc"}
    assert got["f1"].item() == pytest.approx(f1(logits, y), abs=1e-6)
    assert got["auroc"].item() == pytest.approx(auroc(logits, y), abs=1e-5)
    assert batch_mean(f1, logits, y, 32) != pytest.approx(f1(logits, y), abs=1e-3)  # why it is stateful
    assert task.epoch_metrics("test")["f1"].item() == pytest.approx(f1(logits[:10], y[:10]), abs=1e-6)
    task.validation_step(batches[0])  # reset: the next evaluation starts from nothing
    assert task.epoch_metrics("val")["f1"].item() == pytest.approx(f1(logits[:32], y[:32]), abs=1e-6)


def test_stateful_metrics_are_no_part_of_the_checkpoint_or_the_optimizer():
    task = make_task()
    task.validation_step((torch.randn(8, 16), torch.randint(0, CLASSES, (8,))))
    assert [id(p) for p in task.parameters()] == [id(p) for p in task.model.parameters()]
    assert all(key.startswith("model.") for key in task.state_dict())


def test_check_batch_takes_stateful_metrics_and_leaves_no_state():
    task = make_task()
    batch = (torch.randn(8, 16), torch.randint(0, CLASSES, (8,)))
    assert task.check_batch(batch, "train").metrics == {}  # training_step's output: no metrics on the hot path
    assert all(m.update_count == 0 for split in ("val", "test") for m in task.stateful_metrics[split].values())
    wrong = ClassificationTask(nn.Linear(16, CLASSES), metrics={"f1": MulticlassF1Score(num_classes=5)})
    with pytest.raises(ConfigError, match=r"task\.metrics\.f1: MulticlassF1Score on the model's output"):
        wrong.check_batch(batch, "val")  # 10 scores for 5 classes: named by the metric's key


# Uneven shards: 261 val images (val_fraction 0.145) in batches of 32 are 131 + 130 under two ranks, each
# ending in a partial batch; 270 test images are 135 + 135. One epoch, so the last checkpoint is the model
# that was validated. The MLP has no batch norm, whose running statistics differ between ranks.
RUN = ("experiment=digits_misclassified", "model=mlp", "trainer.max_epochs=1", "data.train.val_fraction=0.145",
       "data.eval_batch_size=32", "checkpoint.monitor=val/f1", "callbacks=none")


def predictions(run_dir: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved model's logits on a whole split, in one process."""
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    model = instantiate(cfg.model)
    model.load_state_dict(load_file(str(run_dir / "checkpoints" / "last" / "model.safetensors")))
    data = digits(split, val_fraction=0.145)
    with torch.no_grad():
        return model.eval()(data.tensors[0]), data.tensors[1]


@pytest.mark.e2e
@pytest.mark.parametrize("parallel", [(), pytest.param(("parallel=ddp", "parallel.devices=2", "trainer.device=cpu"),
                                                          marks=pytest.mark.distributed)], ids=["single", "ddp"])
def test_f1_and_auroc_of_a_run_equal_scikit_learns_on_the_same_predictions(tmp_path, parallel):
    proc = run_cli(tmp_path, *RUN, *parallel)
    assert proc.returncode == 0, output(proc)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == (2 if parallel else 1)
    for split in ("val", "test"):
        logits, target = predictions(tmp_path, split)
        assert summary[f"{split}/f1"] == pytest.approx(f1(logits, target), abs=1e-6)
        assert summary[f"{split}/auroc"] == pytest.approx(auroc(logits, target), abs=1e-5)
    logits, target = predictions(tmp_path, "val")
    assert summary["val/acc"] == pytest.approx((logits.argmax(1) == target).float().mean().item(), abs=1e-6)
    assert batch_mean(f1, logits, target, 32) != pytest.approx(summary["val/f1"], abs=1e-3)
    if not parallel:
        assert_misclassified_images_logged(tmp_path, logits, target)


def assert_misclassified_images_logged(run_dir: Path, logits: torch.Tensor, target: torch.Tensor) -> None:
    """Read back with TensorBoard's own reader: 8 columns of 32x32 tiles (8x8 digits scaled 4x), 2 px apart."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["val/misclassified"]
    (event,) = acc.Images("val/misclassified")  # one validation
    shown = min(32, int((logits.argmax(1) != target).sum()))
    columns = min(8, shown)
    rows = -(-shown // columns)
    image = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)))
    assert image.shape == (event.height, event.width, 3) == (2 + rows * 34, 2 + columns * 34, 3)
    assert event.step == json.loads((run_dir / "summary.json").read_text())["step"]
