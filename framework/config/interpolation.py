"""The config's `${...}` as data: every node (`nodes`), the keys a node refers to (`references`), the nodes written as
references to other keys (`interpolations`, which a checkpoint keeps), and what a split is made from (`sources`)."""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, Iterable, Iterator, Optional, cast

from omegaconf import Container, DictConfig, ListConfig, OmegaConf

# ---------------------------------------------------------------------------------------------- interpolations
# A checkpoint saves the config resolved (what the run used) and, beside it, the nodes that were written as references
# to other keys (`data.train.shards: ${data.train_shards}`), so that a resume setting such a key re-derives the nodes
# made from it (framework/app/resume.py). Only plain references are kept: what a resolver gave (`${now:...}`,
# `${oc.env:...}`, `${hydra:...}`) stays what it was when the run started, and a `_target_` (code) is never derived.
_REFERENCE = re.compile(r"\$\{(\.*[\w-]+(?:\.[\w-]+|\[\d+\])*)\}")


def nodes(container: Container, key: str = "") -> Iterator[tuple[str, Container, Any]]:
    """Every node under `container` as (full key, parent, name in parent), without resolving anything."""
    names: Iterable[Any] = (
        range(len(container)) if isinstance(container, ListConfig) else cast(DictConfig, container).keys()
    )
    for name in names:
        full_key = f"{key}[{name}]" if isinstance(container, ListConfig) else f"{key}.{name}" if key else str(name)
        yield full_key, container, name
        if not (OmegaConf.is_missing(container, name) or OmegaConf.is_interpolation(container, name)):
            child = container[name]  # neither missing nor an interpolation: reading it resolves nothing
            if isinstance(child, Container):
                yield from nodes(child, full_key)


def _parent(key: str) -> str:
    return key[: key.rindex("[")] if key.endswith("]") else key.rpartition(".")[0]


def references(written: str, key: str) -> Optional[list[str]]:
    """The full keys that a value written as `written` at `key` refers to, when it does nothing but refer to other
    keys (`${data.root}`, `${data.root}/train`, `${..lr}`); None when it calls a resolver, escapes `\\${` or refers
    to nothing."""
    if "\\${" in written:
        return None
    found = _REFERENCE.findall(written)
    if not found or "${" in _REFERENCE.sub("", written):
        return None
    keys = []
    for ref in found:
        dots = len(ref) - len(ref.lstrip("."))
        base = key
        for _ in range(dots):  # `${.x}` is a sibling of the node, each further dot one level up
            base = _parent(base)
        keys.append(f"{base}.{ref[dots:]}" if dots and base else ref[dots:])
    return keys


def _written(parent: Container, name: Any) -> Any:
    """A node as written: `${...}` unresolved."""
    return cast(Any, OmegaConf.to_container(parent, resolve=False))[name]


def interpolations(cfg: Container) -> dict[str, str]:
    """Every node of `cfg` written as plain references to other keys (see `references`), by full key, as written."""
    written = cast(Any, OmegaConf.to_container(cfg, resolve=False))  # once: `${...}` stay text
    return {
        key: text
        for key, name, text in _plain_nodes(written)
        if name != "_target_" and isinstance(text, str) and "${" in text and references(text, key) is not None
    }


def _plain_nodes(node: Any, key: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(full key, name in parent, value) for every node under a plain dict or list, keyed as `nodes` keys them."""
    items = enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else ()
    for name, value in items:
        full_key = f"{key}[{name}]" if isinstance(node, list) else f"{key}.{name}" if key else str(name)
        yield full_key, name, value
        yield from _plain_nodes(value, full_key)


def resolve_calls(cfg: DictConfig) -> None:
    """Resolve in place every interpolation that calls a resolver, keeping plain references to other keys: the
    config a spawned worker gets, which has no HydraConfig for `${hydra:...}` (and must not read `${now:...}`
    again), and whose checkpoints record the references as a run in this process does."""
    for key, parent, name in list(nodes(cfg)):
        if OmegaConf.is_interpolation(parent, name):
            written = _written(parent, name)
            if not (isinstance(written, str) and references(written, key) is not None):
                value = parent[name]
                parent[name] = OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf of a plain dict (lists are leaves)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def sources(cfg: DictConfig, key: str) -> dict[str, Any]:
    """What the node at `key` is made from, resolved, by full key: its leaves and those of every key its references
    reach, at any depth (`data.train_shards` for `data.train`, whose `shards` is `${data.train_shards}`)."""
    written = interpolations(cfg)
    reached = [key]
    for at in reached:  # grows as references are found
        for node_key, text in written.items():
            if node_key == at or node_key.startswith((f"{at}.", f"{at}[")):
                reached += [ref for ref in references(text, node_key) or () if ref not in reached]
    found: dict[str, Any] = {}
    for at in reached:
        value = OmegaConf.select(cfg, at)
        if isinstance(value, Container):
            found.update(leaves(OmegaConf.to_container(value, resolve=True, enum_to_str=True), at))
        else:
            found[at] = value.name if isinstance(value, Enum) else value
    return found
