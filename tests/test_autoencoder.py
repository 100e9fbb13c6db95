"""`experiment=autoencoder` (experiments/autoencoder.py, docs/autoencoder.md), Lightning's autoencoder with two
validation sets, trained end to end in this process for a few steps: both sets' series are in TensorBoard (read with
its own reader) and in summary.json, each summary number the last point of its series, `best/*` its minimum."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import read_scalars

from framework.app import api

pytestmark = pytest.mark.e2e

SHORT = ("logger.progress_bar=false", "trainer.max_epochs=3", "trainer.limit_train_batches=4")


def test_the_autoencoder_validates_on_both_sets_and_its_summary_holds_their_series_last_points(tmp_path):
    cfg = api.compose(["experiment=autoencoder", *SHORT])
    assert list(cfg.data.val_sets) == ["noisy"] and list(cfg.data.test_sets) == ["noisy"]
    summary = api.run(["experiment=autoencoder", *SHORT, f"hydra.run.dir={tmp_path}"])
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    series = read_scalars(tmp_path)
    for name in ("val/loss", "val/loss/noisy"):
        assert [step for step, _ in series[name]] == [4, 8, 12]  # every epoch's end, each set
        assert summary[name] == pytest.approx(series[name][-1][1], rel=1e-6)  # (TensorBoard keeps float32)
        assert summary[f"best/{name}"] == pytest.approx(min(value for _, value in series[name]), rel=1e-6)
    for name in ("test/loss", "test/loss/noisy"):
        assert summary[name] == pytest.approx(series[name][-1][1], rel=1e-6)
    # The noisy digits are harder to bring back than the clean ones: the two sets are two different numbers.
    assert summary["val/loss/noisy"] > summary["val/loss"] > 0


def test_the_noisy_set_is_the_same_digits_with_the_same_noise_every_time():
    from experiments.autoencoder import noisy_digits
    from framework.zoo.datasets import digits

    first, again = noisy_digits("val"), noisy_digits("val")
    noisy, clean = first.tensors
    assert torch.equal(clean, digits("val").tensors[0]) and torch.equal(noisy, again.tensors[0])
    assert 0.0 <= float(noisy.min()) and float(noisy.max()) <= 1.0 and not torch.equal(noisy, clean)
