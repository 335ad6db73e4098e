"""Benchmark of ``stageload report`` and ``stageload plot`` on a trace of 10^6 samples:
peak memory and wall time, before (the reader that held every sample) and after (running
figures per window, decimated plot lines).

"Before" is the package as it was at commit ``09cb21f`` (``git archive`` into a temporary
folder), "after" this checkout's ``src``. Each run is a fresh child process; its peak
resident set is its own ``ru_maxrss`` (``os.wait4``), its wall the time to exit. Runs go in
pairs (before, after) per command, the order alternating, and the tables give the median
of ``--pairs`` pairs and the ratio after / before.

The trace is what ``stageload meter`` writes (the writer's compact JSON): ``--samples``
samples 10 ms apart, and every ``--stage-every`` samples a stage event with a release and
a load (7 stage names, entered in turn).

Run: ``python bench/report_memory.py [--samples 1000000] [--pairs 7]``. Writes
``bench/results/report_memory/README.md``. Linux (``ru_maxrss`` in KiB), needs ``git``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "report_memory"
BEFORE = "09cb21f"
MiB = 1 << 20


def count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def write_trace(path: Path, samples: int, stage_every: int) -> None:
    """A trace as the meter writes it; footprints rise and fall within each stage."""

    def line(record: dict) -> str:
        return json.dumps(record, separators=(",", ":")) + "\n"

    total = 16 << 30
    with open(path, "w") as f:
        f.write(line({"type": "start", "version": 1, "monotonic": 100.0, "pid": 1,
                      "total": total, "interval": 0.01, "sampler": "process",
                      "meta": {"label": "long"}}))  # fmt: skip
        for i in range(samples):
            t = round(i * 0.01, 6)
            if i % stage_every == 0:
                s = i // stage_every
                stage = f"s{s % 7}"
                f.write(line({"type": "event", "t": t, "kind": "stage", "stage": stage, "pid": 1}))
                f.write(line({"type": "event", "t": round(t + 0.001, 6), "kind": "release",
                              "model": f"m{s % 5}", "stage": stage, "bytes": 300 * MiB,
                              "seconds": 0.001, "reason": "budget", "pid": 1}))  # fmt: skip
                f.write(line({"type": "event", "t": round(t + 0.002, 6), "kind": "load",
                              "model": f"m{(s + 1) % 5}", "stage": stage, "bytes": 300 * MiB,
                              "seconds": 0.5, "pid": 1}))  # fmt: skip
            footprint = (1000 + (i % stage_every) % 997 + (i * 7919) % 100) * MiB
            f.write(line({"type": "sample", "t": t, "footprint": footprint,
                          "available": total - footprint,
                          "available_pct": round(100 - footprint / total * 100, 1),
                          "swap_used": (i * 31) % 10 * MiB, "pressure": 0.0}))  # fmt: skip
        f.write(line({"type": "end", "t": round(samples * 0.01, 6), "samples": samples}))


def old_source(folder: Path) -> Path:
    """The ``src`` folder of commit ``BEFORE``, unpacked into ``folder``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BEFORE, "src"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder / "src"


def run(src: Path, argv: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in MiB and stdout of ``python -m stageload ARGV``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    with tempfile.TemporaryFile() as out:
        began = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-m", "stageload", *argv], stdout=out, stderr=subprocess.PIPE, env=env
        )
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - began
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{argv} with {src} failed: {child.stderr.read().decode()}")
        out.seek(0)
        return wall, usage.ru_maxrss / 1024, out.read().decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=count, default=1_000_000)
    parser.add_argument("--stage-every", type=count, default=10_000)
    parser.add_argument("--pairs", type=count, default=7)
    args = parser.parse_args(argv)

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        trace = folder / "long.jsonl"
        write_trace(trace, args.samples, args.stage_every)
        sources = {"before": old_source(folder / "old"), "after": ROOT / "src"}
        commands = {
            "report": ["report", str(trace)],
            "plot": ["plot", str(trace), "-o", str(folder / "p.png")],
        }
        figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
        texts: dict[str, str] = {}
        for pair in range(args.pairs):
            for name, command in commands.items():
                order = ["before", "after"] if pair % 2 == 0 else ["after", "before"]
                for which in order:
                    wall, rss, text = run(sources[which], command)
                    figures.setdefault((name, which), []).append((wall, rss))
                    if name == "report":
                        texts[which] = text
                    print(f"pair {pair + 1} {name} {which}: {wall:.1f} s, {rss:.0f} MiB")
        same = texts["before"] == texts["after"]
        size = trace.stat().st_size

    rows = []
    for name in commands:
        med = {
            which: (
                statistics.median(w for w, _ in figures[(name, which)]),
                statistics.median(r for _, r in figures[(name, which)]),
            )
            for which in ("before", "after")
        }
        (wb, rb), (wa, ra) = med["before"], med["after"]
        fastest = {which: min(w for w, _ in figures[(name, which)]) for which in med}
        rows.append(
            f"| `stageload {name}` | {rb:.0f} MiB | {ra:.0f} MiB | {ra / rb:.2f} "
            f"| {wb:.1f} s | {wa:.1f} s | {wa / wb:.2f} "
            f"| {fastest['before']:.1f} s | {fastest['after']:.1f} s |"
        )
    load = os.getloadavg()[0]
    text = "\n".join(
        [
            "# Report and plot memory on a long trace",
            "",
            f"`python bench/report_memory.py --samples {args.samples} --stage-every "
            f"{args.stage_every} --pairs {args.pairs}`: a trace of {args.samples:,} samples "
            f"({size / MiB:.0f} MiB, {args.samples // args.stage_every:,} stage entries), "
            f"read by `stageload report` and `stageload plot` as of `{BEFORE}` (before: "
            "every sample held as an object) and now (after: running figures per window, "
            "plot lines min/max-decimated to a few thousand points). Peak RSS is each child "
            f"process's own `ru_maxrss`; median of {args.pairs} pairs, order alternating.",
            "",
            "| command | peak RSS before | after | ratio | wall before | after | ratio "
            "| fastest wall before | after |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Report text identical before and after: {'yes' if same else 'NO'}.",
            "",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, load average {load0:.1f} at the start and "
            f"{load:.1f} at the end: the VM is shared with other work, so walls are noisy "
            "(the fastest pair is the nearest to an idle machine); memory is not.",
            "",
        ]
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "README.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
