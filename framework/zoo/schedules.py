"""LR multipliers for `scheduler=lambda` (LambdaLR): `step -> factor of the group's lr`."""

from __future__ import annotations

import math


def inverse_sqrt(step: int, warmup_steps: int = 50) -> float:
    """Linear warmup, then decay as 1/sqrt(step) (the Transformer paper's schedule, normalised to peak at 1)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return math.sqrt(warmup_steps / (step + 1))
