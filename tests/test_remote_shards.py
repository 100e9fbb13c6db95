"""WebDataset shards at s3:// URLs (`data.train_shards='s3://BUCKET/train-{000000..000003}.tar'`, and the val and
test shards), against a real S3 server on localhost (conftest's `moto` and `s3` fixtures). A run on shards uploaded
there trains bit-identically to a run on the same shards on local disk, in this process and with two DataLoader
workers, each of which opens its own file system (s3fs is not fork-safe); the data's identity names the URLs and a
rewritten shard is other data to a resume; a missing shard, a missing bucket, an unreachable store, no credentials
and a missing s3fs are each one `Error:` line naming the key, the pattern and the cause, before the first step.

Resuming mid-epoch is the stream's plan, which shards at a URL share unchanged with local ones (they differ only in
where a sample's bytes are read): tests/test_streaming_e2e.py kills and resumes it."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    BUCKET,
    KEY_ID,
    SECRET,
    assert_identical,
    final_state,
    on_pythonpath,
    one_error_line,
    output,
    read_scalars,
    run_cli,
)

try:
    import moto.server  # noqa: F401  (conftest's S3 server)
    import s3fs  # noqa: F401  (what reads the shards)
except ImportError:
    pytest.skip("moto[server] and s3fs are not installed (pip install -e '.[s3,dev]')", allow_module_level=True)

from framework.zoo.shards import write_image_shards

pytestmark = pytest.mark.e2e

SPLITS = {"train": 4, "val": 1, "test": 1}  # shards of 24 samples each
REMOTE = f"s3://{BUCKET}/shards"


def pattern(root: str, split: str) -> str:
    return f"{root}/{split}-{{000000..{SPLITS[split] - 1:06d}}}.tar"


def overrides(root: str, *extra: str) -> tuple[str, ...]:
    """A webdataset run on the shards under `root` (a folder or a URL): 6 steps an epoch, 2 epochs."""
    return ("data=webdataset", *(f"data.{split}_shards='{pattern(root, split)}'" for split in SPLITS),
            "data.batch_size=16", "data.shuffle_buffer=32", "data.num_workers=0", "trainer.log_every_n_steps=2",
            *extra)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shards on local disk: random 1x8x8 images (the preset's input shape) and labels, 24 to a shard."""
    folder = tmp_path_factory.mktemp("shards")
    g = torch.Generator().manual_seed(5)
    for split, count in SPLITS.items():
        n = 24 * count
        write_image_shards(folder, split, torch.rand(n, 1, 8, 8, generator=g),
                           torch.randint(0, 10, (n,), generator=g).tolist(), per_shard=24)
    return folder


@pytest.fixture(scope="module")
def local_run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("local") / "run"
    proc = run_cli(run_dir, *overrides(str(shards)))
    assert proc.returncode == 0, output(proc)
    return run_dir


def upload(fs: Any, shards: Path, leave_out: str = "") -> None:
    for path in sorted(shards.glob("*.tar")):
        if path.name != leave_out:
            fs.put_file(str(path), f"{BUCKET}/shards/{path.name}")


def losses(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    return {tag: values for tag, values in read_scalars(run_dir).items() if "loss" in tag or "acc" in tag}


def test_shards_at_an_s3_url_train_bit_identical_to_the_same_shards_on_local_disk(s3, shards, local_run, tmp_path):
    upload(s3, shards)
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *overrides(REMOTE))
    assert proc.returncode == 0, output(proc)
    assert_identical(final_state(run_dir), final_state(local_run))
    assert losses(run_dir) == losses(local_run) and losses(run_dir)  # every logged loss and accuracy, train to test
    # The data's identity names each shard by its URL, with its samples and bytes (those of the local copy).
    identity = json.loads((run_dir / "checkpoints" / "last" / "meta.json").read_text())["data_identity"]
    local = json.loads((local_run / "checkpoints" / "last" / "meta.json").read_text())["data_identity"]
    for split in SPLITS:
        assert [s[0] for s in identity[split]["shards"]] == [
            f"{REMOTE}/{split}-{i:06d}.tar" for i in range(SPLITS[split])]
        assert [s[1:] for s in identity[split]["shards"]] == [s[1:] for s in local[split]["shards"]]
    # Credentials come from the environment and land in no file of the run; the config names the URLs.
    for path in (p for p in run_dir.rglob("*") if p.is_file() and p.name != "git.diff"):  # (source: these constants)
        data = path.read_bytes()
        assert SECRET.encode() not in data and KEY_ID.encode() not in data, path
    assert pattern(REMOTE, "train") in (run_dir / ".hydra" / "config.yaml").read_text()


def test_two_dataloader_workers_read_s3_shards_each_through_its_own_file_system(s3, shards, local_run, tmp_path):
    """Forked workers would fail on their parent's s3fs ("This class is not fork-safe"): each opens its own."""
    upload(s3, shards)
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *overrides(REMOTE, "data.num_workers=2", "data.persistent_workers=true"))
    assert proc.returncode == 0, output(proc)
    assert_identical(final_state(run_dir), final_state(local_run))


@pytest.mark.unit
def test_a_shard_rewritten_at_its_url_is_other_data_to_a_resume(s3, shards, tmp_path):
    """The identity of a shard at a URL is its URL, samples and bytes, as a local one's is its path's (no ETag: not
    every fsspec store has one, and S3's changes with the multipart chunking of the same bytes)."""
    from framework.core.errors import ConfigError
    from framework.data.module import DataModule, check_data
    from framework.data.shards import TarShards

    def identity() -> dict:
        data = DataModule(TarShards(pattern(REMOTE, "train"), key="data.train_shards"), batch_size=4)
        data.setup(seed=0)
        return {split: {**found, "config": {"data.train_shards": "p"}} for split, found in data.identity().items()}

    upload(s3, shards)
    recorded = identity()
    assert check_data(identity(), recorded, accept=False, where="c").changed == {}
    other = write_image_shards(tmp_path, "other", torch.rand(30, 1, 8, 8), [0] * 30, per_shard=30)[0]
    s3.put_file(str(other), f"{BUCKET}/shards/train-000002.tar")
    with pytest.raises(ConfigError, match=r"first difference: s3://htf-bucket/shards/train-000002.tar: 30 samples, "
                                          r"\d+ bytes now; 24, \d+ then"):
        check_data(identity(), recorded, accept=False, where="c")


@pytest.mark.parametrize("case, expected", [
    ("missing shard", "data.train_shards: shard s3://htf-bucket/shards/train-000003.tar does not exist (1 of the 4 "
                      "shards of 's3://htf-bucket/shards/train-{000000..000003}.tar' are missing)"),
    ("missing bucket", "data.train_shards='s3://no-such-bucket/shards/train-{000000..000003}.tar': matches no file "
                       "(4 names, e.g. s3://no-such-bucket/shards/train-000000.tar; not found (The specified bucket "
                       "does not exist))"),
    ("unreachable", "data.train_shards='s3://htf-bucket/shards/train-{000000..000003}.tar': cannot read "
                    "s3://htf-bucket/shards/train-000000.tar: the endpoint cannot be reached"),
    ("no credentials", "data.train_shards='s3://htf-bucket/shards/train-{000000..000003}.tar': cannot read "
                       "s3://htf-bucket/shards/train-000000.tar: no credentials found"),
    ("unknown scheme", "data.train_shards='nosuch://htf-bucket/shards/train-000000.tar': unknown scheme nosuch://"),
    ("credentials in the URL", "data.train_shards='s3://***@htf-bucket/shards/train-000000.tar': the URL holds "
                               "credentials"),
])
def test_a_bad_shard_url_is_one_line_before_training(s3, shards, tmp_path, monkeypatch, case, expected):
    upload(s3, shards, leave_out="train-000003.tar" if case == "missing shard" else "")
    args = list(overrides(REMOTE))
    if case == "missing bucket":
        args.append(f"data.train_shards='{pattern('s3://no-such-bucket/shards', 'train')}'")
    elif case == "unreachable":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    elif case == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    elif case == "unknown scheme":
        args.append("data.train_shards='nosuch://htf-bucket/shards/train-000000.tar'")
    elif case == "credentials in the URL":
        args.append(f"data.train_shards='s3://{KEY_ID}:{SECRET}@htf-bucket/shards/train-000000.tar'")
    start = time.perf_counter()
    line = one_error_line(run_cli(tmp_path / "run", *args))
    assert line.startswith(f"Error: {expected}"), line
    assert SECRET not in line
    assert time.perf_counter() - start < 30  # bounded: connect timeout, few retries
    assert not (tmp_path / "run" / "checkpoints").exists()  # no step taken


def test_without_s3fs_the_line_names_the_extra(s3, shards, tmp_path):
    shadow = tmp_path / "shadow" / "s3fs"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 's3fs'\")\n")
    proc = run_cli(tmp_path / "run", *overrides(REMOTE), env={"PYTHONPATH": on_pythonpath(shadow.parent)})
    line = one_error_line(proc)
    assert line == (f"Error: data.train_shards={pattern(REMOTE, 'train')!r}: s3:// needs a library that is not "
                    "installed: pip install 'hydra-torch-framework[s3]'"), output(proc)
