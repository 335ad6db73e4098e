"""`import stageload` and the CLI stay lean: no torch, matplotlib or diffusers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "matplotlib", "diffusers", "transformers", "numpy")


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
        "import stageload.memory, stageload.units, stageload.events",
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
