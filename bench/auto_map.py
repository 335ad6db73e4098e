"""Several inputs under ``stageload.auto``: ``session.map`` against a ``for`` loop.

Three models of ``--mib`` MiB each (a chain: each model's output is the next one's input),
room for one, ``--items`` inputs. A loop runs each input through the three models in turn,
so each model is released and read again for every input; ``session.map(fn, items)`` runs
the inputs stage-major, so each model is read once for all of them.

Two modes, in one process, back to back in each of ``--runs`` (>= 7) pairs, after one
untimed run of each (the files in the page cache, the memory touched):

- ``loop``: ``[fn(item) for item in items]`` inside the ``auto()`` block;
- ``map``: ``session.map(fn, items)`` inside it.

Figure: the wall time of all the items (the block's set-up outside it), the median of the
runs, and their ratio; the loads each mode made for the items (``load`` and ``reload``
events). ``map``'s time includes the batch's note at each stage of what the parked calls
hold, a walk of every object gc tracks (about 0.1 s a stage here). Outputs
are compared bit for bit between the modes. Results: ``bench/results/auto/map.md``.

    python bench/auto_map.py [--mib 256] [--items 4] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTORY = "auto_map:load"  # this file, imported as ``auto_map`` with bench/ on sys.path
MODES = ("loop", "map")
WIDTH = 1024


def _model(layers: int):  # noqa: ANN202
    from torch import nn

    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def load(path: str):  # noqa: ANN201
    """The factory auto stands in for: the model built, then its file's tensors copied in."""
    import torch
    from safetensors.torch import load_file

    state = load_file(path)
    model = _model(len(state) // 2)
    with torch.no_grad():
        model.load_state_dict(state)
    return model.eval()


def run(mode: str, folder: str, items: int, size: int):  # noqa: ANN201
    """One run of ``mode``: its seconds for all the items, their outputs, the loads made."""
    import torch

    import stageload

    sink = stageload.ListSink()
    with stageload.auto(
        budget=size + size // 2, factories=[FACTORY], defaults=False, events=sink
    ) as session:
        from auto_map import load as factory  # through the module auto wraps

        models = [factory(f"{folder}/{n}.safetensors") for n in "abc"]

        def one(seed: int):  # noqa: ANN202
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                for model in models:
                    x = model(x)
            return x

        first = len(sink.events)  # the factories' loads are before, outside the figure
        start = time.perf_counter()
        outs = [one(i) for i in range(items)] if mode == "loop" else session.map(one, range(items))
        seconds = time.perf_counter() - start
    loads = sum(1 for e in sink.events[first:] if e.kind in ("load", "reload"))
    return seconds, outs, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--items", type=int, default=4)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    if args.runs < 7:
        parser.error("--runs must be at least 7 (the median of 7 pairs or more)")
    sys.path.insert(0, str(ROOT / "bench"))

    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    layers = max(1, args.mib * 2**20 // (4 * WIDTH * (WIDTH + 1)))
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        for name in "abc":
            state = _model(layers).state_dict()
            save_file(state, f"{folder}/{name}.safetensors")
        size = sum(t.numel() * t.element_size() for t in state.values())
        for mode in MODES:  # untimed: the page cache, every page touched once
            run(mode, folder, args.items, size)
        per_mode: dict[str, list[float]] = {m: [] for m in MODES}
        loads: dict[str, set[int]] = {m: set() for m in MODES}
        outs = []
        for _ in range(args.runs):
            for mode in MODES:
                seconds, out, n = run(mode, folder, args.items, size)
                per_mode[mode].append(seconds)
                loads[mode].add(n)
                outs.append(out)
        assert all(torch.equal(a, b) for o in outs for a, b in zip(o, outs[0], strict=True)), (
            "the modes' outputs differ"
        )

    loop, mapped = (statistics.median(per_mode[m]) for m in MODES)
    lines = [
        "# auto: several inputs, `session.map` against a `for` loop",
        "",
        f"`python bench/auto_map.py --mib {args.mib} --items {args.items} --runs {args.runs}`, "
        f"{date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, one torch thread.",
        "",
        f"Three models of {size / 2**20:.1f} MiB ({layers} linear layers of {WIDTH}), chained; "
        f"room for one; {args.items} inputs (batch 4, no grad). The wall time of all the "
        f"inputs, the median of {args.runs} runs, the modes back to back in each run. "
        "Outputs equal bit for bit between the modes.",
        "",
        "| mode | all inputs (ms) | loads for the inputs |",
        "|---|---|---|",
        f"| loop: `[fn(i) for i in items]` | {loop * 1e3:.0f} | {sorted(loads['loop'])} |",
        f"| map: `session.map(fn, items)` | {mapped * 1e3:.0f} | {sorted(loads['map'])} |",
        f"| ratio, loop / map | {loop / mapped:.2f} | |",
        "",
        "Per-run times (ms): "
        + "; ".join(f"{m}: " + ", ".join(f"{s * 1e3:.0f}" for s in per_mode[m]) for m in MODES),
    ]
    out = ROOT / "bench" / "results" / "auto" / "map.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
