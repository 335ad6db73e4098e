"""Benchmark of ``stageload guard``: reaction time from a memory crossing to SIGTERM, and the
guard's CPU use while it watches an idle command.

Reaction: a child allocates 16 MiB every 20 ms (about 800 MiB/s) and reads MemAvailable
after each step; the floor (``--kill-free``) is set 300 MiB under what the machine has when
the run starts, so the machine is never pushed hard. Three times are compared on the
system-wide monotonic clock: when the child first saw available memory under the floor
(crossing), the guard's first trace sample under the floor (detection), and the child's
SIGTERM handler (stop). The guard needs two samples in a row under the floor.

CPU: the guard watches ``sleep`` for ~20 s; its user+system CPU time over that window,
from psutil, as a percentage of one core.

Run: ``PYTHONPATH=src python bench/guard_reaction.py [--runs 7] [--cpu-seconds 20]``.
Writes ``bench/results/guard/guard_reaction.md``. Linux only (reads /proc/meminfo).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "guard"
MiB = 1 << 20

CHILD = r"""
import json, os, signal, sys, time
floor, out = int(sys.argv[1]), sys.argv[2]
times = {}
def on_term(signum, frame):
    times["sigterm"] = time.monotonic()
    with open(out, "w") as f:
        json.dump(times, f)
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
def available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
chunks = []
for _ in range(200):  # at most 3.2 GiB, far past the floor
    chunks.append(b"x" * (16 << 20))
    if "crossing" not in times and available() < floor:
        times["crossing"] = time.monotonic()
    time.sleep(0.02)
time.sleep(30)
"""


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def guard_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "stageload", "guard", *args]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def one_reaction(poll: str | None, tmp: Path, i: int) -> dict[str, float] | None:
    """One run; the times in ms, or None when the crossing was not seen by the child."""
    floor = mem_available() - 300 * MiB
    out, trace = tmp / f"times{i}.json", tmp / f"trace{i}.jsonl"
    flags = ["--wait-free", "0", "--kill-free", f"{floor}B", "--trace", str(trace)]
    if poll:
        flags += ["--poll", poll]
    proc = subprocess.run(
        guard_cmd(*flags, "--", sys.executable, "-c", CHILD, str(floor), str(out)),
        env=env(),
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    if proc.returncode != 3 or not out.exists():
        print(f"  run {i}: guard exit {proc.returncode}: {proc.stderr.strip()[-200:]}")
        return None
    times = json.loads(out.read_text())
    records = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    t0 = records[0]["monotonic"]
    under = [
        r["t"] + t0
        for r in records
        if r["type"] == "sample" and r.get("available") is not None and r["available"] < floor
    ]
    stops = [
        r["t"] + t0
        for r in records
        if r["type"] == "event" and r.get("kind") == "guard" and r["note"].startswith("stop:")
    ]
    if "crossing" not in times or not under or not stops:
        # Another process's allocation crossed the floor before this child did.
        print(f"  run {i}: floor crossed before the child saw it; run left out")
        return None
    return {
        "detect_ms": 1000 * (under[0] - times["crossing"]),
        "decide_ms": 1000 * (stops[0] - under[0]),
        "react_ms": 1000 * (times["sigterm"] - under[0]),
        "total_ms": 1000 * (times["sigterm"] - times["crossing"]),
    }


def cpu_use(seconds: float, trace: Path | None, *extra: str) -> float:
    """Percent of one core the guard used while watching an idle command for ``seconds``."""
    flags = ["--wait-free", "0", *extra] + (["--trace", str(trace)] if trace else [])
    guard = subprocess.Popen(
        guard_cmd(*flags, "--", "sleep", str(int(seconds + 5))), env=env(), stderr=subprocess.PIPE
    )
    try:
        proc = psutil.Process(guard.pid)
        time.sleep(2.0)  # past interpreter start-up and admission
        before, t_before = proc.cpu_times(), time.monotonic()
        time.sleep(seconds)
        after, t_after = proc.cpu_times(), time.monotonic()
    finally:
        guard.terminate()
        guard.wait(30)
    used = (after.user + after.system) - (before.user + before.system)
    return 100.0 * used / (t_after - t_before)


def summarize(values: list[float]) -> str:
    """``median / max`` of ms values."""
    return f"{statistics.median(values):.0f} / {max(values):.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--cpu-seconds", type=float, default=20.0)
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("guard_reaction.py reads /proc/meminfo: Linux only", file=sys.stderr)
        return 2

    rows = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for label, poll in (("adaptive (default)", None), ("fixed --poll 0.5s", "0.5s")):
            runs = []
            for i in range(args.runs):
                result = one_reaction(poll, tmp, i)
                if result:
                    runs.append(result)
                    print(
                        f"{label} run {i}: " + ", ".join(f"{k} {v:.0f}" for k, v in result.items())
                    )
            if runs:
                rows.append((label, runs))
        cpu_plain = cpu_use(args.cpu_seconds, None)
        cpu_trace = cpu_use(args.cpu_seconds, tmp / "cpu.jsonl")
        cpu_fast = cpu_use(args.cpu_seconds, tmp / "fast.jsonl", "--poll", "0.1s")

    lines = [
        "# stageload guard: reaction time and CPU use",
        "",
        f"Machine: {platform.machine()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}. Command: `python bench/guard_reaction.py "
        f"--runs {args.runs} --cpu-seconds {args.cpu_seconds:g}`.",
        "",
        "Child allocating ~800 MiB/s, floor (`--kill-free`) 300 MiB under the available "
        "memory at the start; two samples in a row under the floor stop it. Times in ms "
        "on the system monotonic clock, median / max over the runs. A negative crossing -> "
        "sample time means the guard sampled between the child's allocation and its own "
        "reading of MemAvailable.",
        "",
        "| poll | runs | crossing -> first sample under floor | that sample -> stop decision "
        "| that sample -> SIGTERM in child | crossing -> SIGTERM |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, runs in rows:
        lines.append(
            f"| {label} | {len(runs)} | {summarize([r['detect_ms'] for r in runs])} | "
            f"{summarize([r['decide_ms'] for r in runs])} | "
            f"{summarize([r['react_ms'] for r in runs])} | "
            f"{summarize([r['total_ms'] for r in runs])} |"
        )
    lines += [
        "",
        f"Guard CPU while watching an idle command for {args.cpu_seconds:g} s "
        "(default adaptive poll, 0.5 s with a wide margin):",
        "",
        "| guard | CPU, % of one core |",
        "|---|---:|",
        f"| no trace | {cpu_plain:.2f} |",
        f"| with --trace | {cpu_trace:.2f} |",
        f"| with --trace, --poll 0.1s (the rate near the floor) | {cpu_fast:.2f} |",
        "",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "guard_reaction.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
