"""What torch.compile did during a fit with trainer.compile=true: each recompilation logged with the guard that failed
(as TORCH_LOGS=recompiles shows them live), and the counts for summary.json. torch's records are read through
framework/core/compat.py (a private API, version-checked)."""

from __future__ import annotations

import logging
import os
from typing import Any

from framework.core import compat

log = logging.getLogger(__name__)


def compile_report(since: float, rank_zero: bool) -> dict[str, Any]:
    """This process's compilations since `since` (time.time() at fit's start): {"compilations": N, "recompiles": M}.
    The first compilation of each code object is expected; every later one is a recompilation (a grad mode, a
    batch shape or a train/eval flag the compiled code had not seen), logged once here on rank 0."""
    records = compat.compilations(since)
    recompiles = [r for r in records if r.recompile_reason]
    if rank_zero:
        for r in recompiles:
            where = f"{r.co_name} ({os.path.basename(str(r.co_filename))}:{r.co_firstlineno})"
            log.info("trainer.compile: recompiled %s: %s", where, str(r.recompile_reason).strip())
        if recompiles:
            log.info(
                "trainer.compile: %d compilations, %d of them recompilations (TORCH_LOGS=recompiles shows each "
                "as it happens)",
                len(records),
                len(recompiles),
            )
    return {"compilations": len(records), "recompiles": len(recompiles)}
