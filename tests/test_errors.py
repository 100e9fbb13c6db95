"""A user's mistake ends the run with one message naming the key (or file), the value and what was expected:
exit code 1, no Python traceback (unless HYDRA_FULL_ERROR=1 asks for one).

Each test runs run.py as a subprocess, as a user would. Mistakes in the command line itself (an unknown
key, a wrong type, an unknown group option) are found by Hydra while composing the config and reported by
`framework.app.cli`; the rest go through `framework.app.main`. Both print one `Error: ...` line.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from conftest import one_error_line, output, read_scalars, run_cli

pytestmark = pytest.mark.e2e

# A run that does start training stays tiny.
TINY = ("trainer.max_epochs=1", "trainer.limit_train_batches=2")


def fail(run_dir: Path, *overrides: str) -> str:
    """Run with `overrides`, assert it failed the way a user error should (conftest.one_error_line: exit 1, no
    traceback, one `Error:` line, the last printed, so nothing competes for the reader) and return that line."""
    return one_error_line(run_cli(run_dir, *TINY, *overrides))


def assert_in(text: str, *fragments: str) -> None:
    """Each fragment is in the text; on failure, show the whole text."""
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in:\n{text}"


# ---------------------------------------------------------------- found by Hydra while composing (framework.app.cli)


def test_unknown_key_is_named_with_the_closest_one_and_how_to_add_it(tmp_path: Path) -> None:
    text = fail(tmp_path, "optimizer.lrr=0.1")
    assert_in(text, "optimizer.lrr=0.1: optimizer has no key 'lrr'", "did you mean 'optimizer.lr'?",
              "+optimizer.lrr=0.1")


def test_wrong_type_names_key_value_and_expected_type(tmp_path: Path) -> None:
    text = fail(tmp_path, "trainer.max_epochs=abc")
    assert_in(text, "trainer.max_epochs='abc': expected an integer")


def test_unknown_group_option_lists_the_available_ones(tmp_path: Path) -> None:
    text = fail(tmp_path, "model=nosuchmodel")
    assert_in(text, "model=nosuchmodel: no such option in group 'model'", "expected one of: autoencoder, cnn, mlp, resnet18")


# ---------------------------------------------------------------- reported by framework.app.main


def test_unknown_constructor_argument_names_key_value_and_suggests_the_close_one(tmp_path: Path) -> None:
    text = fail(tmp_path, "+optimizer.momentm=0.9")
    assert_in(text, "optimizer.momentm=0.9", "torch.optim.SGD has no argument 'momentm'",
              "did you mean 'momentum'?", "expected one of:")


def test_unimportable_target_names_key_value_and_missing_module(tmp_path: Path) -> None:
    text = fail(tmp_path, "model._target_=nosuch.module.Model")
    assert_in(text, "model._target_='nosuch.module.Model' cannot be imported", "No module named 'nosuch'",
              "expected a dotted path")


def test_missing_dataset_root_says_which_key_to_set(tmp_path: Path) -> None:
    text = fail(tmp_path, "data=mnist", "data.root=/nonexistent")
    assert_in(text, "data.root='/nonexistent'", "no such directory", "set data.root=")


def test_missing_mandatory_values_are_all_named_with_how_to_set_them(tmp_path: Path) -> None:
    text = fail(tmp_path, "data=image_folder")
    assert_in(text, "data.root=???", "data.num_classes=???", "data.root=VALUE")


def test_broken_interpolation_names_key_and_what_it_points_to(tmp_path: Path) -> None:
    text = fail(tmp_path, "model.num_classes=${data.nosuch}")
    assert_in(text, "model.num_classes='${data.nosuch}' cannot be resolved", "'data.nosuch' not found")


def test_cross_field_validation_names_key_value_and_range(tmp_path: Path) -> None:
    text = fail(tmp_path, "trainer.accumulate_grad_batches=0")
    assert_in(text, "trainer.accumulate_grad_batches=0: expected >= 1")


def test_batch_limit_above_one_is_neither_fraction_nor_count(tmp_path: Path) -> None:
    text = fail(tmp_path, "trainer.limit_train_batches=1.5")
    assert_in(text, "trainer.limit_train_batches=1.5: expected a fraction in (0, 1]")


def test_missing_required_constructor_argument_says_how_to_add_it(tmp_path: Path) -> None:
    text = fail(tmp_path, "~model.num_classes")
    assert_in(text, "model.num_classes is not set", "needs the argument 'num_classes'", "+model.num_classes=VALUE")


def test_missing_argument_of_a_component_the_framework_completes_is_named(tmp_path: Path) -> None:
    # The scheduler is built as a partial (the trainer passes the optimizer): its other arguments are still due.
    text = fail(tmp_path, "scheduler._target_=torch.optim.lr_scheduler.StepLR")
    assert_in(text, "scheduler.step_size is not set", "+scheduler.step_size=VALUE")


def test_value_of_the_wrong_type_for_an_annotated_argument_is_refused_before_training(tmp_path: Path) -> None:
    # CrossEntropyLoss would only fail at the first training step, far from the key.
    text = fail(tmp_path, "task.loss.label_smoothing=abc")
    assert_in(text, "task.loss.label_smoothing='abc'", "takes 'label_smoothing' as float",
              "e.g. task.loss.label_smoothing=0.0")


def test_constructor_rejecting_a_value_names_the_node_and_its_values(tmp_path: Path) -> None:
    text = fail(tmp_path, "optimizer.lr=-1")
    assert_in(text, "optimizer: torch.optim.SGD(", "lr=-1", "ValueError: Invalid learning rate: -1")


def test_diverging_loss_stops_at_its_step_and_keeps_the_events_already_written(tmp_path: Path) -> None:
    text = fail(tmp_path, "optimizer.lr=1e6", "trainer.log_every_n_steps=1", "trainer.limit_train_batches=10")
    match = re.search(r"train/loss became (nan|inf|-inf) at step (\d+)", text)
    assert match, text
    assert_in(text, "optimizer.lr")
    bad_step = int(match.group(2))
    losses = read_scalars(tmp_path)["train/loss"]
    assert losses, "the finite losses logged before the failure are readable"
    assert all(step < bad_step and math.isfinite(value) for step, value in losses), losses
    # It had trained: a run that failed (docs/checkpoints.md), not a refusal; the line says how to go on.
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and f"at step {bad_step}" in summary["error"], summary
    assert "once it is fixed, " in text, text


def test_full_error_env_shows_the_traceback_of_our_config_error(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, *TINY, "trainer.accumulate_grad_batches=0", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0
    assert_in(output(proc), "Traceback", "framework.core.errors.ConfigError: trainer.accumulate_grad_batches=0")
