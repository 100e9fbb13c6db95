"""Entry point in this repository: `python run.py [overrides]` is `htf [overrides]` (framework/app/cli.py). Hydra
composes conf/ (with a --config-dir of your own in front of it, if given) and hands the config to the framework."""
import framework.app.cli

if __name__ == "__main__":
    framework.app.cli.main()
