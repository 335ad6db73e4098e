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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        workload, mode, n, which, trace, result = sys.argv[2:8]
        worker(workload, mode, int(n), which, Path(trace), Path(result))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "summarize":
        # Tables from the runs that finished (traces/*.json), e.g. after a run cut short.
        folders = [Path(f) for f in sys.argv[2:]] or [OUT]
        runs = [json.loads(f.read_text()) for d in folders for f in sorted(d.glob("traces/*.json"))]
        write(runs)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--ns", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--budgets", nargs="+", choices=BUDGETS, default=list(BUDGETS))
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; medians reported")
    p.add_argument("--qwen-gb", type=float, default=0.25, help="GB per large Qwen model")
    args = p.parse_args()
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
    write(runs)


def write(runs: list[dict[str, Any]]) -> None:
    rows = summarize(runs)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=2) + "\n")
    md = table(rows)
    (OUT / "results.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
