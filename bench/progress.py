"""What the load progress bar costs: ``load_weights`` with the bar on against off.

One bf16 checkpoint of ``--gib`` GiB (over ``PROGRESS_MIN_BYTES``, so the bar shows) is
written and read once to warm the page cache. Then ``--pairs`` back-to-back pairs, each a
load with ``STAGELOAD_PROGRESS=1`` and one with ``=0``, the order alternating from pair to
pair; each load fills a fresh module built on ``meta``. The figure is the median of the
per-pair ratios on/off: 1.00 is no cost. On a busy machine that ratio is noise, so the
bar's own work is also timed alone: the bar of a 41 GB load (Qwen-Image 2.1's
transformer) fed every 16 MiB chunk as the readers feed it, with no reading, median of 7.
The bar goes to stderr as in a run; pass ``2>/dev/null`` to keep the terminal clean
(tqdm then writes to a file, as under a log).

Run: ``PYTHONPATH=src python bench/progress.py [--gib 1.5] [--pairs 9]``.
Writes ``bench/results/load/progress.json`` and ``progress.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
from stageload.load.progress import PROGRESS_ENV, PROGRESS_MIN_BYTES, progress  # noqa: E402
from stageload.load.weights import CHUNK  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "load"
GiB = 1 << 30


def _load(path: Path, numel: int, bar: bool) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) of one load."""
    os.environ[PROGRESS_ENV] = "1" if bar else "0"
    module = nn.Module()
    with torch.device("meta"):
        module.w = nn.Parameter(torch.empty(numel, dtype=torch.bfloat16))
    start, cpu = time.perf_counter(), time.process_time()
    load_weights(module, path, name="bench")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del module
    return seconds, cpu


def _bar_alone(nbytes: int) -> float:
    """Seconds of the bar's own work for a load of ``nbytes``: made, fed, closed."""
    os.environ[PROGRESS_ENV] = "1"
    start = time.perf_counter()
    with progress("bench", nbytes) as on_bytes:
        assert on_bytes is not None
        for _ in range(nbytes // CHUNK):
            on_bytes(CHUNK)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/progress.py")
    parser.add_argument("--gib", type=float, default=1.5, help="checkpoint size, GiB")
    parser.add_argument("--pairs", type=int, default=9, help="back-to-back on/off pairs (>= 7)")
    args = parser.parse_args()
    numel = int(args.gib * GiB) // 2
    if numel * 2 <= PROGRESS_MIN_BYTES:
        parser.error(f"--gib must exceed the bar's threshold, {PROGRESS_MIN_BYTES / GiB:g} GiB")
    with tempfile.TemporaryDirectory(prefix="stageload-progress-") as tmp:
        path = Path(tmp) / "w.safetensors"
        save_file({"w": torch.ones(numel, dtype=torch.bfloat16)}, path)
        _load(path, numel, bar=False)  # the page cache is warm from here on
        pairs = []
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            times = {bar: _load(path, numel, bar) for bar in order}
            pairs.append(
                {
                    "on": times[True][0],
                    "off": times[False][0],
                    "on_cpu": times[True][1],
                    "off_cpu": times[False][1],
                }
            )
            print(f"pair {i}: {pairs[-1]}", flush=True)
    seed_bytes = 41 * 10**9
    alone = statistics.median(_bar_alone(seed_bytes) for _ in range(7))
    ratios = [p["on"] / p["off"] for p in pairs]
    cpu_ratios = [p["on_cpu"] / p["off_cpu"] for p in pairs]
    result = {
        "gib": args.gib,
        "pairs": pairs,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "cpu_ratio_min": min(cpu_ratios),
        "cpu_ratio_max": max(cpu_ratios),
        "off_median_s": statistics.median(p["off"] for p in pairs),
        "on_median_s": statistics.median(p["on"] for p in pairs),
        "off_spread": [min(p["off"] for p in pairs), max(p["off"] for p in pairs)],
        "load_average": os.getloadavg(),
        "bar_alone_41GB_s": alone,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "torch": torch.__version__,
        "stderr_tty": sys.stderr.isatty(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "progress.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Load progress bar: cost",
        "",
        f"`PYTHONPATH=src python bench/progress.py --gib {args.gib:g} --pairs {args.pairs}`; "
        f"{result['machine']}, torch {result['torch']}, warm page cache.",
        "",
        "| | median | min | max |",
        "|---|---:|---:|---:|",
        f"| bar on / off, wall, per pair | {result['ratio_median']:.3f} "
        f"| {result['ratio_min']:.3f} | {result['ratio_max']:.3f} |",
        f"| bar on / off, CPU of the process, per pair | {result['cpu_ratio_median']:.3f} "
        f"| {result['cpu_ratio_min']:.3f} | {result['cpu_ratio_max']:.3f} |",
        "",
        f"Median load: {result['off_median_s']:.3f} s off, {result['on_median_s']:.3f} s on "
        f"({args.gib:g} GiB); the loads with the bar off alone ranged "
        f"{result['off_spread'][0]:.3f}-{result['off_spread'][1]:.3f} s. Load average at the "
        f"end: {', '.join(f'{x:.1f}' for x in result['load_average'])}.",
        "",
        f"The bar's own work for a 41 GB load ({seed_bytes // CHUNK} chunks of 16 MiB), "
        f"timed alone: {alone * 1000:.1f} ms, median of 7; that load takes 10-40 s.",
    ]
    (RESULTS / "progress.md").write_text("\n".join(lines) + "\n")
    print(
        f"bar on/off: median {result['ratio_median']:.3f} wall, "
        f"{result['cpu_ratio_median']:.3f} CPU, over {args.pairs} pairs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
