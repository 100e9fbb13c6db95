"""Shared helpers: run the real CLI in a subprocess, compose configs in-process, read TensorBoard events."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Small, quick settings for end-to-end runs; tests add their own overrides after these.
FAST = ("logger.progress_bar=false", "trainer.max_epochs=2")


def run_cli(run_dir: Path | None, *overrides: str, timeout: float = 180, env: dict[str, str] | None = None,
            fast: bool = True) -> subprocess.CompletedProcess:
    """Run `python run.py` like a user would, with its run directory at `run_dir` (None: let the config
    choose, as for resume=RUN_DIR)."""
    where = [f"hydra.run.dir={run_dir}"] if run_dir is not None else []
    args = [sys.executable, str(ROOT / "run.py"), *where, *(FAST if fast else ()), *overrides]
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update(env or {})
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture
def compose() -> Iterator:
    """compose(*overrides) -> the composed DictConfig, exactly as run.py would get it (Hydra's compose API)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    import framework.app  # noqa: F401  (registers the structured-config schemas)

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    def compose_job(*overrides: str):
        cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # as Hydra does for a job: `${hydra:...}` resolves
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield compose_job


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the run's TensorBoard event files, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
