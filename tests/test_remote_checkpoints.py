"""Checkpoints on object storage (`checkpoint.remote=URL`, `resume=URL`, `ckpt=URL`, `init_from=URL`), against a real S3
server on localhost (conftest's `moto` and `s3` fixtures: moto's server mode, as s3fs's own tests run it), and read
back with s3fs itself. A run uploads each kept checkpoint (verified, then published by its manifest) and its records;
the remote mirrors the local keep decisions; every mistake is one line before training; a store that fails mid-run is
one warning; and a run SIGKILLed after a checkpoint, its local directory deleted, resumes from the remote
bit-identical to a run never interrupted."""
from __future__ import annotations

import json
import logging
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    BUCKET,
    KEY_ID,
    KILLHOOK,
    SECRET,
    Moto,
    assert_identical,
    final_state,
    on_pythonpath,
    one_error_line,
    output,
    run_cli,
)

try:
    import moto.server  # noqa: F401  (conftest's S3 server)
    import requests
    import s3fs  # noqa: F401  (the runs' store)
except ImportError:
    pytest.skip("moto[server] and s3fs are not installed (pip install -e '.[s3,dev]')", allow_module_level=True)

from framework.callbacks.base import Callback

pytestmark = pytest.mark.e2e

COMMON = ("logger.progress_bar=false", "trainer.log_every_n_steps=10", "model.dropout=0.2")


def manifests(fs: Any, prefix: str) -> dict[str, dict]:
    return {Path(p).stem: json.loads(fs.cat_file(p)) for p in fs.glob(f"{BUCKET}/{prefix}/checkpoints/*.json")}


def remote_digest(fs: Any, path: str) -> str:
    import xxhash

    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(fs.cat_file(path))


def run_files(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if p.is_file()]


# ---------------------------------------------------------------------------------------------- upload
def test_kept_checkpoints_are_uploaded_verified_published_and_mirrored_with_the_records(s3, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *COMMON, "trainer.max_steps=50", "checkpoint.every_n_steps=10", "checkpoint.keep_last=2",
                   f"checkpoint.remote=s3://{BUCKET}/runs/one", fast=False)
    assert proc.returncode == 0, output(proc)
    published = manifests(s3, "runs/one")
    local = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert set(published) == local  # step-40, step-50, last, best: and no other step-N (keep_last, top-k mirrored)
    assert {"step-40", "step-50", "last"} <= set(published) and "step-10" not in published
    assert published["last"]["data"] == published["step-50"]["data"]  # hard links on disk: one upload
    for name, manifest in published.items():  # what the manifest names is what is on disk, checksum for checksum
        where = f"{BUCKET}/runs/one/checkpoints/data/{manifest['data']}"
        meta = json.loads(s3.cat_file(f"{where}/meta.json"))
        assert meta == json.loads((run_dir / "checkpoints" / name / "meta.json").read_text())
        for file in ("model.safetensors", "state.safetensors"):
            assert remote_digest(s3, f"{where}/{file}") == meta["checksums"][file]
    # The data of withdrawn checkpoints is gone: only what a manifest names is left.
    assert {Path(p).name for p in s3.ls(f"{BUCKET}/runs/one/checkpoints/data")} == {
        m["data"] for m in published.values()}
    for record in (".hydra/config.yaml", ".hydra/overrides.yaml", "provenance.json", "summary.json", "run.log"):
        assert s3.cat_file(f"{BUCKET}/runs/one/{record}") == (run_dir / record).read_bytes(), record
    assert any(Path(p).name.startswith("events.out.tfevents") for p in s3.ls(f"{BUCKET}/runs/one"))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    # Credentials come from the environment and are written into no file of the run.
    for path in run_files(run_dir):
        data = path.read_bytes()
        assert SECRET.encode() not in data and KEY_ID.encode() not in data, path
    assert f"s3://{BUCKET}/runs/one" in (run_dir / "provenance.json").read_text()


def test_ckpt_and_init_from_read_the_remote_downloading_one_checkpoint(s3, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *COMMON, "trainer.max_steps=20", "checkpoint.every_n_steps=10", "checkpoint.keep_last=-1",
                   f"checkpoint.remote=s3://{BUCKET}/runs/two", fast=False)
    assert proc.returncode == 0, output(proc)
    shutil.rmtree(run_dir)
    tested = run_cli(tmp_path / "test", "test", f"ckpt=s3://{BUCKET}/runs/two/checkpoints/step-10")
    assert tested.returncode == 0, output(tested)
    cached = [p for p in (tmp_path / "cache").rglob("meta.json")]
    assert len(cached) == 1 and json.loads(cached[0].read_text())["step"] == 10  # that one checkpoint only
    tuned = run_cli(tmp_path / "tuned", "trainer.max_steps=5", "model.dropout=0.2", f"init_from=s3://{BUCKET}/runs/two")
    assert tuned.returncode == 0, output(tuned)
    steps = sorted(json.loads(p.read_text())["step"] for p in (tmp_path / "cache").rglob("meta.json"))
    assert steps == [10, 20]  # init_from=: the newest


def test_a_remote_holding_a_run_is_never_written_over_nor_resumed_into_another_runs_directory(s3, tmp_path):
    """A second new run on a used prefix would publish over the first run's checkpoints and withdraw the rest; a
    resume=URL into a directory that holds another run, or this run behind the remote, would train from the wrong
    checkpoint and withdraw the remote's newer ones. Each is one line, and the remote keeps what it had."""
    url = f"s3://{BUCKET}/runs/held"
    first = run_cli(tmp_path / "first", *COMMON, "trainer.max_steps=20", "checkpoint.every_n_steps=10", "checkpoint.keep_last=-1",
                    f"checkpoint.remote={url}", fast=False)
    assert first.returncode == 0, output(first)
    before = manifests(s3, "runs/held")
    line = one_error_line(run_cli(tmp_path / "second", *COMMON, "trainer.max_steps=5", f"checkpoint.remote={url}"))
    assert line.startswith(f"Error: checkpoint.remote={url!r}: holds another run's checkpoints (best, last, "
                           f"step-10, step-20; the newest at step 20)"), line
    other = run_cli(tmp_path / "other", *COMMON, "trainer.max_steps=5")
    assert other.returncode == 0, output(other)
    line = one_error_line(run_cli(None, f"resume={url}", f"hydra.run.dir={tmp_path / 'other'}"))
    assert line.startswith(f"Error: resume={url!r}: hydra.run.dir='{tmp_path / 'other'}' holds another run"), line
    stale = tmp_path / "stale"
    shutil.copytree(tmp_path / "first", stale)
    for name in ("last", "best", "step-20"):  # this run as it was at step 10
        shutil.rmtree(stale / "checkpoints" / name, ignore_errors=True)
    line = one_error_line(run_cli(None, f"resume={url}", f"hydra.run.dir={stale}"))
    assert line.startswith(f"Error: resume={url!r}: hydra.run.dir='{stale}' holds this run at step 10, the remote "
                           "at step 20"), line
    assert manifests(s3, "runs/held") == before


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("overrides, expected", [
    (["checkpoint.remote=htf-bucket/runs/x"], "checkpoint.remote='htf-bucket/runs/x': not a URL"),
    (["checkpoint.remote=nosuch://htf-bucket/x"], "checkpoint.remote='nosuch://htf-bucket/x': unknown scheme nosuch://"),
    ([f"checkpoint.remote=s3://{KEY_ID}:{SECRET}@htf-bucket/x"],
     "checkpoint.remote='s3://***@htf-bucket/x': the URL holds credentials"),
    ([f"+checkpoint.remote_options.secret={SECRET}", "checkpoint.remote=s3://htf-bucket/x"],
     "checkpoint.remote_options.secret: a secret in the config would be saved with the run"),
    (["checkpoint.remote=s3://no-such-bucket/x"],
     "checkpoint.remote='s3://no-such-bucket/x': cannot write there: not found (The specified bucket does not exist)"),
    (["checkpoint.remote=s3://htf-bucket/x", "checkpoint.remote_options.endpoint_url=http://127.0.0.1:9"],
     "checkpoint.remote='s3://htf-bucket/x': cannot write there: the endpoint cannot be reached"),
    (["checkpoint.remote=s3://htf-bucket/x", "NO_CREDENTIALS"],
     "checkpoint.remote='s3://htf-bucket/x': cannot write there: no credentials found"),
    (["checkpoint.remote=memory://htf/x"], "checkpoint.remote='memory://htf/x': memory:// is gone when the process"),
    (["checkpoint.remote=s3://htf-bucket"], "checkpoint.remote='s3://htf-bucket': a bucket's root; expected a prefix"),
    (["checkpoint.remote=s3://htf-bucket/a/../b"], "checkpoint.remote='s3://htf-bucket/a/../b': a path with . or .."),
    (["resume=s3://htf-bucket/nothing"], "resume='s3://htf-bucket/nothing': no published checkpoint under"),
    (["test", "ckpt=s3://no-such-bucket/run"], "ckpt='s3://no-such-bucket/run': no such bucket 'no-such-bucket'"),
    (["init_from=s3://htf-bucket/x/checkpoints/best"], "init_from='s3://htf-bucket/x/checkpoints/best': no published"),
])
def test_a_bad_remote_is_one_line_before_training(s3, tmp_path, monkeypatch, overrides, expected):
    if "NO_CREDENTIALS" in overrides:
        overrides = [o for o in overrides if o != "NO_CREDENTIALS"]
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    start = time.perf_counter()
    line = one_error_line(run_cli(tmp_path / "run", *overrides))
    assert line.startswith(f"Error: {expected}"), line
    assert SECRET not in line
    assert time.perf_counter() - start < 30  # bounded: connect timeout, few retries
    assert not (tmp_path / "run").exists()  # refused before the run started: nothing left


def test_without_s3fs_the_command_line_names_the_extra(s3, tmp_path):
    shadow = tmp_path / "shadow" / "s3fs"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 's3fs'\")\n")
    proc = run_cli(tmp_path / "run", "checkpoint.remote=s3://htf-bucket/x",
                   env={"PYTHONPATH": on_pythonpath(shadow.parent)})
    line = one_error_line(proc)
    assert line == ("Error: checkpoint.remote='s3://htf-bucket/x': s3:// needs a library that is not installed: "
                    "pip install 'hydra-torch-framework[s3]'"), output(proc)


# ---------------------------------------------------------------------------------------------- the store failing
class Outage(Callback):
    """Stops the S3 server once the first checkpoint is published, and starts it again at step `back_at` once the
    mirror has said the upload failed: in this process, where the test's server runs."""

    moto: Any = None
    fs: Any = None
    warned = threading.Event()

    def __init__(self, back_at: int, prefix: str) -> None:
        self.back_at, self.prefix, self.down = back_at, prefix, False

    def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        published = f"{BUCKET}/{self.prefix}/checkpoints/step-10.json"
        if not self.down and 10 < step < self.back_at and _wait(lambda: self.fs.exists(published)):
            Outage.moto.stop()
            self.down = True
        if self.down and step == self.back_at:
            assert Outage.warned.wait(60), "the mirror never said the upload failed"
            Outage.moto.start()
            self.down = False


def _wait(condition: Any, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class _Warned(logging.Handler):
    def emit(self, record: Any) -> None:
        if "upload failed" in record.getMessage():
            Outage.warned.set()


def test_a_store_failing_mid_run_is_one_warning_and_the_next_checkpoint_retries(s3, moto, tmp_path):
    Outage.moto, Outage.fs = moto, s3
    Outage.warned.clear()
    handler = _Warned()
    logging.getLogger("framework.checkpoint.mirror").addHandler(handler)
    try:
        proc = run_cli(tmp_path / "run", *COMMON, "trainer.max_steps=40", "checkpoint.every_n_steps=10",
                       "checkpoint.keep_last=-1", f"checkpoint.remote=s3://{BUCKET}/runs/out",
                       "+callbacks.outage._target_=test_remote_checkpoints.Outage", "+callbacks.outage.back_at=25",
                       "+callbacks.outage.prefix=runs/out", fast=False)
    finally:
        logging.getLogger("framework.checkpoint.mirror").removeHandler(handler)
        if not _wait(lambda: _up(moto), 1):
            moto.start()
    assert proc.returncode == 0, output(proc)
    warnings = [line for line in output(proc).splitlines() if "upload failed" in line]
    assert len(warnings) == 1, output(proc)
    assert warnings[0].startswith(f"checkpoint.remote='s3://{BUCKET}/runs/out': upload failed: the endpoint cannot "
                                  "be reached"), warnings[0]
    assert "Traceback" not in output(proc)
    assert {"step-10", "step-20", "step-30", "step-40", "last"} <= set(manifests(s3, "runs/out"))  # retried


def _up(moto: Moto) -> bool:
    try:
        return requests.get(f"{moto.endpoint}/moto-api/", timeout=1).status_code < 500
    except requests.RequestException:
        return False


# ---------------------------------------------------------------------------------------------- kill, then resume
@pytest.mark.slow
def test_a_run_killed_with_its_local_directory_gone_resumes_from_the_remote_bit_identical(s3, tmp_path):
    common = (*COMMON, "trainer.max_steps=50", "checkpoint.every_n_steps=20", "checkpoint.keep_last=1")
    whole = run_cli(tmp_path / "whole", *common, fast=False)
    assert whole.returncode == 0, output(whole)
    url = f"s3://{BUCKET}/runs/killed"
    uploaded = tmp_path / "uploaded"

    def signal_once_published() -> None:  # the kill comes once step 20 is on the remote, however slow the machine
        if _wait(lambda: s3.exists(f"{BUCKET}/runs/killed/checkpoints/step-20.json"), 150):
            uploaded.touch()

    watcher = threading.Thread(target=signal_once_published, daemon=True)
    watcher.start()
    killed = run_cli(tmp_path / "killed", *common, f"checkpoint.remote={url}", fast=False,
                     env={"PYTHONPATH": on_pythonpath(KILLHOOK), "KILL_AT_STEP": "30", "KILL_SIGNAL": "SIGKILL",
                          "KILL_WHEN_EXISTS": str(uploaded)})
    assert killed.returncode == -signal.SIGKILL, output(killed)
    shutil.rmtree(tmp_path / "killed")  # the node and its disk are gone
    resumed = run_cli(tmp_path / "elsewhere", f"resume={url}", "logger.progress_bar=false", fast=False)
    assert resumed.returncode == 0, output(resumed)
    assert "at step 20" in output(resumed)
    assert_identical(final_state(tmp_path / "whole"), final_state(tmp_path / "elsewhere"))
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "elsewhere")]
    for key in [k for k in summaries[0] if k.startswith(("val/", "test/", "train/", "best/"))]:
        assert summaries[0][key] == summaries[1][key], key
    assert manifests(s3, "runs/killed")["last"]["step"] == 50  # and it went on uploading to the same remote


def test_a_file_url_remote_makes_its_folders_and_a_run_resumes_from_it(tmp_path):
    """file:// is fsspec's local file system, which makes no parent folder unless told to (every upload failed)."""
    url = f"file://{tmp_path / 'remote' / 'exp'}"
    proc = run_cli(tmp_path / "run", *COMMON, "trainer.max_steps=20", "checkpoint.every_n_steps=10",
                   f"checkpoint.remote={url}", fast=False)
    assert proc.returncode == 0, output(proc)
    assert "upload failed" not in output(proc) and "not uploaded" not in output(proc), output(proc)
    published = sorted(p.name for p in (tmp_path / "remote" / "exp" / "checkpoints").glob("*.json"))
    assert published == ["best.json", "last.json", "step-20.json"], published
    shutil.rmtree(tmp_path / "run")
    resumed = run_cli(tmp_path / "again", f"resume={url}", "trainer.max_steps=25")
    assert resumed.returncode == 0, output(resumed)
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["step"] == 25



def test_a_checkpoint_the_saver_replaces_while_it_goes_up_is_left_for_the_next_sync_not_a_store_failure(tmp_path):
    """The mirror uploads on its own thread while the saver replaces `last` and prunes `step-N`: a file that then
    reads back as another checkpoint's, or is gone, is the saver's doing, not the store's (a healthy run warned
    "upload failed: UploadMismatch"). A store that returns other bytes for an unchanged checkpoint still fails."""
    from fsspec.implementations.local import LocalFileSystem

    from framework.checkpoint.upload import UploadMismatch, manifest_path, publish
    from framework.core.stores import Store

    run = tmp_path / "run"
    proc = run_cli(run, *COMMON, "trainer.max_steps=20", "checkpoint.every_n_steps=10", "checkpoint.keep_last=-1",
                   fast=False)
    assert proc.returncode == 0, output(proc)
    last, older = run / "checkpoints" / "last", run / "checkpoints" / "step-10"

    class Saver(LocalFileSystem):  # the saver's atomic replacement of `last`, in the middle of the upload
        def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
            super().put_file(lpath, rpath, **kwargs)
            if Path(lpath).parent == last and not (tmp_path / "swapped").exists():
                (tmp_path / "swapped").touch()
                shutil.copytree(older, tmp_path / "next")
                (tmp_path / "next").rename(tmp_path / "previous")
                last.rename(tmp_path / "gone")
                (tmp_path / "previous").rename(last)

    class Corrupting(LocalFileSystem):  # a store that keeps other bytes than it was sent
        def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
            super().put_file(lpath, rpath, **kwargs)
            with open(rpath, "r+b") as f:
                f.write(b"\0")

    remote = tmp_path / "remote"
    store = Store(f"file://{remote}", Saver(auto_mkdir=True), str(remote))
    assert publish(store, last, {}) is None  # left for the next sync: no exception, no manifest
    assert not Path(manifest_path(store, "last")).exists()
    assert publish(store, last, {}) is not None  # the next sync publishes what `last` is now
    assert json.loads(Path(manifest_path(store, "last")).read_text())["step"] == 10
    broken = Store(f"file://{tmp_path / 'broken'}", Corrupting(auto_mkdir=True), str(tmp_path / "broken"))
    with pytest.raises(UploadMismatch, match="read back as"):
        publish(broken, older, {})
