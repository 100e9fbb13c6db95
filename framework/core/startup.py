"""The cyclic garbage collector, paused while a command starts.

Start-up creates hundreds of thousands of long-lived objects (Hydra's config nodes, the modules torch imports on
the first optimizer, `torch._dynamo` among them) and almost no cyclic garbage, yet every few thousand allocations
the collector scans the growing heap: about 0.45 s of a 4 s `python run.py` (bench/RESULTS.md). `cli.main` pauses
it; the run's components are built when `build.build_components` resumes it, so training, and everything a user's
process does after, runs with the collector as Python configures it. Only `gc.disable`/`gc.enable`, Python's
documented switches for this process, are used; nothing is frozen.
"""

from __future__ import annotations

import gc

_paused = False


def pause_collector() -> None:
    """Stop automatic collection until `resume_collector` (a no-op where the user's process has it off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector() -> None:
    """Automatic collection again, if `pause_collector` stopped it; idempotent."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()
