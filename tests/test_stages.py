"""After training, LightningCLI's stages: `python run.py validate|test ckpt=...` evaluates a saved run's weights in
a run directory of its own, prints the same numbers the run's own summary holds, never touches the saved run, and
turns every bad `ckpt=` into one error line."""
from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, fingerprint, one_error_line, output, read_scalars, replace, run_cli

pytestmark = pytest.mark.e2e

TRAIN = ("logger.progress_bar=false", "trainer.max_epochs=2", "trainer.device=cpu")
QUIET = ("logger.progress_bar=false",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A default run (digits, MLP) of 2 epochs: best and last checkpoints, and its own test of `best`."""
    run_dir = tmp_path_factory.mktemp("stages") / "run"
    proc = run_cli(run_dir, *TRAIN, fast=False)
    assert proc.returncode == 0, output(proc)
    return run_dir


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("stages") / "ema"
    proc = run_cli(run_dir, *TRAIN, "callbacks=[default,ema]", "callbacks.ema.decay=0.9", fast=False)
    assert proc.returncode == 0, output(proc)
    return run_dir


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def stage(stage_name: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_cli(run_dir, stage_name, *QUIET, *overrides, fast=False)


def test_test_of_a_run_directory_prints_and_records_the_test_acc_the_run_tested(trained, tmp_path):
    before = fingerprint(trained)
    proc = stage("test", tmp_path / "t", f"ckpt={trained}")
    assert proc.returncode == 0, output(proc)
    got, run = summary(tmp_path / "t"), summary(trained)
    assert run["tested"].startswith("best")  # the run tested its best checkpoint, which ckpt=RUN_DIR picks too
    assert got["test/acc"] == run["test/acc"] and got["test/loss"] == run["test/loss"], (got, run)
    assert got["stage"] == "test" and got["checkpoint"] == str(trained / "checkpoints" / "best")
    assert f"test/acc {run['test/acc']:.4f}" in output(proc)
    assert read_scalars(tmp_path / "t")["test/acc"] == [(got["step"], pytest.approx(got["test/acc"]))]
    assert (tmp_path / "t" / "provenance.json").is_file()
    assert fingerprint(trained) == before  # the saved run is only read


def test_validate_of_the_last_checkpoint_gives_the_runs_final_validation(trained, tmp_path):
    proc = stage("validate", tmp_path / "v", f"ckpt={trained / 'checkpoints' / 'last'}")
    assert proc.returncode == 0, output(proc)
    got, run = summary(tmp_path / "v"), summary(trained)
    assert got["val/acc"] == run["val/acc"] and got["val/loss"] == run["val/loss"], (got, run)
    assert "test/acc" not in got


def test_a_read_only_run_is_evaluated_and_data_and_precision_may_change(trained, tmp_path):
    modes = {p: p.stat().st_mode for p in [trained, *trained.rglob("*")]}
    try:
        for path in modes:
            path.chmod(stat.S_IMODE(modes[path]) & ~0o222)
        proc = stage("test", tmp_path / "ro", f"ckpt={trained}", "data.eval_batch_size=7", "precision=bf16")
    finally:
        for path, mode in modes.items():
            path.chmod(stat.S_IMODE(mode))
    assert proc.returncode == 0, output(proc)
    got = summary(tmp_path / "ro")
    assert got["precision"] == "bf16-autocast" and abs(got["test/acc"] - summary(trained)["test/acc"]) < 0.03


def test_ddp_evaluates_every_sample_once_and_equals_one_process(trained, tmp_path):
    proc = stage("test", tmp_path / "ddp", f"ckpt={trained}", "parallel=ddp", "data.eval_batch_size=7")
    assert proc.returncode == 0, output(proc)
    got = summary(tmp_path / "ddp")
    assert got["world_size"] == 2 and got["test/acc"] == pytest.approx(summary(trained)["test/acc"], abs=1e-6)


def test_the_ema_weights_are_evaluated_where_the_runs_ema_evaluated_them(ema_run, tmp_path):
    proc = stage("test", tmp_path / "e", f"ckpt={ema_run / 'checkpoints' / 'last'}")
    assert proc.returncode == 0, output(proc)
    got, run = summary(tmp_path / "e"), summary(ema_run)
    assert got["weights"] == "EMA weights"
    assert got["test/acc"] == run["test/acc"], (got, run)


def test_a_sweep_over_checkpoints_writes_one_row_each(trained, tmp_path):
    proc = run_cli(None, "-m", "test", f"hydra.sweep.dir={tmp_path / 's'}",
                   f"ckpt={trained / 'checkpoints' / 'best'},{trained / 'checkpoints' / 'last'}", *QUIET, fast=False)
    assert proc.returncode == 0, output(proc)
    rows = list(csv.DictReader((tmp_path / "s" / "summary.csv").open()))
    assert len(rows) == 2 and all(row["status"] == "ok" for row in rows), rows
    assert {float(row["test/acc"]) for row in rows} <= {summary(trained)["test/acc"]}


# Images of 3x8x8 for a model of 64 inputs: data that does not fit the model.
FAKE = ("{_target_: torchvision.datasets.FakeData, size: 5, image_size: [3, 8, 8], "
        "transform: {_target_: torchvision.transforms.ToTensor}}")


@pytest.mark.parametrize("args, expected", [
    (("test", "ckpt=/nonexistent/run"), "Error: ckpt='/nonexistent/run': no such directory; expected a run directory"),
    (("test",), "Error: test: ckpt is not set; expected the run directory or checkpoint directory"),
    (("validate", "ckpt=RUN", "resume=RUN"), "Error: resume='RUN': expected null with validate"),
    (("ckpt=RUN",), "Error: ckpt='RUN': expected null for fit ("),
    (("test", "ckpt=RUN", "model=cnn"), "Error: model=cnn: the run used model=mlp, and its weights cannot carry over"),
    (("test", "ckpt=RUN", "data.test=null"), "Error: data.test: null, so there is nothing to test; expected"),
    (("test", "ckpt=RUN/checkpoints"), "Error: ckpt='RUN/checkpoints': neither a checkpoint (no meta.json) nor a run"),
    # (model.input_shape is ${data.input_shape}: kept, so that the weights fit and the data is what does not)
    (("test", "ckpt=RUN", "data.input_shape=[3,8,8]", "model.input_shape=[1,8,8]"),
     "Error: data.input_shape=[3, 8, 8]: the first test batch has"),
    (("predict", "ckpt=RUN", f"+data.predict={FAKE}"),
     "Error: task: ClassificationTask.predict_step on the first batch to predict ("),
    (("predict", "ckpt=RUN", "parallel=fsdp"), "Error: parallel=fsdp: predict runs each process's own samples"),
    (("test", "+ckpt_path=RUN"), "Error: ckpt_path='RUN': the root config has no key 'ckpt_path'; did you mean 'ckpt'"),
    (("test", "ckpt=RUN", "model.hidden=[32]"),
     "Error: ckpt='RUN/checkpoints/best': its weights do not fit this model (unexpected net.5.bias, net.5.weight;"),
], ids=["missing", "unset", "with-resume", "fit-with-ckpt", "other-model", "no-test-split", "not-a-run",
        "test-data-unfit", "predict-data-unfit", "predict-fsdp", "lightning-ckpt-path", "model-unfit"])
def test_every_bad_ckpt_is_one_error_line_and_leaves_no_run_directory(trained, tmp_path, args, expected):
    args = tuple(a.replace("RUN", str(trained)) for a in args)
    expected = expected.replace("RUN", str(trained))
    proc = run_cli(tmp_path / "x", *args, *QUIET, fast=False)
    assert one_error_line(proc).startswith(expected), output(proc)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_a_damaged_best_falls_back_to_the_newest_intact_checkpoint_and_a_damaged_named_one_is_an_error(
        trained, tmp_path):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(trained), str(copy)], check=True)
    model = copy / "checkpoints" / "best" / "model.safetensors"
    replace(model, model.read_bytes()[:-64])
    proc = stage("test", tmp_path / "fb", f"ckpt={copy}")
    assert proc.returncode == 0, output(proc)
    assert summary(tmp_path / "fb")["checkpoint"] == str(copy / "checkpoints" / "last")
    assert "its best checkpoint is damaged" in output(proc)
    proc = stage("test", tmp_path / "named", f"ckpt={copy / 'checkpoints' / 'best'}")
    assert one_error_line(proc).startswith(f"Error: ckpt='{copy / 'checkpoints' / 'best'}': "), output(proc)


# ---------------------------------------------------------------------------------------------- predict
class KilledMidway(__import__("framework.task", fromlist=["ClassificationTask"]).ClassificationTask):
    """Kills its own process (SIGKILL: nothing runs after it) at predict batch $KILL_AT_PREDICT_BATCH of rank 0."""

    def predict_step(self, batch, batch_idx=0):
        if int(os.environ.get("RANK", "0")) == 0 and batch_idx == int(os.environ.get("KILL_AT_PREDICT_BATCH", "-1")):
            os.kill(os.getpid(), 9)
        return super().predict_step(batch, batch_idx)


def predictions(run_dir: Path):
    import pyarrow.parquet as pq

    return pq.read_table(run_dir / "predictions.parquet")


ODD = "+data.predict={_target_: framework.zoo.datasets.digits, split: train}"  # 1,257 samples: odd


def test_predict_writes_one_row_per_test_sample_in_order_whose_accuracy_is_the_runs_test_acc(trained, tmp_path):
    from framework.zoo.datasets import digits

    proc = stage("predict", tmp_path / "p", f"ckpt={trained}")
    assert proc.returncode == 0, output(proc)
    table = predictions(tmp_path / "p")
    labels = digits("test").tensors[1].tolist()
    assert table.column("index").to_pylist() == list(range(len(labels)))
    assert table.schema.field("probabilities").type.list_size == 10
    correct = sum(p == y for p, y in zip(table.column("prediction").to_pylist(), labels))
    assert correct / len(labels) == pytest.approx(summary(trained)["test/acc"], abs=1e-12)
    assert summary(tmp_path / "p")["rows"] == len(labels) and f"{len(labels)} rows in" in output(proc)
    assert "tensorboard --logdir" not in output(proc)  # a predict run logs rows, not scalars
    assert not (tmp_path / "p" / "predictions.parquet.parts").exists()


def test_predict_under_ddp_on_an_odd_data_set_writes_the_single_process_file_exactly(trained, tmp_path):
    one = stage("predict", tmp_path / "one", f"ckpt={trained}", ODD)
    two = stage("predict", tmp_path / "two", f"ckpt={trained}", ODD, "parallel=ddp", "data.eval_batch_size=100")
    assert one.returncode == 0 and two.returncode == 0, output(one) + output(two)
    assert predictions(tmp_path / "two").column("index").to_pylist() == list(range(1257))
    assert (tmp_path / "two" / "predictions.parquet").read_bytes() == (tmp_path / "one" / "predictions.parquet").read_bytes()


def test_a_predict_killed_midway_and_run_again_keeps_its_chunks_and_ends_with_the_same_file(trained, tmp_path):
    from conftest import TESTS, on_pythonpath

    common = (f"ckpt={trained}", ODD, "task._target_=test_stages.KilledMidway", "data.eval_batch_size=100",
              "trainer.predict_chunk_rows=200")
    env = {**os.environ, "PYTHONPATH": on_pythonpath(TESTS), "OMP_NUM_THREADS": "1"}

    whole = stage("predict", tmp_path / "whole", *common)  # in this process: no kill
    assert whole.returncode == 0, output(whole)
    killed = subprocess.run([sys.executable, str(ROOT / "run.py"), "predict", f"hydra.run.dir={tmp_path / 'run'}",
                             *QUIET, *common], cwd=ROOT, capture_output=True, text=True, timeout=180,
                            env={**env, "KILL_AT_PREDICT_BATCH": "9"})
    assert killed.returncode == -9, output(killed)
    kept = sorted((tmp_path / "run" / "predictions.parquet.parts").glob("*.arrow"))
    assert len(kept) >= 2, kept  # whole chunks of 200 rows were on disk before the kill at row 900
    again = stage("predict", tmp_path / "run", *common)
    assert again.returncode == 0, output(again)
    assert (tmp_path / "run" / "predictions.parquet").read_bytes() == (
        tmp_path / "whole" / "predictions.parquet").read_bytes()


def test_predict_over_a_folder_of_unlabelled_pngs(tmp_path):
    from conftest import make_image_folder
    from PIL import Image

    make_image_folder(tmp_path / "data", {"train": ("cat", "dog"), "val": ("cat", "dog")}, per_class=4)
    run = tmp_path / "run"
    trained = run_cli(run, "data=image_folder", f"data.root={tmp_path / 'data'}", "data.num_classes=2",
                      "data.input_shape=[3,16,16]", "model=cnn", "trainer.max_steps=2", "data.num_workers=0",
                      "data.persistent_workers=false", "data.pin_memory=false", "trainer.device=cpu", fast=False)
    assert trained.returncode == 0, output(trained)
    images = tmp_path / "unlabelled"
    images.mkdir()
    for i in range(7):
        Image.new("RGB", (20 + i, 18), (30 * i, 100, 200 - 20 * i)).save(images / f"img{i}.png")
    (images / "notes.txt").write_text("not an image")
    proc = stage("predict", tmp_path / "p", f"ckpt={run}", "data.num_workers=0",
                 f"+data.predict={{_target_: framework.zoo.datasets.ImageFiles, root: {images}, "
                 "transform: ${data.train.transform}}")
    assert proc.returncode == 0, output(proc)
    table = predictions(tmp_path / "p")
    assert table.num_rows == 7 and set(table.column("prediction").to_pylist()) <= {0, 1}
    listed = (tmp_path / "p" / "predictions.files.txt").read_text().splitlines()
    assert listed == [str(images / f"img{i}.png") for i in range(7)]


class NestedOutput(__import__("framework.task", fromlist=["ClassificationTask"]).ClassificationTask):
    def predict_step(self, batch, batch_idx=0):
        return {"scores": {"a": self.model(batch[0])}}


def test_a_predict_step_output_parquet_cannot_hold_is_one_error_line(trained, tmp_path):

    proc = run_cli(tmp_path / "p", "predict", *QUIET, f"ckpt={trained}", "task._target_=test_stages.NestedOutput",
                   fast=False)
    assert "scores" in one_error_line(proc), output(proc)
