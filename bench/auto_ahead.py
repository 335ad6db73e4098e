"""``stageload auto``'s loads ahead against auto without them and a hand-made plan with them.

A pipeline of diffusers' shape: an encoder, a denoiser twice its size and a decoder the
encoder's size (``--mib`` for the encoder, default 128), each made by a plain factory from
its safetensors file, run in turn for ``--laps`` laps (default 6). The budget holds the
denoiser alone or the encoder beside the decoder (2.1 x the encoder), so every model
reloads at every lap, and during the decoder's stage the next lap's encoder fits: loaded
ahead, its load overlaps the decoder's compute. Three ways, each in a fresh process:

- ``auto, no loads ahead``: ``stageload.auto(prefetch=False)``, every reload at its use;
- ``auto``: ``stageload.auto()`` as it runs by default;
- ``hand, loads ahead``: a hand-made plan, ``StagedModels`` with ``from_safetensors``
  loaders, a stage per model and ``FurthestNextUse(budget, prefetch=True)``.

Figure: the wall time of a lap from the third on (auto records the order in the first two),
the median over a run's laps, then the median of ``--runs`` (>= 7) runs, the modes
interleaved in each run; warm (the files stay in the page cache: reloads run at memory
speed) and cold (each lap starts by dropping the files from the page cache with
``posix_fadvise(DONTNEED)``, so every read comes from the disk, as on a machine whose
memory cannot cache the files beside the models). One torch thread (the load ahead has
the other core). Outputs are compared bit for bit in every run. Results:
``bench/results/auto/ahead.md``.

    python bench/auto_ahead.py [--mib 128] [--batch 32] [--laps 6] [--runs 7]
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
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Each model's name and its depth in layers of the encoder's count.
MODELS = {"encoder": 1, "denoiser": 2, "decoder": 1}
MODES = ("auto, no loads ahead", "auto", "hand, loads ahead")
FACTORY = "auto_ahead:load"  # this file, imported as ``auto_ahead`` with bench/ on sys.path
DEPTH = 4  # layers per unit of size

sys.path.insert(0, str(ROOT / "bench"))
from auto import _net  # noqa: E402 (bench/auto.py's model: Linear layers, then tanh)


def _shape(path: str) -> tuple[int, int]:
    name = Path(path).stem
    return int(os.environ["AHEAD_BENCH_WIDTH"]), DEPTH * MODELS[name]


def load(path: str):  # noqa: ANN201
    """The factory: the model built, then its file's tensors copied in."""
    import torch
    from safetensors.torch import load_file

    net = _net(*_shape(path))()
    with torch.no_grad():
        net.load_state_dict(load_file(path))
    return net


def _drop_from_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(mode: str, folder: str, laps: int, budget: int, batch: int, cold: bool) -> None:
    """One run of one mode; prints a JSON line: lap times, output file."""
    import contextlib

    import torch

    import stageload

    torch.set_num_threads(1)
    module = __import__(FACTORY.partition(":")[0])  # where auto wraps the factory
    paths = [f"{folder}/{n}.safetensors" for n in MODELS]
    width = int(os.environ["AHEAD_BENCH_WIDTH"])
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
    times, outs = [], []
    scope = (
        stageload.auto(budget=budget, factories=[FACTORY], defaults=False, prefetch=mode == "auto")
        if mode.startswith("auto")
        else contextlib.nullcontext()
    )
    with scope, torch.no_grad():
        if mode.startswith("hand"):
            loaders = {
                n: stageload.from_safetensors(_net(*_shape(p)), p, progress=False)
                for n, p in zip(MODELS, paths, strict=True)
            }
            policy = stageload.FurthestNextUse(budget, prefetch=True)
            with stageload.StagedModels(
                loaders, stages={n: [n] for n in MODELS}, policy=policy, prefetch=True
            ) as models:
                for _ in range(laps):
                    if cold:
                        _drop_from_page_cache(paths)
                    start = time.perf_counter()
                    for n in MODELS:
                        models.enter(n)
                        x = models[n](x)
                    times.append(time.perf_counter() - start)
                    outs.append(x)
        else:
            made = [module.load(p) for p in paths]
            for _ in range(laps):
                if cold:
                    _drop_from_page_cache(paths)
                start = time.perf_counter()
                for m in made:
                    x = m(x)
                times.append(time.perf_counter() - start)
                outs.append(x)
    out = Path(folder) / f"out-{mode.replace(' ', '_').replace(',', '')}-{os.getpid()}.pt"
    torch.save(torch.stack(outs), out)
    print(json.dumps({"laps": times, "out": str(out)}))


def run_child(mode: str, folder: str, args: argparse.Namespace, cold: bool) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "bench")]),
        OMP_NUM_THREADS="1",
        AHEAD_BENCH_WIDTH=str(args.width),
    )
    cmd = [sys.executable, __file__, "--child", mode, folder, str(args.laps), str(args.budget)]
    cmd += [str(args.batch), str(int(cold))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="the encoder's MiB (default 128)")
    parser.add_argument("--batch", type=int, default=32, help="rows per call (default 32)")
    parser.add_argument("--laps", type=int, default=6)
    parser.add_argument("--runs", type=int, default=7)
    out = ROOT / "bench" / "results" / "auto" / "ahead.md"
    parser.add_argument("--out", default=str(out))
    args = parser.parse_args()
    if args.runs < 7:
        parser.error("--runs must be at least 7 (medians of 7 or more)")
    if args.laps < 3:
        parser.error("--laps must be at least 3 (auto records the order in the first two)")
    args.width = int(((args.mib << 20) / 4 / DEPTH) ** 0.5)
    unit = DEPTH * (args.width * args.width + args.width) * 4
    args.budget = int(2.1 * unit)

    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "bench"))
    from _touch import touch

    with tempfile.TemporaryDirectory() as folder:
        gen = torch.Generator().manual_seed(1)
        for name, units in MODELS.items():
            tensors = {}
            for i in range(DEPTH * units):
                w = torch.randn(args.width, args.width, generator=gen) / args.width**0.5
                tensors[f"layers.{i}.weight"] = w
                tensors[f"layers.{i}.bias"] = torch.zeros(args.width)
            save_file(tensors, f"{folder}/{name}.safetensors")
        touch(6 * unit)  # this VM backs a page at its first touch: once, for all
        laps: dict[tuple[str, bool], list[float]] = {(m, c): [] for m in MODES for c in (0, 1)}
        equal = True
        for i in range(args.runs):
            for cold in (False, True):
                order = MODES if i % 2 == 0 else MODES[::-1]
                results = {mode: run_child(mode, folder, args, cold) for mode in order}
                want = torch.load(results[MODES[0]]["out"])
                for mode in MODES:
                    laps[mode, cold].append(statistics.median(results[mode]["laps"][2:]))
                    equal &= torch.equal(torch.load(results[mode]["out"]), want)
                print(
                    f"run {i + 1}/{args.runs} {'cold' if cold else 'warm'}: "
                    + ", ".join(f"{m} {laps[m, cold][-1]:.3f} s" for m in MODES),
                    flush=True,
                )

    def row(label: str, cold: bool) -> str:
        plain, auto, hand = (statistics.median(laps[m, cold]) for m in MODES)
        return (
            f"| {label} | {plain:.3f} | {auto:.3f} | {hand:.3f} | {auto / plain:.2f} | "
            f"{auto / hand:.2f} |"
        )

    lines = [
        "# stageload auto's loads ahead",
        "",
        f"{date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, one torch thread. An encoder of {args.mib} MiB, a denoiser of "
        f"{2 * args.mib} and a decoder of {args.mib} ({DEPTH} and {2 * DEPTH} Linear("
        f"{args.width}, {args.width})), batch {args.batch}, budget 2.1 x the encoder, "
        f"{args.laps} laps, medians of {args.runs} runs, modes interleaved. "
        "`python bench/auto_ahead.py`.",
        "",
        "| figure | auto, no loads ahead | auto | hand, loads ahead | auto / no loads ahead | "
        "auto / hand |",
        "|---|---:|---:|---:|---:|---:|",
        row("wall of a lap from the third on, warm (files in the page cache), s", False),
        row("the same, cold (every read from the disk), s", True),
        "",
        f"Outputs bit for bit equal across the modes in every run: {'yes' if equal else 'NO'}.",
        "",
        "Every model reloads at every lap in every mode (the denoiser needs the whole budget);",
        "with loads ahead, the next lap's encoder loads during the decoder's compute.",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if equal else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        mode, folder, laps, budget, batch, cold = sys.argv[2:8]
        child(mode, folder, int(laps), int(budget), int(batch), cold == "1")
        sys.exit(0)
    sys.exit(main())
