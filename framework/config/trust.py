"""A saved config is data, not code: it may only build `_target_`s that the user's own code names (the config trees
the run is composed from, the framework's included; this command line; the framework's package and the project's,
i.e. the packages under the current directory), unless `trust_saved_config=true`. Checked before anything is built.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import logging
from pathlib import Path
from typing import Any, Iterator

import yaml
from omegaconf import DictConfig, OmegaConf

from framework.core.errors import ConfigError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- trust
def targets(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(config key, dotted path) of everything a config would import: `_target_`s and param-group `modules`."""
    if isinstance(node, dict):
        for name, value in node.items():
            child = f"{key}.{name}" if key else str(name)
            if name == "_target_" and value is not None:
                yield child, value
            elif name == "modules" and ".param_groups[" in key and isinstance(value, list):
                yield from ((f"{child}[{i}]", v) for i, v in enumerate(value))
            else:
                yield from targets(value, child)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from targets(value, f"{key}[{i}]")


# libyaml's safe loader where PyYAML has it (its wheels do): the same YAML subset as yaml.safe_load, about six times
# faster on the config trees, which every resume reads whole.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def conf_targets(conf_dirs: list[Path]) -> set[str]:
    """Every dotted path the config trees in `conf_dirs` name (the user's own configs)."""
    found: set[str] = set()
    for folder in conf_dirs:
        for path in folder.rglob("*.yaml"):
            try:
                found.update(str(t) for _, t in targets(yaml.load(path.read_text(), Loader=_SAFE_LOADER)))
            except (yaml.YAMLError, OSError, UnicodeDecodeError):
                continue
    return found


def _in_project(top: str, project: Path) -> bool:
    """Is the top-level package `top` one of the project's own (under `project`, not an installed library)? Found,
    not imported."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    for place in places:
        resolved = Path(place).resolve()
        if "site-packages" in resolved.parts or "dist-packages" in resolved.parts:
            return False
        if resolved.is_relative_to(project.resolve()):
            return True
    return False


def _is_project_code(target: str, project: Path) -> bool:
    """A dotted path to something defined in the framework's package (wherever it is installed) or in a package
    of the user's project (under `project`, the current directory). The package is found without importing
    anything else; only then is the object located (importing the project's own modules), and it must be defined
    there: `framework.app.resume.os.system` reaches `os.system` through a framework module and is refused."""
    top = target.split(".", 1)[0]
    if top != __name__.split(".", 1)[0] and not _in_project(top, project):
        return False
    from framework.config.instantiate import locate

    try:
        obj = locate(target, "_target_")
    except ConfigError:
        return False
    return str(getattr(obj, "__module__", None) or "").split(".", 1)[0] == top


def check_saved_targets(cfg: DictConfig, trusted: set[str], project: Path, source: str) -> None:
    """Refuse, before anything is built, a `_target_` that came from a saved config and that the user's own
    code does not name (`trusted`: the config trees and this command line; plus the framework's and `project`'s
    packages)."""
    container = OmegaConf.to_container(cfg, resolve=False)
    for key, target in targets(container):
        if isinstance(target, str) and (target in trusted or _is_project_code(target, project)):
            continue
        raise ConfigError(
            f"{key}={target!r}: {source} names a target that neither the config trees, this "
            "command line, the framework nor this project's own packages name, so it is not built "
            "(a saved config is data, not code); expected a target of your own, or "
            "trust_saved_config=true for a run you trust"
        )
