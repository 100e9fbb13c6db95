"""Stopping on a signal: SIGTERM or SIGINT asks the loop to finish its step, save `last` and exit.

The handler only records the signal; the training loop polls `received` after each optimizer step (and all
ranks agree on it), so nothing is ever saved inside a signal handler.
"""
from __future__ import annotations

import logging
import signal
from typing import Any, Optional

log = logging.getLogger(__name__)


class SignalWatch:
    """On SIGTERM or SIGINT, ask the loop to stop after the current step (it saves `last` and exits);
    a second signal aborts at once."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalWatch":
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(sig) is signal.SIG_IGN:  # e.g. spawned DDP workers: the parent forwards SIGINT
                continue
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is not None:
            self.__exit__()
            raise KeyboardInterrupt
        self.received = signum
        log.warning("Received %s: finishing this step, then saving checkpoints/last (send again to abort)",
                    signal.Signals(signum).name)

    def __exit__(self, *_exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
