"""`python -m framework`: the `htf` command (framework/app/cli.py), where its script is not on PATH."""

from framework.app.cli import main

if __name__ == "__main__":
    main()
