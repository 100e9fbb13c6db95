"""When a run stops early: a callback's (or the task's) request, held back until trainer.min_epochs and min_steps
are reached, and agreed by every rank together with the signals any rank received, so that every process stops
after the same step.

Agreeing costs the loop no host sync per step. After each optimizer step every rank sends its flags (the signals
it received, whether it asks to stop) in an asynchronous all-reduce and reads the sum the previous step sent: a
request or a signal made at step k is seen by every rank at step k + 1, the step every rank then stops at (and
saves `last` at, on a signal). The flags are CPU tensors reduced over gloo (the run's own group, or one of their
own beside nccl), so reading them never waits for the GPU, and by the next step the sum has long arrived. Where
the loop leaves its steps (the start, an epoch's end) `settle` agrees at once, so that a request from an epoch-end
hook (early stopping after a validation) stops every rank there."""

from __future__ import annotations

import logging
import signal
from typing import Any, Optional

import torch

from framework.checkpoint.state import Progress
from framework.core.signals import SignalWatch
from framework.parallel.strategy import Strategy

log = logging.getLogger(__name__)
_SIGNAL_SLOTS = range(signal.NSIG)  # signal numbers, for agreeing on one across ranks
_REQUEST = signal.NSIG  # the flags' last slot: a rank asked to stop


class Stop:
    def __init__(self, strategy: Strategy, min_epochs: int, min_steps: int) -> None:
        self.strategy, self.min_epochs, self.min_steps = strategy, min_epochs, min_steps
        self.reason = ""  # why the run was asked to stop; not saved: on resume, callbacks decide again
        self._sent = False  # this rank's request went into an agreement (it is not sent twice)
        self._agreed = False  # an agreement showed a request: every rank now judges it at the same step
        self._flags = torch.zeros(len(_SIGNAL_SLOTS) + 1)  # reused: in flight from one step to the next
        self._in_flight: Any = None  # the last step's all-reduce of `_flags`, read after the next step
        self._group: Any = None  # the gloo group the flags are reduced over, found at the first agreement
        self._settled_signal: Optional[int] = None  # a signal `settle` agreed on: the next step stops on it

    def request(self, reason: str) -> None:
        """The first reason given wins."""
        if not self.reason:
            self.reason = reason

    def granted(self, progress: Progress) -> bool:
        """A request counts once every rank agreed on it and min_epochs and min_steps are reached; before those are,
        it is dropped (the callback asks again at its next check), as Lightning does."""
        if not self.reason or (self.strategy.world_size > 1 and not self._agreed):
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
        self.reason, self._sent, self._agreed = "", False, False
        return False

    def agreed(self, watch: SignalWatch) -> Optional[int]:
        """After an optimizer step: the signal to stop on now (if any), agreed by every rank, and any rank's request
        to stop, which becomes this one's. With several ranks, what the previous step sent; this step's flags are
        sent to be read after the next one (none once a signal stops the run)."""
        received = getattr(watch, "received", None)
        if self.strategy.world_size == 1:
            return received
        signum, self._settled_signal = self._settled_signal or self._read(), None
        if signum is None:
            self._send(received)
        return signum

    def settle(self, watch: SignalWatch) -> None:
        """Where the loop is between steps (before the first, after an epoch): the request in flight and any made
        since (an epoch-end hook's) agreed now, the host waiting for it; once per epoch. A signal agreed here stops
        the run after the next step, as one received while the run was starting or validating always did."""
        if self.strategy.world_size == 1:
            return
        self._read()
        self._send(getattr(watch, "received", None))
        self._settled_signal = self._read()

    def _send(self, received: Optional[int]) -> None:
        flags = self._flags
        flags.zero_()
        if received is not None:
            flags[received] = 1.0
        if self.reason and not self._sent:
            flags[_REQUEST] = 1.0
            self._sent = True
        self._in_flight = torch.distributed.all_reduce(flags, group=self._gloo(), async_op=True)

    def _read(self) -> Optional[int]:
        """The sum in flight, if any: a request makes every rank's `_agreed` (and `reason`, where it had none);
        returns the highest signal any rank received."""
        if self._in_flight is None:
            return None
        self._in_flight.wait()
        self._in_flight = None
        summed = self._flags.tolist()
        if summed[_REQUEST]:
            self._agreed = self._sent = True
            self.request("another process's callback asked to stop")
        signalled = [signum for signum in _SIGNAL_SLOTS if summed[signum]]
        return signalled[-1] if signalled else None

    def _gloo(self) -> Any:
        """The run's process group where it reduces CPU tensors (gloo), else a gloo group of every rank beside it."""
        if self._group is None:
            dist = torch.distributed
            backend = str(dist.get_backend())
            self._group = dist.group.WORLD if "gloo" in backend else dist.new_group(backend="gloo")
        return self._group
