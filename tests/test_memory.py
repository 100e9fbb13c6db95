"""framework/parallel/memory.py: perf/max_memory_mb is each epoch's own peak (issue 29, item 8). On the CPU the peak is the
process's resident set (VmHWM), reset at an epoch's start; a large allocation freed in one epoch no longer shows
in the next one's figure."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_scalars

from framework.callbacks.base import Callback, CallbackList
from framework.loop.trainer import Trainer
from framework.parallel.memory import PeakMemory, model_devices

pytestmark = pytest.mark.unit
BIG_MB = 512  # well above the resident set's noise; over glibc's mmap threshold, so freeing it unmaps it
CPU = torch.device("cpu")


def touch_and_free(mb: int = BIG_MB) -> None:
    big = torch.ones(mb * 2**20 // 4)  # written, so resident
    del big


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak through Linux's /proc")
def test_a_reset_forgets_a_peak_that_was_freed():
    peak = PeakMemory([CPU])
    touch_and_free()
    before = peak.read_mb()
    peak.reset()
    after = peak.read_mb()
    assert after < before - BIG_MB / 2, (before, after)


class AllocatesInTheFirstEpoch(Callback):
    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        if trainer.current_epoch == 0:
            touch_and_free()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak through Linux's /proc")
def test_each_epoch_reports_its_own_peak_not_the_processs(compose, tmp_path):
    cfg = compose("logger.progress_bar=false", "callbacks=none", "+callbacks.big._target_=test_memory.AllocatesInTheFirstEpoch",
                  "trainer.max_epochs=2", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                  "trainer.test=false")
    Trainer(cfg, tmp_path).fit()
    (_, first), (_, second) = read_scalars(tmp_path)["perf/max_memory_mb"]
    assert second < first - BIG_MB / 2, (first, second)


def test_the_peak_is_over_the_runs_device_or_every_gpu_under_data_parallel():
    assert model_devices(CPU, data_parallel=False) == [CPU]
    assert model_devices(CPU, data_parallel=True) == [CPU]  # DataParallel on the CPU is one device
    assert model_devices(torch.device("cuda", 1), data_parallel=False) == [torch.device("cuda", 1)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel's devices: needs two GPUs")
def test_under_data_parallel_the_peak_is_the_highest_over_every_visible_gpu():
    peak = PeakMemory(model_devices(torch.device("cuda", 0), data_parallel=True))
    peak.reset()
    big = torch.ones(BIG_MB * 2**20 // 4, device="cuda:1")
    del big
    assert peak.read_mb() >= BIG_MB
