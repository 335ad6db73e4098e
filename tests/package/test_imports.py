"""`import stageload` and the CLI stay lean: no torch, matplotlib, diffusers or ray."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "matplotlib", "diffusers", "transformers", "numpy", "ray", "tqdm")


def modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import stageload",
        "import stageload.cli",
        "import stageload.memory, stageload.units, stageload.core.events",
        # --help imports every subcommand module
        "import contextlib, stageload.cli\n"
        "with contextlib.suppress(SystemExit):\n    stageload.cli.main(['--help'])",
    ],
)
def test_light_imports_pull_in_nothing_heavy(code):
    loaded = modules_after(code)
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_public_names_resolve():
    import stageload

    for name in stageload.__all__:
        assert getattr(stageload, name) is not None
    assert callable(stageload.release) and callable(stageload.share)


def test_the_public_api_is_one_list_and_the_type_checking_mirror_matches_it():
    """``_EXPORTS`` is the one definition; the TYPE_CHECKING imports (for type checkers,
    which cannot run it) must name exactly the same things from the same modules."""
    import ast
    from pathlib import Path

    import stageload

    tree = ast.parse(Path(stageload.__file__).read_text())
    (block,) = [
        n
        for n in tree.body
        if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"
    ]
    mirrored = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert mirrored == stageload._EXPORTS
    assert stageload.__all__ == sorted([*stageload._EXPORTS, "__version__"])
