"""Where a run's time goes (`trainer.profiler`), Lightning's `profiler=simple|pytorch`.

- null: `Profiler` hands the loop its own callables back and times nothing, so the hot loop runs exactly the code
  it runs without a profiler (no per-step check, no context entered).
- simple: `SimpleProfiler` times each phase of fit (data wait, forward, backward, optimizer, logging, checkpoint,
  evaluation; under DDP also the all-reduce wait) and the summary gets the totals, which the closing lines show
  as a table (`table`) and TensorBoard and the trackers get as `profile/*`. On CUDA each timed call waits for the
  device at its start and end, so a phase is charged for its own kernels; that sync happens only here.
- pytorch: `TorchProfiler` records a `torch.profiler` trace of a window of optimizer steps (`wait`, `warmup`,
  `active`, as torch.profiler.schedule takes them), one Chrome trace-event JSON file per rank under
  RUN_DIR/profiler/, cut to `trainer.profiler_max_mb`. Perfetto (ui.perfetto.dev) and chrome://tracing open it.

The loop asks for its step callables once per epoch (`loop_fns`), enters `phase(name)` around the work done
between steps, and reports the epoch's data wait (`add`); entering the profiler starts the clock or the trace.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from framework.core import files

log = logging.getLogger(__name__)

PROFILERS = ("simple", "pytorch")  # and null: off
# The phases, in the table's order. "all-reduce wait" is DDP's only; "other" is the rest of fit's time.
PHASES = ("data wait", "forward", "backward", "all-reduce wait", "optimizer", "logging", "checkpoint", "evaluation")
_NOTHING = contextlib.nullcontext()  # reusable: entering it does nothing


def build_profiler(t: Any, strategy: Any, run_dir: Path, model: nn.Module, progress: Any) -> Profiler:
    """The profiler `trainer.profiler` names (validated by config.validate); `model` as the loop runs it (a DDP
    model gets the simple profiler's timing hook), `progress` for the traced steps' numbers."""
    if t.profiler == "simple":
        return SimpleProfiler(strategy, model)
    if t.profiler == "pytorch":
        s = t.profiler_schedule
        window = (s.wait, s.warmup, s.active)
        return TorchProfiler(strategy, run_dir / "profiler", progress, window, int(t.profiler_max_mb * 2**20))
    return Profiler()


class Profiler:
    """trainer.profiler=null: nothing is timed or traced."""

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def loop_fns(self, training_step: Callable, backward: Callable, optimizer_step: Callable) -> tuple[Callable, ...]:
        """The loop's per-step callables, timed or traced (unchanged here)."""
        return training_step, backward, optimizer_step

    def phase(self, name: str) -> ContextManager[Any]:
        """Entered around a phase done between steps (logging, checkpoint, evaluation)."""
        return _NOTHING

    def add(self, name: str, seconds: float) -> None:
        """Time the loop measured itself (the epoch's data wait, which it always measures)."""

    def finish(self, summary: dict[str, Any], logger: Any, step: int) -> None:
        """At the end of fit, on every rank (it may gather): the figures into the summary and the logger."""


class SimpleProfiler(Profiler):
    """Seconds and calls per phase. Under DDP the gradient all-reduce goes through torch's own default hook
    (`allreduce_hook`, the same averaging), wrapped to note when the last bucket of a backward was ready: the time
    from then until backward returns is the all-reduce wait, the communication computation did not hide (it also
    holds DDP's short copy of the averaged buckets into the gradients), and is taken out of backward's time."""

    def __init__(self, strategy: Any, model: nn.Module) -> None:
        self.strategy, self.cuda = strategy, strategy.device.type == "cuda"
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self.started = time.perf_counter()
        self._ready: Optional[float] = None  # when the last gradient bucket of this backward was ready (DDP)
        # On CUDA a bucket is ready when its kernels are queued, not done: an event on the stream says when.
        self._ready_event = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model.register_comm_hook(model.process_group, self._allreduce)

    # Unannotated: DDP compares the hook's annotations with the GradBucket and Future classes themselves, and this
    # module's annotations are strings (from __future__ import annotations).
    def _allreduce(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if bucket.is_last():  # launched last: from here on backward waits for communication alone
            self._ready = time.perf_counter()
            if self._ready_event is not None:
                self._ready_event.record()
        return allreduce_hook(process_group, bucket)

    def __enter__(self) -> SimpleProfiler:
        self.started = time.perf_counter()
        return self

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.strategy.device)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds  # no call counted: the loop adds up its data wait over an epoch

    def _record(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._record(name, time.perf_counter() - start)

    def _timed(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed

    def _backward(self, backward: Callable) -> Callable:
        @functools.wraps(backward)
        def timed(loss: torch.Tensor) -> None:
            self._sync()
            start = time.perf_counter()
            backward(loss)
            self._sync()
            end, wait = time.perf_counter(), 0.0
            if self._ready is not None:  # a backward that all-reduced (not one under no_sync)
                wait = self._waited(end)
                self._record("all-reduce wait", wait)
                self._ready = None
            self._record("backward", end - start - wait)

        return timed

    def _waited(self, end: float) -> float:
        if self._ready_event is None:
            return end - (self._ready or end)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        done.synchronize()
        return self._ready_event.elapsed_time(done) / 1000

    def loop_fns(self, training_step: Callable, backward: Callable, optimizer_step: Callable) -> tuple[Callable, ...]:
        return self._timed("forward", training_step), self._backward(backward), self._timed("optimizer", optimizer_step)

    def finish(self, summary: dict[str, Any], logger: Any, step: int) -> None:
        total = time.perf_counter() - self.started
        ranks = self.strategy.gather_objects((self.seconds, self.calls, total))  # a collective: every rank
        summary["profile"] = profile_figures(ranks, ddp=self.ddp)
        logger.log_metrics(
            {
                f"profile/{name.replace(' ', '_').replace('-', '')}_s": f["seconds"]
                for name, f in summary["profile"].items()
            },
            step,
        )


def profile_figures(ranks: list[Any], ddp: bool) -> dict[str, dict[str, float]]:
    """Each phase's seconds (the mean over ranks, and the slowest rank's), calls (rank 0's), ms a call and share of
    fit's time; `other` is fit's time in no phase (start, hooks, progress bar, moving batches), `total` all of it."""
    world = len(ranks)
    total = sum(r[2] for r in ranks) / world
    figures = {}
    for name in (*PHASES, "other", "total"):
        if name == "all-reduce wait" and not ddp:
            continue
        if name in PHASES:
            each = [r[0][name] for r in ranks]
        else:
            each = [r[2] - (sum(r[0].values()) if name == "other" else 0.0) for r in ranks]
        calls = ranks[0][1].get(name, 0)
        seconds = sum(each) / world
        figures[name] = {
            "seconds": round(seconds, 6),
            "max_rank_seconds": round(max(each), 6),
            "calls": calls,
            "ms_per_call": round(1000 * seconds / calls, 3) if calls else 0.0,
            "percent": round(100 * seconds / total, 2) if total > 0 else 0.0,
        }
    return figures


def table(profile: dict[str, dict[str, float]], world_size: int) -> list[str]:
    """The closing table of a run with trainer.profiler=simple (loggers.print_summary shows it)."""
    slowest = world_size > 1
    head = f"  {'phase':<16}{'seconds':>10}{'%':>8}{'calls':>8}{'ms/call':>10}" + (
        f"{'slowest rank s':>16}" if slowest else ""
    )
    over = f"mean of {world_size} ranks" if slowest else "one process"
    lines = [f"Time per phase (trainer.profiler=simple, {over}):", head]
    for name, f in profile.items():
        calls = f"{f['calls']:>8}" if f["calls"] else f"{'':>8}"
        per_call = f"{f['ms_per_call']:>10.2f}" if f["calls"] else f"{'':>10}"
        row = f"  {name:<16}{f['seconds']:>10.3f}{f['percent']:>7.1f}%{calls}{per_call}"
        lines.append((row + (f"{f['max_rank_seconds']:>16.3f}" if slowest else "")).rstrip())
    return lines


class TorchProfiler(Profiler):
    """A torch.profiler trace of one window of optimizer steps, counted from this process's first: `wait` steps
    untraced, `warmup` traced but dropped (the profiler's own start-up), `active` kept. A run that ends inside the
    window keeps what was traced. Each rank writes RUN_DIR/profiler/rank<R>_steps<A>-<B>.json."""

    def __init__(
        self, strategy: Any, folder: Path, progress: Any, window: tuple[int, int, int], max_bytes: int
    ) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.rank, self.folder, self.progress, self.max_bytes = strategy.rank, folder, progress, max_bytes
        self.wait, self.warmup, self.active = window
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if strategy.device.type == "cuda" else [])
        self.torch_profiler = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._write,
        )
        self.first_step, self.written = 0, False

    def __enter__(self) -> TorchProfiler:
        self.first_step = self.progress.step
        self.torch_profiler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.torch_profiler.stop()  # a window still being traced is written now
        if not self.written and self.rank == 0:
            log.warning(
                "trainer.profiler=pytorch: no trace written; the run ended after %d steps, before the traced "
                "window (trainer.profiler_schedule: wait=%d, warmup=%d)",
                self.progress.step - self.first_step,
                self.wait,
                self.warmup,
            )

    def loop_fns(self, training_step: Callable, backward: Callable, optimizer_step: Callable) -> tuple[Callable, ...]:
        from torch.profiler import record_function

        def step() -> None:
            with record_function("optimizer_step"):
                optimizer_step()
            self.torch_profiler.step()  # a step of the schedule is an optimizer step

        return _labelled("training_step", training_step), _labelled("backward", backward), step

    def phase(self, name: str) -> ContextManager[Any]:
        from torch.profiler import record_function

        return record_function(name)

    def _write(self, prof: Any) -> None:
        first = self.first_step + self.wait + self.warmup + 1
        path = self.folder / f"rank{self.rank}_steps{first}-{self.progress.step}.json"
        with files.private_dir(self.folder) as scratch:  # torch writes the trace itself: never through a link
            written = scratch / path.name
            prof.export_chrome_trace(str(written))
            cut = cap_trace(written, self.max_bytes)
            files.publish(written, path)
        self.written = True
        if self.rank == 0:
            log.info(
                "trainer.profiler=pytorch: trace of steps %d-%d in %s (open it in ui.perfetto.dev)",
                first,
                self.progress.step,
                path,
            )
        if cut:
            log.warning(
                "trainer.profiler=pytorch: rank %d's trace was cut to its first %d events to stay under "
                "trainer.profiler_max_mb=%g; trace fewer steps (trainer.profiler_schedule.active) or raise it",
                self.rank,
                cut,
                self.max_bytes / 2**20,
            )


def _labelled(name: str, fn: Callable) -> Callable:
    from torch.profiler import record_function

    @functools.wraps(fn)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return labelled


def cap_trace(path: Path, max_bytes: int) -> int:
    """Cut a Chrome trace file over `max_bytes` to its earliest events (metadata kept), in place; returns how many
    timed events were kept, 0 when nothing was cut."""
    size = path.stat().st_size
    if size <= max_bytes:
        return 0
    trace = json.loads(path.read_text())
    events = trace.get("traceEvents", [])
    meta = [e for e in events if e.get("ph") == "M"]
    timed = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: e.get("ts", 0))
    keep = max(1, int(len(timed) * max_bytes / size * 0.9))  # events are of similar size; 10% to spare
    while True:
        trace["traceEvents"] = meta + timed[:keep]
        text = json.dumps(trace)
        if len(text) <= max_bytes or keep == 1:
            break
        keep = max(1, keep * 9 // 10)
    files.write_text(path, text, fsync=False)  # (in a private folder: published once cut)
    return keep
