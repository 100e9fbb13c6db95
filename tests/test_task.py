"""Tasks and metrics compute what they say."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.task.classification import ClassificationTask
from framework.task.metrics import Accuracy

pytestmark = pytest.mark.unit


def test_accuracy_top1_and_topk():
    logits = torch.tensor([[0.9, 0.1, 0.0], [0.1, 0.2, 0.7], [0.5, 0.4, 0.1]])
    target = torch.tensor([0, 1, 2])
    assert Accuracy()(logits, target).item() == pytest.approx(1 / 3)
    assert Accuracy(top_k=2)(logits, target).item() == pytest.approx(2 / 3)


def test_classification_task_loss_is_cross_entropy_and_val_reports_accuracy():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    task = ClassificationTask(model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    expected = nn.functional.cross_entropy(model(x), y)
    assert torch.allclose(task.training_step((x, y)).loss, expected)
    out = task.validation_step((x, y))
    assert set(out.metrics) == {"acc"}
    assert torch.allclose(out.metrics["acc"], (model(x).argmax(1) == y).float().mean())
    assert task.batch_size((x, y)) == 8
