"""stageload.pixal3d reloads a released model from {path}.safetensors, equal to the port's.

Reference: the port's own ``models.from_pretrained``, in this process. Values only: parameters
and buffers are compared, no model output, so any thread count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stageload.pixal3d import Pixal3DRun, import_port

PIL = pytest.importorskip("PIL.Image")


def test_reload_reads_the_file_and_equals_the_ports_from_pretrained(stub, tmp_path):
    import numpy as np

    image = tmp_path / "object.png"
    PIL.fromarray(np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(
        image
    )
    port = import_port(stub)
    real = port.models.from_pretrained
    calls: list[str] = []

    def counted(path: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(Path(str(path)).name)
        return real(path, *args, **kwargs)

    port.models.from_pretrained = counted
    try:
        args = port.parse_args(
            [str(image), "--output", str(tmp_path / "o.glb"), "--device", "cpu", "--seed", "7"]
        )
        events: list[Any] = []
        sink = type("Sink", (), {"emit": lambda self, e: events.append(e)})()
        with Pixal3DRun(port, args, events=sink) as staged:
            staged.execute()
            decoder = staged.models["shape_slat_decoder"]
            reference = real(str(_checkpoint(stub, calls, "shape_slat_decoder")))
            got = dict(decoder.named_parameters()) | dict(decoder.named_buffers())
            want = dict(reference.named_parameters()) | dict(reference.named_buffers())
            assert got.keys() == want.keys()
            for key, ref in want.items():  # pos_freqs, computed in __init__, included
                assert got[key].dtype == ref.dtype and torch.equal(got[key], ref), key
    finally:
        port.models.from_pretrained = real
    reloads = [e.model for e in events if e.kind == "reload"]
    assert "shape_slat_decoder" in reloads
    # Loaded twice in the run (shape_512, decode), built by the port once: the reload read
    # the file into the released model.
    assert sum(1 for c in calls if c.startswith("shape_slat_decoder")) == 1, calls
    assert not [e.note for e in events if e.kind == "note" and "reloads with" in e.note]


def _checkpoint(stub: Path, calls: list[str], name: str) -> Path:
    found = sorted(stub.rglob(f"{name}.safetensors"))
    assert found, (name, calls)
    return found[0].with_suffix("")
