"""What staging adds to one call of a tiny pipeline whose models all fit (issue 34, item 5).

Three pipelines from the same folder, called alternately: eager (``from_pretrained``),
staged with every model kept loaded (``budget="4G"``: nothing is released, so what remains
is the fixed cost of staging), and staged with the default plan (``keep=()``: every model
is released after its stage and reloaded at the next call, for scale). One warm-up call
each, then ``--pairs`` rounds of one call per pipeline; the table gives the median time per
call and the median of the per-round ratios to eager. Torch on one thread.

    python bench/diffusers_call_cost.py --family sd --pairs 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import diffusers  # noqa: E402
import torch  # noqa: E402

from stageload.diffusers import staged_pipeline  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sd", choices=sorted(FAMILIES))
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/diffusers-call-cost")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    fam = FAMILIES[args.family]
    with tempfile.TemporaryDirectory() as tmp:
        path = folder(fam, Path(tmp))
        pipes = {
            "eager": fam.load(path),
            "staged, all loaded": staged_pipeline(fam.cls, path, budget="4G"),
            "staged, reloads": staged_pipeline(fam.cls, path, keep=()),
        }
        for pipe in pipes.values():
            pipe.set_progress_bar_config(disable=True)
            pipe(**fam.call(0))  # warm-up: first loads, allocator, kernels
        times: dict[str, list[float]] = {name: [] for name in pipes}
        for _ in range(args.pairs):
            for name, pipe in pipes.items():
                start = time.perf_counter()
                pipe(**fam.call(0))
                times[name].append(time.perf_counter() - start)
    eager = times["eager"]
    rows = [
        "| pipeline | median ms per call | median ratio to eager |",
        "| --- | ---: | ---: |",
    ]
    for name, ts in times.items():
        ratio = statistics.median(t / e for t, e in zip(ts, eager, strict=True))
        rows.append(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {ratio:.3f} |")
    table = "\n".join(rows)
    text = (
        f"# Fixed cost of a staged call ({args.family}, {args.pairs} rounds)\n\n"
        f"`python bench/diffusers_call_cost.py --family {args.family} --pairs {args.pairs}`, "
        f"torch on one thread, rounds interleaved.\n\n{table}\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.family}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
