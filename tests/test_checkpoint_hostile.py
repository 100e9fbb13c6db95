"""Damaged, hostile and concurrent checkpoints: whatever a checkpoint directory holds, reading it ends in one
line naming the file (DamagedCheckpoint), discovery skips it with a warning and falls back to the newest
intact checkpoint, and nothing hangs, recurses without bound, reads without bound or runs code. A save that
cannot be written (a file over the size limit, a file where a folder belongs) is one CheckpointSaveError line
and leaves nothing behind. `validate_state` / `validate_rng_state` check a loaded state against live objects.

Most cases run in-process on small checkpoints written by `write_checkpoint` (fast). Anything that could block
(FIFOs, devices) runs under `bounded`, so a hang fails the test instead of the suite. The file-size limit is
real: RLIMIT_FSIZE in a subprocess, where writes past it fail with EFBIG (we run as root, and a read-only
mode does not stop root). A few cases run `run.py` end to end, with bounded timeouts.
"""
from __future__ import annotations

import json
import logging
import os
import random
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from conftest import FAST, ROOT, one_error_line, output, replace, run_cli
from safetensors.torch import load_file, save_file

from framework.checkpoint import (
    MAX_META_BYTES,
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointManager,
    CheckpointSaveError,
    DamagedCheckpoint,
    check_compatible,
    digest,
    find_latest,
    link_checkpoint,
    load_weights,
    open_checkpoint,
    validate_rng_state,
    validate_state,
    write_checkpoint,
)
from framework.core import reproducibility
from framework.core.errors import ConfigError, UserError

pytestmark = pytest.mark.unit

S = torch.optim.lr_scheduler


# ---------------------------------------------------------------------------------------------- helpers
def bounded(fn: Callable[..., Any], *args: Any, seconds: float = 30) -> Any:
    """fn(*args) on a thread; the test fails, rather than hangs, if it has not returned within `seconds`."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001  (re-raised below, in the test's thread)
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} blocked for {seconds}s"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def damaged(fn: Callable[..., Any], *args: Any) -> str:
    """The message of the DamagedCheckpoint that fn(*args) raises; it must be one line."""
    with pytest.raises(DamagedCheckpoint) as info:
        bounded(fn, *args)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def small_state(step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A model and a training state shaped like the trainer's: a stepped AdamW, a scheduler, RNG, tuples."""
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = S.StepLR(optimizer, 2)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "loop": {"step": step, "losses": torch.ones(3)}, "rng": {"rank0": reproducibility.rng_state()},
             "extra": (1, "a", None)}
    return model.state_dict(), state


def make_checkpoint(path: Path, step: int) -> Path:
    model, state = small_state(step)
    meta = {"step": step, "epoch": step, "batch_in_epoch": 0, "world_size": 1, "metrics": {"val/acc": 0.5},
            "config": {"trainer": {"max_epochs": 5}}}
    write_checkpoint(path, model, state, meta, durable=False)
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run with intact step-1 and step-2, and `last` (step 3), the one the tests damage."""
    run = tmp_path / "run"
    for step in (1, 2):
        make_checkpoint(run / "checkpoints" / f"step-{step}", step)
    make_checkpoint(run / "checkpoints" / "last", 3)
    return run


def last_of(run: Path) -> Path:
    return run / "checkpoints" / "last"


def read_meta(ck: Path) -> dict[str, Any]:
    return json.loads((ck / META_FILE).read_text())


def write_meta(ck: Path, meta: dict[str, Any], raw: dict[str, str] | None = None) -> None:
    """meta.json with `raw` fields written as literal JSON text (1e999, NaN, numbers of any size)."""
    text = json.dumps({**meta, **{key: f"@@{key}@@" for key in raw or {}}})
    for key, value in (raw or {}).items():
        text = text.replace(f'"@@{key}@@"', value)
    replace(ck / META_FILE, text.encode())


def rewrite_state(ck: Path, tensors: dict[str, torch.Tensor], structure: Any = None) -> None:
    """Replace state.safetensors (and the structure) with checksums that match: only the consistency
    check between the two can tell."""
    (ck / STATE_FILE).unlink()
    save_file(tensors, str(ck / STATE_FILE))
    meta = read_meta(ck)
    meta["checksums"][STATE_FILE] = digest(ck / STATE_FILE)
    if structure is not None:
        meta["structure"] = structure
    write_meta(ck, meta)


def resealed(ck: Path, name: str, data: bytes) -> None:
    """Replace a data file with bytes of our choice and record their checksum: the file is what its meta says."""
    replace(ck / name, data)
    meta = read_meta(ck)
    meta["checksums"][name] = digest(ck / name)
    write_meta(ck, meta)


def assert_falls_back(run: Path, caplog, culprit: Path, because: str = "") -> None:
    """find_latest skips `culprit` with a warning naming it and returns step-2, the newest intact checkpoint."""
    with caplog.at_level(logging.WARNING, logger="framework.checkpoint"):
        found = bounded(find_latest, run)
    assert found is not None and found.path.name == "step-2" and found.step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    named = [w for w in warnings if f"checkpoint {culprit}" in w and because in w]
    assert named, warnings
    assert all("\n" not in w for w in warnings), warnings


# ---------------------------------------------------------------------------------------------- 1. meta.json schema
BAD_FIELDS = [  # (field, literal JSON, what the message says)
    ("step", '"abc"', "step='abc'"), ("step", "1e999", "step=inf"), ("step", "[1]", "step=a list of 1 items"),
    ("step", "null", "step=null"), ("step", "true", "step=true"), ("step", "-1", "step=-1"),
    ("step", "1.5", "step=1.5"), ("step", "NaN", "step=nan"), ("step", str(2**70), "step=1180591620717411303424"),
    ("step", "{}", "step=a dict of 0 entries"),
    ("epoch", '"1"', "epoch='1'"), ("epoch", "-3", "epoch=-3"), ("batch_in_epoch", "{}", "batch_in_epoch=a dict"),
    ("batch_in_epoch", "1e999", "batch_in_epoch=inf"),
    ("world_size", "0", "world_size=0; expected a whole number >= 1"), ("world_size", "false", "world_size=false"),
    ("world_size", '"2"', "world_size='2'"),
    ("metrics", "[1]", "metrics a list of 1 items"), ("metrics", '{"val/acc": "high"}', "metrics val/acc='high'"),
    ("metrics", '{"val/acc": null}', "metrics val/acc=null"), ("metrics", '{"val/acc": true}', "val/acc=true"),
    ("metrics", '"x"', "metrics 'x'"),
    ("config", "null", "config=null"), ("config", "[1]", "config=a list"), ("config", '"trainer"', "config='trainer'"),
    ("checksums", "[1, 2]", "checksums=a list of 2 items"), ("checksums", "null", "checksums=null"),
    ("checksums", '{"model.safetensors": 5, "state.safetensors": 5}', "checksums.model.safetensors=5"),
    ("checksums", '{"model.safetensors": "x"}', "lacks checksums.state.safetensors"),
    ("structure", "null", "structure at / is null"), ("structure", "[1]", "structure at / is a list"),
    ("structure", "5", "structure at / is 5"),
    ("structure", '{"__tensor__": "/loop/losses"}', "structure at / is a dict of 1 entries"),
    ("format_version", '"2"', "format_version='2'"), ("format_version", "true", "format_version=true"),
    ("format_version", "2.0", "format_version=2.0"), ("format_version", "null", "format_version=null"),
    ("format_version", "-1", "format_version=-1"), ("format_version", "[2]", "format_version=a list"),
    ("format_version", "0", "format_version=0"),
]


@pytest.mark.parametrize("field, raw, says", BAD_FIELDS, ids=[f"{f}={r[:20]}" for f, r, _ in BAD_FIELDS])
def test_a_meta_field_of_the_wrong_type_or_range_is_one_line_naming_it(run_dir, field, raw, says):
    last = last_of(run_dir)
    write_meta(last, read_meta(last), raw={field: raw})
    message = damaged(open_checkpoint, last)
    assert message.startswith(f"checkpoint {last}: {META_FILE}") and says in message, message


@pytest.mark.parametrize("field, raw, says", BAD_FIELDS[::3], ids=[f"{f}={r[:20]}" for f, r, _ in BAD_FIELDS[::3]])
def test_discovery_skips_a_checkpoint_with_a_bad_meta_field_and_falls_back(run_dir, caplog, field, raw, says):
    """They used to raise while candidates were sorted: neither skipped nor named."""
    last = last_of(run_dir)
    write_meta(last, read_meta(last), raw={field: raw})
    assert_falls_back(run_dir, caplog, last, says)


WHOLE_META = {  # meta.json's whole content -> what the message says
    "empty": (b"", "is not valid JSON"),
    "a list": (b"[]", "holds a list of 0 items; expected a JSON object"),
    "null": (b"null", "holds null"),
    "a number": (b"42", "holds 42"),
    "a string": (b'"meta"', "holds 'meta'"),
    "an empty object": (b"{}", "format_version=null"),
    "binary": (bytes(range(256)) * 4, "is not valid JSON"),
    "invalid UTF-8": (b'{"step": "\xff\xfe"}', "is not valid JSON"),
    "a 5000-digit number": (b'{"format_version": 2, "step": ' + b"9" * 5000 + b"}", "is not valid JSON"),
    "100000 nested lists": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "100000 nested objects": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    "40 nested lists in the config": (None, "nested more than 32 levels deep"),
}


@pytest.mark.parametrize("kind", WHOLE_META)
def test_a_meta_json_that_is_not_a_checkpoint_description_is_one_line(run_dir, caplog, kind):
    last = last_of(run_dir)
    content, says = WHOLE_META[kind]
    if content is None:
        meta = read_meta(last)
        meta["config"]["deep"] = json.loads("[" * 40 + "]" * 40)
        content = json.dumps(meta).encode()
    replace(last / META_FILE, content)
    message = damaged(open_checkpoint, last)
    assert message.startswith(f"checkpoint {last}: {META_FILE}") and says in message, message
    assert_falls_back(run_dir, caplog, last, says)


def test_a_2_gb_meta_json_is_refused_without_being_read(run_dir):
    last = last_of(run_dir)
    (last / META_FILE).unlink()
    with open(last / META_FILE, "wb") as f:
        f.truncate(2 * 2**30)  # sparse: costs no disk
    tracemalloc.start()
    try:
        message = damaged(open_checkpoint, last)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"{META_FILE} is 2147483648 bytes, over the 16 MiB" in message
    assert peak < 2**20, f"{peak} bytes allocated to refuse it"


def test_a_meta_json_just_over_the_cap_is_refused_and_one_under_it_is_read(run_dir):
    last = last_of(run_dir)
    meta = read_meta(last)
    padding = MAX_META_BYTES - len(json.dumps({**meta, "pad": ""})) - 1
    write_meta(last, {**meta, "pad": "x" * (padding + 2)})
    assert "over the 16 MiB" in damaged(open_checkpoint, last)
    write_meta(last, {**meta, "pad": "x" * padding})
    assert open_checkpoint(last).step == 3


def test_a_hostile_string_in_meta_json_cannot_forge_a_log_line(run_dir, caplog):
    last = last_of(run_dir)
    write_meta(last, {**read_meta(last), "step": "3\nError: forged\x1b[31m"})
    message = damaged(open_checkpoint, last)
    assert "forged" in message and "\n" not in message and "\x1b" not in message
    assert_falls_back(run_dir, caplog, last)


# ---------------------------------------------------------------------------------------------- 2. not regular files
def fifo(path: Path) -> None:
    os.mkfifo(path)


def unix_socket(path: Path) -> None:
    """A socket file at `path` (bound in a short folder, then moved: AF_UNIX paths are limited to 108 bytes)."""
    short = Path(tempfile.mkdtemp(dir="/tmp"))
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(short / "s"))
    server.close()
    os.rename(short / "s", path)
    short.rmdir()


def replace_with(path: Path, make: Callable[[Path], None]) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    make(path)


def link_to(target: str | Path) -> Callable[[Path], None]:
    return lambda path: path.symlink_to(target)


def outside_copy(path: Path) -> None:
    """A link to an identical copy of the file outside the run: its checksum matches, yet it is not the
    checkpoint's own file."""
    copy = path.parents[3] / f"outside-{path.name}"
    shutil.copy(path.with_name(path.name + ".orig"), copy)
    path.symlink_to(copy)


NOT_REGULAR = {  # how -> what the message says
    "a FIFO": (fifo, "is a FIFO; expected a regular file"),
    "a link to a FIFO inside": (lambda p: (fifo(p.with_name("pipe")), p.symlink_to("pipe")), "is a FIFO"),
    "a link to /dev/zero": (link_to("/dev/zero"), "outside the checkpoint"),
    "a link to /dev/urandom": (link_to("/dev/urandom"), "outside the checkpoint"),
    "a directory": (lambda p: p.mkdir(), "is a directory; expected a regular file"),
    "a link to the checkpoint itself": (link_to("."), "is a directory"),
    "a socket": (unix_socket, "is a socket"),
    "a link to a copy outside the run": (outside_copy, "outside the checkpoint"),
    "a link to /etc/passwd": (link_to("/etc/passwd"), "outside the checkpoint"),
    "a dangling link": (link_to("nowhere"), "is missing"),
    "a link loop": (lambda p: (p.with_name("a").symlink_to("b"), p.with_name("b").symlink_to("a"),
                               p.symlink_to("a")), "cannot be read"),
}


@pytest.mark.parametrize("name", [META_FILE, MODEL_FILE, STATE_FILE])
@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_a_checkpoint_file_that_is_not_a_regular_file_inside_it_is_refused_without_blocking(run_dir, caplog, kind,
                                                                                         name):
    last = last_of(run_dir)
    make, says = NOT_REGULAR[kind]
    shutil.copy(last / name, last / (name + ".orig"))
    replace_with(last / name, make)
    message = damaged(open_checkpoint, last)
    assert message.startswith(f"checkpoint {last}: {name} ") and says in message, message
    assert_falls_back(run_dir, caplog, last, name)


def test_a_link_to_a_file_inside_the_checkpoint_is_read(run_dir):
    last = last_of(run_dir)
    os.rename(last / MODEL_FILE, last / "weights.bin")
    (last / MODEL_FILE).symlink_to("weights.bin")
    checkpoint = open_checkpoint(last)
    assert set(checkpoint.model_state()) == {"weight", "bias"}


ENTRIES = {  # an entry of checkpoints/ -> what the warning says
    "a FIFO named step-9": ("step-9", fifo, "is a FIFO; expected a checkpoint directory"),
    "a file named step-3": ("step-3", lambda p: p.write_text("3"), "is a regular file; expected a checkpoint"),
    "last -> /": ("last", link_to("/"), "is a symbolic link to /, not to a checkpoint inside"),
    "last -> /dev/zero": ("last", link_to("/dev/zero"), "is a symbolic link to /dev/zero"),
    "a link to a newer intact checkpoint outside the run": ("step-99", None, "not to a checkpoint inside"),
    "step-8 -> .": ("step-8", link_to("."), "is a symbolic link to"),
    "a dangling link": ("step-7", link_to("step-70"), "which cannot be read"),
    "a socket named last": ("last", unix_socket, "is a socket"),
    "an empty directory": ("step-6", lambda p: p.mkdir(), f"{META_FILE} is missing"),
    "a name with a newline": ("step-5\nError: forged", lambda p: p.write_text(""), "is a regular file"),
}


@pytest.mark.parametrize("kind", ENTRIES)
def test_discovery_skips_whatever_else_is_in_checkpoints_without_blocking(run_dir, caplog, kind):
    name, make, says = ENTRIES[kind]
    folder = run_dir / "checkpoints"
    if make is None:  # an intact checkpoint of a higher step, elsewhere: a link must not smuggle it in
        make = link_to(make_checkpoint(run_dir.parent / "elsewhere", 99))
    replace_with(folder / name, make)
    if name != "last":
        shutil.rmtree(folder / "last")
    with caplog.at_level(logging.WARNING, logger="framework.checkpoint"):
        found = bounded(find_latest, run_dir)
    assert found is not None and found.path.name == "step-2"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(says in w for w in warnings), warnings
    assert all("\n" not in w for w in warnings), warnings


def test_a_link_to_a_checkpoint_inside_checkpoints_is_a_checkpoint(run_dir):
    folder = run_dir / "checkpoints"
    shutil.rmtree(folder / "last")
    (folder / "alias").symlink_to("step-2")
    found = find_latest(run_dir)
    assert found is not None and found.step == 2


@pytest.mark.parametrize("make", [fifo, lambda p: p.write_text("x"), link_to("/dev/zero")],
                         ids=["a FIFO", "a file", "a link to /dev/zero"])
def test_a_checkpoints_folder_that_is_not_a_folder_holds_no_checkpoint(tmp_path, make):
    make(tmp_path / "checkpoints")
    assert bounded(find_latest, tmp_path) is None


@pytest.mark.parametrize("make", [fifo, lambda p: p.write_text("x"), link_to("/dev/zero")],
                         ids=["a FIFO", "a file", "a link to /dev/zero"])
def test_a_checkpoint_named_explicitly_that_is_not_a_directory_is_one_line(tmp_path, make):
    make(tmp_path / "last")
    message = damaged(open_checkpoint, tmp_path / "last")
    assert message.startswith(f"checkpoint {tmp_path / 'last'} is a ") and "expected a directory" in message


def test_init_from_a_fifo_is_one_config_error_without_blocking(tmp_path):
    fifo(tmp_path / "weights.safetensors")
    with pytest.raises(ConfigError, match="weights.safetensors': a FIFO; expected a checkpoint directory"):
        bounded(load_weights, tmp_path / "weights.safetensors")


# ---------------------------------------------------------------------------------------------- 3. structure vs tensors
def mismatched_structure(ck: Path, change: Callable[[dict, dict], None]) -> None:
    tensors = load_file(str(ck / STATE_FILE))
    structure = read_meta(ck)["structure"]
    change(structure, tensors)
    rewrite_state(ck, tensors, structure)


def drop_tensor(structure: dict, tensors: dict) -> None:
    del tensors["/loop/losses"]


def add_tensor(structure: dict, tensors: dict) -> None:
    tensors["/smuggled"] = torch.zeros(2)


def rename_reference(structure: dict, tensors: dict) -> None:
    structure["loop"]["losses"] = {"__tensor__": "/nowhere"}


def reference_twice(structure: dict, tensors: dict) -> None:
    structure["loop"]["copy"] = {"__tensor__": "/loop/losses"}


def nest(value: Any) -> Callable[[dict, dict], None]:
    def change(structure: dict, tensors: dict) -> None:
        structure["loop"]["odd"] = value
    return change


STRUCTURES = {  # how -> what the message says
    "a tensor the state lacks": (drop_tensor, "refers to tensors that state.safetensors lacks: /loop/losses"),
    "an extra tensor": (add_tensor, "state.safetensors holds tensors it does not use: /smuggled"),
    "a reference to no tensor": (rename_reference, "lacks: /nowhere"),
    "a tensor used twice": (reference_twice, "refers twice to /loop/losses"),
    "a tuple that is no list": (nest({"__tuple__": 5}), "at /loop/odd holds 5 under __tuple__"),
    "an item that is no pair": (nest({"__items__": [[1]]}), "holds the item a list of 1 items under __items__"),
    "an unhashable key": (nest({"__items__": [[[1], 2]]}), "not a [key, value] pair"),
    "a tensor name that is a number": (nest({"__tensor__": 5}), "refers to the tensor 5, not a name"),
    "a marker with company": (nest({"__tensor__": "/loop/losses", "x": 1}), "has the keys __tensor__, x"),
    "an unknown marker": (nest({"__class__": "os.system"}), "has the keys __class__"),
    "items that are no list": (nest({"__items__": {"a": 1}}), "under __items__, not a list"),
}


@pytest.mark.parametrize("kind", STRUCTURES)
def test_a_structure_that_does_not_match_the_state_is_one_line_before_anything_loads(run_dir, caplog, kind):
    last = last_of(run_dir)
    change, says = STRUCTURES[kind]
    mismatched_structure(last, change)
    message = damaged(open_checkpoint, last)
    assert message.startswith(f"checkpoint {last}: {META_FILE} structure") and says in message, message
    assert_falls_back(run_dir, caplog, last, says)
    if "structure at" not in message:  # Checkpoint.state() checks it too, whoever opened the checkpoint
        assert says in damaged(open_checkpoint(last, verify=False).state)


HEADERS = {  # a data file's bytes (with a matching checksum) -> what the message says
    "empty": (b"", "header too small"),
    "a header size of 2**62": (struct.pack("<Q", 2**62) + b"{}", "header too large"),
    "offsets beyond the file": (None, "invalid"),
    "an unknown dtype": (None, "unknown variant"),
    "a header that is a list": (None, "invalid JSON in header"),
    "invalid UTF-8": (struct.pack("<Q", 4) + b"\xff\xfe{}", "invalid UTF-8"),
}


def header_file(kind: str) -> bytes:
    content, _ = HEADERS[kind]
    if content is not None:
        return content
    header: Any = {"offsets beyond the file": {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1600]}},
                   "an unknown dtype": {"w": {"dtype": "XX", "shape": [4], "data_offsets": [0, 16]}},
                   "a header that is a list": [1, 2]}[kind]
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(16)


@pytest.mark.parametrize("name", [MODEL_FILE, STATE_FILE])
@pytest.mark.parametrize("kind", HEADERS)
def test_a_data_file_with_its_checksum_but_not_safetensors_is_one_line(run_dir, caplog, kind, name):
    last = last_of(run_dir)
    resealed(last, name, header_file(kind))
    message = damaged(open_checkpoint, last)
    assert message.startswith(f"checkpoint {last}: {name} is not a valid safetensors file"), message
    assert HEADERS[kind][1] in message, message
    assert_falls_back(run_dir, caplog, last, name)


def test_weights_of_a_dtype_that_cannot_be_copied_into_the_model_are_one_error(tmp_path):
    model = torch.nn.Linear(2, 2)
    state = {"weight": torch.empty(2, 2, dtype=torch.float4_e2m1fn_x2), "bias": torch.zeros(2, dtype=torch.float64)}
    with pytest.raises(ConfigError, match=r"\(dtype mismatch weight float4_e2m1fn_x2 vs float32\); expected"):
        check_compatible(model, state, "resume='x'", strict=True)
    check_compatible(model, {"weight": torch.zeros(2, 2, dtype=torch.float16), "bias": state["bias"]}, "x", strict=True)


# ---------------------------------------------------------------------------------------------- 4. concurrent
def test_a_checkpoint_pruned_after_discovery_is_one_line_when_loaded(run_dir):
    found = find_latest(run_dir)
    shutil.rmtree(found.path)
    assert f"{MODEL_FILE} is missing" in damaged(found.model_state)
    assert f"{STATE_FILE} is missing" in damaged(found.state)


def test_a_data_file_swapped_for_a_fifo_after_discovery_cannot_block_the_load(run_dir):
    found = find_latest(run_dir)
    replace_with(found.path / STATE_FILE, fifo)
    assert f"{STATE_FILE} is a FIFO" in damaged(found.state)


class Fixed:
    """A checkpoint's content as the trainer's TrainingState.collect() gives it."""

    def __init__(self, *content: Any) -> None:
        self.content = content

    def collect(self) -> tuple:
        return self.content


def test_discovery_while_another_process_keeps_saving_into_the_run_never_fails(tmp_path):
    """A second run saving into the same folder (every step, pruning, `last` replaced each time) while
    discovery runs: it may find any intact checkpoint, but never raises, blocks or returns nothing."""
    folder = tmp_path / "checkpoints"
    make_checkpoint(folder / "stable", 0)  # never pruned: there is always something intact to find
    manager = CheckpointManager(folder, save_last=True, every_n_steps=1, keep_last=2, fsync=False)
    model, state = small_state(1)
    done = threading.Event()

    def keep_saving() -> None:
        try:
            for step in range(1, 120):
                manager.save(Fixed(model, state, {"step": step, "config": {}}), step, periodic=True)
        finally:
            done.set()

    writer = threading.Thread(target=keep_saving, daemon=True)
    writer.start()
    found_steps = []
    while not done.is_set():
        found = bounded(find_latest, tmp_path)
        assert found is not None
        found_steps.append(found.step)
    writer.join(30)
    assert not writer.is_alive()
    assert bounded(find_latest, tmp_path).step == 119 and found_steps


# ---------------------------------------------------------------------------------------------- 5. validate_state
def roundtrip(state: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The state as a checkpoint gives it back (tuples, int keys and tensors as the format rebuilds them)."""
    path = tmp_path / f"roundtrip-{len(list(tmp_path.iterdir()))}"
    write_checkpoint(path, {}, state, {"step": 1, "config": {}}, durable=False)
    return open_checkpoint(path).state()


def linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def stepped(make: Callable[[Any], torch.optim.Optimizer], steps: int = 3) -> torch.optim.Optimizer:
    model = linear()
    optimizer = make(model.parameters())
    for _ in range(steps):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    return optimizer


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1), "sgd momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p), "adamw amsgrad": lambda p: torch.optim.AdamW(p, amsgrad=True),
    "nadam": lambda p: torch.optim.NAdam(p), "radam": lambda p: torch.optim.RAdam(p),
    "adamax": lambda p: torch.optim.Adamax(p), "adagrad": lambda p: torch.optim.Adagrad(p),
    "adadelta": lambda p: torch.optim.Adadelta(p), "rprop": lambda p: torch.optim.Rprop(p),
    "asgd": lambda p: torch.optim.ASGD(p), "rmsprop": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
    "two groups": lambda p: torch.optim.AdamW([{"params": list(p)[:2]}, {"params": [], "lr": 0.5}]),
}
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS["adafactor"] = lambda p: torch.optim.Adafactor(p)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_validate_state_accepts_a_saved_optimizer_against_a_fresh_one_and_a_stepped_one(tmp_path, kind):
    saved = roundtrip({"optimizer": stepped(OPTIMIZERS[kind]).state_dict()}, tmp_path)["optimizer"]
    fresh = OPTIMIZERS[kind](linear().parameters())
    validate_state(saved, fresh.state_dict(), "optimizer")
    validate_state(saved, stepped(OPTIMIZERS[kind], steps=1).state_dict(), "optimizer")


SCHEDULERS = {
    "step": lambda o: S.StepLR(o, 2), "multistep": lambda o: S.MultiStepLR(o, [2, 4]),
    "exponential": lambda o: S.ExponentialLR(o, 0.9), "cosine": lambda o: S.CosineAnnealingLR(o, 10),
    "onecycle": lambda o: S.OneCycleLR(o, 0.1, total_steps=20), "plateau": lambda o: S.ReduceLROnPlateau(o),
    "lambda": lambda o: S.LambdaLR(o, lambda s: 0.9**s),
    "sequential": lambda o: S.SequentialLR(o, [S.LinearLR(o), S.CosineAnnealingLR(o, 5)], [2]),
    "warm restarts": lambda o: S.CosineAnnealingWarmRestarts(o, 3), "cyclic": lambda o: S.CyclicLR(o, 0.01, 0.1),
    "polynomial": lambda o: S.PolynomialLR(o, 5),
    "chained": lambda o: S.ChainedScheduler([S.ConstantLR(o), S.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_validate_state_accepts_a_saved_scheduler_against_a_fresh_one(tmp_path, kind):
    optimizer = torch.optim.SGD(linear().parameters(), lr=0.1, momentum=0.9)
    scheduler = SCHEDULERS[kind](optimizer)
    for _ in range(5):
        optimizer.step()
        scheduler.step(0.5) if kind == "plateau" else scheduler.step()
    saved = roundtrip({"scheduler": scheduler.state_dict()}, tmp_path)["scheduler"]
    fresh = SCHEDULERS[kind](torch.optim.SGD(linear().parameters(), lr=0.1, momentum=0.9))
    validate_state(saved, fresh.state_dict(), "scheduler")


def test_validate_state_accepts_a_saved_gradscaler_against_a_fresh_one(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    model = linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for loss_scale in (1.0, float("inf"), 1.0):  # one skipped step: the scale went down
        scaler.scale(model(torch.ones(2, 4)).sum() * loss_scale).backward()
        scaler.step(optimizer)
        scaler.update()
    saved = roundtrip({"scaler": scaler.state_dict()}, tmp_path)["scaler"]
    validate_state(saved, torch.amp.GradScaler("cpu").state_dict(), "precision/scaler")


REAL_RUNS = [(), ("optimizer=adamw",), ("scheduler=step",), ("scheduler=multistep",), ("scheduler=cosine",),
             ("scheduler=warmup_cosine",), ("scheduler=onecycle",), ("scheduler=plateau",), ("scheduler=lambda",),
             ("scheduler=exponential",), ("precision=fp16",), ("precision=bf16",),
             ("callbacks=[default,ema,metric_history]", "trainer.max_time=3600")]


@pytest.mark.parametrize("overrides", REAL_RUNS, ids=[" ".join(o) or "defaults" for o in REAL_RUNS])
def test_validate_state_accepts_every_component_a_real_run_saved_against_a_freshly_built_trainer(compose, tmp_path,
                                                                                             overrides):
    """No false alarm on what the trainer really saves, for every optimizer, scheduler and precision option:
    the state of a finished run, checked against the components of a trainer built to resume it."""
    from framework.loop.trainer import Trainer

    cfg = compose("logger.progress_bar=false", "logger.tensorboard=false", "trainer.max_epochs=2",
                  "trainer.limit_train_batches=3", *overrides)
    (tmp_path / "run").mkdir()
    (tmp_path / "fresh").mkdir()
    Trainer(cfg, tmp_path / "run").fit()
    state = open_checkpoint(tmp_path / "run" / "checkpoints" / "last").state()
    fresh = Trainer(cfg, tmp_path / "fresh")
    fresh.run.state.check(state, "checkpoint")  # every registered part against the live component it is for
    assert set(state) == set(fresh.run.state.parts)


def adam_with(change: Callable[[dict], None], live_stepped: bool = False) -> tuple[dict, dict]:
    saved = stepped(OPTIMIZERS["adam"]).state_dict()
    change(saved)
    live = stepped(OPTIMIZERS["adam"], 1) if live_stepped else OPTIMIZERS["adam"](linear().parameters())
    return saved, live.state_dict()


MISMATCHES = {  # (saved, live) -> what the message says
    "exp_avg of another shape": (adam_with(lambda s: s["state"][0].update(exp_avg=torch.zeros(3, 5)), True),
                                 "optimizer/state/0/exp_avg: the checkpoint holds a float32 tensor of shape (3, 5), "
                                 "expected a float32 tensor of shape (3, 4)"),
    "exp_avg of another dtype": (adam_with(lambda s: s["state"][1].update(exp_avg=torch.zeros(3).double()), True),
                                 "optimizer/state/1/exp_avg: the checkpoint holds a float64 tensor"),
    "a step that is a string": (adam_with(lambda s: s["state"][2].update(step="3"), True),
                                "optimizer/state/2/step: the checkpoint holds '3', expected a float32 tensor"),
    "a per-parameter state that is a number": (adam_with(lambda s: s["state"].update({0: 5})),
                                               "optimizer/state/0: the checkpoint holds 5"),
    "the state of a parameter no group lists": (adam_with(lambda s: s["state"].update({7: {}})),
                                                "optimizer/state/7: the checkpoint holds the state of parameter 7"),
    "a group less": (adam_with(lambda s: s["param_groups"].append(dict(s["param_groups"][0]))),
                     "optimizer/param_groups: the checkpoint holds a list of 2 items, expected a list of 1 items"),
    "a parameter less": (adam_with(lambda s: s["param_groups"][0]["params"].pop()),
                         "optimizer/param_groups/0/params: the checkpoint holds a list of 3 items, expected a list "
                         "of 4"),
    "parameter ids repeated": (adam_with(lambda s: s["param_groups"][0].update(params=[0, 0, 1, 2])),
                               "optimizer/param_groups: the parameter ids 0, 0, 1, 2 are not distinct"),
    "parameter ids that are not whole numbers": (
        adam_with(lambda s: s["param_groups"][0].update(params=[0, 1, 2, 3.5])), "are not distinct whole numbers"),
    "an SGD state for Adam": ((stepped(OPTIMIZERS["sgd momentum"]).state_dict(),
                               OPTIMIZERS["adam"](linear().parameters()).state_dict()),
                              "optimizer/param_groups/0: the checkpoint's state lacks betas, eps, amsgrad ... and has "
                              "momentum, dampening, nesterov too"),
    "an lr that is a string": (adam_with(lambda s: s["param_groups"][0].update(lr="0.1")),
                               "optimizer/param_groups/0/lr: the checkpoint holds '0.1', expected 0.001"),
    "no optimizer state at all": (({}, OPTIMIZERS["adam"](linear().parameters()).state_dict()),
                                  "optimizer: the checkpoint's state lacks state, param_groups"),
    "a list for the optimizer": (([], OPTIMIZERS["adam"](linear().parameters()).state_dict()),
                                 "optimizer: the checkpoint holds a list of 0 items, expected a dict of 2 entries"),
}


@pytest.mark.parametrize("kind", MISMATCHES)
def test_validate_state_names_the_path_and_what_differs_in_one_line(kind):
    (saved, live), says = MISMATCHES[kind]
    message = damaged(validate_state, saved, live, "optimizer")
    assert says in message, message


def test_validate_state_on_scheduler_and_scaler_values_of_the_wrong_kind():
    optimizer = torch.optim.SGD(linear().parameters(), lr=0.1)
    live = S.StepLR(optimizer, 2).state_dict()
    assert "scheduler/last_epoch: the checkpoint holds 'abc', expected 0" in damaged(
        validate_state, {**live, "last_epoch": "abc"}, live, "scheduler")
    assert "scheduler/base_lrs: the checkpoint holds a list of 3 items, expected a list of 1 items" in damaged(
        validate_state, {**live, "base_lrs": [0.1] * 3}, live, "scheduler")
    assert "scheduler/_is_initial: the checkpoint holds 1, expected false" in damaged(
        validate_state, {**live, "_is_initial": 1}, live, "scheduler")
    scaler = torch.amp.GradScaler("cpu").state_dict()
    assert "precision/scaler/scale: the checkpoint holds null, expected 65536.0" in damaged(
        validate_state, {**scaler, "scale": None}, scaler, "precision/scaler")


def test_validate_state_growing_buffers_and_not_yet_set_values():
    validate_state({"losses": torch.ones(7), "best": 0.5, "names": ["a"]}, {"losses": torch.zeros(0), "best": None,
                                                                              "names": []}, "loop")
    assert "loop/losses: the checkpoint holds a float32 tensor of shape (7, 2)" in damaged(
        validate_state, {"losses": torch.ones(7, 2)}, {"losses": torch.zeros(0)}, "loop")
    assert "loop/best: the checkpoint holds a list of 0 items, expected null" in damaged(
        validate_state, {"best": []}, {"best": None}, "loop")
    assert "loop/step: the checkpoint holds true, expected 0" in damaged(
        validate_state, {"step": True}, {"step": 0}, "loop")
    validate_state({"step": 3.0}, {"step": 0}, "loop")  # int and float are both numbers


def test_validate_state_keeps_a_hostile_key_on_one_line():
    saved = {"state": {}, "param_groups": [{"params": [0], "lr\nError: forged": 1}]}
    live = {"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]}
    assert "'lr\\nError: forged' too" in damaged(validate_state, saved, live, "optimizer")


# ---------------------------------------------------------------------------------------------- 6. RNG states
def rng_with(change: Callable[[dict], None]) -> dict[str, Any]:
    state = reproducibility.rng_state()
    change(state)
    return state


def python_state(change: Callable[[list], None]) -> Callable[[dict], None]:
    def apply(state: dict) -> None:
        version, internal, gauss = state["python"]
        words = [version, list(internal), gauss]
        change(words)
        state["python"] = (words[0], tuple(words[1]), words[2])
    return apply


RNG_DAMAGE = {  # how -> what the message says
    "python version 2": (python_state(lambda w: w.__setitem__(0, 2)), "rng/rank0/python"),
    "python 624 words": (python_state(lambda w: w[1].pop()), "rng/rank0/python"),
    "python word of 33 bits": (python_state(lambda w: w[1].__setitem__(5, 2**32)), "rng/rank0/python"),
    "python position 625": (python_state(lambda w: w[1].__setitem__(624, 625)), "rng/rank0/python"),
    "python gauss 'x'": (python_state(lambda w: w.__setitem__(2, "x")), "rng/rank0/python"),
    "python state a string": (lambda s: s.update(python="abc"), "rng/rank0/python: the checkpoint holds 'abc'"),
    "numpy position 625 (a segfault later)": (lambda s: s["numpy"].update(pos=625), "rng/rank0/numpy"),
    "numpy position -1": (lambda s: s["numpy"].update(pos=-1), "rng/rank0/numpy"),
    "numpy key of 623": (lambda s: s["numpy"].update(key=s["numpy"]["key"][:623]), "rng/rank0/numpy"),
    "numpy key of floats": (lambda s: s["numpy"].update(key=s["numpy"]["key"].double()), "rng/rank0/numpy"),
    "numpy key negative": (lambda s: s["numpy"]["key"].__setitem__(0, -1), "rng/rank0/numpy"),
    "numpy has_gauss 2": (lambda s: s["numpy"].update(has_gauss=2), "rng/rank0/numpy"),
    "numpy gauss a string": (lambda s: s["numpy"].update(gauss="z"), "rng/rank0/numpy"),
    "torch state of 10 bytes": (lambda s: s.update(torch=torch.zeros(10, dtype=torch.uint8)),
                                "rng/rank0/torch: the checkpoint holds no valid torch RNG state (Expected a "
                                "CPUGeneratorImplState of size 5056"),
    "torch state of random bytes": (lambda s: s.update(torch=torch.randint(0, 255, (5056,), dtype=torch.uint8)),
                                    "Invalid mt19937 state"),
    "torch state of int64": (lambda s: s.update(torch=s["torch"].long()), "expected a torch RNG state (a 1-d uint8"),
    "no torch state": (lambda s: s.pop("torch"), "expected the python, numpy and torch RNG states"),
    "cuda states not a list": (lambda s: s.update(cuda=5), "rng/rank0/cuda: the checkpoint holds 5"),
    "a cuda state of floats": (lambda s: s.update(cuda=[torch.zeros(16)]), "rng/rank0/cuda/0"),
}


@pytest.mark.parametrize("kind", RNG_DAMAGE)
def test_validate_rng_state_refuses_what_set_rng_state_would_choke_on_or_crash_later(tmp_path, kind):
    change, says = RNG_DAMAGE[kind]
    state = roundtrip({"rng": rng_with(change)}, tmp_path)["rng"]
    before = (random.getstate(), np.random.get_state(legacy=False)["state"]["pos"], torch.get_rng_state())
    message = damaged(validate_rng_state, state, "rng/rank0")
    assert says in message, message
    after = (random.getstate(), np.random.get_state(legacy=False)["state"]["pos"], torch.get_rng_state())
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])  # the global RNGs are untouched


def test_a_valid_rng_state_passes_and_then_restores(tmp_path):
    state = roundtrip({"rng": reproducibility.rng_state()}, tmp_path)["rng"]
    expected = (random.random(), np.random.rand(), torch.rand(1))
    validate_rng_state(state, "rng/rank0")
    reproducibility.set_rng_state(state)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])


def test_validate_rng_state_of_a_list_is_one_line():
    assert "rng/rank0: the checkpoint holds a list of 1 items" in damaged(validate_rng_state, [1], "rng/rank0")


# ---------------------------------------------------------------------------------------------- 7. registry
@pytest.mark.parametrize("state, says", [
    ({"periodic": "step-2"}, "checkpoints/periodic: the checkpoint holds 'step-2'"),
    ({"periodic": [2]}, "checkpoints/periodic"),
    ({"top_k": [["high", "step-2"]]}, "checkpoints/top_k/0: the checkpoint holds a list of 2 items"),
    ({"top_k": [[0.5]]}, "checkpoints/top_k/0"),
    ({"top_k": {"a": 1}}, "checkpoints/top_k: the checkpoint holds a dict of 1 entries"),
    ([], "checkpoints: the checkpoint holds a list of 0 items"),
])
def test_the_registry_state_is_checked_before_it_is_loaded(tmp_path, state, says):
    assert says in damaged(CheckpointManager.check_state_dict, state, "checkpoints")
    manager = CheckpointManager(tmp_path, save_last=True)
    with pytest.raises(DamagedCheckpoint):
        manager.load_state_dict(state)
    assert manager.periodic == [] and manager.top_k == []  # nothing half-loaded


# ---------------------------------------------------------------------------------------------- 8. failed saves
def assert_save_error(err: BaseException, path: Path) -> str:
    message = str(err)
    assert isinstance(err, CheckpointSaveError) and isinstance(err, UserError) and isinstance(err, OSError)
    assert message.startswith(f"could not save checkpoint {path} (") and "the previous checkpoints are kept" in message
    assert "\n" not in message
    return message


def test_a_save_where_a_file_stands_for_the_checkpoints_folder_is_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "checkpoints").write_text("not a folder")
    with pytest.raises(CheckpointSaveError) as info:
        make_checkpoint(tmp_path / "checkpoints" / "last", 1)
    assert "Not a directory" in assert_save_error(info.value, tmp_path / "checkpoints" / "last")


def test_a_link_that_cannot_be_made_is_one_line_and_leaves_nothing(tmp_path):
    make_checkpoint(tmp_path / "step-1", 1)
    (tmp_path / "step-1" / STATE_FILE).unlink()
    with pytest.raises(CheckpointSaveError) as info:
        link_checkpoint(tmp_path / "step-1", tmp_path / "last")
    assert_save_error(info.value, tmp_path / "last")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


LIMITED_SAVE = r'''
import sys, torch
from pathlib import Path
from framework.checkpoint import CheckpointSaveError, CheckpointWriter, write_checkpoint
folder, mode, size = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
big, small = {"w": torch.zeros(size // 4)}, {"w": torch.zeros(4)}
writer = CheckpointWriter(background=True)
try:
    if mode == "model file":
        write_checkpoint(folder / "last", big, {"m": torch.zeros(1)}, {"step": 2, "config": {}})
    elif mode == "state file":  # the model file is written, then the state file fails
        write_checkpoint(folder / "last", small, {"m": big["w"]}, {"step": 2, "config": {}})
    elif mode == "meta file":
        write_checkpoint(folder / "last", small, {}, {"step": 2, "config": {"pad": "x" * size}})
    else:
        writer.write(folder / "last", big, {}, {"step": 2, "config": {}})
        if mode == "background, raised at the next write":
            writer.write(folder / "step-3", small, {}, {"step": 3, "config": {}})
        writer.wait()
except CheckpointSaveError as err:
    print(err)
    writer.close()  # as the trainer does on its way out: a save queued after the failed one finishes
    sys.exit(3)
'''


def limit_file_size(limit: int) -> Callable[[], None]:
    """For preexec_fn: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored, as Python does anyway)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["model file", "state file", "meta file", "background, raised at wait",
                                  "background, raised at the next write"])
def test_a_save_beyond_the_file_size_limit_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, mode):
    make_checkpoint(tmp_path / "last", 1)
    proc = subprocess.run([sys.executable, "-c", LIMITED_SAVE, str(tmp_path), mode, str(400_000)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size(100_000))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "File too large" in lines[0], proc.stdout + proc.stderr
    assert lines[0].startswith(f"could not save checkpoint {tmp_path / 'last'} (")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old"))
    assert open_checkpoint(tmp_path / "last").step == 1
    if mode == "background, raised at the next write":  # the save after the failed one was still made
        assert open_checkpoint(tmp_path / "step-3").step == 3


# ---------------------------------------------------------------------------------------------- 9. end to end
SMALL = ("trainer.max_epochs=2", "trainer.limit_train_batches=2", "logger.tensorboard=false",
         "checkpoint.every_n_epochs=1", "checkpoint.keep_last=-1")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished run: step-2, step-4, last (step 4) and best."""
    run = tmp_path_factory.mktemp("base") / "run"
    proc = run_cli(run, *SMALL, timeout=180)
    assert proc.returncode == 0, output(proc)
    return run


def copy_run(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "run", symlinks=True))


@pytest.mark.e2e
def test_cli_resume_run_dir_walks_past_every_hostile_entry_to_the_newest_intact_checkpoint(base, tmp_path):
    run = copy_run(base, tmp_path)
    folder = run / "checkpoints"
    fifo(folder / "step-9")
    (folder / "step-8").symlink_to("/")
    (folder / "step-7").write_text("7")
    (folder / "step-6").symlink_to("/dev/zero")
    replace_with(folder / "last" / META_FILE, fifo)
    best = folder / "best"
    write_meta(best, read_meta(best), raw={"step": '"abc"'})
    proc = run_cli(None, f"resume={run}", "trainer.max_epochs=3", fast=False, timeout=120)
    assert proc.returncode == 0, output(proc)
    assert f"Resumed from {folder / 'step-4'} at step 4" in output(proc)
    for says in (f"checkpoint {folder / 'step-9'} is a FIFO", f"checkpoint {folder / 'step-8'} is a symbolic link to /",
                 f"checkpoint {folder / 'step-7'} is a regular file", f"checkpoint {folder / 'step-6'} is a symbolic",
                 f"checkpoint {folder / 'last'}: {META_FILE} is a FIFO",
                 f"checkpoint {best}: {META_FILE} has step='abc'"):
        assert says in output(proc), output(proc)


CLI_DAMAGE = {  # how the named checkpoint is damaged -> what the one error line says
    "meta.json a FIFO": (lambda ck: replace_with(ck / META_FILE, fifo), f"{META_FILE} is a FIFO"),
    "model.safetensors a FIFO": (lambda ck: replace_with(ck / MODEL_FILE, fifo), f"{MODEL_FILE} is a FIFO"),
    "state.safetensors -> /dev/urandom": (lambda ck: replace_with(ck / STATE_FILE, link_to("/dev/urandom")),
                                          f"{STATE_FILE} is a symbolic link to /dev/urandom, outside the checkpoint"),
    "step 'abc'": (lambda ck: write_meta(ck, read_meta(ck), raw={"step": '"abc"'}), f"{META_FILE} has step='abc'"),
    "100000 nested lists": (lambda ck: replace(ck / META_FILE, b"[" * 100_000 + b"]" * 100_000),
                            f"{META_FILE} is nested too deeply"),
    "an extra tensor": (lambda ck: mismatched_structure(ck, add_tensor), f"{META_FILE} structure does not match "
                        f"{STATE_FILE} ({STATE_FILE} holds tensors it does not use: /smuggled)"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("kind", CLI_DAMAGE)
def test_cli_resume_of_a_hostile_checkpoint_named_explicitly_is_one_error_line(base, tmp_path, kind):
    run = copy_run(base, tmp_path)
    last = run / "checkpoints" / "last"
    damage, says = CLI_DAMAGE[kind]
    damage(last)
    line = one_error_line(run_cli(tmp_path / "new", f"resume={last}", timeout=120))
    assert f"checkpoint {last}: {says}" in line, line


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("async_save", ["true", "false"])
def test_cli_a_periodic_save_beyond_the_file_size_limit_stops_with_one_line_and_the_run_resumes_later(base, tmp_path,
                                                                                                       async_save):
    """A resumed run whose disk is "full" (every file capped at 200 kB; a model file is 340 kB): its first save
    fails, the run ends with one line and exit 1, nothing half-written is left, every earlier checkpoint still
    opens, and once there is room the run resumes from the newest of them."""
    run = copy_run(base, tmp_path)
    folder = run / "checkpoints"
    before = {p.name: open_checkpoint(p).step for p in folder.iterdir()}
    args = [sys.executable, str(ROOT / "run.py"), *FAST, f"resume={run}", "trainer.max_epochs=4",
            f"checkpoint.async_save={async_save}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env,
                          preexec_fn=limit_file_size(200_000))
    line = one_error_line(proc)
    assert f"could not save checkpoint {folder / 'step-6'} (" in line and "File too large" in line, line
    assert "the previous checkpoints are kept" in line
    assert not [p for p in folder.iterdir() if p.name.endswith((".tmp", ".old"))]
    assert {p.name: open_checkpoint(p).step for p in folder.iterdir()} == before
    resumed = run_cli(None, f"resume={run}", "trainer.max_epochs=3", fast=False, timeout=180)
    assert resumed.returncode == 0, output(resumed)
    assert f"Resumed from {folder / 'last'} at step 4" in output(resumed)
    assert open_checkpoint(folder / "last").step == 6
