"""A stack of residual MLP blocks with a checkpoint on disk: a model to stream.

The tests and ``bench/stream.py`` build one larger than a memory cgroup, save it with
:func:`save_block_stack`, and run it eagerly (``from_safetensors``) and streamed
(``stageload.streamed``) in child processes inside that cgroup.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    """``x + W2 gelu(W1 norm(x))``: two ``width x width`` linears, 8 width^2 bytes in float32."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class BlockStack(nn.Module):
    """``head(blocks(embed(x)))`` with ``depth`` blocks in ``self.blocks`` (a ModuleList)."""

    def __init__(self, width: int = 256, depth: int = 4, features: int = 32) -> None:
        super().__init__()
        self.config = {"width": width, "depth": depth, "features": features}
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def block_bytes(width: int, itemsize: int = 4) -> int:
    """Bytes of one :class:`Block`'s weights."""
    return (2 * width * width + 4 * width) * itemsize


def save_block_stack(
    path: str | os.PathLike[str], *, width: int, depth: int, features: int = 32, seed: int = 0
) -> dict[str, Any]:
    """Write a :class:`BlockStack` with weights drawn from ``seed`` to ``path``; returns its
    config. Drawn tensor by tensor from one generator, so the file depends on the seed only."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in BlockStack(width, depth, features).state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        if key.endswith("norm.weight"):
            tensors[key] = torch.ones(shape)
        else:  # scaled so activations stay O(1) through deep stacks
            tensors[key] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    # safetensors needs every tensor at once; at 1 GB that is the file's size in memory,
    # taken by the writer (outside any cgroup) only.
    save_file(tensors, os.fspath(path))
    return {"width": width, "depth": depth, "features": features}


class PeakFootprint:
    """This process's peak footprint (``stageload.memory``: anonymous + shmem + swap),
    sampled every ``interval`` seconds on a thread while the ``with`` body runs.

    Not a cgroup's peak, which also counts the page cache the reads filled (reclaimable,
    and reclaimed at the limit), nor VmHWM, which counts library pages charged elsewhere.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        from ..memory import read_process

        while True:
            footprint = read_process(os.getpid()).footprint or 0
            self.peak = max(self.peak, footprint)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakFootprint:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(mode: str, checkpoint: str, out: str | None, *, rows: int = 8, prefetch: bool = True,
        config: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """Load the stack ``eager`` (``from_safetensors``) or ``streamed``, run it once on a
    fixed input, save the output to ``out``; returns seconds and the stream's stats."""
    import json
    import time

    from ..core.streamed import stream_of, streamed
    from ..load.checkpoint import read_header
    from ..load.weights import from_safetensors

    if config is None:
        entries = read_header(Path(checkpoint))
        width = entries["embed.weight"].shape[0]
        features = entries["embed.weight"].shape[1]
        depth = len({k.split(".")[1] for k in entries if k.startswith("blocks.")})
        config = {"width": width, "depth": depth, "features": features}
    cfg = dict(config)

    def build() -> BlockStack:
        return BlockStack(cfg["width"], cfg["depth"], cfg["features"])

    x = torch.randn(rows, cfg["features"], generator=torch.Generator().manual_seed(1))
    with PeakFootprint() as meter:
        start = time.perf_counter()
        if mode == "eager":
            model = from_safetensors(build, checkpoint)()
        elif mode == "streamed":
            model = streamed(build, checkpoint, prefetch=prefetch, name="stack")
        else:
            raise ValueError(f"mode must be 'eager' or 'streamed', got {mode!r}")
        loaded = time.perf_counter()
        with torch.inference_mode():
            y = model(x)
        done = time.perf_counter()
    if out is not None:
        torch.save(y, out)
    stream = stream_of(model)
    result = {
        "mode": mode,
        "peak_footprint": meter.peak,
        "load_seconds": loaded - start,
        "call_seconds": done - loaded,
        "stats": stream.stats.to_dict() if stream is not None else None,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":  # python -m stageload.testing.blocks MODE CHECKPOINT OUT [--no-prefetch]
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    run(args[0], args[1], args[2] if len(args) > 2 else None,
        prefetch="--no-prefetch" not in sys.argv)  # fmt: skip
