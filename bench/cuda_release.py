"""Release on CUDA: how long until a released model's device memory is back, and is it all.

Builds a model of ``--size-gib`` float32 weights on the GPU (16 MiB matrices), releases it
with ``stageload.release`` and reports, median of ``--repeat`` runs: the seconds release()
took (it empties each storage and calls ``torch.cuda.empty_cache``), and
``memory_allocated`` / ``memory_reserved`` before and after, relative to the empty device.
Needs a CUDA device; writes bench/results/cuda/release.md.

    python bench/cuda_release.py [--size-gib 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
from torch import nn

from stageload import release

CHUNK = 16 * 2**20


def one_run(total: int) -> dict[str, float]:
    torch.cuda.synchronize()
    base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    model = nn.ParameterList(
        nn.Parameter(torch.ones(CHUNK // 4, device="cuda")) for _ in range(total // CHUNK)
    )
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated() - base_alloc
    start = time.perf_counter()
    freed = release(model, name="m")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "freed": freed,
        "loaded": loaded,
        "allocated_left": torch.cuda.memory_allocated() - base_alloc,
        "reserved_left": torch.cuda.memory_reserved() - base_reserved,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cuda"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    total = int(args.size_gib * 2**30)
    runs = [one_run(total) for _ in range(args.repeat)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    text = (
        f"# Release on CUDA ({date.today().isoformat()})\n\n"
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}. "
        f"Model: {med['loaded'] / 2**30:.2f} GiB float32 on the device, median of "
        f"{args.repeat} runs.\n\n"
        "| release() s | freed GiB | memory_allocated left | memory_reserved left |\n"
        "| ---: | ---: | ---: | ---: |\n"
        f"| {med['seconds'] * 1e3:.1f} ms | {med['freed'] / 2**30:.2f} | "
        f"{med['allocated_left']:.0f} B | {med['reserved_left']:.0f} B |\n"
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "release.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
