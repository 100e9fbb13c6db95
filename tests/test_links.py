"""Nothing the framework writes destroys a run (issue 42): every file it writes into a run, checkpoint, predict or
export directory is a new inode renamed into place (framework/core/files.py), so a symbolic link planted at any
name it writes (the file itself, or its `.tmp`) is replaced, never written through, and a file that another name
hard-links (checkpoints share theirs) is replaced, never rewritten in place. Export refuses to write into a
checkpoint or a run directory, and a file system error is one `Error:` line naming the path.

Each test plants links to "victim" files outside the run, runs the real command, and checks that every victim
still holds its bytes."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from conftest import one_error_line, output, run_cli, run_export

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRAIN = ("trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
         "logger=[tensorboard,csv]", "checkpoint.every_n_epochs=1", "checkpoint.keep_last=2")


@pytest.fixture
def trained(tmp_path) -> Path:
    """A finished one-epoch run (checkpoints last, best and step-3; metrics.csv), to be continued."""
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *TRAIN)
    assert proc.returncode == 0, output(proc)
    return run_dir


class Victims:
    """Files and folders outside the run with known bytes; `untouched()` checks each still holds them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir()
        self.expected: dict[Path, bytes] = {}

    def file(self, name: str) -> Path:
        path = self.folder / name.replace("/", "_")
        data = f"victim {name}\n".encode() * 7
        path.write_bytes(data)
        self.expected[path] = data
        return path

    def folder_with_files(self, name: str) -> Path:
        """A folder with a checkpoint's file names in it: a link to it stands where a save makes `NAME.tmp/`."""
        folder = self.folder / name.replace("/", "_")
        folder.mkdir()
        for file in ("model.safetensors", "state.safetensors", "meta.json"):
            data = f"victim {name}/{file}\n".encode()
            (folder / file).write_bytes(data)
            self.expected[folder / file] = data
        return folder

    def untouched(self) -> None:
        changed = [str(p) for p, data in self.expected.items() if not p.is_file() or p.read_bytes() != data]
        assert not changed, f"written through a link: {changed}"


def plant_symlinks(run_dir: Path, victims: Victims, names: list[str]) -> None:
    for name in names:
        path = run_dir / name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        target = victims.folder_with_files(name) if name.startswith("checkpoints/") else victims.file(name)
        path.symlink_to(target)


def plant_hard_links(run_dir: Path, victims: Victims, names: list[str]) -> None:
    """Each name becomes a second name of a victim file holding what the run's file held (so the run reads the
    same), as checkpoints' files are hard links of each other."""
    for name in names:
        path = run_dir / name
        victim = victims.folder / ("hard_" + name.replace("/", "_"))
        data = path.read_bytes() if path.is_file() else b"victim\n"
        victim.write_bytes(data)
        victims.expected[victim] = data
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        os.link(victim, path)


# What a continued run writes in its directory: each name, and the temporary name it is written through.
RUN_FILES = ["summary.json", "metrics.csv", "param_groups.json", "run.log", ".lock"]
RUN_TMP = ["summary.json.tmp", "metrics.csv.tmp", "param_groups.json.tmp", "trackers.json.tmp",
           "checkpoints/last.tmp", "checkpoints/best.tmp", "checkpoints/last.old", "checkpoints/step-6.tmp"]


def test_a_continued_run_replaces_links_at_every_name_it_writes_and_leaves_their_targets(trained, tmp_path):
    victims = Victims(tmp_path / "victims")
    plant_symlinks(trained, victims, RUN_TMP)
    plant_hard_links(trained, victims, RUN_FILES)
    for name in ("model.safetensors", "state.safetensors"):  # a leftover half-save holding a link to a victim
        (trained / "checkpoints" / "best.old").mkdir(exist_ok=True)
        os.link(victims.file(f"best.old/{name}"), trained / "checkpoints" / "best.old" / name)

    proc = run_cli(None, f"resume={trained}", "trainer.max_epochs=2")

    assert proc.returncode == 0, output(proc)
    victims.untouched()
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["epoch"] == 2
    assert not (trained / "summary.json").is_symlink() and (trained / "summary.json").stat().st_nlink == 1
    rows = (trained / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,name,value" and any(row.startswith("6,") for row in rows)  # continued, whole
    assert "Resumed from" in (trained / "run.log").read_text()


def test_symbolic_links_at_the_files_a_continued_run_writes_are_replaced(trained, tmp_path):
    victims = Victims(tmp_path / "victims")
    plant_symlinks(trained, victims, ["metrics.csv", "run.log", ".lock", "param_groups.json"])

    proc = run_cli(None, f"resume={trained}", "trainer.max_epochs=2")

    assert proc.returncode == 0, output(proc)
    victims.untouched()
    for name in ("metrics.csv", "run.log", ".lock", "param_groups.json"):
        assert (trained / name).is_file() and not (trained / name).is_symlink(), name


def test_predict_writes_through_no_link_planted_in_its_directory(trained, tmp_path):
    out = tmp_path / "predicted"
    victims = Victims(tmp_path / "victims")
    plant_symlinks(out, victims, ["predictions.parquet.tmp", "predictions.parquet.parts/part-r00000-000000.arrow.tmp",
                                  "predictions.parquet.parts/part-r00000-000000.arrow", "summary.json.tmp",
                                  "run.log", ".lock"])
    plant_hard_links(out, victims, ["predictions.parquet"])

    proc = run_cli(out, "predict", f"ckpt={trained}")

    assert proc.returncode == 0, output(proc)
    victims.untouched()
    import pyarrow.parquet as pq

    assert pq.read_table(out / "predictions.parquet").num_rows > 0


def test_export_writes_through_no_link_planted_in_its_folder(trained, tmp_path):
    out = tmp_path / "exported"
    victims = Victims(tmp_path / "victims")
    plant_symlinks(out, victims, ["model.safetensors.tmp", "export.json", "export.json.tmp", "model.pt"])
    plant_hard_links(out, victims, ["model.safetensors"])

    proc = export(str(trained), "--out", str(out), "--format", "torchscript")

    assert proc.returncode == 0, output(proc)
    victims.untouched()
    assert json.loads((out / "export.json").read_text())["safetensors"]["max_abs_diff"] == 0


def test_lr_find_writes_through_no_link_planted_in_its_directory(tmp_path):
    out = tmp_path / "lr"
    victims = Victims(tmp_path / "victims")
    plant_symlinks(out, victims, ["lr_find.json.tmp", "lr_find.png", "summary.json.tmp", "param_groups.json"])
    plant_hard_links(out, victims, ["lr_find.json"])

    proc = run_cli(out, "lr_find", "lr_find.num_steps=8")

    assert proc.returncode == 0, output(proc)
    victims.untouched()
    assert json.loads((out / "lr_find.json").read_text())["lrs"]


def export(*args: str) -> subprocess.CompletedProcess:
    return run_export(*args)


@pytest.mark.parametrize("which", ["best", "last"])
def test_export_into_a_checkpoint_is_refused_and_the_run_still_tests_the_same(trained, tmp_path, which):
    before = json.loads((trained / "summary.json").read_text())

    refused = export(str(trained), "--out", str(trained / "checkpoints" / which))

    line = one_error_line(refused)
    assert f"--out='{trained / 'checkpoints' / which}'" in line and "checkpoint" in line
    tested = run_cli(tmp_path / "tested", "test", f"ckpt={trained}")
    assert tested.returncode == 0, output(tested)
    assert "damaged" not in output(tested)
    summary = json.loads((tmp_path / "tested" / "summary.json").read_text())
    assert summary["test/acc"] == before["test/acc"] and summary["test/loss"] == before["test/loss"]


@pytest.mark.parametrize("where", ["checkpoints", "run", "file"])
def test_export_refuses_a_run_directory_its_checkpoints_folder_and_a_file_in_one_line(trained, where):
    out = {"checkpoints": trained / "checkpoints", "run": trained, "file": trained / "summary.json"}[where]
    before = {p: p.read_bytes() for p in trained.rglob("*") if p.is_file() and p.name != "run.log"}

    line = one_error_line(export(str(trained), "--out", str(out)))

    assert f"--out='{out}'" in line
    assert {p: p.read_bytes() for p in before} == before


@contextlib.contextmanager
def read_only_mount(path: Path) -> Iterator[None]:
    """A read-only tmpfs at `path` (root only): writes there fail with EROFS, and its folder cannot be removed
    (EBUSY), as on a read-only or busy file system."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_predictions_parts_on_a_read_only_file_system_are_one_line_naming_them(trained, tmp_path):
    out = tmp_path / "predicted"
    parts = out / "predictions.parquet.parts"
    with read_only_mount(parts):
        proc = run_cli(out, "predict", f"ckpt={trained}")

    line = one_error_line(proc)
    assert line.startswith("Error: predictions: cannot write to") and str(parts) in line


def test_export_to_a_read_only_file_system_is_one_line_naming_the_path(trained, tmp_path):
    with read_only_mount(tmp_path / "ro"):
        line = one_error_line(export(str(trained), "--out", str(tmp_path / "ro" / "export")))
    assert str(tmp_path / "ro" / "export") in line and "Read-only file system" in line
