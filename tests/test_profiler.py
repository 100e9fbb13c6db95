"""trainer.profiler: `simple` ends the run with a table of time per phase (also in summary.json and TensorBoard),
`pytorch` leaves a Chrome trace-event JSON file per rank of a window of steps, cut to a size, and `null` hands the
loop its own callables (nothing timed, nothing entered)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import output, read_scalars, run_cli
from torch import nn

from framework.config.validate import validate
from framework.core.errors import ConfigError
from framework.loop.trainer import Trainer
from framework.observe.profiler import PHASES, Profiler, SimpleProfiler, cap_trace
from framework.observe.summary import print_summary
from framework.parallel.strategy import SingleDevice

pytestmark = pytest.mark.unit

TINY = ("logger.progress_bar=false", "trainer.max_epochs=1", "trainer.limit_train_batches=6",
        "trainer.limit_val_batches=2", "trainer.limit_test_batches=2")


def fit(compose, run_dir: Path, *overrides: str) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(compose(*TINY, *overrides), run_dir).fit()


def trace_events(path: Path) -> list[dict]:
    """The trace as Chrome and Perfetto read it: a JSON object whose traceEvents are complete ('X') events and
    metadata, each timed one with a name, a start and a duration in microseconds."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    timed = [e for e in events if e.get("ph") == "X"]
    assert timed and all(isinstance(e["name"], str) and e["ts"] >= 0 and e["dur"] >= 0 for e in timed), path
    return events


def test_simple_profiler_ends_the_run_with_the_phase_table_in_the_summary_and_tensorboard(compose, tmp_path, caplog):
    summary = fit(compose, tmp_path, "trainer.profiler=simple", "checkpoint.save_last=true", "trainer.log_every_n_steps=2")
    profile = summary["profile"]
    assert list(profile) == [p for p in PHASES if p != "all-reduce wait"] + ["other", "total"]  # one process: no DDP
    assert profile["forward"]["calls"] == profile["backward"]["calls"] == profile["optimizer"]["calls"] == 6
    assert profile["evaluation"]["calls"] == 2  # the validation and the test
    assert profile["logging"]["calls"] == 5  # steps 2, 4 and 6, the epoch's means and the flush after training
    assert profile["checkpoint"]["calls"] >= 1
    assert all(f["seconds"] > 0 for name, f in profile.items() if name != "data wait")
    parts = sum(f["seconds"] for name, f in profile.items() if name != "total")
    assert parts == pytest.approx(profile["total"]["seconds"], rel=1e-3)  # "other" is the rest: nothing unaccounted
    assert json.loads((tmp_path / "summary.json").read_text())["profile"] == profile
    scalars = read_scalars(tmp_path)
    assert scalars["profile/forward_s"] == [(6, pytest.approx(profile["forward"]["seconds"]))]
    assert "profile/data_wait_s" in scalars and "profile/total_s" in scalars

    with caplog.at_level(logging.INFO, logger="framework.summary"):  # the closing lines' logger (stdout, run.log)
        print_summary(summary, tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "framework.summary"]
    start = lines.index("Time per phase (trainer.profiler=simple, one process):")
    assert lines[start + 1].split() == ["phase", "seconds", "%", "calls", "ms/call"]
    assert lines[start + 3].split()[:2] == ["forward", f"{profile['forward']['seconds']:.3f}"]
    assert lines[-1].split()[:3] == ["total", f"{profile['total']['seconds']:.3f}", "100.0%"]  # the run ends with it


def test_no_profiler_hands_the_loop_its_own_callables(compose, tmp_path):
    off = Profiler()
    fns = (lambda b, i: None, lambda loss: None, lambda: None)
    assert all(a is b for a, b in zip(off.loop_fns(*fns), fns))  # no wrapper: the hot loop runs its own code
    assert off.phase("checkpoint") is off.phase("evaluation")  # one shared no-op context
    summary = fit(compose, tmp_path, "trainer.max_steps=2")
    assert "profile" not in summary and not (tmp_path / "profiler").exists()


def test_pytorch_profiler_writes_a_chrome_trace_of_the_window(compose, tmp_path):
    fit(compose, tmp_path, "trainer.profiler=pytorch", "trainer.profiler_schedule.wait=1",
        "trainer.profiler_schedule.warmup=1", "trainer.profiler_schedule.active=2")
    (trace,) = (tmp_path / "profiler").iterdir()
    assert trace.name == "rank0_steps3-4.json"  # steps 1 waited, 2 warmed up, 3 and 4 traced
    names = {e["name"] for e in trace_events(trace)}
    assert {"ProfilerStep#2", "ProfilerStep#3", "training_step", "backward", "optimizer_step"} <= names
    assert "ProfilerStep#4" not in names and "aten::linear" in names


def test_a_trace_over_the_cap_keeps_its_first_events_under_it(compose, tmp_path):
    fit(compose, tmp_path, "trainer.profiler=pytorch", "trainer.profiler_max_mb=0.02")
    (trace,) = (tmp_path / "profiler").iterdir()
    assert trace.stat().st_size <= 0.02 * 2**20
    events = trace_events(trace)
    assert any(e.get("ph") == "M" for e in events)  # the process and thread names stay

    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": f"op{i}", "ts": i, "dur": 1, "pid": 1, "tid": 1}
                                                 for i in range(1000)]}))
    kept = cap_trace(whole, whole.stat().st_size // 2)
    cut = json.loads(whole.read_text())["traceEvents"]
    assert 0 < kept == len(cut) < 500 and [e["name"] for e in cut] == [f"op{i}" for i in range(kept)]


def test_a_run_shorter_than_the_window_writes_no_trace_and_says_so(compose, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="framework.observe.profiler"):
        fit(compose, tmp_path, "trainer.profiler=pytorch", "trainer.max_steps=1")
    assert not list((tmp_path / "profiler").glob("*.json"))
    assert "no trace written; the run ended after 1 steps" in caplog.text


@pytest.mark.parametrize(("override", "expected"), [
    ("trainer.profiler=advanced", "trainer.profiler='advanced': expected null (off), simple (time per phase) or "
                                  "pytorch (a torch.profiler trace)"),
    ("trainer.profiler_schedule.active=0", "trainer.profiler_schedule.active=0: expected a whole number >= 1"),
    ("trainer.profiler_max_mb=0", "trainer.profiler_max_mb=0.0: expected a size in MB > 0"),
])
def test_a_bad_profiler_setting_is_one_line_naming_it(compose, override, expected):
    with pytest.raises(ConfigError) as err:
        validate(compose(override))
    assert str(err.value).startswith(expected), str(err.value)


def test_ddp_all_reduce_wait_is_timed_by_a_comm_hook_and_taken_out_of_backward(tmp_path):
    """A one-process gloo group: DDP runs the all-reduce through the profiler's hook (torch's own allreduce_hook,
    the same averaging), and the backward that reduced is split into compute and the wait after its last bucket."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        profiler = SimpleProfiler(SingleDevice(torch.device("cpu")), model)
        forward, backward, step = profiler.loop_fns(lambda x: model(x).sum(), lambda loss: loss.backward(), lambda: 0)
        with profiler:
            for _ in range(3):
                backward(forward(torch.randn(4, 8)))
            with model.no_sync():  # accumulating: no all-reduce, no wait
                backward(forward(torch.randn(4, 8)))
        summary: dict = {}
        profiler.finish(summary, logger=_Logger(), step=4)
    finally:
        dist.destroy_process_group()
    profile = summary["profile"]
    assert profile["all-reduce wait"]["calls"] == 3 and profile["backward"]["calls"] == 4
    assert profile["all-reduce wait"]["seconds"] > 0


class _Logger:
    """What finish() logs to (the metric logger's TensorBoardLogger), kept."""

    def __init__(self) -> None:
        self.logged: dict = {}

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged.update(metrics)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_pytorch_profiler_leaves_one_chrome_trace_per_rank(tmp_path):
    proc = run_cli(tmp_path, "parallel=ddp", "parallel.devices=2", "trainer.profiler=pytorch", "trainer.max_epochs=1",
                   "trainer.limit_train_batches=6", "trainer.limit_val_batches=1", "trainer.test=false",
                   env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, output(proc)
    traces = sorted(p.name for p in (tmp_path / "profiler").iterdir())
    assert traces == ["rank0_steps3-5.json", "rank1_steps3-5.json"]
    for name in traces:
        names = {e["name"] for e in trace_events(tmp_path / "profiler" / name)}
        assert {"ProfilerStep#2", "training_step", "backward"} <= names
