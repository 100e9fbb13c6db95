"""Entry point: Hydra composes conf/ and hands the config to the framework."""
import hydra
from omegaconf import DictConfig

import framework.app


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> object:
    return framework.app.main(cfg)


if __name__ == "__main__":
    main()
