"""The framework's config tree. Installed as the package framework.conf (pyproject.toml maps conf/ to it), so
Hydra finds it from any directory as pkg://framework.conf; Hydra only reads a package that has this file."""
