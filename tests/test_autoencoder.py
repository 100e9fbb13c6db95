"""`experiment=autoencoder` (experiments/autoencoder.py, docs/autoencoder.md), Lightning's autoencoder with two
validation sets, trained end to end in this process for a few steps: both sets' series are in TensorBoard (read with
its own reader) and in summary.json, each summary number the last point of its series, `best/*` its minimum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import read_scalars

from framework.app import api

pytestmark = pytest.mark.e2e

SHORT = ("logger.progress_bar=false", "trainer.max_epochs=3", "trainer.limit_train_batches=4")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("autoencoder")
    api.run(["experiment=autoencoder", *SHORT, f"hydra.run.dir={run_dir}"])
    return run_dir


def test_the_autoencoder_validates_on_both_sets_and_its_summary_holds_their_series_last_points(trained):
    cfg = api.compose(["experiment=autoencoder", *SHORT])
    assert list(cfg.data.val_sets) == ["noisy"] and list(cfg.data.test_sets) == ["noisy"]
    summary = json.loads((trained / "summary.json").read_text())
    series = read_scalars(trained)
    for name in ("val/loss", "val/loss/noisy"):
        assert [step for step, _ in series[name]] == [4, 8, 12]  # every epoch's end, each set
        assert summary[name] == pytest.approx(series[name][-1][1], rel=1e-6)  # (TensorBoard keeps float32)
        assert summary[f"best/{name}"] == pytest.approx(min(value for _, value in series[name]), rel=1e-6)
    for name in ("test/loss", "test/loss/noisy"):
        assert summary[name] == pytest.approx(series[name][-1][1], rel=1e-6)
    # The noisy digits are harder to bring back than the clean ones: the two sets are two different numbers.
    assert summary["val/loss/noisy"] > summary["val/loss"] > 0


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_the_validate_and_test_stages_evaluate_every_set_of_the_best_weights(trained, tmp_path, stage):
    summary = api.run([stage, f"ckpt={trained}", f"hydra.run.dir={tmp_path}", "logger.progress_bar=false"])
    fit, series = json.loads((trained / "summary.json").read_text()), read_scalars(trained)
    best_step = summary["step"]  # the best checkpoint's: the lowest val/loss
    if stage == "validate":
        at_best = {name: dict(series[name])[best_step] for name in ("val/loss", "val/loss/noisy")}
        assert {k: summary[k] for k in at_best} == pytest.approx(at_best, rel=1e-6)
    else:
        assert {k: summary[k] for k in ("test/loss", "test/loss/noisy")} == {
            k: fit[k] for k in ("test/loss", "test/loss/noisy")
        }  # fit tested the same weights


def test_the_noisy_set_is_the_same_digits_with_the_same_noise_every_time():
    from experiments.autoencoder import noisy_digits
    from framework.zoo.datasets import digits

    first, again = noisy_digits("val"), noisy_digits("val")
    noisy, clean = first.tensors
    assert torch.equal(clean, digits("val").tensors[0]) and torch.equal(noisy, again.tensors[0])
    assert 0.0 <= float(noisy.min()) and float(noisy.max()) <= 1.0 and not torch.equal(noisy, clean)
