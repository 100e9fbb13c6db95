"""Mistakes Hydra finds while composing the config (framework/app/cli.py): one `Error: ...` line naming what was
typed and what would be valid, exit code 1, no traceback; HYDRA_FULL_ERROR=1 still shows Hydra's own report.

Each runs run.py as a subprocess, as a user would; all fail before any training starts (well under a second).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF, ROOT, one_error_line, output, run_cli
from omegaconf import OmegaConf

from framework.app import cli
from framework.config.validate import validate

pytestmark = pytest.mark.e2e


def only_line(proc: subprocess.CompletedProcess) -> str:
    """The entry point's one `Error: ...` line (conftest.one_error_line), and nothing else was printed."""
    line = one_error_line(proc)
    assert output(proc).strip() == line, output(proc)
    return line


def assert_in(line: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in:\n{line}"


@pytest.mark.parametrize("override, fragments", [
    ("model=cnnn", ["model=cnnn: no such option in group 'model'", "did you mean 'cnn'?",
                    "expected one of: autoencoder, cnn, mlp, resnet18"]),
    ("modle=mlp", ["modle=mlp: no config group or key 'modle'", "did you mean 'model'?", "expected one of:"]),
    ("optimizer.lrr=1", ["optimizer.lrr=1: optimizer has no key 'lrr'", "did you mean 'optimizer.lr'?",
                         "+optimizer.lrr=1"]),
    ("trainer.max_epoch=1", ["trainer.max_epoch=1: trainer has no key 'max_epoch'",
                             "did you mean 'trainer.max_epochs'?", "expected one of: accumulate_grad_batches"]),
    ("trainer.check_val_every_n_epoch=1", ["trainer has no key 'check_val_every_n_epoch'",
                                           "did you mean 'trainer.val_every_n_epochs'?"]),
    ("trainer.max_epochs=abc", ["trainer.max_epochs='abc': expected an integer"]),
    ("precision.mode=fp61", ["precision.mode='fp61': did you mean 'fp16'? expected one of: fp32, amp, bf16, fp16"]),
    ("optimizer.lr=[1,", ["optimizer.lr=[1,: malformed override", "expected key=value"]),
], ids=["unknown-option", "unknown-group", "open-group-key", "closed-group-key", "lightning-name", "wrong-type",
        "wrong-enum", "malformed"])
def test_compose_mistake_is_one_line_naming_it_and_what_is_valid(tmp_path: Path, override: str,
                                                                  fragments: list[str]) -> None:
    line = only_line(run_cli(tmp_path, override))
    assert_in(line, *fragments)
    if override.startswith("trainer."):  # a framework group: `+` cannot add a key, so it is never suggested
        assert "+" not in line, line


@pytest.mark.parametrize("flags", [("optimizer.lr=0.1,0.2", "-m", "--cfg", "job"), ("--info", "-m")],
                         ids=["multirun-cfg", "info-multirun"])
def test_two_of_hydras_modes_at_once_is_one_line(tmp_path: Path, flags: tuple[str, ...]) -> None:
    """Hydra itself raises a bare ValueError (with its traceback) for -m with --cfg or --info."""
    line = only_line(run_cli(tmp_path, *flags))
    assert_in(line, "Only one of --run, --multirun, --cfg, --info", "expected --cfg job")
    assert not any(tmp_path.iterdir())


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "model" / "cnn.yaml").write_text("_target_: framework.zoo.models.SimpleCNN\nhidden: [1, 2\ndropout: 0.0\n")
    line = only_line(run_cli(tmp_path / "run", "model=cnn", f"--config-path={conf}"))
    assert_in(line, f"{conf / 'model' / 'cnn.yaml'} line 3: invalid YAML (expected ',' or ']'")


def test_run_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    line = only_line(run_cli(tmp_path / "file" / "run"))
    assert_in(line, f"hydra.run.dir={tmp_path / 'file' / 'run'}: cannot create or write the run directory",
              "Not a directory")


def test_full_error_env_keeps_hydras_traceback(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "model=cnnn", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1
    assert_in(output(proc), "Traceback", "MissingConfigException", "Could not find 'model/cnnn'")


def test_non_zero_torchrun_rank_prints_nothing_but_fails(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "model=cnnn", env={"RANK": "1"})
    assert proc.returncode == 1
    assert output(proc).strip() == ""


def test_help_lists_the_groups_options_without_internal_schemas(tmp_path: Path) -> None:
    proc = run_cli(None, "--help", fast=False)
    assert proc.returncode == 0, output(proc)
    assert_in(proc.stdout, "precision: amp, bf16, fp16, fp32\n", "trainer: default\n",
              "logger: csv, many, mlflow, tensorboard, wandb\n")
    assert "schema" not in proc.stdout


@pytest.mark.unit
def test_omegaconf_error_raised_by_our_own_code_is_a_bug_not_a_user_mistake() -> None:
    strict = OmegaConf.create({"model": {}}, flags={"struct": True})
    with pytest.raises(Exception) as ours:
        validate(strict)  # reads cfg.trainer: a ConfigAttributeError raised inside framework/
    assert cli.describe(ours.value, []) is None
    with pytest.raises(Exception) as hydras:
        strict.trainer  # the same error, raised outside our code (as while Hydra composes)
    assert cli.describe(hydras.value, ["trainer=x"]) is not None


def test_a_run_records_the_config_and_overrides_it_ran_with(tmp_path: Path) -> None:
    """What Hydra writes in the run directory is what the job got: RUN mode, the command line's overrides, the
    config with them applied."""
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "trainer.dry_run=true", "optimizer.lr=0.05")
    assert proc.returncode == 0, output(proc)
    hydra_yaml = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra
    assert hydra_yaml.mode == "RUN"
    assert "optimizer.lr=0.05" in list(hydra_yaml.overrides.task)
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").optimizer.lr == 0.05


def test_a_config_that_sets_hydra_mode_multirun_still_sweeps(tmp_path: Path) -> None:
    """`hydra.mode: MULTIRUN` in a config makes a plain command line a sweep, as in Hydra (its sweep override
    would be an error in RUN mode)."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text("defaults:\n  - htf\n  - _self_\nhydra:\n  mode: MULTIRUN\n")
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(tmp_path / "run", f"--config-dir={conf}", "optimizer.lr=0.05,0.1", f"hydra.sweep.dir={sweep_dir}",
                   "trainer.max_steps=1", "trainer.test=false")
    assert proc.returncode == 0, output(proc)
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0_optimizer.lr=0.05", "1_optimizer.lr=0.1"]


def test_run_py_in_a_copy_of_the_checkout_reads_the_copys_conf(tmp_path: Path) -> None:
    """A worktree or a copy of the repository, run with an environment whose editable install points at this
    checkout: its run.py composes its own conf/ (an option only the copy has is found), with its own framework."""
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "framework", copy / "framework", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(CONF, copy / "conf")
    shutil.copy(ROOT / "run.py", copy / "run.py")
    (copy / "conf" / "task" / "mine.yaml").write_text((CONF / "task" / "classification.yaml").read_text())
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, str(copy / "run.py"), f"hydra.run.dir={run_dir}", "task=mine",
                           "trainer.dry_run=true", "logger.progress_bar=false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, output(proc)
    sources = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.config_sources
    framework_tree = [s.path for s in sources if s.provider in ("main", "framework")]
    assert framework_tree == [str(copy / "conf")], framework_tree
    assert OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.choices.task == "mine"


def test_help_into_a_reader_that_went_away_is_not_an_error(tmp_path: Path) -> None:
    """`htf --help | head`: stdout's reader has closed the pipe. Before, this was reported as a run directory
    that could not be written ('Broken pipe'); now it ends quietly with exit 1, as Python's docs advise."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--help"], cwd=tmp_path, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
