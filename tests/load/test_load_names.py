"""load/ and its users share public names only, and load/ never imports core/.

Streaming lives in ``load/stream.py`` on the public load plan of ``load/weights``
(``targets``, ``plan``, ``read``, ``install``); the batch it meets at is handed in
(``MeetingPoint``) by ``stageload.core.streamed``. Read from the source with ``ast``: every
import counts, at module level or inside a function, type-checking ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
LOAD = SRC / "stageload" / "load"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, source: str | None = None) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from module import name`` of a stageload module."""
    tree = ast.parse(source if source is not None else path.read_text())
    package = _module(path).rpartition(".")[0] if path.name != "__init__.py" else _module(path)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target.startswith("stageload"):
            out += [(target, a.name) for a in node.names]
    return out


def private_imports(path: Path, source: str | None = None) -> list[str]:
    """Private names (``_x``) imported from another stageload module by ``path``."""
    return [f"{m}.{n}" for m, n in imported(path, source) if n.startswith("_")]


def test_load_imports_no_private_name_and_nothing_of_core() -> None:
    problems = []
    for path in sorted(LOAD.glob("*.py")):
        problems += [f"{path.name}: {p}" for p in private_imports(path)]
        problems += [
            f"{path.name} imports {m}" for m, _ in imported(path) if m.startswith("stageload.core")
        ]
    assert problems == []


def test_no_module_imports_a_private_name_of_load() -> None:
    problems = [
        f"{path.relative_to(SRC)}: {m}.{n}"
        for path in sorted((SRC / "stageload").rglob("*.py"))
        for m, n in imported(path)
        if m.startswith("stageload.load") and n.startswith("_") and _module(path) != m
    ]
    assert problems == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from .weights import _read_all, plan", ["stageload.load.weights._read_all"]),
        ("def f():\n    from ..core.batch import current_batch", []),
    ],
)
def test_control_the_reader_sees_private_and_core_imports(source: str, found: list[str]) -> None:
    path = LOAD / "stream.py"
    assert private_imports(path, source) == found
    if not found:
        assert imported(path, source) == [("stageload.core.batch", "current_batch")]
