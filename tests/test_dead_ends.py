"""No dead ends: a refusal names the key it came from, and the way forward it gives works when followed (each
test here runs the command a refusal suggests, as a user would). A run killed before its first checkpoint
continues with the resume=RUN_DIR its refusal names; an init_from= or resume= path that holds nothing to start
from is one error naming the key; a fast_dev_run keeps nothing and never touches a run
(framework/app/main.py, framework/app/resume.py, framework/app/rundir.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import (
    KILLHOOK,
    TESTS,
    fingerprint,
    make_image_folder,
    make_mnist,
    on_pythonpath,
    one_error_line,
    output,
    run_cli,
    saved_config,
)

from framework.zoo.models import MLP

pytestmark = pytest.mark.e2e

# After its 2nd of 4 steps (its first checkpoint is at the epoch's end); this module importable, for its model.
KILL_IN_FIRST_EPOCH = {"PYTHONPATH": on_pythonpath(KILLHOOK, TESTS),
                       "KILL_AT_STEP": "2", "KILL_SIGNAL": "SIGKILL"}
# One epoch of 4 steps, with settings of its own that a resume must bring back.
OWN = ("trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.test=false", "optimizer.lr=0.05")


class MLPKilledWhileBuilding(MLP):
    """The default model, except that with $KILL_WHILE_BUILDING set the process SIGKILLs itself while building it:
    a run killed during start-up, once Hydra has saved its config and before anything else."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if os.environ.get("KILL_WHILE_BUILDING"):
            os.kill(os.getpid(), signal.SIGKILL)
        super().__init__(*args, **kwargs)


def succeeded(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, output(proc)
    return output(proc)


def killed_in_first_epoch(run_dir: Path, *overrides: str) -> Path:
    proc = run_cli(run_dir, *OWN, *overrides, env=KILL_IN_FIRST_EPOCH)
    assert proc.returncode == -signal.SIGKILL, output(proc)
    assert (run_dir / ".hydra" / "config.yaml").is_file() and not (run_dir / "checkpoints" / "last").exists()
    return run_dir


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A cnn run that finished, with checkpoints/last and best (copy it before changing it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    succeeded(run_cli(run_dir, *OWN, "model=cnn"))
    return run_dir


@pytest.fixture(scope="module")
def never_saved(tmp_path_factory) -> Path:
    """A cnn run SIGKILLed in its first epoch, before its first checkpoint (copy it before changing it)."""
    return killed_in_first_epoch(tmp_path_factory.mktemp("killed") / "run", "model=cnn")


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


# ----------------------------------------------------------------------------------------------- the same command again
@pytest.mark.slow
@pytest.mark.parametrize("state", ["killed while starting up", "killed in its first epoch", "finished"])
def test_the_same_command_again_names_resume_run_dir_and_that_command_continues_the_run(tmp_path, state):
    run_dir = tmp_path / "run"
    own = (*OWN, "model._target_=test_dead_ends.MLPKilledWhileBuilding")
    env = {"PYTHONPATH": on_pythonpath(TESTS)}  # the model is this module's
    if state == "killed while starting up":
        killed = run_cli(run_dir, *own, env={**env, "KILL_WHILE_BUILDING": "1"})
        assert killed.returncode == -signal.SIGKILL, output(killed)
        assert (run_dir / ".hydra" / "config.yaml").is_file() and not (run_dir / "checkpoints").exists()
    elif state == "killed in its first epoch":
        killed_in_first_epoch(run_dir, *own[len(OWN):], "model.hidden=[32]")
        own = (*own, "model.hidden=[32]")
    else:
        succeeded(run_cli(run_dir, *own, env=env))
    line = one_error_line(run_cli(run_dir, *own, env=env))
    suggested = re.search(r"expected (resume=\S+) to continue it", line)
    assert suggested and suggested.group(1) == f"resume={run_dir}", line
    text = succeeded(run_cli(None, suggested.group(1), env=env, fast=False))
    assert ("starting it again from step 0 with its saved config" in text) == (state != "finished"), text
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 4
    config = saved_config(run_dir)  # the killed run's own settings, not the defaults
    assert config["model"]["_target_"] == "test_dead_ends.MLPKilledWhileBuilding"
    assert config["optimizer"]["lr"] == 0.05 and config["trainer"]["limit_train_batches"] == 4
    assert config["model"]["hidden"] == ([32] if state == "killed in its first epoch" else [256, 256])


@pytest.mark.slow
def test_a_run_that_finished_without_a_checkpoint_is_never_offered_resume(tmp_path):
    run_dir = tmp_path / "run"
    own = (*OWN, "checkpoint=none")
    succeeded(run_cli(run_dir, *own))
    before = fingerprint(run_dir)
    line = one_error_line(run_cli(run_dir, *own))
    assert "already holds a run" in line and "resume=" not in line and "expected another directory" in line
    line = one_error_line(run_cli(None, f"resume={run_dir}", fast=False))
    assert line.startswith(f"Error: resume='{run_dir}': the run finished without saving a checkpoint"), line
    assert fingerprint(run_dir) == before
    succeeded(run_cli(tmp_path / "another", *own))  # what both refusals ask for


# ------------------------------------------------------------------------------------- resume of a run that never saved
def test_resume_of_a_run_that_never_saved_takes_this_command_line_on_top_of_its_saved_config(never_saved, tmp_path):
    run_dir = copy_of(never_saved, tmp_path)
    # No state to carry over: another model is no refusal, but a start in the same directory with another model.
    text = succeeded(run_cli(None, f"resume={run_dir}", "trainer.limit_train_batches=2", "model=mlp", fast=False))
    assert "trainer.limit_train_batches: 4 -> 2" in text and "model: cnn -> mlp" in text
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 2
    config = saved_config(run_dir)
    assert config["model"]["_target_"] == "framework.zoo.models.MLP" and config["optimizer"]["lr"] == 0.05


def test_resume_of_a_run_that_never_saved_keeps_its_init_from(finished_run, tmp_path):
    run_dir = killed_in_first_epoch(tmp_path / "run", "model=cnn", f"init_from={finished_run}")
    text = succeeded(run_cli(None, f"resume={run_dir}", fast=False))
    assert f"init_from={finished_run}: its newest intact checkpoint" in text
    assert saved_config(run_dir)["init_from"] == str(finished_run / "checkpoints" / "last")


def test_a_saved_config_of_a_run_that_never_saved_builds_only_what_the_users_code_names(never_saved, tmp_path):
    run_dir = copy_of(never_saved, tmp_path)
    path = run_dir / ".hydra" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["task"]["loss"] = {"_target_": "torch.nn.MultiMarginLoss"}
    path.write_text(yaml.safe_dump(config))
    line = one_error_line(run_cli(None, f"resume={run_dir}", fast=False))
    assert "task.loss._target_='torch.nn.MultiMarginLoss'" in line and str(path) in line
    assert "or trust_saved_config=true for a run you trust" in line
    succeeded(run_cli(None, f"resume={run_dir}", "trust_saved_config=true", fast=False))
    assert saved_config(run_dir)["task"]["loss"]["_target_"] == "torch.nn.MultiMarginLoss"


# -------------------------------------------------------------------------------------------- paths that name their key
def flip_a_byte(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.unlink()  # a new inode: checkpoints share files by hard links
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("what", ["an empty directory", "a run that never saved", "a damaged checkpoint"])
def test_init_from_a_path_without_weights_is_one_error_naming_init_from(never_saved, finished_run, tmp_path, what):
    if what == "an empty directory":
        source = tmp_path / "empty"
        source.mkdir()
    elif what == "a run that never saved":
        source = never_saved
    else:
        source = copy_of(finished_run, tmp_path) / "checkpoints" / "last"
        flip_a_byte(source)
    run_dir = tmp_path / "run"
    line = one_error_line(run_cli(run_dir, *OWN, "model=cnn", f"init_from={source}"))
    assert line.startswith(f"Error: init_from='{source}': "), line
    assert not run_dir.exists()


def test_init_from_a_run_directory_starts_from_its_newest_checkpoint(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    text = succeeded(run_cli(run_dir, *OWN, "model=cnn", f"init_from={finished_run}"))
    assert f"init_from={finished_run}: its newest intact checkpoint, {finished_run / 'checkpoints' / 'last'}" in text
    assert saved_config(run_dir)["init_from"] == str(finished_run / "checkpoints" / "last")


@pytest.mark.parametrize("what, says", [("a file", "not a directory"),
                                        ("an empty directory", "neither a run directory")])
def test_resume_of_a_path_that_is_no_run_is_one_error_naming_resume(tmp_path, what, says):
    source = tmp_path / "source"
    source.mkdir()
    if what == "a file":
        source = source / "model.safetensors"
        source.write_bytes(b"not a run")
    run_dir = tmp_path / "run"
    line = one_error_line(run_cli(run_dir, f"resume={source}"))
    assert line.startswith(f"Error: resume='{source}': {says}"), line
    assert not run_dir.exists()


# ----------------------------------------------------------------------------------------------- other advice, followed
def test_another_optimizer_on_resume_names_a_new_run_command_that_works(finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    line = one_error_line(run_cli(None, f"resume={run_dir}", "optimizer=adamw", fast=False))
    assert "optimizer=adamw: the run used optimizer=sgd" in line
    suggested = re.search(r"for a new run from its weights instead: (.+), without resume=\)", line)
    assert suggested, line
    succeeded(run_cli(tmp_path / "new", *OWN, *suggested.group(1).split()))  # the cnn weights fit: model=cnn


@pytest.mark.slow
def test_the_values_a_refusal_asks_for_are_the_ones_that_work(tmp_path):
    """resolve_all's `e.g. KEY=VALUE` and check_paths's `set data.root=...`, filled in as a user would."""
    line = one_error_line(run_cli(tmp_path / "a", *OWN, "data=image_folder"))
    suggested = re.search(r"e\.g\. (.+)$", line)
    assert suggested and suggested.group(1) == "data.root=VALUE data.num_classes=VALUE", line
    make_image_folder(tmp_path / "images", {"train": ("cat", "dog"), "val": ("cat", "dog")})
    values = {"data.root": str(tmp_path / "images"), "data.num_classes": "2"}
    filled = [f"{key}={values[key]}" for key in (item.split("=")[0] for item in suggested.group(1).split())]
    succeeded(run_cli(tmp_path / "b", *OWN, "data=image_folder", *filled, "data.input_shape=[3,8,8]",
                      "data.num_workers=0", "data.persistent_workers=false"))

    line = one_error_line(run_cli(tmp_path / "c", *OWN, "data=mnist", "data.root=/nonexistent"))
    assert "set data.root=/path/to/data" in line
    make_mnist(tmp_path / "mnist")
    succeeded(run_cli(tmp_path / "d", *OWN, "data=mnist", f"data.root={tmp_path / 'mnist'}"))


# --------------------------------------------------------------------------------------------------------- fast_dev_run
def test_a_fast_dev_run_leaves_no_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    succeeded(run_cli(run_dir, "trainer.fast_dev_run=true"))
    assert not run_dir.exists()
    # Into a folder that holds other things (not a run): only what the dev run wrote goes.
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    succeeded(run_cli(run_dir, "trainer.fast_dev_run=true"))
    assert [p.name for p in run_dir.iterdir()] == ["notes.txt"]


def test_a_fast_dev_runs_closing_summary_says_nothing_was_kept(tmp_path):
    text = succeeded(run_cli(tmp_path / "run", "trainer.fast_dev_run=true"))
    assert "fast_dev_run: nothing was kept" in text and "Run directory:" not in text


@pytest.mark.slow
def test_a_fast_dev_run_never_touches_a_run_and_its_advice_works(finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    before = fingerprint(run_dir)
    line = one_error_line(run_cli(None, f"resume={run_dir}", "trainer.fast_dev_run=true", fast=False))
    assert line.startswith("Error: trainer.fast_dev_run=true: ") and f"resume={run_dir}" in line, line
    assert fingerprint(run_dir) == before and not list((run_dir / ".hydra").glob("resumed-*"))
    assert "expected trainer.fast_dev_run=false to continue it, or no resume= for a dev run of its own" in line
    succeeded(run_cli(None, f"resume={run_dir}", "trainer.fast_dev_run=false", "trainer.max_epochs=2", fast=False))
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 8
    succeeded(run_cli(tmp_path / "dev", "trainer.fast_dev_run=true"))
    assert not (tmp_path / "dev").exists()
