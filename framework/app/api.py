"""The framework as a Python library: compose a run's config from overrides, run a stage, get its summary, in this
process (as Lightning's tests call `Trainer.fit`). `python run.py OVERRIDES` is this, plus Hydra's command line
(`-m` sweeps, `--cfg`, `--help`), the one-line error report and the exit code.

    from framework.app import api

    summary = api.run(["trainer.max_epochs=2", "hydra.run.dir=/tmp/run"])   # fit; summary.json's contents
    summary = api.run(["test", "ckpt=/tmp/run", "hydra.run.dir=/tmp/tested"])  # a stage by its word
    cfg = api.compose(["model=cnn"])                                            # the job's config, not run

A mistake is a `UserError` (framework.core.errors) whose message is the line the command line prints, a run stopped
by a signal an `Interrupted`. The run's log goes to its run.log and to whatever logging the caller configured;
Hydra's own logging set-up is not applied, so a notebook's or a test's logging is left as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.core.utils import run_job
from hydra.types import HydraContext
from omegaconf import DictConfig, open_dict

from framework.app import cli, main
from framework.app.download import argv_with_local_copies
from framework.app.resume import argv_with_saved_choices, new_invocation
from framework.config.schema import register
from framework.config.trees import framework_conf_dir
from framework.core.errors import ConfigError, Interrupted, os_error_line
from framework.core.runlog import RunLogHandler
from framework.observe.progress import file_only

log = logging.getLogger(__name__)


def compose(
    overrides: Sequence[str] = (), *, config_dir: Optional[Path] = None, config_name: str = "config"
) -> DictConfig:
    """The job's config as `python run.py OVERRIDES` composes it (the hydra node left out). `config_dir`: your own
    config tree, in front of the framework's (the command line's --config-dir)."""
    with _composing(config_dir):
        cfg = _compose(list(overrides), config_dir, config_name)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def run(
    overrides: Sequence[str] = (), *, config_dir: Optional[Path] = None, config_name: str = "config"
) -> dict[str, Any]:
    """Run the stage the overrides name (a first word `test`, `stage=test`; fit by default) in this process, as
    `python run.py OVERRIDES` runs it: the same run directory (`hydra.run.dir`), the same files, the same checks.
    Returns the stage's summary (summary.json's contents; {} for a dry run)."""
    new_invocation()
    with _composing(config_dir):
        cfg = _compose(list(overrides), config_dir, config_name)
        loader = GlobalHydra.instance().config_loader()
        context = HydraContext(loader, _NoCallbacks())  # type: ignore[arg-type]
        try:
            done = run_job(_job, cfg, "hydra.run.dir", None, context, False)
        except OSError as err:  # Hydra could not make the run directory or write .hydra/ into it
            raise ConfigError(cli.describe(err, list(overrides)) or str(err)) from None
    result = done.return_value
    if isinstance(result, _Failed):
        raise result.error
    return result


@dataclasses.dataclass
class _Failed:
    error: BaseException


def _job(cfg: DictConfig) -> Any:
    """The job as Hydra runs it (its run directory made, `.hydra/` written, HydraConfig set), with its run.log. What
    it raises comes back as a value, raised by `run` (Hydra would log every failed job's overrides as an error)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with _run_log(run_dir):
        try:
            return main.run_job(cfg)
        except Exception as err:  # noqa: BLE001  (raised again by `run`, as it was)
            if (run_dir / "run.log").exists():  # a run that started keeps its record (a refused one left nothing)
                stopped = isinstance(err, Interrupted)
                level = logging.WARNING if stopped else logging.ERROR
                file_only(f"{'' if stopped else 'Error: '}{_line(err)}", log, level)
            return _Failed(err)


def _line(err: BaseException) -> str:
    return os_error_line(err) if isinstance(err, OSError) else str(err)


def _compose(overrides: list[str], config_dir: Optional[Path], config_name: str) -> DictConfig:
    """Hydra's composition of the overrides as the command line prepares them (the stage word, a resume's saved
    choices); a mistake Hydra finds is the command line's one line, as a ConfigError."""
    argv = cli.with_stage(["api", *overrides])
    trees = [config_dir.absolute()] if config_dir is not None else []
    argv = argv_with_saved_choices(argv_with_local_copies(argv), [*trees, framework_conf_dir()], config_name)
    try:  # hydra.mode as the command line sets it (recorded in .hydra/hydra.yaml)
        return hydra_compose(config_name, overrides=[*argv[1:], "hydra.mode=RUN"], return_hydra_config=True)
    except Exception as err:  # noqa: BLE001  (re-raised unless it is a user's mistake Hydra found)
        message = cli.describe(err, argv[1:])
        if message is None:
            raise
        raise ConfigError(message) from None


@contextlib.contextmanager
def _composing(config_dir: Optional[Path]) -> Iterator[None]:
    """Hydra initialised on the user's tree (else the framework's), the framework's tree after it in the search
    path, the schemas registered: what the command line sets up before composing."""
    register()
    Plugins.instance().register(cli.FrameworkConfigs)
    primary = config_dir.absolute() if config_dir is not None else framework_conf_dir()
    with initialize_config_dir(config_dir=str(primary), version_base="1.3", job_name="run"):
        yield


@contextlib.contextmanager
def _run_log(run_dir: Path) -> Iterator[None]:
    """run.log in the run directory while the job runs, and the framework's INFO lines reaching it (the caller's
    own logging, if any, gets them too); both undone afterwards."""
    framework_log = logging.getLogger("framework")
    level = framework_log.level
    if framework_log.getEffectiveLevel() > logging.INFO:
        framework_log.setLevel(logging.INFO)
    handler: Optional[RunLogHandler] = None
    root = logging.getLogger()
    try:
        if os.environ.get("RANK", "0") == "0":
            handler = RunLogHandler(str(run_dir / "run.log"))
            handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
            root.addHandler(handler)
        yield
    finally:
        if handler is not None:
            root.removeHandler(handler)
            handler.close()
        framework_log.setLevel(level)


class _NoCallbacks:
    """Hydra's job callbacks, of which a single job run from Python has none (a sweep's are the command line's)."""

    def on_job_start(self, **_: Any) -> None:
        pass

    def on_job_end(self, **_: Any) -> None:
        pass
