"""framework.core.compat: the private APIs it uses still do what it was written for, on the versions installed."""
from __future__ import annotations

import pytest
import torch
from torchmetrics import MaxMetric, MeanMetric

from framework.core import compat
from framework.task.metrics import load_metric_state, metric_state

pytestmark = pytest.mark.unit


def test_a_metric_state_with_its_update_count_comes_back_exactly():
    metric = MeanMetric()
    for value in (1.0, 2.0, 6.0):
        metric.update(torch.tensor(value))
    saved = metric_state(metric)
    fresh = MeanMetric()
    load_metric_state(fresh, saved, torch.device("cpu"))
    assert fresh.update_count == 3  # what compute() and forward() read: restored through framework.core.compat
    assert float(fresh.compute()) == pytest.approx(3.0)
    fresh.update(torch.tensor(3.0))
    assert float(fresh.compute()) == pytest.approx(3.0) and fresh.update_count == 4


def test_set_update_count_refuses_a_metric_without_the_private_count():
    metric = MaxMetric()
    del metric._update_count  # as a torchmetrics release that renamed it would leave us
    with pytest.raises(RuntimeError, match="written for torchmetrics 1.x"):
        compat.set_update_count(metric, 2)
