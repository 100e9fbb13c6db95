"""The overhead benchmark's pieces work: `experiment=bench` composes to the specified workload and trains, the
hand-written loops train on the same data, and bench/overhead.py runs end to end. No wall-clock assertion:
times depend on the machine (bench/RESULTS.md has the figures)."""
from __future__ import annotations

import contextlib
import io
import sys

import pytest
import torch
from conftest import ROOT, read_scalars

from framework.loop.trainer import Trainer
from framework.zoo.synthetic import classification

sys.path.insert(0, str(ROOT / "bench"))
import handwritten  # noqa: E402
import overhead  # noqa: E402

pytestmark = pytest.mark.unit


def test_synthetic_data_is_the_specified_seeded_classification():
    x, y = classification().tensors
    assert x.shape == (32_768, 128) and x.dtype == torch.float32
    assert y.shape == (32_768,) and y.dtype == torch.int64
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01  # standard normal
    assert set(y.unique().tolist()) == set(range(10))
    again_x, again_y = classification().tensors
    assert torch.equal(x, again_x) and torch.equal(y, again_y)
    assert not torch.equal(x, classification(seed=1).tensors[0])


def test_bench_experiment_composes_to_the_workload_and_trains(compose, tmp_path):
    cfg = compose("experiment=bench", "trainer.max_steps=5", "trainer.log_every_n_steps=2")
    assert cfg.name == "bench"
    assert cfg.data.batch_size == 128 and cfg.data.shuffle and cfg.data.drop_last
    assert cfg.data.val is None and cfg.data.test is None and not cfg.trainer.test
    assert not cfg.logger.progress_bar and cfg.logger.tensorboard
    assert cfg.precision.mode.value == "fp32" and cfg.parallel.strategy.value == "single"

    trainer = Trainer(cfg, tmp_path)
    model = trainer.run.strategy.unwrap(trainer.run.task.model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(128, 256), (256, 256), (256, 10)]
    assert len(trainer.run.optimizers.param_groups) == 1
    group = trainer.run.optimizers.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]) == (0.05, 0.9, 0.0, False)
    assert trainer.run.data.num_batches("train") == 32_768 // 128
    # The framework and the hand-written loops train on the same tensors.
    for ours, theirs in zip(trainer.run.data.datasets["train"].tensors, classification(seed=handwritten.DATA_SEED).tensors):
        assert torch.equal(ours, theirs)

    with contextlib.redirect_stdout(io.StringIO()):
        summary = trainer.fit()
    assert summary["step"] == 5
    assert [step for step, _ in read_scalars(tmp_path)["train/loss"]] == [2, 4, 5]


def test_hand_written_loops_start_from_the_framework_initial_weights(compose, tmp_path):
    trainer = Trainer(compose("experiment=bench", "trainer.max_steps=1"), tmp_path)
    ours = [p.detach() for p in trainer.run.task.model.parameters()]
    torch.manual_seed(handwritten.SEED)
    theirs = list(handwritten.make_model().parameters())
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("name", sorted(handwritten.LOOPS))
def test_hand_written_loop_trains_and_logs(name, tmp_path, monkeypatch):
    monkeypatch.setattr(handwritten, "LOG_EVERY", 2)
    steps, last = handwritten.LOOPS[name](5, tmp_path)
    assert steps == 5 and 0 < last < 10
    assert [step for step, _ in read_scalars(tmp_path)["train/loss"]] == [2, 4]


@pytest.mark.e2e  # a whole benchmark script, in this process
def test_overhead_script_runs_end_to_end(capsys):
    timings = overhead.main(["--reps", "1", "--short", "2", "--long", "4", "--device", "cpu", "--no-lightning"])
    assert set(timings.runs) == {"framework", "dataloader", "permutation"}
    assert all(len(runs) == 1 for runs in timings.runs.values())
    out = capsys.readouterr().out
    assert "framework / dataloader" in out and "framework / permutation" in out
    assert "lightning: not installed (or --no-lightning); skipped" in out


@pytest.mark.e2e  # a whole benchmark script, in this process
def test_predict_script_runs_end_to_end(capsys):
    """bench/predict.py with tiny sizes: a 5-step checkpoint of experiment=bench, the framework's predict stage
    (checked to write the hand-written loop's predictions) and the hand-written loops, one repetition."""
    import predict

    timings = predict.main(["--reps", "1", "--short", "1", "--long", "3", "--train-steps", "5", "--no-lightning"])
    assert set(timings.runs) == {"framework", "handwritten", "dataloader"}
    assert all(len(runs) == 1 for runs in timings.runs.values())
    out = capsys.readouterr().out
    assert "framework / handwritten" in out and "framework / dataloader" in out
    assert "lightning: not installed (or --no-lightning); skipped" in out


@pytest.mark.e2e
def test_realistic_script_runs_end_to_end(tmp_path, capsys):
    """bench/realistic.py on 20 PNGs: its ImageFolder, then the framework (run.py in a subprocess, timing read
    from its run directory) and the hand-written loop, one repetition of 2 epochs each."""
    import realistic

    ratios = realistic.main(["--reps", "1", "--settings", "w0", "--contenders", "framework,handwritten",
                             "--images", "20", "--data", str(tmp_path / "images")])
    for split, count in (("train", 20), ("val", 10)):
        folders = sorted((tmp_path / "images" / split).iterdir())
        assert [f.name for f in folders] == [str(c) for c in range(10)]  # every class in each split
        assert sum(len(list(f.glob("*.png"))) for f in folders) == count
    assert list(ratios) == ["w0/none: framework / handwritten"]
    assert len(ratios["w0/none: framework / handwritten"]) == 1 and ratios["w0/none: framework / handwritten"][0] > 0
    out = capsys.readouterr().out
    assert "framework" in out and "handwritten" in out and "lightning: not installed (or not in --contenders)" in out


def test_realistic_contenders_train_the_framework_model_and_optimizer(compose, tmp_path):
    """bench/realistic.py's hand-written and Lightning contenders build the model the framework's overrides
    build (same layers, same initial weights) and the same parameter groups."""
    import realistic

    realistic.make_images(tmp_path / "images", 10, 10)
    overrides = realistic.framework_overrides(tmp_path / "images", tmp_path / "run", 0, 1, 2, "none")
    trainer = Trainer(compose(*[o for o in overrides if not o.startswith("hydra.")]), tmp_path / "run")
    ours = trainer.run.strategy.unwrap(trainer.run.task.model).state_dict()
    theirs = realistic.make_model().state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    groups = realistic.make_optimizer(realistic.make_model()).param_groups
    assert sorted((len(g["params"]), g["lr"], g["momentum"], g["weight_decay"]) for g in groups) == \
        sorted((len(g["params"]), g["lr"], g["momentum"], g["weight_decay"]) for g in trainer.run.optimizers.param_groups)


@pytest.mark.e2e  # a whole benchmark script, in this process
def test_checkpoint_training_cost_script_runs_end_to_end(capsys):
    """bench/checkpoint.py --training: epochs after a save against epochs after none, the save made by the
    default checkpoint policy's manager on the background writer; one repetition of 2-step epochs."""
    import checkpoint

    result = checkpoint.main(["--training", "--reps", "1", "--steps", "2"])
    assert list(result) == ["training"] and result["training"] > -1
    out = capsys.readouterr().out
    assert "rep 1/1: epoch after a save" in out and "cost of a save to its epoch: median" in out


def test_gan_hand_loop_starts_from_the_framework_initial_weights_on_its_data(compose, tmp_path):
    """bench/gan.py's hand-written loop builds the generator and discriminator the framework's `experiment=gan`
    builds (same weights from the same seed) and trains on the same images."""
    import gan

    trainer = Trainer(compose("experiment=gan", *gan.QUIET, "trainer.max_steps=1"), tmp_path)
    task = trainer.run.task
    generator, discriminator, validation_z = gan.make_nets()
    for ours, theirs in ((task.generator, generator), (task.discriminator, discriminator)):
        ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
        assert list(ours_state) == list(theirs_state)
        assert all(torch.equal(ours_state[k], theirs_state[k]) for k in ours_state)
    assert torch.equal(task.validation_z, validation_z)
    assert [(type(o).__name__, g["lr"], g["betas"]) for o in trainer.run.optimizers for g in o.param_groups] == \
        [("Adam", gan.LR, gan.BETAS)] * 2
    assert trainer.run.data.num_batches("train") == 20  # 1,257 images in batches of 64, the last one short
    assert torch.equal(trainer.run.data.datasets["train"].tensors[0], gan.digits("train", pixel_range=(-1.0, 1.0)).tensors[0])


def test_gan_hand_loop_trains_both_nets_and_logs_at_the_cadence(tmp_path, monkeypatch):
    import gan

    monkeypatch.setattr(gan, "LOG_EVERY", 2)
    steps, g_loss, d_loss = gan.hand_loop(21, tmp_path)  # one whole epoch (20 batches) and a step
    assert steps == 21 and 0 < g_loss < 10 and 0 < d_loss < 10
    scalars = read_scalars(tmp_path)
    assert [step for step, _ in scalars["g_loss"]] == [step for step, _ in scalars["d_loss"]] == list(range(2, 21, 2))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    images.Reload()
    assert [e.step for e in images.Images("generated_images")] == [0]  # the task's grid, at the one epoch's end


@pytest.mark.e2e  # a whole benchmark script, in this process
def test_gan_script_runs_end_to_end(capsys):
    import gan

    timings = gan.main(["--reps", "1", "--short", "2", "--long", "4"])
    assert set(timings.runs) == {"framework", "hand"}
    assert all(len(runs) == 1 for runs in timings.runs.values())
    assert "framework / hand" in capsys.readouterr().out
