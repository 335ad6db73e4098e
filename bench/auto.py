"""``stageload auto`` against the script alone (eager) and a hand-made plan (issue 38).

Three models of equal size (``--mib`` each, default 256), each made by a plain factory
(built on ``meta``, given memory with ``to_empty``, its safetensors file copied in), run in
turn for ``--laps`` laps (default 3). Three ways, each in a fresh process:

- ``eager``: the script as written: the three models made up front, all resident;
- ``hand``: a hand-made plan: ``StagedModels`` with the script's factory as each model's
  loader and a stage per model, ``enter(stage)`` before each model's use (room for one
  model: each stage releases the other models);
- ``hand-files``: the same plan with stageload's own loaders (``from_safetensors``: the
  structure on ``meta``, the file read in place): the best hand-made plan here;
- ``auto``: the same script as eager, under ``stageload.auto`` with the budget of one model
  (it reloads from the files: the factory's argument names them, and its first load read
  them unchanged).

Figures, each the median of ``--runs`` (>= 7) runs, the modes interleaved in each run:
peak footprint (RssAnon + RssShmem, sampled every millisecond by a thread, in runs of
their own so the sampler does not slow the timed ones), and the wall time of a lap after
the first (the first lap of auto records the order; later laps follow it), also less the
time the lap spent in garbage collections (``gc.callbacks``). Outputs are
compared bit for bit with eager's in every run. Results: ``bench/results/auto/three_models.md``.

    python bench/auto.py [--mib 256] [--laps 3] [--runs 7]
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
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("a", "b", "c")
MODES = ("eager", "hand", "hand-files", "auto")
FACTORY = "auto:load_model"  # this file, imported as ``auto`` with bench/ on sys.path


def _net(width: int, depth: int):  # noqa: ANN202
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.layers(x))

    return Net


def load_model(path: str):  # noqa: ANN201
    """The factory: a model built on ``meta``, given empty memory of its own, and its
    weights copied in from the file one tensor at a time, as ``from_pretrained`` reads a
    checkpoint: anonymous memory, which the peak below counts. (It mapped the file's
    tensors before, ``assign=True``: file pages, which RssAnon + RssShmem leave out, so
    eager's peak read 150 MiB for 384 MiB of weights; ``load_state_dict(load_file(path))``
    would hold a second copy of the whole model while it loads.)"""
    import torch
    from safetensors import safe_open

    width, depth = int(os.environ["AUTO_BENCH_WIDTH"]), int(os.environ["AUTO_BENCH_DEPTH"])
    with torch.device("meta"):
        net = _net(width, depth)()
    net = net.to_empty(device="cpu")
    state = net.state_dict()
    with torch.no_grad(), safe_open(path, "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            state[key].copy_(f.get_tensor(key))
    return net


def _peak_sampler() -> tuple[threading.Event, list[int]]:
    """A thread that records the highest RssAnon + RssShmem every millisecond."""
    stop, peak = threading.Event(), [0]

    def sample() -> None:
        while not stop.is_set():
            fields = {}
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(("RssAnon:", "RssShmem:")):
                        key, value = line.split(":")
                        fields[key] = int(value.split()[0]) * 1024
            peak[0] = max(peak[0], sum(fields.values()))
            stop.wait(0.001)

    threading.Thread(target=sample, daemon=True).start()
    return stop, peak


def _gc_clock() -> list[float]:
    """A one-item list that sums the seconds this process spends in garbage collections
    (every generation, explicit or automatic), from ``gc.callbacks``."""
    import gc

    total, started = [0.0], [0.0]

    def clock(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - started[0]

    gc.callbacks.append(clock)
    return total


def child(mode: str, folder: str, laps: int, sample: bool, budget: int) -> None:
    """One run of one mode; prints a JSON line: lap times, their time in garbage
    collections, peak, output file."""
    import contextlib

    import torch

    import stageload

    torch.set_num_threads(1)
    # The factory as a script calls it: through its module, where auto wraps it.
    module = __import__(FACTORY.partition(":")[0])
    stop, peak = _peak_sampler() if sample else (threading.Event(), [0])
    paths = [f"{folder}/{n}.safetensors" for n in NAMES]
    width = int(os.environ["AUTO_BENCH_WIDTH"])
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(0))
    times, collecting, outs = [], [], []
    gc_seconds = _gc_clock()
    scope = (
        stageload.auto(budget=budget, factories=[FACTORY], defaults=False)
        if mode == "auto"
        else contextlib.nullcontext()
    )
    # Inference, as scripts run it: without no_grad each output's graph holds every weight
    # it used, and auto keeps such a model loaded (a release would free memory under it).
    with scope, torch.no_grad():
        if mode in ("hand", "hand-files"):
            if mode == "hand":
                loaders = {
                    n: (lambda p=p: module.load_model(p)) for n, p in zip(NAMES, paths, strict=True)
                }
            else:
                net = _net(width, int(os.environ["AUTO_BENCH_DEPTH"]))
                loaders = {
                    n: stageload.from_safetensors(lambda: net(), p, progress=False)
                    for n, p in zip(NAMES, paths, strict=True)
                }
            models = stageload.StagedModels(loaders, stages={n: [n] for n in NAMES})
            for _ in range(laps):
                start, gc_start = time.perf_counter(), gc_seconds[0]
                for n in NAMES:
                    models.enter(n)
                    x = models[n](x)
                times.append(time.perf_counter() - start)
                collecting.append(gc_seconds[0] - gc_start)
                outs.append(x)
            models.close()
        else:
            made = [module.load_model(p) for p in paths]
            for _ in range(laps):
                start, gc_start = time.perf_counter(), gc_seconds[0]
                for m in made:
                    x = m(x)
                times.append(time.perf_counter() - start)
                collecting.append(gc_seconds[0] - gc_start)
                outs.append(x)
    stop.set()
    out = Path(folder) / f"out-{mode}-{os.getpid()}.pt"
    torch.save(torch.stack(outs), out)
    print(json.dumps({"laps": times, "gc": collecting, "peak": peak[0], "out": str(out)}))


def run_child(mode: str, folder: str, args: argparse.Namespace, sample: bool) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "bench")]),
        OMP_NUM_THREADS="1",
        AUTO_BENCH_WIDTH=str(args.width),
        AUTO_BENCH_DEPTH=str(args.depth),
    )
    budget = int(args.mib * 1.1) << 20
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        folder,
        str(args.laps),
        str(int(sample)),
        str(budget),
    ]  # noqa: E501
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per model (default 256)")
    parser.add_argument("--laps", type=int, default=3)
    parser.add_argument("--runs", type=int, default=7)
    out = ROOT / "bench" / "results" / "auto" / "three_models.md"
    parser.add_argument("--out", default=str(out))
    args = parser.parse_args()
    if args.runs < 7:
        parser.error("--runs must be at least 7 (medians of 7 or more)")
    args.depth = 4
    args.width = int(((args.mib << 20) / 4 / args.depth) ** 0.5)

    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "bench"))
    from _touch import touch

    with tempfile.TemporaryDirectory() as folder:
        gen = torch.Generator().manual_seed(1)
        for n in NAMES:
            tensors = {}
            for i in range(args.depth):
                tensors[f"layers.{i}.weight"] = (
                    torch.randn(args.width, args.width, generator=gen) / args.width**0.5
                )  # noqa: E501
                tensors[f"layers.{i}.bias"] = torch.zeros(args.width)
            save_file(tensors, f"{folder}/{n}.safetensors")
        touch(4 * (args.mib << 20))  # this VM backs a page at its first touch: once, for all
        peaks: dict[str, list[int]] = {m: [] for m in MODES}
        laps: dict[str, list[float]] = {m: [] for m in MODES}
        bare: dict[str, list[float]] = {m: [] for m in MODES}  # laps less their collections
        equal = True
        for i in range(args.runs):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                peaks[mode].append(run_child(mode, folder, args, sample=True)["peak"])
            results = {mode: run_child(mode, folder, args, sample=False) for mode in order}
            want = torch.load(results["eager"]["out"])
            for mode in MODES:
                laps[mode].append(statistics.median(results[mode]["laps"][1:]))
                timed = results[mode]
                less = [t - g for t, g in zip(timed["laps"], timed["gc"], strict=True)]
                bare[mode].append(statistics.median(less[1:]))
                equal &= torch.equal(torch.load(results[mode]["out"]), want)
            print(
                f"run {i + 1}/{args.runs}: " + ", ".join(f"{m} {laps[m][-1]:.3f} s" for m in MODES),
                flush=True,
            )  # noqa: E501

    med = {m: statistics.median(peaks[m]) for m in MODES}
    lap = {m: statistics.median(laps[m]) for m in MODES}
    net = {m: statistics.median(bare[m]) for m in MODES}
    mib = 1 << 20
    lines = [
        "# stageload auto against eager and a hand-made plan",
        "",
        f"{date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, one torch thread. Three models of {args.mib} MiB "
        f"({args.depth} Linear({args.width}, {args.width})), {args.laps} laps, "
        f"medians of {args.runs} runs, modes interleaved. `python bench/auto.py`.",
        "",
        "| figure | eager | hand (factory) | hand (files) | auto | auto / hand (factory) | "
        "auto / hand (files) | auto / eager |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| peak footprint (RssAnon + RssShmem), MiB | {med['eager'] / mib:.0f} | "
        f"{med['hand'] / mib:.0f} | {med['hand-files'] / mib:.0f} | {med['auto'] / mib:.0f} | "
        f"{med['auto'] / med['hand']:.2f} | {med['auto'] / med['hand-files']:.2f} | "
        f"{med['auto'] / med['eager']:.2f} |",
        "| wall of a lap after the first (warm: files in the page cache), s | "
        f"{lap['eager']:.3f} | {lap['hand']:.3f} | "
        f"{lap['hand-files']:.3f} | {lap['auto']:.3f} | {lap['auto'] / lap['hand']:.2f} | "
        f"{lap['auto'] / lap['hand-files']:.2f} | {lap['auto'] / lap['eager']:.2f} |",
        "| the same less the lap's garbage collections, s | "
        f"{net['eager']:.3f} | {net['hand']:.3f} | "
        f"{net['hand-files']:.3f} | {net['auto']:.3f} | {net['auto'] / net['hand']:.2f} | "
        f"{net['auto'] / net['hand-files']:.2f} | {net['auto'] / net['eager']:.2f} |",
        "",
        f"Outputs bit for bit equal to eager's in every run: {'yes' if equal else 'NO'}.",
        "",
        "Budget of auto: 1.1 x one model; the hand-made plans list one model per stage. All",
        "three reload each model at each use (room for one): their laps time those loads.",
        "A hand-made plan's `enter` collects garbage once per stage (`gc.collect()`, as the",
        "earlier stageload's `release` did); auto's releases do not (they free the weights",
        "in place): the second lap row takes every collection out of every mode's laps.",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if equal else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        mode, folder, laps, sample, budget = sys.argv[2:7]
        child(mode, folder, int(laps), sample == "1", int(budget))
    else:
        sys.exit(main())
