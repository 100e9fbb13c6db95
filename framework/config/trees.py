"""Where config trees are: the framework's own (`framework_conf_dir`: conf/ in a checkout, framework/conf in a
wheel) and any source Hydra names (`pkg://`, `file://`, a folder)."""

from __future__ import annotations

import importlib.resources
import importlib.util
import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- config trees
def package_dir(package: str) -> Optional[Path]:
    """The folder of an installed package of config files (Hydra's `pkg://PACKAGE`), or None without one."""
    try:
        folder = importlib.resources.files(package)
    except (ImportError, ValueError, TypeError):
        return None
    return folder if isinstance(folder, Path) and folder.is_dir() else None


def framework_conf_dir() -> Path:
    """The framework's own config tree: the one shipped with the `framework` package imported in this process.

    A wheel installs it inside the package (framework/conf); in a checkout it is conf/ beside framework/. Asking
    the import system for `framework.conf` instead would answer from the environment's editable install, which
    may point at another checkout (a worktree, a copy) whose tree then won over this checkout's own conf/."""
    here = Path(__file__).resolve().parents[1]  # the framework package
    wheel = here / "conf"
    return wheel if (wheel / "htf.yaml").is_file() else here.parent / "conf"


def source_dir(path: str, schema: Optional[str] = None) -> Optional[Path]:
    """The folder of a config source (`pkg://a.b`, `file://DIR` or `DIR`; or Hydra's recorded path and schema),
    or None where it is not one on disk."""
    if schema is None:
        schema, _, rest = path.partition("://")
        schema, path = (schema, rest) if rest else ("file", path)
    if schema == "pkg":
        return package_dir(path.replace("/", "."))
    folder = Path(path)
    return folder.resolve() if schema == "file" and folder.is_dir() else None
