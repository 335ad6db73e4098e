"""Huge pages (Linux, THP mode ``madvise``): a load on demand advises them for its fresh
weights, a load ahead does not, and :func:`stageload.release` takes the advice back before
the memory is freed, so malloc's reuse of it is not advised.

Read from the mapping's ``VmFlags`` in /proc/self/smaps (``hg``: advised), in a fresh
process each (tests/fixtures/huge_pages_probe.py): advice on freed memory outlives the code
that freed it, and this pytest process has loaded and freed many models before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

PROBE = Path(__file__).parents[1] / "fixtures" / "huge_pages_probe.py"


def _advice_mode() -> bool:
    try:
        return "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and _advice_mode()),
    reason="huge pages are advised only on Linux in THP mode madvise",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("huge") / "linear.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"weight": torch.randn(2048, 1024, generator=g)}, str(path))  # 8 MiB
    return path


def probe(checkpoint: Path, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(PROBE), str(checkpoint), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_load_ahead_fills_plain_pages_where_a_load_on_demand_advises_huge_ones(
    checkpoint: Path,
) -> None:
    on_demand = probe(checkpoint, "on-demand")
    ahead = probe(checkpoint, "ahead")
    assert "hg" in on_demand["loaded"]  # control: the same load, on the calling thread
    assert ahead["loaded"] is not None and "hg" not in ahead["loaded"]


def test_release_takes_the_advice_back_before_the_memory_is_freed(checkpoint: Path) -> None:
    # From malloc's heap, the freed weight stays mapped, so its flags can still be read.
    taken_back = probe(checkpoint, "on-demand", "--heap")
    kept = probe(checkpoint, "on-demand", "--heap", "--advice-kept")
    assert "hg" in taken_back["loaded"] and "hg" in kept["loaded"]
    # Control: without taking it back, the freed memory stays advised for its next use.
    assert kept["released"] is not None and "hg" in kept["released"]
    assert taken_back["released"] is not None and "hg" not in taken_back["released"]
