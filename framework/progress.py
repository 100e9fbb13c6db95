"""The console progress of a run."""
from __future__ import annotations

import sys
from typing import Mapping


class ProgressBar:
    """A tqdm bar per epoch; metrics shown are refreshed only at log steps (no extra host syncs)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.bar = None

    def start_epoch(self, epoch: int, total: int, initial: int = 0) -> None:
        if self.enabled:
            from tqdm import tqdm

            self.close()
            self.bar = tqdm(total=total, initial=initial, desc=f"epoch {epoch}", dynamic_ncols=True,
                            leave=False, file=sys.stderr)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def show(self, metrics: Mapping[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k.split("/", 1)[-1] if k.startswith("train/") else k: f"{v:.4g}"
                                  for k, v in metrics.items()}, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
