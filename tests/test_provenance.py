"""What a run records about itself: run.log holds the console's lines (the closing summary and errors included),
provenance.json names the command line, git state, versions, host and devices; git.diff exists iff dirty."""
from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import FAST, ROOT, output, run_cli

from framework.app import launch
from framework.observe import provenance
from framework.observe.summary import SUMMARY_LOGGER, print_summary
from framework.task.classification import ClassificationTask

pytestmark = pytest.mark.e2e

QUICK = ("trainer.max_epochs=1", "trainer.limit_train_batches=3", "checkpoint=none", "trainer.test=false")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True, timeout=30).stdout


def test_a_run_logs_its_closing_summary_to_run_log_and_records_its_provenance(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *QUICK, process=True)  # the process's own command line is recorded
    assert proc.returncode == 0, output(proc)
    summary = proc.stdout.splitlines()[-4:]  # on stdout, plain, as print() wrote it
    assert summary[0].startswith("Done in ") and summary[-1].startswith("View it with:  tensorboard --logdir")
    logged = [line.split("] - ", 1)[1] for line in (run_dir / "run.log").read_text().splitlines() if "] - " in line]
    assert summary == logged[-4:]

    record = json.loads((run_dir / "provenance.json").read_text())
    argv = [str(ROOT / "run.py"), f"hydra.run.dir={run_dir}", *FAST, *QUICK]
    assert record["argv"] == argv and record["command"] == shlex.join([sys.executable, *argv])
    assert record["git"]["commit"] == git(ROOT, "rev-parse", "HEAD").strip()
    dirty = subprocess.run(["git", "diff", "HEAD", "--quiet"], cwd=ROOT, timeout=30).returncode == 1
    assert record["git"]["dirty"] == dirty and (run_dir / "git.diff").is_file() == dirty
    assert record["git"]["diff"] == ("git.diff" if dirty else None)
    import hydra
    import torch

    assert record["versions"] == {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": record["versions"]["cudnn"], "hydra": hydra.__version__,
        "framework": metadata.version("hydra-torch-framework")}
    assert record["host"] == socket.gethostname() and record["cwd"] == str(ROOT)
    assert record["devices"] == (["cpu"] if not torch.cuda.is_available() else
                                 [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])


def test_an_error_after_training_started_reaches_run_log(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *QUICK, "optimizer.lr=1e9", "trainer.log_every_n_steps=1")
    assert proc.returncode == 1, output(proc)
    error = next(line for line in proc.stderr.splitlines() if line.startswith("Error: "))
    assert f"[ERROR] - {error}" in (run_dir / "run.log").read_text()


@pytest.mark.unit
def test_a_spawned_rank_zero_logs_the_summary_to_stdout_and_run_log(tmp_path, capsys):
    root, summary_logger = logging.getLogger(), logging.getLogger(SUMMARY_LOGGER)
    saved = (root.handlers[:], root.level, summary_logger.handlers[:], summary_logger.propagate)
    try:
        launch._configure_logging(0, tmp_path)
        print_summary({"seconds": 1.0, "epoch": 1, "step": 3, "precision": "fp32", "world_size": 2,
                       "val/acc": 0.5}, tmp_path)
        for handler in root.handlers:
            handler.flush()
    finally:
        for handler in set(root.handlers + summary_logger.handlers) - set(saved[0] + saved[2]):
            handler.close()
        root.handlers[:], summary_logger.handlers[:] = saved[0], saved[2]
        root.setLevel(saved[1])
        summary_logger.propagate = saved[3]
    shown = capsys.readouterr()
    assert shown.out.startswith("Done in 1.0 s: 1 epoch, 3 steps (fp32, world size 2)\n  val/acc 0.5000\n")
    assert shown.err == ""
    assert (tmp_path / "run.log").read_text().count("[framework.summary][INFO] - ") == 4


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("lr = 0.1\n")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "first")
    return repo


def test_a_clean_checkout_has_no_diff_and_a_dirty_one_writes_git_diff(repo, tmp_path):
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    clean.mkdir(), dirty.mkdir()
    record = json.loads(provenance.write(clean, repo, []).read_text())
    assert record["git"] == {"commit": git(repo, "rev-parse", "HEAD").strip(), "dirty": False, "untracked": [],
                             "diff": None}
    assert not (clean / "git.diff").exists()

    (repo / "train.py").write_text("lr = 0.2\n")
    (repo / "new.py").write_text("")
    record = json.loads(provenance.write(dirty, repo, ["optimizer.lr=0.2"]).read_text())
    assert record["git"]["dirty"] is True and record["git"]["untracked"] == ["new.py"]
    assert record["overrides"] == ["optimizer.lr=0.2"]
    assert "+lr = 0.2" in (dirty / "git.diff").read_text()


def test_outside_a_checkout_or_without_git_the_git_fields_are_null(tmp_path, repo, monkeypatch):
    nothing = {"commit": None, "dirty": None, "untracked": None}
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git looks for no checkout above tmp_path
    assert provenance.git_state(plain) == (nothing, None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no git binary at all
    assert provenance.git_state(repo) == (nothing, None)


def test_a_resumed_run_keeps_the_original_record_and_adds_its_own(repo, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = provenance.write(run_dir, repo, [])
    original = first.read_text()
    (repo / "train.py").write_text("lr = 0.3\n")
    second = provenance.write(run_dir, repo, ["resume=auto"])
    assert first.read_text() == original
    assert second.name.startswith("provenance-resumed-") and second.suffix == ".json"
    assert json.loads(second.read_text())["git"]["diff"] == f"git-{second.stem.split('-', 1)[1]}.diff"
    assert (run_dir / f"git-{second.stem.split('-', 1)[1]}.diff").is_file()


class MarkingTask(ClassificationTask):
    """Classification that creates the file $FIRST_STEP_MARKER at its first training step."""

    def training_step(self, batch):
        marker = Path(os.environ["FIRST_STEP_MARKER"])
        if not marker.exists():
            marker.touch()
        return super().training_step(batch)


def test_git_never_delays_the_first_step(tmp_path, monkeypatch):
    """A stand-in `git` that answers only once training has taken its first step (as a `git status` of a large
    checkout can take seconds): recorded before training, as it was, the stand-in would give up and the record would
    have no commit; recorded beside training, it has the stand-in's commit. The run is in this process: the
    framework finds git on $PATH as it calls it, and reads GIT_TIMEOUT_S then too."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "first-step"
    bin_dir.mkdir()
    # On a loaded machine the first step can come more than git's 3 s after the record starts: give git 60 s (the
    # stand-in waits 30 s at most), so only a record taken before training can miss the commit.
    monkeypatch.setattr(provenance, "GIT_TIMEOUT_S", 60.0)
    (bin_dir / "git").write_text(f"#!/bin/sh\nfor i in $(seq 1 600); do [ -e {marker} ] && break; sleep 0.05; done\n"
                                 f"[ -e {marker} ] || exit 1\n"
                                 'if [ "$1" = rev-parse ]; then echo 0123456789abcdef0123456789abcdef01234567; fi\n')
    (bin_dir / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FIRST_STEP_MARKER", str(marker))
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *QUICK, "task._target_=test_provenance.MarkingTask")
    assert proc.returncode == 0, output(proc)
    record = json.loads((run_dir / "provenance.json").read_text())
    assert record["git"] == {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False, "untracked": [],
                             "diff": None}


def test_a_run_stopped_mid_epoch_says_how_far_into_the_epoch_it_got(tmp_path):
    """max_steps=5 of a 20-batch epoch printed '0 epochs, 5 steps', which reads as if nothing was trained."""
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "trainer.max_steps=5", "checkpoint=none", "trainer.test=false")
    assert proc.returncode == 0, output(proc)
    assert "Done in " in proc.stdout and ": 0 epochs and 5 of 20 batches, 5 steps (fp32, world size 1)" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["epoch"], summary["batch_in_epoch"], summary["epoch_batches"]) == (0, 5, 20)
