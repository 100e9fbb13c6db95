"""Optimizers with parameter groups from rules, and schedulers that hear of each step, epoch and validation
(`groups`). Public for configs: `NORM_LAYERS` (a rule's `modules`), `WarmupCosineLR`."""

from framework.optim.groups import NORM_LAYERS, WarmupCosineLR

__all__ = ["NORM_LAYERS", "WarmupCosineLR"]
