"""framework/faststart.py shortens composing a config: the result must be Hydra's and OmegaConf's own, to the byte.

Everything is done twice, in two fresh processes: with Hydra's and OmegaConf's own code, and with the shortcuts
installed. Composed: every option of every group in conf/ (hydra/ included), every experiment, the plugins' own
options, the overrides that reshape a defaults list, and a user's tree that interpolates its defaults; a config
that fails to compose must fail with the same error. Loaded: broken and hostile YAML files, which must fail with
PyYAML's own error, mark and message. Written: awkward strings as values, keys and list items. Deep-copied:
a composed config and structured, typed, read-only and resolver-cached nodes, node by node.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONF, ROOT

# Each script below starts so: argv[1] says which way it runs.
SHORTCUTS_OR_NOT = r"""
import sys
from framework import faststart
if sys.argv[1] == "shortcuts":
    faststart.install()
"""

COMPOSE_ALL = SHORTCUTS_OR_NOT + r"""
import json, os, sys
from pathlib import Path
from hydra import compose, initialize_config_dir
from hydra.core.plugins import Plugins
from omegaconf import OmegaConf
from framework import cli, config
import framework.app  # noqa: F401  (the resolvers conf/ uses)
config.register()
Plugins.instance().register(cli.FrameworkConfigs)
cases, out = json.loads(sys.argv[2]), {}
for name, (config_dir, overrides) in cases.items():
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        try:
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            out[name] = OmegaConf.to_yaml(cfg)
        except Exception as err:  # the same mistake must be reported the same way
            out[name] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""

LOAD_ALL = SHORTCUTS_OR_NOT + r"""
import json, sys
from omegaconf import OmegaConf
out = {}
for path in json.loads(sys.argv[2]):
    for how in ("path", "stream", "text"):
        try:
            if how == "path":
                value = OmegaConf.load(path)
            elif how == "stream":
                with open(path, encoding="utf-8") as f:
                    value = OmegaConf.load(f)
            else:
                value = OmegaConf.create(open(path, encoding="utf-8").read())
            out[f"{path} {how}"] = OmegaConf.to_yaml(value)
        except Exception as err:
            out[f"{path} {how}"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


DUMP_ALL = SHORTCUTS_OR_NOT + r"""
import json, sys
from omegaconf import OmegaConf
out = {}
for i, text in enumerate(json.loads(sys.argv[2])):
    for name, value in {"value": {"k": text}, "key": {text or "_": 1}, "list": {"k": [text, {"x": text}]},
                        "deep": {"a": {"b": {"c": [text, text + text]}}}}.items():
        try:
            out[f"{i} {name}"] = OmegaConf.to_yaml(OmegaConf.create(value))
        except Exception as err:
            out[f"{i} {name}"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


COPY_ALL = SHORTCUTS_OR_NOT + r"""
import copy, enum, json, sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf, flag_override
from framework import config
import framework.app  # noqa: F401  (the resolvers conf/ uses)
config.register()

class Color(enum.Enum):
    RED = 1
    BLUE = 2

@dataclass
class Part:
    size: Optional[int] = None
    by_color: Dict[Color, int] = field(default_factory=lambda: {Color.RED: 1})
    tags: List[str] = field(default_factory=lambda: ["a"])

OmegaConf.register_new_resolver("counted", lambda x: [x, {"n": x}], use_cache=True)

def describe(node, path="", out=None):
    out = [] if out is None else out
    m = node._metadata
    out.append(f"{path} {type(node).__name__} {m.ref_type} {m.object_type} {m.optional} {m.key!r} "
               f"{sorted(m.flags.items()) if m.flags is not None else None} {m.flags_root} "
               f"{sorted((k, sorted(v.items())) for k, v in m.resolver_cache.items())} "
               f"{getattr(m, 'key_type', '-')} {getattr(m, 'element_type', '-')} "
               f"{node._is_missing()} {node._is_none()}")
    if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
        for key in node.keys():
            describe(node._get_node(key), f"{path}.{key}", out)
    elif isinstance(node, ListConfig) and not node._is_missing() and not node._is_none():
        for i in range(len(node)):
            describe(node._get_node(i), f"{path}[{i}]", out)
    return out

out = {}
with initialize_config_dir(config_dir=sys.argv[2], version_base="1.3"):
    # Hydra's `now` (registered again as Hydra starts) would put each process's own clock in the resolver cache
    OmegaConf.register_new_resolver("now", lambda pattern: f"now {pattern}", use_cache=True, replace=True)
    cfg = compose("config", overrides=["callbacks=[default,ema]"], return_hydra_config=True)
cfg.hydra.runtime.cwd  # noqa: B018
extra = OmegaConf.create({"part": OmegaConf.structured(Part), "none": None, "missing": "???", 3: "int key",
                          "cached": "${counted:7}", "again": "${cached}"})
extra.cached  # noqa: B018  (fills the resolver cache)
OmegaConf.set_readonly(extra.part, True)
with flag_override(extra, "allow_objects", True):
    extra.obj = Color.BLUE
for name, node in {"composed": cfg, "extra": extra, "part": extra.part, "tags": extra.part.tags}.items():
    twin = copy.deepcopy(node)
    out[name] = describe(twin)
    out[name + " yaml"] = OmegaConf.to_yaml(twin)
    assert describe(twin) == describe(node), name
# the copy is its own: flags and the resolver cache
twin = copy.deepcopy(extra)
OmegaConf.set_readonly(twin.part, False)
twin._metadata.resolver_cache["counted"].clear()
twin.part.size = 3
out["independent"] = [OmegaConf.is_readonly(extra.part), bool(extra._metadata.resolver_cache["counted"]),
                      extra.part.size, extra.cached is not twin.cached]
print(json.dumps(out))
"""


def both_ways(script: str, cases: object) -> tuple[dict[str, str], dict[str, str]]:
    def run(mode: str) -> dict[str, str]:
        argument = cases if isinstance(cases, str) else json.dumps(cases)
        proc = subprocess.run([sys.executable, "-c", script, mode, argument], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    return run("hydra"), run("shortcuts")


def user_tree(root: Path) -> Path:
    """A user's tree whose defaults list interpolates two choices (Hydra's `- server: ${db}_${mode}`); its groups
    set keys the framework's schema has."""
    for group in ("db", "mode", "server"):
        (root / group).mkdir(parents=True)
    (root / "config.yaml").write_text("defaults:\n  - htf\n  - db: mysql\n  - mode: fast\n"
                                      "  - server: ${db}_${mode}\n  - _self_\n")
    for i, mode in enumerate(("fast", "safe")):
        (root / "mode" / f"{mode}.yaml").write_text(f"# @package _global_\ntrainer:\n  max_epochs: {i + 2}\n")
    for i, db in enumerate(("mysql", "sqlite")):
        (root / "db" / f"{db}.yaml").write_text(f"# @package _global_\nseed: {i + 7}\n")
        for mode in ("fast", "safe"):
            (root / "server" / f"{db}_{mode}.yaml").write_text(f"# @package _global_\nname: {db}_{mode}_server\n")
    return root


def test_every_option_composes_to_the_same_config_with_and_without_the_shortcuts(tmp_path):
    conf = str(CONF)
    options = [f"{group.relative_to(CONF).as_posix()}={path.relative_to(group).with_suffix('').as_posix()}"
               for group in sorted(p for p in CONF.rglob("*") if p.is_dir() and p.name != "__pycache__")
               for path in sorted(group.glob("*.yaml"))]
    assert any(o.startswith("experiment=") for o in options) and any(o.startswith("hydra/launcher=") for o in options)
    cases = {option: (conf, [option]) for option in options}
    cases.update({
        "defaults": (conf, []),
        "callbacks list": (conf, ["callbacks=[default,ema]"]),
        "callback removed": (conf, ["~callbacks.grad_norm", "+trainer.max_epoch=1"]),
        "added callback": (conf, ["+callbacks.mine={_target_:framework.callbacks.EMA,decay:0.9}"]),
        "unknown option": (conf, ["model=resnet81"]),
        "wrong type": (conf, ["trainer.max_epochs=many"]),
        "joblib": (conf, ["hydra/launcher=joblib"]),
        "submitit": (conf, ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=3"]),
        "submitit slurm": (conf, ["hydra/launcher=submitit_slurm"]),
        "optuna": (conf, ["hydra/sweeper=optuna", "hydra/sweeper/sampler=random"]),
        "basic sweeper": (conf, ["hydra/sweeper=basic", "hydra.sweeper.max_batch_size=2"]),
        "plugin option typo": (conf, ["hydra/launcher=submitit_locl"]),
    })
    tree = str(user_tree(tmp_path / "user"))
    cases.update({"interpolated defaults": (tree, []),
                  "interpolated defaults, overridden": (tree, ["db=sqlite", "mode=safe"]),
                  "interpolated defaults, no such option": (tree, ["db=oracle"])})
    hydra_own, shortened = both_ways(COMPOSE_ALL, cases)
    assert "name: mysql_fast_server" in hydra_own["interpolated defaults"]  # the interpolation was resolved
    assert "name: sqlite_safe_server" in hydra_own["interpolated defaults, overridden"]
    assert hydra_own["unknown option"].startswith("MissingConfigException")
    assert sum(not v.startswith(("MissingConfig", "ConfigComposition", "Validation")) for v in hydra_own.values()) \
        >= len(options)  # the options themselves compose
    for name in cases:
        assert shortened[name] == hydra_own[name], name


BROKEN = {
    "unclosed_list.yaml": "a: [1, 2\nb: 3\n",
    "nested_colon.yaml": "a: b: c\n",
    "tab.yaml": "a:\n\t- 1\n",
    "duplicate.yaml": "lr: 0.1\nlr: 0.2\n",
    "mixed.yaml": "- a\nb: 1\n",
    "quote.yaml": "a: 'x\n",
    "alias.yaml": "a: *x\n",
    "nul.yaml": "\x00a: 1",
    "indent.yaml": "a: 1\n  b: 2\n",
    "two_documents.yaml": "---\na: 1\n---\nb: 2\n",
    "directive.yaml": "%YAML 9\n---\na: 1",
    "python_object.yaml": "a: !!python/object/apply:os.system [echo hi]\n",
    "python_name.yaml": "a: !!python/name:os.system\n",
    "not_utf8.yaml": "a: \udcff\n",
    "values.yaml": "a: 1.5e3\nb: 2020-01-01\nc: !!python/object/apply:pathlib.Path [x]\nd: 1_000\ne: .inf\n"
                   "f: 0x1F\ng: yes\nh: ~\ni: 1e3\nj: '${oc.env:HOME}'\nk: {x: [1, {y: 2}]}\n",
    "anchors.yaml": "base: &b {lr: 0.1}\nother:\n  <<: *b\n  wd: 0.0\n",
    "empty.yaml": "",
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_or_hostile_yaml_file_fails_with_pyyamls_own_error(name, tmp_path):
    path = tmp_path / name
    path.write_bytes(BROKEN[name].encode("utf-8", "surrogateescape"))
    hydra_own, shortened = both_ways(LOAD_ALL, [str(path)])
    assert shortened == hydra_own
    if name.startswith("python_"):
        assert all("could not determine a constructor" in v for v in hydra_own.values())


AWKWARD = ["", " ", "a ", " a", "yes", "No", "on", "off", "null", "~", "1", "-1", "1.0", "1e3", "1_000", "0x1F", "0o7",
           ".inf", "-.inf", ".nan", "2020-01-01", "2020-01-01 12:30:00", "12:30", "${a}", "${oc.env:HOME,/x}", "a: b",
           "a #b", "#a", "- a", "[a]", "{a}", "a,b", "a\nb", "a\n", "\n", "\n\n", "\ta", "a\tb", "\u00e9t\u00e9",
           "\u65e5\u672c", "\U0001f642", "\u2028", "\u2029", "\x85", "\x7f", "\x01", "\ufeff", "'", '"', "\\", "a'b",
           'a"b', "x" * 200, "word " * 40, "long\nmulti line\n" * 5, "trailing  \n", "%a", "@a", "`a", "!a", "&a",
           "*a", "|", ">", "?", "? a", ":a", "a:", "-", "--", "---", "...", "=", "<<", "a  b", "\r\n", "a\rb"]


def test_yaml_written_with_the_shortcuts_is_pyyamls_byte_for_byte():
    hydra_own, shortened = both_ways(DUMP_ALL, AWKWARD)
    assert len(hydra_own) == 4 * len(AWKWARD)
    assert shortened == hydra_own


def test_a_deep_copy_of_a_config_is_omegaconfs_own_with_the_shortcuts():
    """Every node's metadata (types, key, flags, resolver cache) copied as Python's deepcopy copies it, the copy
    independent of the original, for a composed config and for structured, typed, read-only, cached nodes."""
    hydra_own, shortened = both_ways(COPY_ALL, str(CONF))
    assert hydra_own["independent"] == [True, True, None, True]
    assert any("Color" in line for line in hydra_own["part"])
    assert shortened == hydra_own


def test_the_shortcuts_are_installed_by_the_command_line_only():
    """Another Hydra application importing the framework (or a test) keeps Hydra's own code."""
    code = ("import framework.cli, framework.app, omegaconf._utils as u, omegaconf.omegaconf as o,"
            " hydra._internal.defaults_list as d;"
            "print(u.get_yaml_loader.__module__, o.get_omega_conf_dumper.__module__,"
            " d._create_interpolation_map.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["omegaconf._utils", "omegaconf._utils", "hydra._internal.defaults_list"], \
        proc.stderr
