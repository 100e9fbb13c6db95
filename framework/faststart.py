"""Costs of composing a config that buy nothing, removed in the process that runs `framework.cli.main`.

- **YAML is parsed by libyaml.** OmegaConf reads every config file with PyYAML's pure-Python parser (~1.5 ms
  per file; a composition reads 30 or more). `install()` gives OmegaConf a loader that scans and parses with
  libyaml (`yaml.CSafeLoader`, about 5x faster) and builds the values with OmegaConf's own rules: its float
  and timestamp resolvers, its `pathlib` constructors, its refusal of a duplicate key (all taken from
  `omegaconf._utils.get_yaml_loader`, not copied). A document libyaml rejects is parsed again by OmegaConf's
  own loader, so a broken file fails with PyYAML's message and mark, and one that only PyYAML accepts still
  loads as it did. Without libyaml (PyYAML built without it) nothing changes.
- **Hydra's ConfigStore is not deep-copied per composition.** `CachingConfigRepository` deep-copies the config
  repository it wraps, and with it the process-wide ConfigStore singleton that every source holds: every
  structured config the framework, Hydra and its installed plugins registered (~10 ms). The copy is only
  read. Deep-copying the singleton now returns it, as a singleton's copy should; pickling it (a launcher
  shipping Hydra's state to a job) still carries its contents.
- **Hydra builds its map of known choices only for a defaults list that interpolates one.** For every config in
  the defaults tree, Hydra 1.3 builds an OmegaConf map of the choices made so far, which only a default like
  `- server: ${db}_server` reads (~20 ms for the framework's 30-odd configs). It is now built only for a
  defaults list with such an entry, which is the only case Hydra's own code reads it in.

Each shortcut is checked in tests/test_faststart.py: composing every option of every group (and a user's tree
with interpolated defaults) gives the same config, to the byte, with and without them.
"""
from __future__ import annotations

import io
from typing import Any

import yaml

_installed = False


def install() -> None:
    """Idempotent; only the calling process is affected (nothing is written anywhere)."""
    global _installed
    if _installed:
        return
    _installed = True
    from hydra.core.config_store import ConfigStore

    ConfigStore.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]
    _known_choices_on_demand()
    if getattr(yaml, "__with_libyaml__", False):
        import omegaconf._utils
        import omegaconf.basecontainer

        loader = _libyaml_loader(omegaconf._utils.get_yaml_loader)
        # omegaconf.omegaconf imports get_yaml_loader from _utils when it loads; basecontainer at import time.
        omegaconf._utils.get_yaml_loader = omegaconf.basecontainer.get_yaml_loader = lambda: loader


def _known_choices_on_demand() -> None:
    from hydra._internal import defaults_list

    build = getattr(defaults_list, "_create_interpolation_map", None)
    if build is None:  # not Hydra 1.3's internals: nothing to shorten
        return

    def create_interpolation_map(overrides: Any, defaults: list[Any], self_added: bool) -> Any:
        # `_create_defaults_tree_impl` resolves an interpolated default of `defaults` with it, nothing else.
        if any(d.is_interpolation() for d in defaults):
            return build(overrides, defaults, self_added)
        return None

    defaults_list._create_interpolation_map = create_interpolation_map


def _libyaml_loader(pure_python: Any) -> type:
    reference = pure_python()  # OmegaConf's loader class: its resolvers, constructors and duplicate-key check

    class Loader(yaml.cyaml.CParser, reference):  # type: ignore[misc,valid-type,name-defined]
        """OmegaConf's loader with libyaml's parser in front of its (pure-Python) reader, scanner and parser:
        what `yaml.CSafeLoader` is to `yaml.SafeLoader`."""

        def __init__(self, stream: Any) -> None:
            if hasattr(stream, "read"):  # kept, to parse it again if libyaml rejects it
                text, name = stream.read(), getattr(stream, "name", "<file>")
                stream = io.BytesIO(text) if isinstance(text, bytes) else io.StringIO(text)
                stream.name = name
            self._document = stream
            yaml.cyaml.CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

        def get_single_data(self) -> Any:
            try:
                return super().get_single_data()
            except yaml.YAMLError:
                document = self._document
                if hasattr(document, "seek"):
                    document.seek(0)
                again = reference(document)
                try:
                    return again.get_single_data()  # PyYAML's error, or its value where only PyYAML accepts it
                finally:
                    again.dispose()

    return Loader
