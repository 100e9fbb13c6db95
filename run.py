"""Entry point: Hydra composes conf/ and hands the config to the framework."""
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import framework.app
import framework.cli
import framework.config
import framework.launch
import framework.resume

framework.config.register()  # the structured-config schemas conf/ is composed against


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> object:
    return framework.app.main(cfg)


if __name__ == "__main__":
    sys.argv += framework.launch.rank_zero_only_overrides()  # under torchrun: one run directory, from rank 0
    sys.argv = framework.resume.argv_with_saved_choices(sys.argv, Path(__file__).parent / "conf")  # resume=...
    framework.cli.run(main)  # Hydra's compose-time errors (bad override, YAML) as one line
