"""A Hydra-driven, Lightning-style experiment framework for PyTorch."""

# The one version number: pyproject.toml reads it from here; `htf --version` and every summary.json report it.
__version__ = "0.1.0"
