"""The package's layers: no import cycles, and lower layers never import higher ones.

Read from the source with ``ast``, so every import counts, at module level or inside a
function. Imports under ``if TYPE_CHECKING:`` count for cycles (a type checker follows
them, and a cycle there is a design knot all the same), not for layers: the package root's
lazy export table imports every public name for type checkers only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "stageload"

#: Each layer may import only from the layers before it (and itself). Observation and
#: process control sit above the core; adapters, entry points and test support on top.
LAYERS: list[tuple[str, ...]] = [
    ("stageload", "stageload.units", "stageload.errors", "stageload.external"),
    ("stageload.core.events", "stageload.core.rng"),
    ("stageload.hooks", "stageload.memory"),
    ("stageload.load",),
    ("stageload.core",),
    ("stageload.meter", "stageload.report"),
    ("stageload.guard",),
    (
        "stageload.diffusers",
        "stageload.pixal3d",
        "stageload.ray",
        "stageload.demo",
        "stageload.autostage",
    ),
    ("stageload.cli", "stageload.pixal3d.cli", "stageload.testing", "stageload.__main__"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(path: Path, known: set[str], *, type_checking: bool = False) -> set[str]:
    """The stageload modules ``path`` imports (a ``from X import name`` of a submodule
    counts as importing that submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("stageload"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("stageload"):
                continue
            submodules = {f"{target}.{a.name}" for a in node.names} & known
            found.update(submodules)
            if len(submodules) < len(node.names):  # a name defined in ``target`` itself
                found.add(target)
    found.discard(name)
    return {m for m in found if m in known}


def graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, known, type_checking=type_checking) for p in paths}


def layer_of(module: str) -> int:
    best, index = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    if index < 0:
        raise AssertionError(f"{module} belongs to no layer in LAYERS; add it")
    return index


def test_no_import_cycles() -> None:
    edges = graph(type_checking=True)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "source",
    [
        "from . import staged\n",  # a sibling submodule
        "from .staged import StagedModels\n",
    ],
)
def test_the_reader_sees_a_cycle(tmp_path: Path, source: str) -> None:
    """Control: two modules that import each other make a cycle the reader finds."""
    package = tmp_path / "stageload" / "core"
    package.mkdir(parents=True)
    (tmp_path / "stageload" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "staged.py").write_text("from .batch import Batch\n")
    (package / "batch.py").write_text(source)
    known = {"stageload", "stageload.core", "stageload.core.staged", "stageload.core.batch"}
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        assert "stageload.core.batch" in imports_of(package / "staged.py", known)
        assert "stageload.core.staged" in imports_of(package / "batch.py", known)
    finally:
        SRC = saved


def test_the_reader_sees_a_cycle_through_a_type_checking_import(tmp_path: Path) -> None:
    """Control: an import under ``if TYPE_CHECKING:`` counts for cycles, not for layers."""
    package = tmp_path / "stageload" / "core"
    package.mkdir(parents=True)
    (tmp_path / "stageload" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .staged import S\n"
    (package / "batch.py").write_text(source)
    known = {"stageload", "stageload.core", "stageload.core.staged", "stageload.core.batch"}
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        batch = package / "batch.py"
        assert "stageload.core.staged" in imports_of(batch, known, type_checking=True)
        assert "stageload.core.staged" not in imports_of(batch, known)
    finally:
        SRC = saved


# -- the tests mirror the source ----------------------------------------------------------

TESTS = Path(__file__).resolve().parents[1]
#: Folders of tests/ that are no part of the source: the package as a whole, shared fixtures.
NOT_SOURCE = {"package", "fixtures", "__pycache__"}


def misplaced_tests(tests: Path, package: Path) -> list[str]:
    """Test modules outside a folder that mirrors a source package, and folders that mirror
    none."""
    parts = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    wrong = [str(p.relative_to(tests)) for p in tests.glob("test_*.py")]
    for folder in sorted(p for p in tests.iterdir() if p.is_dir()):
        if folder.name not in NOT_SOURCE | parts:
            wrong.append(f"{folder.name}/ (no src/stageload/{folder.name}/)")
    return wrong


def test_the_tests_mirror_the_source() -> None:
    assert misplaced_tests(TESTS, PACKAGE) == []


def test_control_a_flat_test_and_a_stray_folder_are_found(tmp_path: Path) -> None:
    (tmp_path / "src" / "core").mkdir(parents=True)
    (tmp_path / "src" / "core" / "__init__.py").write_text("")
    tests = tmp_path / "tests"
    (tests / "core").mkdir(parents=True)
    (tests / "trace").mkdir()
    (tests / "test_flat.py").write_text("")
    assert misplaced_tests(tests, tmp_path / "src") == [
        "test_flat.py",
        "trace/ (no src/stageload/trace/)",
    ]
