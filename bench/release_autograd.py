"""What ``release`` pays to cut a model loose from autograd before freeing it.

Each tensor a release takes gets a new version (``torch.autograd.graph.increment_version``)
after a read of its reference count (``held_by_autograd``): a backward through a graph that
still holds the weights then raises instead of reading freed memory. Measured on models
with many tensors, where a per-tensor cost shows most:

- ``blocks``: 64 blocks of (Linear(128, 128), LayerNorm(128)), 256 tensors, 8.5 MiB;
- ``wide``: 8 Linear(1024, 1024), 16 tensors, 32 MiB.

Each released with the cut (today) and without it (``_cut_from_autograd`` replaced by
nothing), in two states: after a call under ``torch.no_grad()`` (no graph: inference) and
with the output of a call with gradients on still alive (a graph holding every weight).
Inside ``releasing(collect=False)``, so no garbage collection is timed. Each model is built
and called just before its release (its memory touched). Pairs run back to back, the order
alternating; medians of ``--pairs`` (>= 7) pairs, and the median of the per-pair ratios.
Results: ``bench/results/release_autograd/README.md``.

    python bench/release_autograd.py [--pairs 9]
"""

from __future__ import annotations

import argparse
import functools
import platform
import time
import warnings
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch
from release_gc import pairs  # (beside this script) the same pairs, medians and ratios
from torch import nn

import stageload.hooks.release as release_module
from stageload import release
from stageload.hooks.release import releasing

MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "blocks": (
        lambda: nn.Sequential(
            *[m for _ in range(64) for m in (nn.Linear(128, 128), nn.LayerNorm(128))]
        ),
        128,
    ),
    "wide": (lambda: nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]), 1024),
}


def time_release(build: Callable[[], nn.Module], width: int, graph: bool, cut: bool) -> float:
    torch.manual_seed(0)
    model = build()
    x = torch.randn(4, width)
    if graph:
        out = model(x)  # its graph holds every weight
    else:
        with torch.no_grad():
            out = model(x)
    saved = release_module._cut_from_autograd
    if not cut:
        release_module._cut_from_autograd = lambda m, s, k, done: setattr(done, "cut", 0)
    try:
        with warnings.catch_warnings(), releasing(collect=False):
            warnings.simplefilter("ignore")  # the warning for the graph: not timed apart
            start = time.perf_counter()
            release(model)
            seconds = time.perf_counter() - start
    finally:
        release_module._cut_from_autograd = saved
    del out
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("bench/results/release_autograd"))
    args = parser.parse_args()
    if args.pairs < 7:
        parser.error(f"--pairs {args.pairs}: at least 7 pairs, for a median")
    torch.set_num_threads(1)
    rows = []
    for name, (build, width) in MODELS.items():
        tensors = len(list(build().state_dict()))
        for graph in (False, True):
            time_release(build, width, graph, True)  # warm-up
            one = functools.partial(time_release, build, width, graph)
            a, b, r = pairs(one, args.pairs)
            state = "output with its graph alive" if graph else "after a no_grad call"
            rows.append(
                f"| {name} ({tensors} tensors) | {state} | {a * 1e3:.2f} | {b * 1e3:.2f} "
                f"| {r:.2f} |"
            )
    text = "\n".join(
        [
            "# What release pays to cut a model loose from autograd",
            "",
            f"`python bench/release_autograd.py --pairs {args.pairs}`, {date.today()}, "
            f"{platform.system()} {platform.machine()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, one torch thread. Medians of {args.pairs} pairs "
            "(order alternating); ratio: the median of per-pair ratios. Release inside "
            "`releasing(collect=False)`: no garbage collection timed.",
            "",
            "| model | state | release with the cut (ms) | without (ms) | ratio |",
            "| --- | --- | ---: | ---: | ---: |",
            *rows,
            "",
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
