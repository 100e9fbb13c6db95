"""The package map of framework/ (ARCHITECTURE.md), checked on the source: at most 15 top-level entries; each package
imports only the packages below it (`BELOW`), at run time and under TYPE_CHECKING alike; no import cycle between
modules at run time; no framework class inherits another framework class to share state; and no module assigns
into another object's attribute chain (`x.part.attr = ...`, `self.part.attr = ...`) or mutates a container it reaches
that way, but for the documented exceptions in `ALLOWED_WRITES`."""

from __future__ import annotations

import ast
import collections
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.unit

FRAMEWORK = Path(__file__).resolve().parent.parent / "framework"
SOURCES = sorted(FRAMEWORK.rglob("*.py"))

# Each package, and the packages it may import (the layers below it); `framework` is the package's own __init__
# (its version). Bottom to top.
BELOW: dict[str, set[str]] = {
    "core": set(),
    "config": {"core"},
    "task": {"core", "config"},
    "callbacks": {"core", "config", "task"},
    "data": {"core", "config"},
    "optim": {"core", "config"},
    "checkpoint": {"core", "config", "task"},
    "parallel": {"core", "config", "checkpoint"},
    "observe": {"core", "config", "task", "checkpoint", "optim"},
    "loop": {"core", "config", "task", "callbacks", "data", "optim", "checkpoint", "parallel", "observe", "framework"},
    "zoo": {"core", "config", "task", "data"},
}
BELOW["stages"] = {*BELOW["loop"], "loop", "zoo"}
BELOW["app"] = {*BELOW["stages"], "stages"}

# Writes into another object's attribute chain that are the documented way to do what they do.
ALLOWED_WRITES = {
    # config nodes, changed under open_dict where the app or a stage settles the config
    ("stages/evaluate.py", "cfg.checkpoint.monitor"),
    ("stages/evaluate.py", "cfg.checkpoint.save_top_k"),
    ("stages/evaluate.py", "cfg.checkpoint.save_last"),
    ("stages/evaluate.py", "cfg.checkpoint.every_n_steps"),
    ("stages/evaluate.py", "cfg.checkpoint.every_n_epochs"),
    ("stages/evaluate.py", "cfg.trainer.test_ckpt"),
    ("app/sweep_launchers.py", "config.hydra.job.num"),
    ("app/sweep_launchers.py", "config.hydra.job.id"),
    # torch's documented switches
    ("core/reproducibility.py", "torch.backends.cudnn.deterministic"),
    ("core/reproducibility.py", "torch.backends.cudnn.benchmark"),
    # Lightning's documented `LightningModule.trainer`: what the task's self.trainer is during a run
    ("loop/run.py", "parts.task.trainer"),
    # the torch LR scheduler a Scheduler wraps, rebased on resume: `base_lrs`, torch's documented base of a schedule
    ("optim/schedulers.py", "self.scheduler.base_lrs"),
}


def _module(path: Path) -> str:
    parts = path.relative_to(FRAMEWORK.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """The top-level package a dotted framework name is in; `framework` for the root's own modules and names."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (FRAMEWORK / parts[1] / "__init__.py").is_file() else "framework"


def _imports(path: Path) -> Iterator[tuple[int, str, bool, bool]]:
    """(line, imported framework module or name, under TYPE_CHECKING, from-import) for every import in the file."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(child) for child in ast.walk(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "framework":
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}", id(node) in typing_only, True
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "framework":
                    yield node.lineno, alias.name, id(node) in typing_only, False


def test_the_top_level_holds_at_most_15_entries_each_package_saying_its_job() -> None:
    entries = [p for p in FRAMEWORK.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
    assert len(entries) <= 15, sorted(p.name for p in entries)
    for package in (p for p in entries if p.is_dir()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"{package.name}/__init__.py states no job"
    assert {p.name for p in entries if p.is_dir()} == set(BELOW), "the package map names every package"


def test_every_package_imports_only_the_packages_below_it() -> None:
    upward = []
    for path in SOURCES:
        importer = _package(_module(path))
        if importer == "framework":  # the root's own: the version, and __main__ (the command line's entry)
            continue
        for line, imported, typing_only, _ in _imports(path):
            target = _package(imported)
            if target not in (importer, "framework") and target not in BELOW.get(importer, set()):
                where = " (under TYPE_CHECKING)" if typing_only else ""
                upward.append(f"{path.relative_to(FRAMEWORK)}:{line} imports {imported}{where}")
    assert not upward, "\n".join(upward)


def test_no_import_cycle_between_modules_at_run_time() -> None:
    modules = {_module(p): p for p in SOURCES}
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        for _, imported, typing_only, from_import in _imports(path):
            if typing_only:
                continue
            # `from framework.a import b`: module a.b if it is one, and a (its __init__ runs); `import a.b`: a.b
            for candidate in (imported, imported.rsplit(".", 1)[0]) if from_import else (imported,):
                if candidate in modules and candidate != name:
                    graph[name].add(candidate)
    cycles = _cycles(graph, list(modules))
    assert not cycles, cycles


def _cycles(graph: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}, ["a", "b", "c"]) == [["a", "b"]]


# The classes users subclass by design (their own task and callbacks extend these), and exception hierarchies.
EXTENSION_POINTS = {"Task", "Callback"}


def _classes() -> dict[str, bool]:
    """Every framework class by name, and whether it holds state (assigns `self.<attr>` in a method)."""
    found = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assigns = [t for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                           for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
                found[node.name] = any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                       and t.value.id == "self" for t in assigns)
    return found


def test_no_framework_class_inherits_another_framework_class_to_share_state() -> None:
    """A class may extend a framework class that holds no state (an interface with defaults: Strategy, Profiler), or
    one users extend by design (Task, Callback); never one whose state it would share (as Trainer(Run) did)."""
    classes = _classes()
    sharing = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                if not isinstance(base, ast.Name):  # torchvision.datasets.CIFAR10, nn.Module: not ours
                    continue
                name = base.id
                if classes.get(name) and name not in EXTENSION_POINTS and not name.endswith("Error"):
                    sharing.append(f"{path.relative_to(FRAMEWORK)}: {node.name}({name})")
    assert not sharing, sharing


MUTATORS = {"append", "extend", "clear", "update", "pop", "insert", "remove", "add", "discard", "setdefault"}


def _chain(node: ast.AST) -> tuple[str, list[str]]:
    """`a.b.c` as ("a", ["b", "c"]); a subscript's value is followed (`a.b[k]` is `a.b`)."""
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else "?"), list(reversed(attrs))


def writes_into_other_objects(path: Path) -> list[str]:
    """Every `x.part.attr = ...` (an assignment, augmented or not, into an attribute chain two deep or more, through
    any name, `self` included; `x.part.items[k] = ...` too) and every mutating call on such a chain
    (`self.part.items.append(...)`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)):
                name, attrs = _chain(target)
                if len(attrs) >= 2:
                    found.append(".".join([name, *attrs]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            name, attrs = _chain(node.func.value)
            if len(attrs) >= 2:
                found.append(".".join([name, *attrs]) + f".{node.func.attr}()")
    return found


def test_no_module_writes_into_another_objects_attributes_but_the_documented_exceptions() -> None:
    writes = {(str(p.relative_to(FRAMEWORK)), w) for p in SOURCES for w in writes_into_other_objects(p)}
    assert writes <= ALLOWED_WRITES, sorted(writes - ALLOWED_WRITES)
    assert len(ALLOWED_WRITES) == 12  # the closing note gives this figure: an addition is a decision, not a drift


def test_the_write_check_finds_a_write(tmp_path: Path) -> None:
    source = tmp_path / "reach.py"
    source.write_text("def f(run):\n    run.logger.batch_n = 3\n    run.window.losses.append(1)\n    run.a = 1\n")
    assert writes_into_other_objects(source) == ["run.logger.batch_n", "run.window.losses.append()"]
