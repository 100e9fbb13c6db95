"""framework/loop/stop.py under a real gloo process group of two spawned processes (issue 29, item 7): agreeing on a stop
costs no host sync per step (a rank leaves a step's agreement without waiting for the other to reach it), and
every rank still stops at the same step, one after the request or the signal; at an epoch's end (`settle`) a
request is agreed at once, and a signal held while the run started stops it after the first step; a request before
min_steps is dropped on every rank and does not come back."""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from conftest import rank_queue, start_ranks

from framework.checkpoint.state import Progress
from framework.loop.stop import Stop
from framework.parallel.strategy import DDPStrategy

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]
HOLD_S = 20  # how long rank 1 waits for rank 0 to leave a step's agreement alone; it should take milliseconds
STEPS = 6


PARALLEL = SimpleNamespace(strategy="ddp", backend="gloo", timeout_s=120, find_unused_parameters=False,
                           static_graph=False, cpu_offload=False, reshard_after_forward=True, shard_modules=None)


class Watch:
    received: Optional[int] = None


def _steps(stop: Stop, watch: Watch, rank: int, *, request_at: int = 0, signal_at: int = 0) -> dict[str, Any]:
    """STEPS optimizer steps as the loop takes them: callbacks (rank 0 may request), agreement, granted?"""
    seen: dict[str, Any] = {"granted": None, "signal": None}
    for step in range(1, STEPS + 1):
        if rank == 0 and step == request_at:
            stop.request("rank 0's callback")
        if rank == 1 and step == signal_at:
            watch.received = signal.SIGUSR1
        signum = stop.agreed(watch)
        if signum is not None:
            seen["signal"] = [step, signum]
            break
        if stop.granted(Progress(step=step)):
            seen["granted"] = step
            break
    seen["reason"] = stop.reason
    return seen


def _worker(rank: int, world: int, port: int, passed: Any, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    strategy, result = DDPStrategy(PARALLEL, "cpu"), {}  # the run's own: a gloo process group of `world`
    try:
        # Rank 1 takes each step only once rank 0 has left that step's agreement: rank 0 must not wait for it.
        stop, alone = Stop(strategy, 0, 0), 0
        stop.settle(Watch())
        for step in range(1, STEPS + 1):
            if rank == 1:
                try:
                    passed.get(timeout=HOLD_S)
                    alone += 1
                except queue.Empty:  # rank 0 is waiting in this step's agreement: a host sync per step
                    break
            stop.agreed(Watch())
            if rank == 0:
                passed.put(step)
        if rank == 1:
            for _ in range(alone + 1, STEPS + 1):  # what rank 0 still waits for, after a hold ran out
                stop.agreed(Watch())
        result["alone"] = alone
        stop.settle(Watch())
        result["request"] = _steps(Stop(strategy, 0, 0), Watch(), rank, request_at=3)
        result["signal"] = _steps(Stop(strategy, 0, 0), Watch(), rank, signal_at=2)
        held = Stop(strategy, 0, min_steps=5)
        result["before_min_steps"] = _steps(held, Watch(), rank, request_at=1)
        held.settle(Watch())
        result["before_min_steps"]["settled"] = held.granted(Progress(step=STEPS))
        at_epoch_end = Stop(strategy, 0, 0)
        at_epoch_end.settle(Watch())
        if rank == 1:
            at_epoch_end.request("rank 1's on_train_epoch_end")
        at_epoch_end.settle(Watch())
        result["epoch_end"] = [at_epoch_end.granted(Progress(step=10)), at_epoch_end.reason]
        starting, watch = Stop(strategy, 0, 0), Watch()
        if rank == 1:
            watch.received = signal.SIGUSR1  # held while the run was starting
        starting.settle(watch)
        result["signal_at_start"] = starting.agreed(watch)  # after the first step
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(result))
        strategy.teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_agree_on_stops_without_waiting_for_each_other_at_every_step(tmp_path):
    passed = rank_queue()
    start_ranks(_worker, (2, _free_port(), passed, str(tmp_path)))
    zero, one = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1))
    assert one["alone"] == STEPS  # rank 0 left every step's agreement before rank 1 reached it
    # A request at step 3 (rank 0's) is seen by both at step 4, which both stop after.
    assert zero["request"] == {"granted": 4, "signal": None, "reason": "rank 0's callback"}
    assert one["request"] == {"granted": 4, "signal": None, "reason": "another process's callback asked to stop"}
    # A signal rank 1 received at step 2: both stop on it at step 3 (where the trainer saves `last`).
    assert zero["signal"]["signal"] == one["signal"]["signal"] == [3, signal.SIGUSR1]
    # Before min_steps the request is dropped on both ranks, and not seen again (nor at the epoch's end).
    for rank in (zero, one):
        assert rank["before_min_steps"] == {"granted": None, "signal": None, "reason": "", "settled": False}
    # At an epoch's end, rank 1's request stops both ranks there.
    assert zero["epoch_end"] == [True, "another process's callback asked to stop"]
    assert one["epoch_end"] == [True, "rank 1's on_train_epoch_end"]
    # A signal rank 1 held while the run was starting: both stop after the first step.
    assert zero["signal_at_start"] == one["signal_at_start"] == signal.SIGUSR1
