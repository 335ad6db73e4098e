"""What keeping a user's changes costs a staged component: the time change tracking adds to
a load and a release, and the memory a kept LoRA holds.

Change tracking (``stageload.diffusers._placeholder.Tracked``) records each checkpoint
tensor after a fill (address, version counter, a strided sample of ``SAMPLES`` elements:
``stageload.load.changes``, the check auto's session makes too) and checks it at release.
Measured on a model of ``--gib`` GiB of float32 Linear layers, already in memory (the VM's
first-touch cost is paid before timing), medians of ``--repeat`` runs; printed as seconds
and as a share of reading the same bytes from a warm page cache.

    python bench/changes.py --gib 1 --repeat 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

from stageload import load_weights  # noqa: E402
from stageload.diffusers._placeholder import Tracked, named_tensors  # noqa: E402


def model(gib: float) -> nn.Module:
    layers = max(1, int(gib * (1 << 30) / (4096 * 1024 * 4)))
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(1024, 4096, bias=False) for _ in range(layers)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        real = model(args.gib).to_empty(device="cpu")
        for p in real.parameters():
            p.data.normal_()
        file = Path(tmp) / "m.safetensors"
        save_file(real.state_dict(), file)
        nbytes = sum(p.nbytes for p in real.parameters())
        del real
        loaded = model(args.gib)
        load_weights(loaded, file)  # touches the memory once before timing
        tracked = Tracked(loaded)
        fresh = {id(t) for _, t in named_tensors(loaded)}
        reads, fills, checks = [], [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            load_weights(loaded, file)  # warm page cache, in place: the read to compare with
            reads.append(time.perf_counter() - start)
            start = time.perf_counter()
            tracked.filled(loaded, fresh)
            fills.append(time.perf_counter() - start)
            start = time.perf_counter()
            kept = tracked.retain(loaded)
            checks.append(time.perf_counter() - start)
            if kept:
                raise SystemExit(f"unchanged weights reported as changed: {len(kept)}")
    read, fill, check = (statistics.median(x) for x in (reads, fills, checks))
    result = {
        "bytes": nbytes,
        "tensors": len(fresh),
        "read_s (load_weights, warm cache)": read,
        "record_after_fill_s": fill,
        "check_at_release_s": check,
        "tracking / read": (fill + check) / read,
        "repeat": args.repeat,
    }
    print(json.dumps(result, indent=2))
    out = ROOT / "bench" / "results" / "changes" / "tracking.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
