"""Gradient accumulation under DDP, with real gloo process groups: accumulating under `no_sync` trains exactly
like one process on the same samples, and runs one gradient all-reduce per optimizer step, not one per
micro-batch."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import final_state, output, run_cli, start_ranks
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from framework.app.launch import free_port
from framework.loop.trainer import Trainer
from framework.parallel.strategy import DDPStrategy

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

ACCUMULATE = 4
# 10 micro-batches per epoch in windows of 4, 4 and 2: six optimizer steps cross an epoch boundary and take
# the short window at the epoch's end, where the all-reduce must happen too.
LOOP = ("trainer.max_steps=6", f"trainer.accumulate_grad_batches={ACCUMULATE}", "trainer.limit_train_batches=10",
        "trainer.limit_val_batches=1", "trainer.test=false", "trainer.device=cpu", "model.dropout=0.0")
MICRO_BATCHES = 20  # 10 per epoch, two epochs


def test_two_processes_accumulating_4_match_one_process_on_the_same_samples(tmp_path):
    # EpochSampler gives rank r the positions r, r+2, r+4, ... of the epoch's order, so micro-batch k of the
    # two ranks (batch b each) together holds positions [2kb, 2(k+1)b): micro-batch k of one process with
    # batch 2b. Both runs therefore average the same samples' gradients for every optimizer step.
    env = {"OMP_NUM_THREADS": "1"}
    ddp = run_cli(tmp_path / "ddp", "parallel=ddp", "parallel.devices=2", "data.batch_size=16", *LOOP, env=env)
    assert ddp.returncode == 0, output(ddp)
    single = run_cli(tmp_path / "single", "data.batch_size=32", *LOOP, env=env)
    assert single.returncode == 0, output(single)

    for run_dir in (tmp_path / "ddp", tmp_path / "single"):
        assert json.loads((run_dir / "summary.json").read_text())["step"] == 6
    expected, got = final_state(tmp_path / "single"), final_state(tmp_path / "ddp")
    assert set(got) == set(expected)
    assert any(name.startswith("state:") for name in expected)  # the momentum buffers are compared too
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _counting_worker(rank: int, world: int, ports: list[int], cfg: Any, run_dir: Path) -> None:
    """Fit twice: as the framework is, then with DDPStrategy.no_sync returning None (an all-reduce on every
    backward); each time a communication hook records every gradient bucket DDP reduces."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    for name, port in zip(("no_sync", "without"), ports):
        if name == "without":
            DDPStrategy.no_sync = lambda self, model: None
        os.environ["MASTER_PORT"] = str(port)
        trainer = Trainer(cfg, run_dir / name)
        buckets: list[tuple[int, bool]] = []  # (elements, last bucket of this backward)

        def count(state, bucket):  # unannotated: DDP rejects the string annotations of `from __future__`
            buckets.append((bucket.buffer().numel(), bucket.is_last()))
            return allreduce_hook(state, bucket)

        trainer.run.model.register_comm_hook(None, count)
        summary = trainer.fit()  # tears the process group down: the next fit joins a fresh one
        params = sum(p.numel() for p in trainer.run.model.module.parameters() if p.requires_grad)
        record = {"buckets": buckets, "steps": summary["step"], "params": params}
        (run_dir / f"{name}-rank{rank}.json").write_text(json.dumps(record))


def test_ddp_runs_one_gradient_all_reduce_per_optimizer_step(compose, tmp_path):
    from omegaconf import OmegaConf

    cfg = compose("parallel=ddp", "data.batch_size=16", "logger.progress_bar=false", "checkpoint=none", *LOOP)
    OmegaConf.resolve(cfg)  # spawned workers have no HydraConfig to resolve `${hydra:...}` with
    start_ranks(_counting_worker, (2, [free_port(), free_port()], cfg, tmp_path))

    rounds = {}
    for name in ("no_sync", "without"):
        for rank in (0, 1):
            record = json.loads((tmp_path / f"{name}-rank{rank}.json").read_text())
            assert record["steps"] == 6
            # One round = every bucket of one backward; each round reduces every gradient element once.
            ends = [i + 1 for i, (_, last) in enumerate(record["buckets"]) if last]
            assert ends and ends[-1] == len(record["buckets"])
            starts = [0, *ends[:-1]]
            for start, end in zip(starts, ends):
                assert sum(n for n, _ in record["buckets"][start:end]) == record["params"]
            rounds[name, rank] = len(ends)
    assert rounds["no_sync", 0] == rounds["no_sync", 1] == 6  # one per optimizer step
    # One per micro-batch: 4x as many in a full window of 4, 2x in the epoch's last window of 2.
    assert rounds["without", 0] == rounds["without", 1] == MICRO_BATCHES
