"""The one place a private API of a dependency is used, because no public one does the job; each checks the version
it was written for, so another version fails loudly here (tests/test_compat.py) rather than silently elsewhere.

- torchmetrics 1.x keeps a Metric's update count in `_update_count`, which `compute()` and `forward()` read and
  `load_state_dict()` never restores; there is a public getter (`update_count`) and no setter. An exact resume of a
  task's metrics needs the count back.
- torch.compile keeps a record of each compilation (`torch._dynamo.utils.get_compilation_metrics()`: when it
  started, the code compiled and, for a recompilation, the guard that failed); no public API counts
  recompilations, which trainer.compile reports in summary.json.
"""

from __future__ import annotations

from typing import Any

TORCHMETRICS_MAJOR = 1  # the release series `set_update_count` was written and tested for
_UPDATE_COUNT = "_update_count"


def set_update_count(metric: Any, count: int) -> None:
    """Give a torchmetrics Metric back the number of updates it had seen (see the module docstring)."""
    import torchmetrics

    major = int(torchmetrics.__version__.split(".")[0])
    if major != TORCHMETRICS_MAJOR or not hasattr(metric, _UPDATE_COUNT):
        raise RuntimeError(
            f"framework.core.compat.set_update_count was written for torchmetrics {TORCHMETRICS_MAJOR}.x "
            f"(Metric.{_UPDATE_COUNT}); this is torchmetrics {torchmetrics.__version__}: check that "
            "the private attribute still holds the update count, then update TORCHMETRICS_MAJOR"
        )
    setattr(metric, _UPDATE_COUNT, int(count))


TORCH_MAJOR = 2  # the release series `compilations` was written and tested for (2.14)
_COMPILATION_FIELDS = ("start_time", "co_name", "co_filename", "co_firstlineno", "recompile_reason")


def compilations(since: float) -> list[Any]:
    """torch.compile's records of the compilations that started at or after `since` (time.time()), oldest first;
    each has `co_name`, `co_filename`, `co_firstlineno` and `recompile_reason` (None unless a recompilation).
    torch keeps the last 64 records."""
    import torch
    from torch._dynamo.utils import get_compilation_metrics

    records = get_compilation_metrics()
    major = int(torch.__version__.split(".")[0])
    if major != TORCH_MAJOR or not all(hasattr(r, f) for r in records for f in _COMPILATION_FIELDS):
        raise RuntimeError(
            f"framework.core.compat.compilations was written for torch {TORCH_MAJOR}.x's CompilationMetrics (fields "
            f"{', '.join(_COMPILATION_FIELDS)}); this is torch {torch.__version__}: check that "
            "torch._dynamo.utils.get_compilation_metrics still records them, then update TORCH_MAJOR"
        )
    return [r for r in records if r.start_time is not None and r.start_time >= since]
