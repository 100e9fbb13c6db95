"""framework/core/startup.py: the collector is paused while a command starts and runs again once the run is built, and
a process that had turned it off itself keeps it off."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from framework.core import startup
from framework.loop.build import build_components
from framework.parallel.strategy import SingleDevice

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def collector_as_found() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    startup.resume_collector()
    (gc.enable if enabled else gc.disable)()


def test_pause_stops_automatic_collection_and_resume_starts_it_again() -> None:
    gc.enable()
    startup.pause_collector()
    assert not gc.isenabled()
    startup.resume_collector()
    assert gc.isenabled()
    startup.resume_collector()  # idempotent
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off() -> None:
    gc.disable()
    startup.pause_collector()
    startup.resume_collector()
    assert not gc.isenabled()


def test_the_collector_runs_again_once_the_runs_components_are_built(compose, tmp_path: Path) -> None:
    """Training, and whatever follows in the user's process, runs with the collector on."""
    cfg = compose("trainer.device=cpu")
    gc.enable()
    startup.pause_collector()
    build_components(cfg, SingleDevice(torch.device("cpu")), tmp_path)
    assert gc.isenabled()
