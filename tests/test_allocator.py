"""framework/parallel/allocator.py: glibc malloc with fixed thresholds, so a step's freed tensors serve the next step.

Each test runs a fresh Python process (malloc's state is per process): the allocation pattern of a training
step (tensors of 1-16 MiB, every page written, then all freed), repeated, with page faults counted."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")]

STEPS = r"""
import resource, statistics, sys
import torch
from framework.parallel import allocator
applied = allocator.keep_freed_memory() if sys.argv[1] == "tuned" else None
sizes = [(1 << 20) * k for k in (2, 8, 4, 16, 3, 12, 6, 1)]

def step():
    tensors = [torch.ones(size // 4) for size in sizes]  # every page written, as a step's activations are
    del tensors

for _ in range(5):
    step()
faults = []
for _ in range(50):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, statistics.median(faults))  # a step that grows the heap once more is not the thrash
"""


def faults_per_step(mode: str, env: dict[str, str] | None = None) -> tuple[str, float]:
    proc = subprocess.run([sys.executable, "-c", STEPS, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    applied, faults = proc.stdout.split()
    return applied, float(faults)


def test_a_step_reuses_the_memory_the_last_step_freed():
    """With the framework's thresholds the step's ~52 MiB come back from the heap without a page fault. With
    glibc's own, moving ones the same script measured either 0 or 8,672 faults in every step (all of it again),
    from one run to the next, which is why that case is not asserted. The median step is asserted: one step
    in 50 may still grow the heap once more (1,536 faults in one step here; a CI run averaged 72 per step),
    which is growth, not thrash."""
    applied, faults = faults_per_step("tuned")
    assert applied == "True"
    assert faults < 50, faults  # 0 in every run measured


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}],
                         ids=["malloc-env", "glibc-tunables", "preloaded-allocator"])
def test_a_users_own_allocator_settings_are_left_alone(env):
    applied, _ = faults_per_step("tuned", env)  # a preload library that is missing only makes the loader warn
    assert applied == "False"
