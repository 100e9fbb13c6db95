"""The one place a private API of a dependency is used, because no public one does the job; each checks the version
it was written for, so another version fails loudly here (tests/test_compat.py) rather than silently elsewhere.

- torchmetrics 1.x keeps a Metric's update count in `_update_count`, which `compute()` and `forward()` read and
  `load_state_dict()` never restores; there is a public getter (`update_count`) and no setter. An exact resume of a
  task's metrics needs the count back.
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
            f"framework.compat.set_update_count was written for torchmetrics {TORCHMETRICS_MAJOR}.x "
            f"(Metric.{_UPDATE_COUNT}); this is torchmetrics {torchmetrics.__version__}: check that "
            "the private attribute still holds the update count, then update TORCHMETRICS_MAJOR"
        )
    setattr(metric, _UPDATE_COUNT, int(count))
