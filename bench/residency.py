"""Residency under a memory budget: N calls of a pipeline, eager against staged loading today,
staged with a budget, and staged with a budget and prefetch.

Each (workload, N, mode, budget) runs in its own process under MemoryMeter (sampler process,
0.05 s). Reported against eager at the same N: wall time, wall time from the 2nd call on,
loads (load + reload + prefetch events), and (peak footprint - footprint before loading) /
budget. The outputs' sha256 must agree across modes. Results: bench/results/residency/.

Workloads:
  demo  the demo pipeline with ``stageload demo``'s default weights (268 + 336 + 268 MiB of
        float32), loaded with ``from_safetensors`` in every mode (it draws no random numbers,
        so prefetch may run it), and a lighter call: batch 8, 2 encode passes, 4 steps.
  qwen  a Qwen-Image 2.1 pipeline with random weights, ``--qwen-gb`` GB per large model
        (float16 on disk, run in bfloat16, so every weight is copied into process memory),
        64x64, two steps, one prompt and generator per call.

Budgets, from the models' sizes s1 >= s2 >= s3 (checkpoint headers): all = s1+s2+s3 plus
1 %; two = s1 + s2 + s3/2 (any two fit, never three); one = s1 + s3/2 (the largest fits,
with no second model beside it).

    python bench/residency.py                               # demo and qwen, N = 1 4 8
    python bench/residency.py --workloads demo --ns 1 4     # a quick look

The prefetch cost model (issue 22), ``python bench/residency.py cost``: three real modules
(96 + 128 + 96 MiB float32, ``from_safetensors`` from real files), three stages of one
model each, ``--calls`` calls; the page cache dropped before each load (``cold``, as where
memory is tight) or kept (``warm``); per stage the model's first layer and a fixed amount of filler
compute (matrix products, a count calibrated once to about ``--long`` or ``--short``
seconds, the same count in every mode, so outputs can be compared bit for bit). Budgets:
roomy (all three) and two of three; modes: no prefetch, prefetch with the cost model,
prefetch with it off. Runs interleaved, ``--repeats`` each (medians), in this process, after
touching the working size once (bench/_touch.py).

What a background load takes from the compute beside it, ``python bench/residency.py
contention``: the filler alone, then beside a cold load on another thread, pairs back to
back: at nice 0 and at +10 (the priority loads ahead ran at until issue 37 removed it for
gaining nothing here), with 4, 2 or 1 readers, into huge-page-advised or plain destinations.

The slow tail of loads ahead, ``python bench/residency.py tail``: the long cold case
prefetching at every stage, each run in a fresh process, with loads ahead into huge pages or
plain ones, and huge-page advice taken back on release or left on freed memory.

The first call under a budget (issue 22), ``python bench/residency.py first-call``: the same
three modules, a budget for two, no ``sizes=``: models and bytes held while each stage's
code runs, with the release after a load (``after_load``) and without it (the rule before).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "residency"
MODES = ("eager", "staged", "budget", "budget+prefetch")
BUDGETS = ("all", "two", "one")
WORKLOADS = ("demo", "qwen")
QWEN = Path(os.environ.get("STAGELOAD_BENCH_QWEN", "/tmp/stageload-bench/qwen21-0.25g"))


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))


def _sha(tensors: list[Any]) -> list[str]:
    return [hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest() for t in tensors]


def budget_bytes(sizes: dict[str, int], which: str) -> int:
    s1, s2, s3 = sorted(sizes.values(), reverse=True)[:3]
    return {"all": int((s1 + s2 + s3) * 1.01), "two": s1 + s2 + s3 // 2, "one": s1 + s3 // 2}[which]


# -- workers: one cell in this process --------------------------------------------------------


def demo_sizes() -> tuple[Any, Path, dict[str, int]]:
    from stageload.demo.pipeline import MODELS, SIZES, default_cache_dir, ensure_weights
    from stageload.load.checkpoint import checkpoint_bytes

    folder, _ = ensure_weights(SIZES["default"], default_cache_dir())
    sizes = {m: checkpoint_bytes(folder / f"{m}.safetensors") for m in MODELS}
    return SIZES["default"], folder, sizes


def work_demo(mode: str, n: int, budget: int | None, sink: Any, times: list[float]) -> list[Any]:
    from dataclasses import replace

    from stageload import StagedModels
    from stageload.demo.pipeline import MODELS, STAGES, build_model
    from stageload.demo.pipeline import run_pipeline as pipeline
    from stageload.load.weights import from_safetensors

    size, folder, sizes = demo_sizes()
    call = replace(size, batch=8, encode_passes=2, steps=4)
    loaders = {
        m: from_safetensors(lambda m=m: build_model(size, m), folder / f"{m}.safetensors")
        for m in MODELS
    }
    kwargs: dict[str, Any] = {}
    if mode.startswith("budget"):
        kwargs = {"budget": budget, "sizes": sizes, "prefetch": mode.endswith("prefetch")}
    pinned = MODELS if mode == "eager" else ()
    times.append(time.perf_counter())
    models = StagedModels(loaders, stages=STAGES, pinned=pinned, events=sink, **kwargs)
    if mode == "eager":
        for name in MODELS:
            models[name]
    outs = []
    for i in range(n):
        outs.append(pipeline(models, replace(call, seed=call.seed + i), models.enter))
        times.append(time.perf_counter())
    return outs


def qwen_sizes() -> dict[str, int]:
    import torch

    from stageload.diffusers import _plan

    names = ("text_encoder", "transformer", "vae")
    return _plan.component_sizes(QWEN, dict.fromkeys(names, torch.bfloat16))


def work_qwen(mode: str, n: int, budget: int | None, sink: Any, times: list[float]) -> list[Any]:
    import diffusers
    import torch

    from stageload import Event
    from stageload.diffusers import _dtype_kwarg, _plan, staged_pipeline
    from stageload.diffusers.measure import _materialized
    from stageload.testing import diffusers as fixtures  # noqa: F401 (registers the processor)

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    cls, dtype = diffusers.QwenImage21Pipeline, torch.bfloat16
    times.append(time.perf_counter())
    if mode == "eager":
        extra = _materialized(_plan.model_components(QWEN), str(QWEN), dtype)
        pipe = cls.from_pretrained(QWEN, **_dtype_kwarg(dtype), **extra)
        for name in ("text_encoder", "transformer", "vae"):  # counted as the staged ones are
            sink.emit(Event("load", model=name))
    else:
        kwargs: dict[str, Any] = {}
        if mode.startswith("budget"):
            kwargs = {"budget": budget, "prefetch": mode.endswith("prefetch")}
        pipe = staged_pipeline(
            cls, QWEN, torch_dtype=dtype, disable_mmap=True, keep=(), events=sink, **kwargs
        )
    outs = []
    for i in range(n):
        generator = torch.Generator().manual_seed(i)
        out = pipe(
            prompt=f"a lighthouse at night, picture {i}",
            height=64,
            width=64,
            output_resolution=64,
            num_inference_steps=2,
            output_type="pt",
            generator=generator,
        )
        outs.append(out.images)
        times.append(time.perf_counter())
    return outs


def worker(workload: str, mode: str, n: int, which: str, trace: Path, result: Path) -> None:
    import torch

    from stageload import ListSink, MemoryMeter, TeeSink
    from stageload.memory import read_process
    from stageload.report.records import read_trace

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    sizes = demo_sizes()[2] if workload == "demo" else qwen_sizes()
    budget = budget_bytes(sizes, which) if mode.startswith("budget") else None
    sink = ListSink()
    times: list[float] = []
    base = read_process().footprint
    with MemoryMeter(trace, 0.05, meta={"label": f"{workload} {mode} {which} N={n}"}) as meter:
        work = work_demo if workload == "demo" else work_qwen
        outs = work(mode, n, budget, TeeSink(meter, sink), times)
    samples = [s.footprint for s in read_trace(trace).samples if s.footprint is not None]
    loads = [e for e in sink.events if e.kind in ("load", "reload", "prefetch")]
    out = {
        "workload": workload,
        "mode": mode,
        "budget_name": which if budget else None,
        "budget": budget,
        "sizes": sizes,
        "n": n,
        "wall_seconds": times[-1] - times[0],
        "call_seconds": [b - a for a, b in zip(times, times[1:], strict=False)],
        "loads": len(loads),
        "prefetch_seconds": sum(e.seconds or 0 for e in loads if e.kind == "prefetch"),
        "load_seconds": sum(e.seconds or 0 for e in loads),
        "peak_footprint": max(samples) if samples else None,
        "baseline_footprint": base,
        "over_budget_notes": len([e for e in sink.kinds("note") if "over the budget" in e.note]),
        "sha256": _sha(outs),
    }
    result.write_text(json.dumps(out, indent=2) + "\n")


# -- parent ----------------------------------------------------------------------------------


def build_qwen(path: Path, gb: float) -> None:
    if (path / "model_index.json").exists():
        return
    code = (
        "import torch; from stageload.testing import diffusers as f; "
        f"f.build('qwen-image-2.1', {str(path)!r}, dtype=torch.float16, "
        f"size=f.Size.for_bytes({int(gb * 1e9)}, bytes_per_param=2), vae_dim=16)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


def run_one(workload: str, mode: str, n: int, which: str, rep: int) -> dict[str, Any]:
    stem = f"{workload}-{mode.replace('+', '-')}-{which}-n{n}-r{rep}"
    trace, result = OUT / "traces" / f"{stem}.jsonl", OUT / "traces" / f"{stem}.json"
    cmd = [sys.executable, __file__, "worker", workload, mode, str(n), which, str(trace)]
    proc = subprocess.run([*cmd, str(result)], env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{stem} failed:\n{proc.stderr[-3000:]}")
    data = json.loads(result.read_text())
    print(f"{stem}: {data['wall_seconds']:.1f} s, {data['loads']} loads", flush=True)
    return data


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    cells = sorted({(r["workload"], r["n"]) for r in runs}, key=lambda k: (k[0], k[1]))
    for workload, n in cells:
        mine = [r for r in runs if (r["workload"], r["n"]) == (workload, n)]
        eager = [r for r in mine if r["mode"] == "eager"]
        e_wall = statistics.median(r["wall_seconds"] for r in eager) if eager else None
        e_rest = statistics.median(sum(r["call_seconds"][1:]) for r in eager) if eager else None
        hashes = {tuple(r["sha256"]) for r in mine}
        for mode in MODES:
            for which in (None, *BUDGETS):
                got = [r for r in mine if r["mode"] == mode and r["budget_name"] == which]
                if not got:
                    continue
                wall = statistics.median(r["wall_seconds"] for r in got)
                rest = statistics.median(sum(r["call_seconds"][1:]) for r in got)
                peak = statistics.median(r["peak_footprint"] - r["baseline_footprint"] for r in got)
                rows.append(
                    {
                        "workload": workload,
                        "n": n,
                        "mode": mode,
                        "budget": which,
                        "budget_bytes": got[0]["budget"],
                        "wall_seconds": wall,
                        "wall_vs_eager": wall / e_wall if e_wall else None,
                        "from_2nd_vs_eager": rest / e_rest if e_rest and n > 1 else None,
                        "loads": got[0]["loads"],
                        "load_seconds": statistics.median(r["load_seconds"] for r in got),
                        "prefetch_seconds": statistics.median(r["prefetch_seconds"] for r in got),
                        "peak_over_baseline": peak,
                        "peak_vs_budget": peak / got[0]["budget"] if got[0]["budget"] else None,
                        "over_budget_notes": got[0]["over_budget_notes"],
                        "runs": len(got),
                        "identical": len(hashes) == 1,
                    }
                )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(value: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if value is None else fmt.format(value)

    lines = [
        "| workload | N | mode | budget | wall s | / eager | 2nd call on / eager | loads "
        "| prefetch s | (peak - base) / budget | outputs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        budget = (
            "-" if r["budget"] is None else f"{r['budget']} ({r['budget_bytes'] / 2**20:.0f} MiB)"
        )
        lines.append(
            f"| {r['workload']} | {r['n']} | {r['mode']} | {budget} | {r['wall_seconds']:.1f} | "
            f"{f(r['wall_vs_eager'])} | {f(r['from_2nd_vs_eager'])} | {r['loads']} | "
            f"{f(r['prefetch_seconds'], '{:.1f}')} | {f(r['peak_vs_budget'])} | "
            f"{'identical' if r['identical'] else 'DIFFER'} |"
        )
    return "\n".join(lines)


# -- the prefetch cost model ------------------------------------------------------------------
COST_MODES = ("roomy", "two", "two+prefetch", "two+prefetch, cost model off")
LOAD_KINDS = ("load", "reload", "prefetch")
PAGES = {"thp": "huge pages advised", "plain": "plain"}


def positive(text: str) -> int:
    """A count flag (``--repeats``, ``--calls``, ``--runs``): a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def p90(sorted_values: list[float]) -> float:
    """The 90th percentile (nearest rank below) of values already sorted."""
    return sorted_values[int(0.9 * (len(sorted_values) - 1))]


def publish(path: Path, lines: list[str]) -> None:
    """Write a results table (markdown lines) and print it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


COST_SIZES = {"a": 6, "b": 8, "c": 6}  # Linear(2048, 2048) layers: 16 MiB each


def cost_checkpoints(folder: Path) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file
    from torch import nn

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, layers in COST_SIZES.items():
        path = folder / f"{name}-{layers}.safetensors"
        if not path.exists():
            torch.manual_seed(layers)
            model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(layers)])
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        paths[name] = path
    return paths


def filler(iters: int) -> Any:
    """Deterministic stand-in compute: ``iters`` products of two 384x384 matrices."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(384, 384, generator=g)
    b = torch.randn(384, 384, generator=g) / 20
    for _ in range(iters):
        a = torch.tanh(a @ b) + 0.5  # away from 0: denormals would slow later iterations
    return a


def calibrate(seconds: float) -> int:
    """Filler iterations for about ``seconds``, from the median of 5 timings."""
    filler(20)
    per = []
    for _ in range(5):
        start = time.perf_counter()
        filler(30)
        per.append((time.perf_counter() - start) / 30)
    return max(1, round(seconds / statistics.median(per)))


def drop_cache(path: Path) -> None:
    """Drop ``path`` from the page cache, as memory pressure would before a reload."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_cold_read(path: Path) -> float:
    """Seconds to read ``path`` once, cold, sequentially into one reused 16 MiB buffer: the
    disk's own time for the bytes a load reads, beside which loads are judged."""
    buf = memoryview(bytearray(16 << 20))
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        start, offset = time.perf_counter(), 0
        while n := os.preadv(fd, [buf], offset):
            offset += n
        return time.perf_counter() - start
    finally:
        os.close(fd)


def cost_run(
    paths: dict[str, Path], mode: str, iters: int, calls: int, cold: bool = False
) -> dict[str, Any]:
    import torch
    from torch import nn

    from stageload import ListSink, StagedModels, rng_free
    from stageload.core.policy import FurthestNextUse
    from stageload.load.checkpoint import checkpoint_bytes
    from stageload.load.weights import from_safetensors

    sizes = {n: checkpoint_bytes(p) for n, p in paths.items()}
    s1, s2, s3 = sorted(sizes.values(), reverse=True)
    budget = int(sum(sizes.values()) * 1.01) if mode == "roomy" else s1 + s2 + s3 // 2
    stages = {f"stage-{n}": (n,) for n in paths}
    loaders = {
        n: from_safetensors(
            lambda n=n: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(COST_SIZES[n])]), p
        )
        for n, p in paths.items()
    }
    if cold:  # every load reads the disk, as where the page cache cannot hold the weights

        def cold_loader(load: Any, path: Path) -> Any:
            return rng_free(lambda: (drop_cache(path), load())[1])

        loaders = {n: cold_loader(loaders[n], paths[n]) for n in loaders}
    kw: dict[str, Any] = {"budget": budget}
    if "prefetch" in mode:
        kw = {
            "policy": FurthestNextUse(budget, prefetch=True, cost_model="off" not in mode),
            "prefetch": True,
        }
    sink = ListSink()
    x0 = torch.linspace(-1, 1, 2048).repeat(4, 1)
    outs = []
    start = time.perf_counter()
    with (
        torch.no_grad(),
        StagedModels(loaders, stages=stages, sizes=sizes, events=sink, **kw) as models,
    ):
        for call in range(calls):
            x = x0 + call
            for stage, (name,) in stages.items():
                models.enter(stage)
                # One layer of the model: its weights shape the output, while the stage's
                # time is the filler's (a whole forward pass alone hides most loads).
                x = torch.tanh(models[name][0](x)) + filler(iters)[:4, :1].sum()
            outs.append(x)
    wall = time.perf_counter() - start
    kinds = [e.kind for e in sink.events]
    notes = [e.note for e in sink.kinds("note") if e.note and e.note.startswith("prefetch ")]
    return {
        "mode": mode,
        "wall_seconds": wall,
        "loads": sum(k in LOAD_KINDS for k in kinds),
        "prefetches": kinds.count("prefetch"),
        "load_seconds": [e.seconds for e in sink.events if e.kind in LOAD_KINDS],
        "ahead_seconds": [e.seconds for e in sink.events if e.kind == "prefetch"],
        "made": sum(": made" in n for n in notes),
        "skipped": sum(": skipped" in n for n in notes),
        "budget": budget,
        "sha256": _sha(outs),
    }


def cost_main(argv: list[str]) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _touch import touch

    p = argparse.ArgumentParser(description="the prefetch cost model")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--calls", type=positive, default=4)
    p.add_argument("--long", type=float, default=0.3, help="filler seconds per stage")
    p.add_argument("--short", type=float, default=0.02)
    p.add_argument("--dir", type=Path, default=Path("/tmp/stageload-bench-cost"))
    p.add_argument("--cache", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    p.add_argument("--stages", nargs="+", choices=("long", "short"), default=["long", "short"])
    p.add_argument("--out", type=Path, default=OUT, help="folder for the tables and JSON")
    args = p.parse_args(argv)
    # One compute thread: with two, an OpenMP barrier waits on a thread that other
    # processes' jobs have descheduled, and the same filler took from 0.05 to 1 s per stage.
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    paths = cost_checkpoints(args.dir)
    for path in paths.values():
        path.read_bytes()  # page cache warm: this bench times the policy, not the disk
    touched = touch(2 * sum(p.stat().st_size for p in paths.values()))
    iters = {c: calibrate(args.long if c == "long" else args.short) for c in args.stages}
    cases = {f"{c}, {cache}": (iters[c], cache == "cold") for cache in args.cache for c in iters}
    runs: list[dict[str, Any]] = []
    raw: list[float] = []
    for rep in range(args.repeats):
        for case, (n, cold) in cases.items():
            raw.append(raw_cold_read(paths["b"]))
            # Interleaved, so machine load hits every mode alike, and each repeat starts one
            # mode later: the machine drifted by up to 20 % within a repeat.
            for mode in COST_MODES[rep % 4 :] + COST_MODES[: rep % 4]:
                got = cost_run(paths, mode, n, args.calls, cold) | {"case": case, "iters": n}
                runs.append(got)
                print(
                    f"r{rep} {case:11s} {mode:30s} {got['wall_seconds']:.2f} s, "
                    f"{got['loads']} loads ({got['prefetches']} prefetched), "
                    f"made {got['made']} skipped {got['skipped']}",
                    flush=True,
                )
    rows = []
    med = statistics.median
    for case in cases:
        cell = {m: [r for r in runs if r["case"] == case and r["mode"] == m] for m in COST_MODES}
        wall = {m: med(r["wall_seconds"] for r in cell[m]) for m in COST_MODES}
        gap = wall["two"] - wall["roomy"]
        hashes = {tuple(r["sha256"]) for r in runs if r["case"] == case}
        for m in COST_MODES:
            # Loads ahead pooled over the cell's runs: their spread, not only their middle,
            # decides whether they hide (a slow tail leaves the next stage waiting).
            ahead = sorted(t for r in cell[m] for t in r["ahead_seconds"])
            rows.append(
                {
                    "case": case,
                    "filler_seconds": args.long if case.startswith("long") else args.short,
                    "mode": m,
                    "wall_seconds": wall[m],
                    "vs_two": wall[m] / wall["two"],
                    "gap_closed": (wall["two"] - wall[m]) / gap if gap > 0 else None,
                    "loads": med(r["loads"] for r in cell[m]),
                    "prefetches": med(r["prefetches"] for r in cell[m]),
                    "load_seconds": med(med(r["load_seconds"]) for r in cell[m]),
                    "ahead_p50": med(ahead) if ahead else None,
                    "ahead_p90": p90(ahead) if ahead else None,
                    "identical": len(hashes) == 1,
                    "runs": len(cell[m]),
                }
            )
    lines = [
        f"# The prefetch cost model ({args.calls} calls, {args.repeats} runs per cell, medians)",
        "",
        f"Machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end "
        f"(medians of interleaved runs; ratios within a case). Memory touched once before "
        f"timing ({touched:.1f} s, bench/_touch.py). Cold: each checkpoint dropped from the "
        f"page cache (posix_fadvise DONTNEED) right before each of its loads, as where memory "
        f"is too tight to cache it; warm: read once beforehand and never dropped. The disk "
        f"alone: a raw sequential cold read of the 128 MiB checkpoint, once per case and "
        f"repeat, took {statistics.median(raw):.3f} s (median; {min(raw):.3f}-{max(raw):.3f}).",
        "",
        "| stage compute, page cache | mode | wall s | / two, no prefetch | share of the gap "
        "to roomy closed | loads | of which prefetched | median load s "
        "| load ahead s, median / 90th percentile | outputs |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        closed = "-" if r["gap_closed"] is None else f"{r['gap_closed']:.2f}"
        spread = "-" if r["ahead_p50"] is None else f"{r['ahead_p50']:.2f} / {r['ahead_p90']:.2f}"
        lines.append(
            f"| {r['case']} ({r['filler_seconds']:g} s filler) | {r['mode']} | "
            f"{r['wall_seconds']:.2f} | {r['vs_two']:.2f} | {closed} | {r['loads']:g} | "
            f"{r['prefetches']:g} | {r['load_seconds']:.2f} | {spread} | "
            f"{'identical' if r['identical'] else 'DIFFER'} |"
        )
    publish(args.out / "cost.md", lines)
    (args.out / "cost.json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=2) + "\n")
    for path in paths.values():
        path.unlink()
    args.dir.rmdir()


def first_call(paths: dict[str, Path], trim: bool) -> dict[str, Any]:
    """One call with a budget for two of the three models and no ``sizes=``: the models
    and bytes held each time a stage's code runs, and at most at any event (a load event
    comes before the releases its size makes due)."""
    import torch
    from torch import nn

    from stageload import ListSink, StagedModels
    from stageload.core.policy import FurthestNextUse
    from stageload.hooks.release import module_bytes
    from stageload.load.checkpoint import checkpoint_bytes
    from stageload.load.weights import from_safetensors

    class TrimOff(FurthestNextUse):
        def after_load(self, *args: Any) -> list[str]:  # the rule before issue 22
            return []

    sizes = {n: checkpoint_bytes(p) for n, p in paths.items()}
    s1, s2, s3 = sorted(sizes.values(), reverse=True)
    budget = s1 + s2 + s3 // 2
    loaders = {
        n: from_safetensors(
            lambda n=n: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(COST_SIZES[n])]), p
        )
        for n, p in paths.items()
    }
    stages = {f"stage-{n}": (n,) for n in paths}
    sink = ListSink()
    policy = FurthestNextUse(budget) if trim else TrimOff(budget)
    held: list[tuple[int, int]] = []
    with torch.no_grad(), StagedModels(loaders, stages=stages, events=sink, policy=policy) as m:
        for stage, (name,) in stages.items():
            m.enter(stage)
            m[name](torch.zeros(1, 2048))
            resident = m.resident()
            held.append((len(resident), sum(module_bytes(x) for x in resident.values())))
    live, peak = 0, 0
    for e in sink.events:
        if e.kind in LOAD_KINDS:
            live += e.bytes or 0
        elif e.kind == "release" and e.reason != "close":
            live -= e.bytes or 0
        peak = max(peak, live)
    return {
        "rule": "after_load (issue 22)" if trim else "before (no release until enter)",
        "budget": budget,
        "models_held_max": max(n for n, _ in held),
        "bytes_held_max": max(b for _, b in held),
        "bytes_at_events_max": peak,
    }


def first_call_main() -> None:
    folder = Path("/tmp/stageload-bench-firstcall")
    paths = cost_checkpoints(folder)
    rows = [first_call(paths, trim) for trim in (True, False)]
    mib = 2**20
    lines = [
        "# The first call under a budget for two of three, no sizes= (one run each: counts "
        "and bytes are exact, not timings)",
        "",
        f"Models 96 + 128 + 96 MiB float32 (`from_safetensors`), "
        f"budget {rows[0]['budget'] / mib:.0f} MiB.",
        "",
        "| rule | models held while a stage's code runs, at most | their bytes / budget | "
        "bytes at any event / budget |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['models_held_max']} | {r['bytes_held_max'] / r['budget']:.2f} | "
            f"{r['bytes_at_events_max'] / r['budget']:.2f} |"
        )
    publish(OUT / "first-call.md", lines)
    (OUT / "first-call.json").write_text(json.dumps(rows, indent=2) + "\n")
    for path in paths.values():
        path.unlink()
    folder.rmdir()


# -- what a background load takes from the compute it overlaps --------------------------------
def contention_main(argv: list[str]) -> None:
    """A stage's filler alone, then beside a cold load of the 128 MiB model on another thread,
    pairs back to back, the load's thread at nice 0 and at +10."""
    import threading

    import torch
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _touch import touch

    from stageload.load.weights import from_safetensors

    p = argparse.ArgumentParser(description="what a background load takes from compute")
    p.add_argument("--runs", type=positive, default=7)
    p.add_argument("--seconds", type=float, default=0.3, help="filler seconds")
    p.add_argument("--dir", type=Path, default=Path("/tmp/stageload-bench-cost"))
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    path = cost_checkpoints(args.dir)["b"]
    touched = touch(2 * path.stat().st_size)
    iters = calibrate(args.seconds)
    import stageload.load.weights as weights

    # (nice, reader threads, destination pages): the load as on demand, then as ahead.
    nicer = 10  # the priority loads ahead ran at before issue 37
    variants = [
        (0, 4, "thp"),
        (nicer, 4, "thp"),
        (nicer, 4, "plain"),
        (nicer, 2, "plain"),
        (nicer, 1, "plain"),
    ]
    build = lambda: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # noqa: E731
    samples: dict[tuple[int, int, str], list[tuple[float, float, float]]] = {
        v: [] for v in variants
    }
    for run in range(args.runs):
        # Variants interleaved within a run (rotated per run), so drift hits them alike.
        for nice, threads, pages in variants[run % 5 :] + variants[: run % 5]:
            load = from_safetensors(build, path, threads=threads)
            weights._ALLOC = pages
            start = time.perf_counter()
            filler(iters)
            alone = time.perf_counter() - start
            drop_cache(path)
            took: list[float] = []

            def background(nice: int = nice, took: list[float] = took, load: Any = load) -> None:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
                t0 = time.perf_counter()
                load()
                took.append(time.perf_counter() - t0)

            thread = threading.Thread(target=background)
            start = time.perf_counter()
            thread.start()
            filler(iters)
            beside = time.perf_counter() - start
            thread.join()
            samples[(nice, threads, pages)].append((alone, beside, took[0]))
    med = statistics.median
    rows = [
        {
            "nice": nice,
            "threads": threads,
            "pages": pages,
            "alone": med(a for a, _, _ in got),
            "beside": med(b for _, b, _ in got),
            "taken": med(b - a for a, b, _ in got),
            "load": med(t for _, _, t in got),
        }
        for (nice, threads, pages), got in samples.items()
    ]
    for r in rows:
        print(r, flush=True)
    lines = [
        f"# What a cold background load takes from the compute beside it ({args.runs} pairs)",
        "",
        f"Filler compute of about {args.seconds:g} s on {torch.get_num_threads()} torch "
        f"thread(s), alone and then beside "
        f"a cold load (page cache dropped) of a 128 MiB checkpoint on another thread, pairs "
        f"back to back, medians. Machine: {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; memory touched once before timing ({touched:.1f} s).",
        "",
        "| load thread's nice | reader threads | destination pages | filler alone s "
        "| filler beside the load s | taken from the filler s (median of pairs) | the load s |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| +{r['nice']} | {r['threads']} | {PAGES[r['pages']]} | {r['alone']:.3f} | "
            f"{r['beside']:.3f} | "
            f"{r['taken']:.3f} | {r['load']:.3f} |"
        )
    publish(OUT / f"contention-{torch.get_num_threads()}t.md", lines)


# -- the slow tail of loads ahead -------------------------------------------------------------
TAIL_VARIANTS = {
    "now": "plain pages ahead, huge-page advice taken back on release",
    "huge pages ahead": "loads ahead advise huge pages too (as before)",
    "advice kept on release": "plain pages ahead, advice left on freed memory (as before)",
}


def tail_worker(
    variant: str, calls: int, seconds: float, folder: Path, warmup: int
) -> dict[str, Any]:
    """One process: a run loading on demand (huge pages, as any process that loaded before),
    then the measured run, prefetching at every stage; the loads ahead's times."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _touch import touch

    import stageload.hooks.release as release
    import stageload.load.weights as weights

    if variant == "huge pages ahead":
        weights.in_background = lambda: False
    elif variant == "advice kept on release":
        release.forget_huge_pages = lambda ptr, nbytes: None
    torch.set_num_threads(1)
    paths = cost_checkpoints(folder)
    touch(2 * sum(p.stat().st_size for p in paths.values()))
    iters = calibrate(seconds)
    cost_run(paths, "two", iters, warmup, cold=True)
    got = cost_run(paths, "two+prefetch, cost model off", iters, calls, cold=True)
    return {"variant": variant, "wall_seconds": got["wall_seconds"], "ahead": got["ahead_seconds"]}


def tail_main(argv: list[str]) -> None:
    """Loads ahead's times in the cost bench's long cold case, prefetching at every stage,
    with huge pages ahead or not and the advice taken back on release or not; each run in a
    fresh process (advice on freed memory outlives a run), variants interleaved."""
    p = argparse.ArgumentParser(description="the slow tail of loads ahead")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--calls", type=positive, default=12)
    p.add_argument("--seconds", type=float, default=0.3, help="filler seconds per stage")
    p.add_argument("--warmup", type=positive, default=3, help="calls loading on demand first")
    p.add_argument("--name", default="tail", help="the table's file name, without .md")
    p.add_argument("--dir", type=Path, default=Path("/tmp/stageload-bench-cost"))
    args = p.parse_args(argv)
    names = list(TAIL_VARIANTS)
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for variant in names[rep % 3 :] + names[: rep % 3]:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "tail-worker",
                    variant,
                    str(args.calls),
                    str(args.seconds),
                    str(args.dir),
                    str(args.warmup),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            ahead = sorted(runs[-1]["ahead"])
            print(
                f"r{rep} {variant:24s} wall {runs[-1]['wall_seconds']:.2f} s, loads ahead "
                f"median {statistics.median(ahead):.3f} s, over 0.25 s: "
                f"{sum(t > 0.25 for t in ahead)} of {len(ahead)}",
                flush=True,
            )
    lines = [
        f"# The slow tail of loads ahead ({args.repeats} runs per variant, {args.calls} calls)",
        "",
        f"The cost bench's long cold case (three modules of 96, 128 and 96 MiB, a budget for two, "
        f"{args.seconds:g} s of filler per stage on one torch thread, each checkpoint dropped "
        f"from the page cache before its load), prefetching at every stage. Each run in a "
        f"fresh process, after a run of {args.warmup} calls loading on demand with huge pages; "
        f"variants "
        f"interleaved. Loads ahead pooled over the runs. Machine: {os.cpu_count()} CPUs, load "
        f"average {os.getloadavg()[0]:.1f} at the end.",
        "",
        "| variant | what | wall s (median) | loads ahead | median s | 90th percentile s "
        "| over 0.25 s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for variant in names:
        mine = [r for r in runs if r["variant"] == variant]
        ahead = sorted(t for r in mine for t in r["ahead"])
        lines.append(
            f"| {variant} | {TAIL_VARIANTS[variant]} | "
            f"{statistics.median(r['wall_seconds'] for r in mine):.2f} | {len(ahead)} | "
            f"{statistics.median(ahead):.3f} | {p90(ahead):.3f} | "
            f"{sum(t > 0.25 for t in ahead) / len(ahead):.0%} |"
        )
    publish(OUT / f"{args.name}.md", lines)


def main() -> None:
    global OUT  # --out moves the tables and traces
    if len(sys.argv) > 1 and sys.argv[1] == "first-call":
        first_call_main()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "cost":
        cost_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "contention":
        contention_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "tail":
        tail_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "tail-worker":
        variant, calls, seconds, folder, warmup = sys.argv[2:7]
        got = tail_worker(variant, int(calls), float(seconds), Path(folder), int(warmup))
        print(json.dumps(got))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        workload, mode, n, which, trace, result = sys.argv[2:8]
        worker(workload, mode, int(n), which, Path(trace), Path(result))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "summarize":
        # Tables from the runs that finished (traces/*.json), e.g. after a run cut short.
        folders = [Path(f) for f in sys.argv[2:]] or [OUT]
        runs = [json.loads(f.read_text()) for d in folders for f in sorted(d.glob("traces/*.json"))]
        if not runs:  # traces/ is not committed (results.json holds every run): keep the tables
            sys.exit(f"no runs in {[str(d / 'traces') for d in folders]}: nothing to summarize")
        write(runs)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--ns", nargs="+", type=positive, default=[1, 4, 8])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--budgets", nargs="+", choices=BUDGETS, default=list(BUDGETS))
    p.add_argument("--repeats", type=positive, default=3, help="runs per cell; medians reported")
    p.add_argument("--qwen-gb", type=float, default=0.25, help="GB per large Qwen model")
    p.add_argument("--out", type=Path, default=OUT, help="folder for tables and traces")
    args = p.parse_args()
    OUT = args.out
    (OUT / "traces").mkdir(parents=True, exist_ok=True)
    if "qwen" in args.workloads:
        path = Path(f"/tmp/stageload-bench/qwen21-{args.qwen_gb:g}g")
        os.environ["STAGELOAD_BENCH_QWEN"] = str(path)
        build_qwen(path, args.qwen_gb)
    runs = []
    for workload in args.workloads:
        for n in args.ns:
            for rep in range(args.repeats):
                for mode in args.modes:  # interleaved, so machine load hits every mode alike
                    for which in args.budgets if mode.startswith("budget") else ["-"]:
                        runs.append(run_one(workload, mode, n, which, rep))
    if not write(runs):
        sys.exit("outputs DIFFER between modes (the tables say where): the figures do not stand")


def write(runs: list[dict[str, Any]]) -> bool:
    rows = summarize(runs)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=2) + "\n")
    md = table(rows)
    (OUT / "results.md").write_text(md + "\n")
    print(md)
    return all(row["identical"] for row in rows)  # False: a mode's output differs


if __name__ == "__main__":
    main()
