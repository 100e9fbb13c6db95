"""Entry point behind run.py: validate the composed config, then hand it to the Trainer.

User mistakes (`UserError`) end the run with one line on stderr and exit code 1, no traceback;
`HYDRA_FULL_ERROR=1` re-raises them so the traceback is there when you want it.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework import config
from framework.errors import ConfigError, UserError

log = logging.getLogger(__name__)

config.register()


def resolve_all(cfg: DictConfig) -> None:
    """Resolve every interpolation and `???` now, so a broken one is reported by its key before anything runs."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        message = str(err).splitlines()[0]
        raise ConfigError(f"{key}: {message}") from None


def check_paths(cfg: DictConfig) -> None:
    root = cfg.data.get("root")
    if root is not None and not Path(root).is_dir():
        raise ConfigError(f"data.root={root!r}: no such directory (relative paths start at {os.getcwd()}); "
                          "expected the folder holding the data set's files: set data.root=/path/to/data")


def main(cfg: DictConfig) -> Any:
    try:
        resolve_all(cfg)
        config.validate(cfg)
        check_paths(cfg)
        from framework.trainer import Trainer  # imported after validation: a bad config fails fast

        return Trainer(cfg, Path(HydraConfig.get().runtime.output_dir)).fit()
    except UserError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("Error: %s", err)
        sys.exit(1)
