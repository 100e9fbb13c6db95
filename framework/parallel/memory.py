"""Peak memory over one epoch (`perf/max_memory_mb`): reset when the epoch starts, read when it ends, so each epoch
reports its own peak, not the process's since it started (nor an earlier job's of a sweep run in the same process).

- CUDA: the caching allocator's peak of allocated memory, the highest over the devices the model runs on (every
  visible GPU under DataParallel, whose replicas and outputs live on all of them);
- elsewhere: this process's peak resident set, Linux's VmHWM, which writing 5 to /proc/self/clear_refs resets to
  the current resident set; without /proc, getrusage's ru_maxrss, the peak since the process started."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")
_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)


def model_devices(device: torch.device, data_parallel: bool) -> list[torch.device]:
    """The devices a run's peak is the highest over: `device`, or under DataParallel every visible GPU."""
    if data_parallel and device.type == "cuda":
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [device]


class PeakMemory:
    """`reset()` at an epoch's start, `read_mb()` at its end: the peak in MiB in between."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.cuda = [d for d in devices if d.type == "cuda"]

    def reset(self) -> None:
        for device in self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if not self.cuda:
            try:  # a kernel interface, not a file of ours: written in place, as the kernel asks
                fd = os.open(_CLEAR_REFS, os.O_WRONLY)
                try:
                    os.write(fd, b"5")
                finally:
                    os.close(fd)
            except OSError:  # no /proc (or not Linux): ru_maxrss, the peak since the start, is all there is
                pass

    def read_mb(self) -> float:
        if self.cuda:
            return max(torch.cuda.max_memory_allocated(d) for d in self.cuda) / 2**20
        try:
            found = _HWM.search(_STATUS.read_text())
        except OSError:
            found = None
        if found is not None:
            return int(found.group(1)) / 1024
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
