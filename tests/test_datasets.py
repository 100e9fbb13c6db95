"""The data presets read real on-disk formats: files are written byte for byte in the official layouts
(MNIST idx, CIFAR-10 python pickles, ImageFolder PNGs) into tmp_path, then loaded through the same config
and code a user's run goes through. In-process where the CLI adds nothing; end to end for exit codes,
error messages and a whole training run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_cifar10, make_image_folder, make_mnist, one_error_line, output, run_cli, write_idx

from framework.config.instantiate import build
from framework.core.errors import ConfigError
from framework.data.module import DataModule
from framework.zoo.datasets import digits

pytestmark = pytest.mark.unit

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
QUICK = ("data.num_workers=0", "data.persistent_workers=false", "data.pin_memory=false", "trainer.max_epochs=1")


# ---------------------------------------------------------------------------------------------- fixtures
def first_batch(data: DataModule, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch as a run would get it (through the DataModule's loader, not dataset indexing)."""
    data.setup(seed=0)
    return next(iter(data.batches(split)))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# ---------------------------------------------------------------------------------------------- digits
def samples(dataset: torch.utils.data.TensorDataset) -> set[tuple[bytes, int]]:
    """Each (image, label) as a hashable row; the 1,797 digits images are all distinct, so sets compare splits."""
    images, labels = dataset.tensors
    return {(x.numpy().tobytes(), int(y)) for x, y in zip(images, labels)}


def test_digits_splits_cover_all_1797_images_disjointly_and_identically_every_call():
    splits = {s: digits(s) for s in ("train", "val", "test")}
    assert {s: len(d) for s, d in splits.items()} == {"train": 1257, "val": 270, "test": 270}
    rows = {s: samples(d) for s, d in splits.items()}
    assert len(rows["train"] | rows["val"] | rows["test"]) == 1797
    for s, d in splits.items():
        assert all(torch.equal(a, b) for a, b in zip(d.tensors, digits(s).tensors))


def test_digits_direct_csv_read_equals_sklearn_load_digits():
    from sklearn.datasets import load_digits

    reference = load_digits()
    expected = {((image / 16.0).astype(np.float32).tobytes(), int(y))
                for image, y in zip(reference.images, reference.target)}
    assert len(expected) == 1797
    splits = [digits(s) for s in ("train", "val", "test")]
    assert set().union(*(samples(d) for d in splits)) == expected
    assert all(d.tensors[0].dtype == torch.float32 and d.tensors[1].dtype == torch.int64 for d in splits)
    assert splits[0].tensors[0].shape[1:] == (1, 8, 8)


def test_digits_val_and_test_follow_the_split_settings_given_to_train(compose):
    cfg = compose("data.train.split_seed=7", "data.train.val_fraction=0.2", "data.train.test_fraction=0.1")
    data = build(cfg.data, "data")
    rows = {s: samples(d) for s, d in data.datasets.items()}
    assert {s: len(r) for s, r in rows.items()} == {"train": 1258, "val": 359, "test": 180}
    assert len(rows["train"] | rows["val"] | rows["test"]) == 1797
    assert rows["test"] != samples(digits("test"))  # the seed given to train reached test too


# ---------------------------------------------------------------------------------------------- MNIST
def test_mnist_idx_files_load_with_a_fixed_10_percent_holdout_and_exact_pixels(compose, tmp_path):
    arrays = make_mnist(tmp_path)
    data = build(compose("data=mnist", f"data.root={tmp_path}", *QUICK).data, "data")
    train, val, test = (data.datasets[s] for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (36, 4, 20)
    assert not set(train.indices) & set(val.indices) and set(train.indices) | set(val.indices) == set(range(40))

    x, y = first_batch(data, "train")
    assert x.shape == (36, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    images, labels = arrays["train"]
    for i in (0, len(val) - 1):  # val sample i is file row val.indices[i], normalized as the yaml says
        image, label = val[i]
        row = val.indices[i]
        expected = (torch.from_numpy(images[row]).float() / 255 - MNIST_MEAN) / MNIST_STD
        assert torch.allclose(image[0], expected, atol=1e-6) and label == labels[row]
    image, label = test[19]
    test_images, test_labels = arrays["test"]
    assert torch.allclose(image[0] * MNIST_STD + MNIST_MEAN, torch.from_numpy(test_images[19]).float() / 255,
                          atol=1e-6) and label == test_labels[19]


def test_mnist_holdout_val_follows_the_split_seed_given_to_train(compose, tmp_path):
    make_mnist(tmp_path)
    default = build(compose("data=mnist", f"data.root={tmp_path}").data, "data").datasets["val"]
    data = build(compose("data=mnist", f"data.root={tmp_path}", "data.train.split_seed=5").data, "data")
    train, val = data.datasets["train"], data.datasets["val"]
    assert (len(train), len(val)) == (36, 4) and set(train.indices) | set(val.indices) == set(range(40))
    assert val.indices != default.indices


def test_mnist_folder_without_idx_files_names_the_missing_files(compose, tmp_path):
    # torchvision alone would say "Dataset not found. You can use download=True", naming no file.
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx(raw / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    write_idx(raw / "train-labels-idx1-ubyte", np.zeros(2, np.uint8))
    cfg = compose("data=mnist", f"data.root={tmp_path}")
    with pytest.raises(ConfigError, match=r"data\.root=.*no t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte in"):
        build(cfg.data, "data")


@pytest.mark.e2e
def test_mnist_trains_end_to_end_with_persistent_worker_processes(tmp_path):
    root = tmp_path / "data"
    make_mnist(root)
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "data=mnist", f"data.root={root}", "data.num_workers=2",
                   "data.persistent_workers=true", "data.pin_memory=false", "trainer.max_epochs=2")
    assert proc.returncode == 0, output(proc)
    result = summary(run_dir)
    assert result["epoch"] == 2 and {"val/acc", "test/acc"} <= set(result)


@pytest.mark.e2e
def test_mnist_root_that_does_not_exist_is_one_error_line_naming_data_root(tmp_path):
    proc = run_cli(tmp_path / "run", "data=mnist", "data.root=/does/not/exist")
    line = one_error_line(proc)
    assert output(proc).strip() == line  # all it printed
    assert "data.root='/does/not/exist'" in line


# ---------------------------------------------------------------------------------------------- CIFAR-10
def test_cifar10_pickles_load_channels_first_with_exact_pixels(compose, tmp_path):
    batches = make_cifar10(tmp_path)
    cfg = compose("data=cifar10", f"data.root={tmp_path}", "data.train.dataset.verify_checksums=false", *QUICK)
    data = build(cfg.data, "data")
    train, val, test = (data.datasets[s] for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (36, 4, 8)
    assert train.dataset.classes[9] == "truck"

    x, y = first_batch(data, "train")
    assert x.shape == (36, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    rows = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    labels = sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    mean, std = torch.tensor(CIFAR_MEAN).view(3, 1, 1), torch.tensor(CIFAR_STD).view(3, 1, 1)
    image, label = val[0]
    row = val.indices[0]
    expected = torch.from_numpy(rows[row]).float().view(3, 32, 32) / 255  # rows are R, G, B planes
    assert torch.allclose(image * std + mean, expected, atol=1e-5) and label == labels[row]
    image, label = test[7]
    test_rows, test_labels = batches["test_batch"]
    assert torch.allclose(image * std + mean, torch.from_numpy(test_rows[7]).float().view(3, 32, 32) / 255,
                          atol=1e-5) and label == test_labels[7]


@pytest.mark.e2e
def test_cifar10_unofficial_files_fail_the_checksum_with_one_line_naming_the_switch(tmp_path):
    root = tmp_path / "data"
    make_cifar10(root)
    proc = run_cli(tmp_path / "run", "data=cifar10", f"data.root={root}", "model=cnn", *QUICK)
    line = one_error_line(proc)
    assert output(proc).strip() == line  # all it printed
    assert "data_batch_1" in line and "data.train.dataset.verify_checksums=false" in line


@pytest.mark.e2e
def test_cifar10_unofficial_files_train_end_to_end_without_checksums(tmp_path):
    root = tmp_path / "data"
    make_cifar10(root)
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "data=cifar10", f"data.root={root}", "data.train.dataset.verify_checksums=false",
                   "model=cnn", "data.batch_size=16", *QUICK)
    assert proc.returncode == 0, output(proc)
    result = summary(run_dir)
    assert result["step"] == 3 and {"val/acc", "test/acc"} <= set(result)


# ---------------------------------------------------------------------------------------------- ImageFolder
def test_image_folder_resizes_to_input_shape_and_labels_by_class_folder(compose, tmp_path):
    make_image_folder(tmp_path, {"train": ("cat", "dog", "emu"), "val": ("cat", "dog", "emu")})
    cfg = compose("data=image_folder", f"data.root={tmp_path}", "data.num_classes=3", "data.input_shape=[3,12,20]",
                  *QUICK)
    data = build(cfg.data, "data")
    assert (len(data.datasets["train"]), len(data.datasets["val"])) == (9, 9) and data.datasets["test"] is None
    x, y = first_batch(data, "train")
    assert x.shape == (9, 3, 12, 20) and x.dtype == torch.float32  # grey PNGs come out RGB too
    assert sorted(y.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert data.datasets["val"].class_to_idx == {"cat": 0, "dog": 1, "emu": 2}


def test_image_folder_num_classes_must_match_the_class_folders(compose, tmp_path):
    make_image_folder(tmp_path, {"train": ("cat", "dog", "emu"), "val": ("cat", "dog", "emu")}, per_class=1)
    for wrong in (2, 4):  # too few outputs would crash mid-run, too many would train silently
        cfg = compose("data=image_folder", f"data.root={tmp_path}", f"data.num_classes={wrong}")
        with pytest.raises(ConfigError, match=rf"data\.num_classes={wrong}: .* 3 class folders .* "
                                              r"set data\.num_classes=3"):
            build(cfg.data, "data")


def test_image_folder_val_with_other_class_folders_is_refused(compose, tmp_path):
    # ImageFolder alone would number val's (cat, emu) as 0, 1: emu's label would silently become dog's.
    make_image_folder(tmp_path, {"train": ("cat", "dog", "emu"), "val": ("cat", "emu")}, per_class=1)
    cfg = compose("data=image_folder", f"data.root={tmp_path}", "data.num_classes=3")
    with pytest.raises(ConfigError, match=r"class folders of val/ \(cat, emu\) differ from those of train/"):
        build(cfg.data, "data")


@pytest.mark.e2e
def test_image_folder_trains_end_to_end(tmp_path):
    root = tmp_path / "data"
    make_image_folder(root, {"train": ("cat", "dog", "emu"), "val": ("cat", "dog", "emu")})
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "data=image_folder", f"data.root={root}", "data.num_classes=3", "model=cnn",
                   "data.input_shape=[3,16,16]", "data.batch_size=4", *QUICK)
    assert proc.returncode == 0, output(proc)
    result = summary(run_dir)
    assert result["step"] == 3 and "val/acc" in result and "test/acc" not in result


# ---------------------------------------------------------------------------------------------- FakeData
@pytest.mark.e2e
def test_fake_data_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "data=fake", "model=cnn", "data.train.size=64", "data.val.size=32",
                   "data.input_shape=[3,16,16]", *QUICK)
    assert proc.returncode == 0, output(proc)
    result = summary(run_dir)
    assert result["step"] == 1 and result["epoch"] == 1 and "val/acc" in result


@pytest.mark.e2e
def test_a_cifar10_file_that_would_run_code_is_refused_with_one_line(tmp_path):
    """The batches are pickles; with verify_checksums=false nothing vouches for them, so only the types CIFAR-10
    holds may be unpickled: a file naming any other callable is one error line and its code never runs."""
    import pickle

    root = tmp_path / "data"
    make_cifar10(root)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (root / "cifar-10-batches-py" / "data_batch_3").write_bytes(pickle.dumps({"data": Payload(), "labels": []}))
    proc = run_cli(tmp_path / "run", "data=cifar10", f"data.root={root}", "model=cnn",
                   "data.train.dataset.verify_checksums=false", *QUICK)
    line = one_error_line(proc)
    assert output(proc).strip() == line  # all it printed
    assert "data_batch_3: not a CIFAR-10 batch" in line and "system" in line, line
    assert not marker.exists()
