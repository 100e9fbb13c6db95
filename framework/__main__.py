"""`python -m framework`: the `htf` command (framework/cli.py), where its script is not on PATH."""

from framework.cli import main

if __name__ == "__main__":
    main()
