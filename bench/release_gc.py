"""What the garbage collection in ``release`` costs (issue 36, item 2).

``release`` now runs one ``gc.collect()`` after freeing (once per ``enter()`` for all the
models it releases), so a dead reference cycle holding tensors goes with the release.
A full collection walks every tracked object, so its cost grows with the process's heap.
Measured here in one process that holds ``--objects`` extra tracked Python objects
(lists; 0 and 10^6 by default) beside torch:

- ``release``: ``release(model)`` of one model (eight Linear(512, 512), 8 MiB), with the
  collection (today) and without it (before: the collection replaced by nothing);
- ``enter``: ``StagedModels.enter`` of a stage that releases three such models (one
  collection for the three), with and without;
- ``gc.collect()`` alone.

A last row repeats the largest count after ``gc.freeze()`` (the objects built so far moved
out of every later collection's walk), the remedy for a process whose heap is large.

Pairs run back to back, the order alternating; medians of ``--pairs`` (>= 7) pairs, and the
median of the per-pair ratios. Results: ``bench/results/release_gc/README.md``.

    python bench/release_gc.py [--pairs 9] [--objects 0 1000000]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch
from torch import nn

import stageload.hooks.release as release_module
from stageload import StagedModels, release


def model() -> nn.Module:
    with torch.device("meta"):
        m = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    return m.to_empty(device="cpu")


def time_release(collect: bool) -> float:
    m = model()
    saved = release_module.collect_garbage
    if not collect:
        release_module.collect_garbage = lambda: None  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        release(m)
        return time.perf_counter() - start
    finally:
        release_module.collect_garbage = saved  # type: ignore[assignment]


def time_enter(collect: bool) -> float:
    models = StagedModels(
        {name: model for name in ("a", "b", "c")},
        stages={"all": ["a", "b", "c"], "none": []},
        preserve_rng=False,
    )
    models.enter("all")
    for name in ("a", "b", "c"):
        models[name]
    saved = release_module.collect_garbage
    if not collect:
        release_module.collect_garbage = lambda: None  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        models.enter("none")
        return time.perf_counter() - start
    finally:
        release_module.collect_garbage = saved  # type: ignore[assignment]


def time_collect() -> float:
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start


def pairs(fn: Callable[[bool], float], n: int) -> tuple[float, float, float]:
    """Median seconds with, without, and the median per-pair ratio with/without."""
    with_, without, ratios = [], [], []
    for i in range(n):
        if i % 2:
            b, a = fn(False), fn(True)
        else:
            a, b = fn(True), fn(False)
        with_.append(a)
        without.append(b)
        ratios.append(a / b)
    return statistics.median(with_), statistics.median(without), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--objects", type=int, nargs="+", default=[0, 1_000_000])
    parser.add_argument("--out", type=Path, default=Path("bench/results/release_gc"))
    args = parser.parse_args()
    if args.pairs < 7:
        parser.error(f"--pairs {args.pairs}: at least 7 pairs, for a median")
    torch.set_num_threads(1)
    rows = []
    for count, freeze in [*((c, False) for c in args.objects), (max(args.objects), True)]:
        held = [[] for _ in range(count)]  # tracked by the collector, alive all along
        gc.collect()
        if freeze:
            gc.freeze()
        tracked = len(gc.get_objects())
        r = pairs(lambda c: time_release(c), args.pairs)
        e = pairs(lambda c: time_enter(c), args.pairs)
        collect = statistics.median(time_collect() for _ in range(args.pairs))
        rows.append(
            (f"{count:,}" + (", then gc.freeze()" if freeze else ""), tracked, r, e, collect)
        )
        print(count, freeze, tracked, r, e, collect, flush=True)
        if freeze:
            gc.unfreeze()
        del held
    ms = 1000
    lines = [
        "# The cost of the garbage collection in release",
        "",
        f"`python bench/release_gc.py --pairs {args.pairs}`, {date.today()}, "
        f"{platform.system()} {platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, one torch thread, on a shared 2-core VM (other jobs "
        "running). Medians of "
        f"{args.pairs} pairs (order alternating); ratio: the median of per-pair ratios.",
        "One model: eight Linear(512, 512), 8 MiB; `enter` releases three of them.",
        "",
        "| extra objects | tracked objects (walked) | release with gc (ms) | without (ms) | ratio "
        "| enter (3 releases) with gc (ms) | without (ms) | ratio | gc.collect() alone (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for count, tracked, r, e, collect in rows:
        lines.append(
            f"| {count} | {tracked:,} | {r[0] * ms:.1f} | {r[1] * ms:.1f} | {r[2]:.1f} "
            f"| {e[0] * ms:.1f} | {e[1] * ms:.1f} | {e[2]:.1f} | {collect * ms:.1f} |"
        )
    lines += [
        "",
        "The collection's cost is the process's heap, not the model: it is paid once per "
        "`enter()` (not per model released) and never inside a forward (a streamed block's "
        "release). A process that keeps millions of long-lived objects can move them out "
        "of the collector's walk with `gc.freeze()` after building them.",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
