"""The LR range test, `python run.py lr_find` (framework/stages/lr_find.py, issue 34): the run's own optimizer, parameter-group
multipliers and accumulation; the run put back afterwards and no checkpoint written; deterministic for a seed; the
curve as a PNG and in TensorBoard; the suggestion an override whose run reaches val/acc >= 0.97 on the digits MLP."""
from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import output, read_scalars, run_cli

from framework.core.errors import ConfigError
from framework.stages import lr_find, lr_plot

pytestmark = pytest.mark.unit

# Established by hand (seed 42, the default 20 epochs of the digits MLP, SGD with momentum 0.9): the final val/acc
# reached 0.9704 at lr 0.015, 0.98 from 0.03 to 0.2, 0.9778 at 0.3; 0.9630 at 0.01 and 0.9556 at 0.35, 0.585 at 0.5.
GOOD_LRS = (0.015, 0.3)
QUIET = ("logger.progress_bar=false", "checkpoint=none")


def test_the_lrs_grow_exponentially_and_the_suggestion_is_a_tenth_of_the_lowest_losss_lr():
    lrs = lr_find.schedule(1e-4, 1.0, 5)
    assert lrs == pytest.approx([1e-4, 1e-3, 1e-2, 1e-1, 1.0])
    lrs = lr_find.schedule(1e-6, 1.0, 40)
    losses = [2.0] * 12 + [2.0 - 0.1 * i for i in range(1, 20)] + [float("inf")] * 9  # lowest at step 30
    assert lr_find.suggest(lrs, losses) == pytest.approx(lrs[30] / 10)
    assert lr_find.suggest(lrs, [1.0] * 5 + [1e-3] * 5 + [float("nan")] * 5) is None  # lowest before the skip
    assert lr_find.steepest(lrs, [2.0] * 15 + [1.0] + [0.9] * 24) == pytest.approx(lrs[15])


def _run(compose, tmp_path, *overrides: str):
    from framework.loop.run import assemble

    cfg = compose("stage=fit", "trainer.device=cpu", *QUIET, *overrides)
    return assemble(cfg, tmp_path)


def test_every_group_is_scaled_by_its_multiplier_and_the_run_is_put_back_with_no_checkpoint(compose, tmp_path):
    run = _run(compose, tmp_path, "lr_find.num_steps=12", "optimizer.lr=0.5",
               "optimizer.param_groups=[{name: head, params: ['net.3.*', 'net.5.*'], lr_mult: 0.1}]")
    names = [g.get("name") for g in run.optimizers.param_groups]
    before = {k: v.clone() for k, v in run.module.state_dict().items()}
    opt_before, rng_before = run.optimizers.state_dict(), torch.get_rng_state()
    with lr_find.kept_states(run):
        curve = lr_find.range_test(run, run.cfg.lr_find)
        lrs = {name: g["lr"] for name, g in zip(names, run.optimizers.param_groups)}
        assert lrs["head"] == pytest.approx(0.1 * curve.lrs[-1]) and len(set(lrs.values())) == 2, lrs
        assert any(not torch.equal(before[k], v) for k, v in run.module.state_dict().items())  # it trained
    assert all(torch.equal(before[k], v) for k, v in run.module.state_dict().items())
    after = run.optimizers.state_dict()
    assert [g["lr"] for g in after["param_groups"]] == [g["lr"] for g in opt_before["param_groups"]]
    assert after["state"] == opt_before["state"] == {}  # no momentum buffers were kept
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert not (tmp_path / "checkpoints").exists()


def test_accumulating_two_batches_of_32_draws_the_curve_of_batches_of_64_and_a_seed_repeats_it(compose, tmp_path):
    """Each step's loss is the mean over its micro-batches, and its gradient theirs: 2 x 32 samples step as 64 (the
    same samples: the order is one permutation per epoch, whatever the batch size). Lightning's ignores accumulation."""
    steps = "lr_find.num_steps=12"  # within the first epoch (19 batches of 64)

    def curve(*overrides: str) -> list[float]:
        run = _run(compose, tmp_path / str(len(list(tmp_path.iterdir()))), steps, *overrides)
        with lr_find.kept_states(run):
            return lr_find.range_test(run, run.cfg.lr_find).losses

    whole = curve("data.batch_size=64")
    accumulated = curve("data.batch_size=32", "trainer.accumulate_grad_batches=2")
    assert accumulated == pytest.approx(whole, rel=1e-4) and len(whole) == 12
    assert curve("data.batch_size=64") == whole  # bit for bit for the same seed
    assert curve("data.batch_size=64", "seed=7") != whole


@pytest.mark.parametrize("override, said", [
    ("lr_find.max_lr=1e-7", "lr_find.max_lr=1e-07: expected a learning rate > lr_find.min_lr=1e-06"),
    ("lr_find.num_steps=1", "lr_find.num_steps=1: expected a number of optimizer steps >= 2"),
    ("lr_find.early_stop_threshold=1.0", "lr_find.early_stop_threshold=1.0: expected null (never stop early)"),
    ("ckpt=outputs", "ckpt='outputs': expected null with lr_find"),
])
def test_bad_lr_find_settings_are_one_line_naming_the_key(compose, override, said):
    from framework.config.validate import validate

    with pytest.raises(ConfigError, match="^" + re.escape(said)):
        validate(compose("stage=lr_find", override))


def test_a_range_that_ends_below_its_start_names_both_ends(compose):
    from framework.config.validate import validate

    with pytest.raises(ConfigError) as refused:
        validate(compose("stage=lr_find", "lr_find.max_lr=0.1", "lr_find.min_lr=1"))
    assert str(refused.value) == "lr_find.max_lr=0.1: expected a learning rate > lr_find.min_lr=1.0"


def summary_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "framework.summary"]


def test_no_suggestion_is_null_in_summary_json_and_said_on_the_console(compose, tmp_path, caplog):
    """Too short a test for a suggestion (its first 10 steps are skipped): summary.json is JSON (null, not NaN),
    and says why, as the closing lines do; no `optimizer.lr=` line to copy."""
    caplog.set_level("INFO")
    summary = lr_find.find_lr(compose("stage=lr_find", *QUIET, "lr_find.num_steps=5"), tmp_path)
    written = json.loads((tmp_path / "summary.json").read_text(),
                         parse_constant=lambda name: pytest.fail(f"summary.json holds {name}"))
    assert written["suggested_lr"] is None and summary["suggested_lr"] is None
    assert written["no_suggestion"].startswith("no finite loss after the first 10 steps (5 ran)")
    lines = summary_lines(caplog)
    assert any(line.startswith("  no suggestion: no finite loss after the first 10 steps") for line in lines)
    assert not [line for line in lines if line.startswith("optimizer.lr=")]
    json.loads((tmp_path / "lr_find.json").read_text(), parse_constant=lambda name: pytest.fail(name))


def test_trainer_max_steps_is_fits_length_and_lr_find_says_so_in_one_line(compose, tmp_path, caplog):
    """The range test's length is lr_find.num_steps, as every run-length key of the trainer is fit's (Lightning's
    tuner likewise): a trainer.max_steps on the command line is named in one line, not silently ignored."""
    caplog.set_level("INFO")
    summary = lr_find.find_lr(compose("stage=lr_find", *QUIET, "lr_find.num_steps=12", "trainer.max_steps=3"),
                              tmp_path)
    assert summary["step"] == 12
    said = [r.getMessage() for r in caplog.records if "trainer.max_steps" in r.getMessage()]
    assert said == ["lr_find: trainer.max_steps=3 is fit's length, not the range test's: "
                    "it takes lr_find.num_steps=12 optimizer steps"], said
    caplog.clear()
    lr_find.find_lr(compose("stage=lr_find", *QUIET, "lr_find.num_steps=12"), tmp_path / "plain")
    assert not [r for r in caplog.records if "trainer.max_steps" in r.getMessage()]


def test_without_matplotlib_pillow_draws_the_plot(tmp_path):
    from PIL import Image

    lrs = lr_find.schedule(1e-5, 1.0, 30)
    losses = [2.3 - 0.05 * i for i in range(20)] + [5.0] * 10
    lr_plot.with_pillow(lrs, losses, losses, 0.01, tmp_path / "curve.png")
    with Image.open(tmp_path / "curve.png") as image:
        assert image.size == lr_plot.SIZE and len(image.convert("RGB").getcolors(1 << 16)) > 3  # lines, not blank


@pytest.mark.e2e
def test_lr_find_prints_an_override_in_the_good_range_and_a_run_at_it_reaches_97_percent(tmp_path):
    found = run_cli(tmp_path / "find", "lr_find", fast=False)
    assert found.returncode == 0, output(found)
    line = re.search(r"^optimizer\.lr=(\S+)$", found.stdout, re.MULTILINE)
    assert line, output(found)
    lr = float(line.group(1))
    assert GOOD_LRS[0] <= lr <= GOOD_LRS[1], output(found)
    record = json.loads((tmp_path / "find" / "lr_find.json").read_text())
    assert len(record["lrs"]) == 100 and record["suggestion"] == pytest.approx(lr, rel=1e-2)
    assert (tmp_path / "find" / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(read_scalars(tmp_path / "find")["lr_find/loss"]) == 100
    assert not (tmp_path / "find" / "checkpoints").exists()
    trained = run_cli(tmp_path / "fit", line.group(0), "checkpoint=none", "trainer.test=false", fast=False)
    assert trained.returncode == 0, output(trained)
    assert json.loads((tmp_path / "fit" / "summary.json").read_text())["val/acc"] >= 0.97


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.slow
def test_under_ddp_the_ranks_draw_one_curve(tmp_path):
    proc = run_cli(tmp_path, "lr_find", "parallel=ddp", "parallel.devices=2", "trainer.device=cpu",
                   "lr_find.num_steps=12", "data.batch_size=32")
    assert proc.returncode == 0, output(proc)  # lr_find checks that every rank's curve is rank 0's
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == 2
    assert len(json.loads((tmp_path / "lr_find.json").read_text())["lrs"]) == 12
