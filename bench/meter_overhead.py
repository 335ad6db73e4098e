"""Benchmark of MemoryMeter's samplers: start-up time, CPU per sample, and what a thread misses.

Start-up: wall time of ``MemoryMeter.start()`` (start record, sampler ready, first sample
written) and of ``stop()``, for the sampler process and the thread, median of ``--runs``.

CPU: the sampler process runs for ``--cpu-seconds`` at a 0.1 s interval while this
process sleeps; its user+system CPU time (psutil, read just before stop) divided by the
samples it took gives CPU per sample, and from that the share of one core at the default
0.5 s interval. The sampler's own footprint (RssAnon+RssShmem) is read from /proc too.

Peak: one ``list.sort(key=bytearray)`` call that holds the GIL while it builds and frees
1 GiB of sort keys; the peak each sampler recorded over the baseline, at a 0.02 s interval.

Run: ``PYTHONPATH=src python bench/meter_overhead.py [--runs 7] [--cpu-seconds 20]``.
Writes ``bench/results/meter/meter_overhead.md``. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from stageload.meter import MemoryMeter  # noqa: E402
from stageload.meter.tracefile import read_records  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "meter"
MiB = 1 << 20


def startup(sampler: str, runs: int, folder: Path) -> tuple[float, float]:
    starts, stops = [], []
    for i in range(runs):
        meter = MemoryMeter(folder / f"s-{sampler}-{i}.jsonl", 0.5, sampler=sampler)
        began = time.perf_counter()
        meter.start()
        starts.append(time.perf_counter() - began)
        began = time.perf_counter()
        meter.stop()
        stops.append(time.perf_counter() - began)
    return statistics.median(starts), statistics.median(stops)


def cpu(seconds: float, folder: Path) -> tuple[float, int, int]:
    """CPU seconds per sample of the sampler process, samples taken, its footprint."""
    meter = MemoryMeter(folder / "cpu.jsonl", 0.1).start()
    assert meter.start_record is not None
    proc = psutil.Process(meter.start_record["sampler_pid"])
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    status = Path(f"/proc/{proc.pid}/status").read_text()
    fields = {line.split(":")[0]: line.split()[1] for line in status.splitlines() if "kB" in line}
    footprint = (int(fields["RssAnon"]) + int(fields["RssShmem"])) * 1024
    meter.stop()
    used = (after.user - before.user) + (after.system - before.system)
    samples = meter.samples or 1
    return used / samples, samples, footprint


def peak(folder: Path) -> dict[str, int]:
    items = [64 << 20] * 16
    paths = {s: folder / f"peak-{s}.jsonl" for s in ("process", "thread")}
    with MemoryMeter(paths["process"], 0.02), MemoryMeter(paths["thread"], 0.02, sampler="thread"):
        time.sleep(0.2)
        items.sort(key=bytearray)
        time.sleep(0.2)
    out = {}
    for sampler, path in paths.items():
        fp = [r["footprint"] for r in read_records(path) if r["type"] == "sample"]
        out[sampler] = max(fp) - min(fp)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--cpu-seconds", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        p_start, p_stop = startup("process", args.runs, folder)
        t_start, t_stop = startup("thread", args.runs, folder)
        per_sample, samples, footprint = cpu(args.cpu_seconds, folder)
        peaks = peak(folder)
    lines = [
        "# MemoryMeter sampler overhead",
        "",
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, `python bench/meter_overhead.py "
        f"--runs {args.runs} --cpu-seconds {args.cpu_seconds:g}`",
        "",
        "| | sampler process | thread |",
        "| --- | --- | --- |",
        f"| `start()` (median of {args.runs}) | {p_start * 1000:.0f} ms "
        f"| {t_start * 1000:.0f} ms |",
        f"| `stop()` (median of {args.runs}) | {p_stop * 1000:.1f} ms | {t_stop * 1000:.1f} ms |",
        f"| peak seen inside one GIL-holding 1 GiB call | {peaks['process'] / MiB:.0f} MiB "
        f"| {peaks['thread'] / MiB:.0f} MiB |",
        "",
        f"Sampler process CPU: {per_sample * 1000:.2f} ms per sample over {samples} samples, "
        f"so {per_sample / 0.5 * 100:.2f}% of one core at the default 0.5 s interval "
        f"({per_sample / 0.1 * 100:.1f}% at 0.1 s). Its own footprint: "
        f"{footprint / MiB:.1f} MiB (not counted in the measured tree: it runs detached).",
        "",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "meter_overhead.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
