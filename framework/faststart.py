"""Costs of composing a config that buy nothing, removed in the process that runs `framework.cli.main`.

- **YAML is parsed by libyaml.** OmegaConf reads every config file with PyYAML's pure-Python parser (~1.5 ms
  per file; a composition reads 30 or more). `install()` gives OmegaConf a loader that scans and parses with
  libyaml (`yaml.CSafeLoader`, about 5x faster) and builds the values with OmegaConf's own rules: its float
  and timestamp resolvers, its `pathlib` constructors, its refusal of a duplicate key (all taken from
  `omegaconf._utils.get_yaml_loader`, not copied). A document libyaml rejects is parsed again by OmegaConf's
  own loader, so a broken file fails with PyYAML's message and mark, and one that only PyYAML accepts still
  loads as it did. Without libyaml (PyYAML built without it) nothing changes.
- **YAML is written by libyaml**, with OmegaConf's own representers (`OmegaConf.to_yaml`: the run directory's
  `.hydra/*.yaml` and the config shown in TensorBoard; ~4 ms a dump, a third of that with libyaml), when every
  string in the document is printable ASCII (newlines and tabs allowed). libyaml writes some other strings
  unlike PyYAML (and U+0085 wrongly), so a document with one is written by OmegaConf's own dumper.
- **Hydra's ConfigStore is not deep-copied per composition.** `CachingConfigRepository` deep-copies the config
  repository it wraps, and with it the process-wide ConfigStore singleton that every source holds: every
  structured config the framework, Hydra and its installed plugins registered (~10 ms). The copy is only
  read. Deep-copying the singleton now returns it, as a singleton's copy should; pickling it (a launcher
  shipping Hydra's state to a job) still carries its contents.
- **A structured config stored as a class is built when first loaded.** ConfigStore builds each stored config
  (`OmegaConf.structured`) when it is stored: scanning Hydra's plugins builds the joblib, submitit and optuna
  configs of the `sweeps` extra (~10 ms) that a run without them never loads. A dataclass stored as a class is
  now built on its first load, once; an instance or a dict is still built at once, as its owner may change it.
- **OmegaConf copies a node's metadata field by field.** Hydra deep-copies configs as it composes them, then
  three times more as a job starts (~6 ms each for the framework's ~280 nodes), and half of it is Python's
  generic `deepcopy` taking each node's small `Metadata` dataclass apart and together again. Its fields are
  types, booleans, a key, a dict of flags and a resolver cache: the flags are copied as the dict of booleans
  they are, the key and the cache with `deepcopy` (only where not a plain value or not empty), the rest is
  shared as the immutable values it is. Only for the fields OmegaConf 2.3 has; any other version keeps its own.
- **Hydra builds its map of known choices only for a defaults list that interpolates one.** For every config in
  the defaults tree, Hydra 1.3 builds an OmegaConf map of the choices made so far, which only a default like
  `- server: ${db}_server` reads (~20 ms for the framework's 30-odd configs). It is now built only for a
  defaults list with such an entry, which is the only case Hydra's own code reads it in.

Each shortcut is checked in tests/test_faststart.py, with and without the shortcuts: composing every option of
every group (and a user's tree with interpolated defaults) gives the same YAML, to the byte; broken and hostile
files fail with the same error; awkward strings are written the same.
"""
from __future__ import annotations

import copy
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
    _classes_built_on_first_load(ConfigStore)
    _metadata_copied_by_field()
    _known_choices_on_demand()
    if getattr(yaml, "__with_libyaml__", False):
        import omegaconf._utils
        import omegaconf.basecontainer
        import omegaconf.omegaconf

        loader = _libyaml_loader(omegaconf._utils.get_yaml_loader)
        # omegaconf.omegaconf imports get_yaml_loader from _utils when it loads; basecontainer at import time.
        omegaconf._utils.get_yaml_loader = omegaconf.basecontainer.get_yaml_loader = lambda: loader
        dumper = _libyaml_dumper(omegaconf._utils.get_omega_conf_dumper())
        omegaconf.omegaconf.get_omega_conf_dumper = lambda: dumper  # OmegaConf.to_yaml's, imported at import time


def _classes_built_on_first_load(store_type: type) -> None:
    from omegaconf import OmegaConf

    build_now, find = store_type.store, store_type._load

    def store(self: Any, name: str, node: Any, group: Any = None, package: Any = None, provider: Any = None) -> None:
        if not isinstance(node, type):
            build_now(self, name, node, group, package, provider)
            return
        build_now(self, name, {}, group, package, provider)  # the entry where and as Hydra files it ...
        entry = self._open(group or "")
        entry[name if name.endswith(".yaml") else f"{name}.yaml"].node = node  # ... holding the class for now

    def load_entry(self: Any, config_path: str) -> Any:
        entry = find(self, config_path)
        if isinstance(entry.node, type):
            entry.node = OmegaConf.structured(entry.node)  # once: the stored entry keeps the built config
        return entry

    store_type.store, store_type._load = store, load_entry


_METADATA_FIELDS = {"ref_type", "object_type", "optional", "key", "flags", "flags_root", "resolver_cache"}
_PLAIN_KEYS = (str, int, float, bool, type(None))


def _metadata_copied_by_field() -> None:
    import dataclasses
    from collections import defaultdict

    from omegaconf.base import ContainerMetadata, Metadata

    container_fields = _METADATA_FIELDS | {"key_type", "element_type"}
    if ({f.name for f in dataclasses.fields(Metadata)} != _METADATA_FIELDS
            or {f.name for f in dataclasses.fields(ContainerMetadata)} != container_fields):
        return  # another OmegaConf's metadata: its own deepcopy

    def deepcopy_metadata(self: Metadata, memo: dict[int, Any]) -> Metadata:
        new = object.__new__(type(self))
        memo[id(self)] = new
        fields = new.__dict__
        fields.update(self.__dict__)  # types, booleans: immutable, shared as deepcopy shares them
        if not isinstance(self.key, _PLAIN_KEYS):
            fields["key"] = copy.deepcopy(self.key, memo)
        if self.flags is not None:
            fields["flags"] = dict(self.flags)  # flag name -> True/False/None
        fields["resolver_cache"] = (copy.deepcopy(self.resolver_cache, memo) if self.resolver_cache
                                    else defaultdict(dict))
        return new

    Metadata.__deepcopy__ = deepcopy_metadata  # type: ignore[attr-defined]  (ContainerMetadata inherits it)


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


def _libyaml_dumper(reference: type) -> type:
    """OmegaConf's dumper (its quoting of strings that read as other types) with libyaml's serializer and
    emitter, what `yaml.CDumper` is to `yaml.Dumper`, for a document whose strings are printable ASCII (newlines
    and tabs allowed); any other goes to OmegaConf's own dumper. libyaml writes some strings differently from
    PyYAML (`\\r`, U+0085 with stray spaces, characters beyond the BMP unescaped)."""

    class Dumper(yaml.cyaml.CEmitter, reference):  # type: ignore[misc,valid-type,name-defined]
        def __init__(self, stream: Any, default_style: Any = None, default_flow_style: Any = False,
                     canonical: Any = None, indent: Any = None, width: Any = None, allow_unicode: Any = None,
                     line_break: Any = None, encoding: Any = None, explicit_start: Any = None,
                     explicit_end: Any = None, version: Any = None, tags: Any = None, sort_keys: bool = True) -> None:
            self._settings = dict(default_style=default_style, default_flow_style=default_flow_style,
                                  canonical=canonical, indent=indent, width=width, allow_unicode=allow_unicode,
                                  line_break=line_break, encoding=encoding, explicit_start=explicit_start,
                                  explicit_end=explicit_end, version=version, tags=tags, sort_keys=sort_keys)
            self._stream, self._pure_python, self._opened = stream, None, False
            yaml.cyaml.CEmitter.__init__(self, stream, canonical=canonical, indent=indent, width=width,
                                         encoding=encoding, allow_unicode=allow_unicode, line_break=line_break,
                                         explicit_start=explicit_start, explicit_end=explicit_end, version=version,
                                         tags=tags)
            yaml.representer.Representer.__init__(self, default_style=default_style,
                                                  default_flow_style=default_flow_style, sort_keys=sort_keys)
            yaml.resolver.Resolver.__init__(self)

        def open(self) -> None:  # deferred: the first document decides who writes the stream
            pass

        def represent(self, data: Any) -> None:
            if self._pure_python is None and not self._opened and not _plain(data):
                self._pure_python = reference(self._stream, **self._settings)
                self._pure_python.open()
            if self._pure_python is not None:
                self._pure_python.represent(data)
                return
            if not self._opened:
                yaml.cyaml.CEmitter.open(self)
                self._opened = True
            super().represent(data)

        def close(self) -> None:
            if self._pure_python is not None:
                self._pure_python.close()
            elif self._opened:
                yaml.cyaml.CEmitter.close(self)

        def dispose(self) -> None:
            if self._pure_python is not None:
                self._pure_python.dispose()
            yaml.cyaml.CEmitter.dispose(self)

    return Dumper


_PLAIN = frozenset(map(chr, range(0x20, 0x7F))) | {"\n", "\t"}


def _plain(data: Any) -> bool:
    """Every string in `data` (keys included) is printable ASCII, newlines and tabs allowed."""
    if isinstance(data, str):
        return data.isascii() and _PLAIN.issuperset(data)
    if isinstance(data, dict):
        return all(_plain(k) and _plain(v) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        return all(_plain(v) for v in data)
    return True
