"""What a call costs under ``stageload auto`` while two threads' models are over the budget.

Two threads in two models with room for one (a web server's two requests): thread A is
inside model ``a``'s call, this thread calls model ``b``, which loads over the budget
because ``a`` cannot go under its call. From then on, until ``a``'s call ends, each call
of ``b`` that ends looks again for room (``AutoSession.call_ended``): it orders the
loaded models and asks of each whether a thread is inside it (a walk of every thread's
stack, against the ids of the model's submodules). This bench measures that cost against
the same calls with room for both (the check is then one attribute read).

Two modes, in one process, back to back in each of ``--runs`` (>= 7) pairs:

- ``over the budget``: room for one model, ``a``'s call parked on thread A: every call
  of ``b`` ends with the room check;
- ``within it``: room for both, ``a``'s call parked the same way: no check.

Each model is ``--blocks`` blocks (default 48) of a transformer's shape (two norms, four
projections, an MLP: 11 submodules a block, 529 in all at 48), ``--width`` wide (default
64: a tiny compute, so the check's share is as large as it gets). Figure: the time of one
call of ``b`` (no grad, batch 1), the median of ``--calls`` calls per run, then the median
of the runs, and their ratio. Outputs are compared bit for bit between the modes.
Results: ``bench/results/auto/overlap.md``.

    python bench/auto_overlap.py [--blocks 48] [--width 64] [--calls 200] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTORY = "auto_overlap:load"  # this file, imported as ``auto_overlap`` with bench/ on sys.path
MODES = ("over the budget", "within it")


def _block(width: int):  # noqa: ANN202
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)
            self.v, self.o = nn.Linear(width, width), nn.Linear(width, width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
            )

        def forward(self, x):  # noqa: ANN001, ANN202
            h = self.norm1(x)
            x = x + self.o(self.q(h) * self.k(h).sigmoid() + self.v(h))
            return x + self.mlp(self.norm2(x))

    return Block


def load(path: str):  # noqa: ANN201
    """The factory auto stands in for: the model built, then its file's tensors copied in."""
    import torch
    from safetensors.torch import load_file
    from torch import nn

    blocks, width = (int(v) for v in os.environ["OVERLAP_BENCH_SHAPE"].split(","))
    model = nn.Sequential(*[_block(width)() for _ in range(blocks)])
    with torch.no_grad():
        model.load_state_dict(load_file(path))
    return model.eval()


def run(mode: str, folder: str, calls: int, size: int):  # noqa: ANN201
    """One run of ``mode``: per-call times of ``b`` while ``a``'s call is parked, and b's
    last output."""
    import torch

    import stageload

    inside, go = threading.Event(), threading.Event()
    width = int(os.environ["OVERLAP_BENCH_SHAPE"].split(",")[1])
    x = torch.ones(1, width)
    budget = size + size // 2 if mode == MODES[0] else 3 * size
    with stageload.auto(budget=budget, factories=[FACTORY], defaults=False) as session:
        # Through the module auto wraps (this file runs as __main__, a module of its own).
        from auto_overlap import load as factory

        a, b = (factory(f"{folder}/{n}.safetensors") for n in "ab")

        def park(*_: object) -> None:
            inside.set()
            go.wait()

        hook = a[0].register_forward_pre_hook(park)

        def call_a() -> None:
            with torch.no_grad():
                a(x)

        thread = threading.Thread(target=call_a, daemon=True)
        with torch.no_grad():
            thread.start()
            inside.wait()
            for _ in range(20):  # b's load, and every page its calls touch
                out = b(x)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                out = b(x)
                times.append(time.perf_counter() - start)
        over = session._over  # read while a's call is still parked
        go.set()
        thread.join()
        hook.remove()
    assert over is (mode == MODES[0]), (mode, over)  # the mode measures what it says
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    if args.runs < 7:
        parser.error("--runs must be at least 7 (the median of 7 pairs or more)")
    os.environ["OVERLAP_BENCH_SHAPE"] = f"{args.blocks},{args.width}"
    sys.path.insert(0, str(ROOT / "bench"))

    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        for name in "ab":
            blocks = [_block(args.width)() for _ in range(args.blocks)]
            state = torch.nn.Sequential(*blocks).state_dict()
            save_file(state, f"{folder}/{name}.safetensors")
        size = sum(t.numel() * t.element_size() for t in state.values())
        modules = sum(1 for _ in torch.nn.Sequential(*blocks).modules())
        per_mode: dict[str, list[float]] = {m: [] for m in MODES}
        outs = []
        for _ in range(args.runs):
            for mode in MODES:
                seconds, out = run(mode, folder, args.calls, size)
                per_mode[mode].append(seconds)
                outs.append(out)
        assert all(torch.equal(o, outs[0]) for o in outs), "the modes' outputs differ"

    over, within = (statistics.median(per_mode[m]) * 1e6 for m in MODES)
    lines = [
        "# auto: a call's cost while two threads' models are over the budget",
        "",
        f"`python bench/auto_overlap.py --blocks {args.blocks} --width {args.width} "
        f"--calls {args.calls} --runs {args.runs}`, {date.today()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, one torch thread.",
        "",
        f"Each model: {modules} submodules, {size / 2**20:.2f} MiB. One call of `b` "
        "(no grad, batch 1) while thread A is parked inside `a`'s call; the median of "
        f"{args.calls} calls per run, the median of {args.runs} runs, the modes back to "
        "back in each run. Outputs equal bit for bit between the modes.",
        "",
        "| mode | one call of b (µs) |",
        "|---|---|",
        f"| {MODES[0]}: room for one, each call's end looks for room | {over:.0f} |",
        f"| {MODES[1]}: room for both, no check | {within:.0f} |",
        f"| ratio, over / within | {over / within:.2f} |",
        f"| the check's cost per call (µs) | {over - within:.0f} |",
        "",
        "Per-run medians (µs): "
        + "; ".join(f"{m}: " + ", ".join(f"{s * 1e6:.0f}" for s in per_mode[m]) for m in MODES),
    ]
    out = ROOT / "bench" / "results" / "auto" / "overlap.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
