"""The house rules of framework/, checked on its source: sizes a reader can hold (no class over 300 lines, no function
over 60), no private API of a dependency outside framework/core/compat.py, and no line that replaces another package's
function, method or class attribute at run time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

FRAMEWORK = Path(__file__).resolve().parent.parent / "framework"
SOURCES = sorted(FRAMEWORK.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_source_tree_is_found() -> None:
    assert len(SOURCES) > 40, SOURCES  # a wrong path would make every check below pass on nothing


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(FRAMEWORK)))
def test_no_class_over_300_lines_and_no_function_over_60(path: Path) -> None:
    too_long = []
    for node in ast.walk(_tree(path)):
        limit = 300 if isinstance(node, ast.ClassDef) else 60
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if lines > limit:
                too_long.append(f"{node.name}: {lines} lines (limit {limit})")
    assert not too_long, too_long


PRIVATE = re.compile(r"_internal|omegaconf\._|gc\.freeze")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(FRAMEWORK)))
def test_no_private_api_of_hydra_or_omegaconf_outside_the_compat_module(path: Path) -> None:
    if path.name == "compat.py":
        return
    found = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert not found, found


def _imported_names(tree: ast.Module) -> set[str]:
    """Names bound by imports of other packages (`import torch`, `from hydra import x`): what must not be assigned
    into."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("framework")}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("framework"):
            if node.level == 0:
                names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(FRAMEWORK)))
def test_no_line_replaces_an_attribute_of_another_package(path: Path) -> None:
    """`torch.backends.cudnn.benchmark = True` is a documented setting, and `sys.argv` the arguments Hydra's main
    reads, not patches: they are allowed by name."""
    settings = {"torch.backends.cudnn.benchmark", "torch.backends.cudnn.deterministic", "sys.argv"}
    tree = _tree(path)
    imported = _imported_names(tree)
    patches = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            first = node.args[0] if node.args else None
            if first is not None and _root(first) in imported:
                patches.append(f"{node.lineno}: setattr({ast.unparse(first)}, ...)")
        for target in targets:
            if isinstance(target, ast.Attribute) and _root(target) in imported and ast.unparse(target) not in settings:
                patches.append(f"{node.lineno}: {ast.unparse(target)} = ...")
    assert not patches, patches


def test_the_patch_check_finds_a_patch() -> None:
    """The check above is not vacuous: the same walk flags a real patch."""
    tree = ast.parse("import hydra\nfrom omegaconf import OmegaConf\nOmegaConf.load = print\nhydra.main = None\n")
    imported = _imported_names(tree)
    flagged = [
        ast.unparse(t)
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and _root(t) in imported
    ]
    assert flagged == ["OmegaConf.load", "hydra.main"]


ROOT = FRAMEWORK.parent


@pytest.mark.parametrize(("name", "limit", "unit"), [("ARCHITECTURE.md", 1200, "words"), ("README.md", 250, "lines")])
def test_the_architecture_and_the_readme_stay_short(name: str, limit: int, unit: str) -> None:
    """ARCHITECTURE.md is a diagram and one short section per part (at most 1,200 words, as `wc -w` counts them);
    the README is a first page, not a manual (at most 250 lines). A new part tightens the text, not lengthens it."""
    text = (ROOT / name).read_text()
    size = len(text.split()) if unit == "words" else len(text.splitlines())
    assert size > limit // 10, f"{name}: {size} {unit}: the wrong file?"  # a wrong path would pass on nothing
    assert size <= limit, f"{name}: {size} {unit}, over the limit of {limit}"


def test_the_readmes_task_is_the_file_its_experiment_trains() -> None:
    """The README's Python is experiments/readme_task.py, which `experiment=readme` trains (the resume matrix runs
    it): an edit to one that is not made to the other fails here, so the page a newcomer copies is the tested code."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "README.md has no ```python block"
    assert blocks[0] == (ROOT / "experiments" / "readme_task.py").read_text()
    assert "experiments.readme_task.DigitsTask" in (ROOT / "conf" / "experiment" / "readme.yaml").read_text()
