"""Optimizers with parameter groups from rules (`groups`), and schedulers that hear of each step, epoch and
validation (`schedulers`). Public for configs: `NORM_LAYERS` (a rule's `modules`), `WarmupCosineLR`."""

from framework.optim.groups import NORM_LAYERS
from framework.optim.schedulers import WarmupCosineLR

__all__ = ["NORM_LAYERS", "WarmupCosineLR"]
