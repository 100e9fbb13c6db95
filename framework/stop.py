"""When a run stops early: a callback's (or the task's) request, held back until trainer.min_epochs and min_steps
are reached, and agreed by every rank after an optimizer step together with the signals any rank received, so
that every process stops after the same step."""

from __future__ import annotations

import logging
import signal
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)
_SIGNAL_SLOTS = range(signal.NSIG)  # signal numbers, for agreeing on one across ranks


class Stop:
    def __init__(self, strategy: Any, min_epochs: int, min_steps: int) -> None:
        self.strategy, self.min_epochs, self.min_steps = strategy, min_epochs, min_steps
        self.reason = ""  # why the run was asked to stop; not saved: on resume, callbacks decide again

    def request(self, reason: str) -> None:
        """The first reason given wins."""
        if not self.reason:
            self.reason = reason

    def granted(self, progress: Any) -> bool:
        """A request counts once min_epochs and min_steps are reached; before that it is dropped (the callback asks
        again at its next check), as Lightning does."""
        if not self.reason:
            return False
        if progress.epoch >= self.min_epochs and progress.step >= self.min_steps:
            return True
        if self.strategy.is_rank_zero:
            log.info(
                "%s: not yet, trainer.min_epochs=%d and min_steps=%d (at epoch %d, step %d)",
                self.reason,
                self.min_epochs,
                self.min_steps,
                progress.epoch,
                progress.step,
            )
        self.reason = ""
        return False

    def agreed(self, watch: Any) -> Optional[int]:
        """After an optimizer step: the signal to stop on (if any), and whether a stop was requested, agreed by every
        rank. Returns the signal; another rank's request becomes this one's."""
        received = getattr(watch, "received", None)
        if self.strategy.world_size == 1:
            return received
        # One slot per signal number, the last for a requested stop: every rank learns which signals any rank got
        # (a signal reaches each worker at its own moment) and stops on the same one, the highest.
        flags = torch.zeros(len(_SIGNAL_SLOTS) + 1, device=self.strategy.device)
        if received is not None:
            flags[received] = 1.0
        flags[-1] = float(bool(self.reason))
        summed = self.strategy.all_reduce_sum(flags).tolist()
        if summed[-1] and not self.reason:
            self.request("another process's callback asked to stop")
        signalled = [signum for signum in _SIGNAL_SLOTS if summed[signum]]
        return signalled[-1] if signalled else None
