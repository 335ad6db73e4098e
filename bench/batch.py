"""N calls of a pipeline: eager, staged call by call, and staged stage-major (``map``).

For each workload and N, each mode runs in its own process under MemoryMeter (sampler
process, 0.05 s) and reports wall time, model loads and the peak footprint; the table
gives each against eager at the same N. Results: bench/results/batch/ (results.json,
results.md, the traces).

Workloads:
  demo  the demo pipeline with ``stageload demo``'s default weights (268 + 336 + 268 MiB
        of float32 Linear layers) and a lighter call (batch 8, 2 encode passes, 4 steps,
        against 32, 6 and 8), one seed per call.
  qwen  a Qwen-Image 2.1 pipeline with random weights, ~1 GB per large model (float16 on
        disk, run in bfloat16, so every weight is copied into process memory), 64x64, two
        steps, one prompt and generator per call.

Modes:
  eager        every model loaded up front and kept; the calls one after the other.
  staged       stageload's staged loading; the calls one after the other (each reloads).
  stage-major  the same registry, the calls through ``models.map`` / ``pipe.stageload.map``.

Wall time runs from the start of loading (after imports) to the last output. The outputs'
sha256 must agree across modes, or the run is marked as differing.

    python bench/batch.py                                   # both workloads, N = 1 2 4 8
    python bench/batch.py --workloads demo --ns 1 2 --repeats 1    # a quick look
    python bench/batch.py --workloads qwen --qwen-gb 0.25          # a smaller Qwen
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
OUT = ROOT / "bench" / "results" / "batch"
MODES = ("eager", "staged", "stage-major")
WORKLOADS = ("demo", "qwen")
# Wall and CPU clocks, set by each workload once its weights exist, right before loading.
START = [0.0, 0.0]
# The Qwen fixture's folder, built on first use; the parent sets it for its workers.
QWEN = Path(os.environ.get("STAGELOAD_BENCH_QWEN", "/tmp/stageload-bench/qwen21-1g"))


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))


# -- worker: one mode, one N, in this process ----------------------------------------------


def _sha(tensors: list[Any]) -> list[str]:
    return [hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest() for t in tensors]


def work_demo(mode: str, n: int, meter: Any, sink: Any) -> list[Any]:
    from dataclasses import replace

    from stageload import TeeSink
    from stageload.demo import MODELS, SIZES, default_cache_dir, ensure_weights, make_models
    from stageload.demo import run_pipeline as pipeline

    # The default demo's weights; per call a quarter of its batch and fewer passes, so that
    # N = 8 fits the time this contended machine gives (loads dominate more than in the demo).
    folder, _ = ensure_weights(SIZES["default"], default_cache_dir())
    size = replace(SIZES["default"], batch=8, encode_passes=2, steps=4)
    meter.mark("start")
    START[:] = [time.perf_counter(), time.process_time()]
    kind = "eager" if mode == "eager" else "staged"
    models = make_models(kind, size, folder, TeeSink(meter, sink))
    if mode == "eager":
        for name in MODELS:
            models[name]

    def one(i: int) -> Any:
        return pipeline(models, replace(size, seed=size.seed + i), models.enter)

    if mode == "stage-major":
        return models.map(one, range(n))
    return [one(i) for i in range(n)]


def work_qwen(mode: str, n: int, meter: Any, sink: Any) -> list[Any]:
    import diffusers
    import torch

    from stageload import TeeSink
    from stageload.diffusers import _dtype_kwarg, _plan, staged_pipeline
    from stageload.diffusers.measure import _materialized
    from stageload.testing import diffusers as fixtures  # noqa: F401 (registers the processor)

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    cls, dtype = diffusers.QwenImage21Pipeline, torch.bfloat16
    meter.mark("start")
    START[:] = [time.perf_counter(), time.process_time()]
    if mode == "eager":
        models = _plan.model_components(QWEN)
        extra = _materialized(models, str(QWEN), dtype)  # weights in process memory
        pipe = cls.from_pretrained(QWEN, **_dtype_kwarg(dtype), **extra)
        for name in ("text_encoder", "transformer", "vae"):  # counted as the staged ones are
            sink.emit(_load_event(name))
    else:
        events = TeeSink(meter, sink)
        pipe = staged_pipeline(cls, QWEN, torch_dtype=dtype, disable_mmap=True, events=events)

    def call(i: int) -> dict[str, Any]:
        size = 64
        return {
            "prompt": f"a lighthouse at night, picture {i}",
            "height": size,
            "width": size,
            "output_resolution": size,
            "num_inference_steps": 2,
            "output_type": "pt",
            "generator": torch.Generator().manual_seed(i),
        }

    if mode == "stage-major":
        outs = pipe.stageload.map([call(i) for i in range(n)])
    else:
        outs = [pipe(**call(i)) for i in range(n)]
    return [o.images for o in outs]


def _load_event(name: str) -> Any:
    from stageload import Event

    return Event("load", model=name)


def worker(workload: str, mode: str, n: int, trace: Path, result: Path, threads: int) -> None:
    import torch

    from stageload import ListSink, MemoryMeter
    from stageload.report.records import read_trace

    torch.set_num_threads(threads)
    sink = ListSink()
    with MemoryMeter(trace, 0.05, meta={"label": f"{workload} {mode} N={n}"}) as meter:
        outs = (work_demo if workload == "demo" else work_qwen)(mode, n, meter, sink)
        wall = time.perf_counter() - START[0]
        cpu = time.process_time() - START[1]  # all threads; the sampler is another process
    samples = [s.footprint for s in read_trace(trace).samples if s.footprint is not None]
    notes = [e.bytes for e in sink.kinds("note") if e.note and e.note.startswith("batch:")]
    out = {
        "workload": workload,
        "mode": mode,
        "n": n,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "loads": len([e for e in sink.events if e.kind in ("load", "reload")]),
        "peak_footprint": max(samples) if samples else None,
        "held_intermediates_max": max(notes) if notes else None,
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


def run_one(workload: str, mode: str, n: int, rep: int, threads: int) -> dict[str, Any]:
    stem = f"{workload}-{mode}-n{n}-r{rep}"
    trace, result = OUT / "traces" / f"{stem}.jsonl", OUT / "traces" / f"{stem}.json"
    cmd = [sys.executable, __file__, "worker", workload, mode, str(n), str(trace), str(result)]
    proc = subprocess.run([*cmd, str(threads)], env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{stem} failed:\n{proc.stderr[-3000:]}")
    data = json.loads(result.read_text())
    print(
        f"{stem}: {data['wall_seconds']:.1f} s, {data['loads']} loads, "
        f"peak {data['peak_footprint'] / 2**30:.2f} GiB",
        flush=True,
    )
    return data


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted(
        {(r["workload"], r["n"]) for r in runs}, key=lambda k: (WORKLOADS.index(k[0]), k[1])
    )
    for workload, n in keys:
        by_mode = {}
        for mode in MODES:
            mine = [r for r in runs if (r["workload"], r["n"], r["mode"]) == (workload, n, mode)]
            if mine:
                cpu = [r["cpu_seconds"] for r in mine if "cpu_seconds" in r]
                by_mode[mode] = {
                    "wall_seconds": statistics.median(r["wall_seconds"] for r in mine),
                    "cpu_seconds": statistics.median(cpu) if cpu else None,
                    "loads": mine[0]["loads"],
                    "peak_footprint": statistics.median(r["peak_footprint"] for r in mine),
                    "held_intermediates_max": mine[0]["held_intermediates_max"],
                    "runs": len(mine),
                    "sha256": mine[0]["sha256"],
                }
        hashes = {tuple(m["sha256"]) for m in by_mode.values()}
        rows.append({"workload": workload, "n": n, "modes": by_mode, "identical": len(hashes) == 1})
    return rows


def _ratio(value: float | None, base: dict[str, Any] | None, key: str) -> str:
    if value is None or base is None or not base.get(key):
        return "-"
    return f"{value / base[key]:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    gib, mib = 2**30, 2**20
    lines = [
        "| workload | N | mode | wall s | / eager | CPU s | / eager | loads | peak GiB "
        "| / eager | held by parked calls MiB | outputs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        eager = row["modes"].get("eager")
        for mode, m in row["modes"].items():
            cpu, held = m["cpu_seconds"], m["held_intermediates_max"]
            lines.append(
                f"| {row['workload']} | {row['n']} | {mode} | {m['wall_seconds']:.1f} | "
                f"{_ratio(m['wall_seconds'], eager, 'wall_seconds')} | "
                f"{'-' if cpu is None else f'{cpu:.1f}'} | {_ratio(cpu, eager, 'cpu_seconds')} | "
                f"{m['loads']} | {m['peak_footprint'] / gib:.2f} | "
                f"{_ratio(m['peak_footprint'], eager, 'peak_footprint')} | "
                f"{'-' if held is None else f'{held / mib:.1f}'} | "
                f"{'identical' if row['identical'] else 'DIFFER'} |"
            )
    return "\n".join(lines)


def goals(rows: list[dict[str, Any]]) -> str:
    """The issue's three goals, checked on the table's figures."""
    lines = []
    for workload in WORKLOADS:
        mine = [r for r in rows if r["workload"] == workload and "stage-major" in r["modes"]]
        if not mine:
            continue
        loads = sorted({r["modes"]["stage-major"]["loads"] for r in mine})
        lines.append(
            f"- {workload}: stage-major loads for N = "
            f"{', '.join(str(r['n']) for r in mine)}: {loads} (independent of N: "
            f"{'yes' if len(loads) == 1 else 'no'})"
        )
        single = next((r for r in rows if r["workload"] == workload and r["n"] == 1), None)
        base = single["modes"].get("staged") if single else None
        for r in mine:
            m = r["modes"]["stage-major"]
            if base is not None and m["held_intermediates_max"] is not None:
                bound = base["peak_footprint"] + m["held_intermediates_max"]
                lines.append(
                    f"  - N = {r['n']}: peak {m['peak_footprint'] / 2**30:.3f} GiB against "
                    f"staged single-call peak + held intermediates {bound / 2**30:.3f} GiB "
                    f"({'within' if m['peak_footprint'] <= bound else 'over'})"
                )
            eager = r["modes"].get("eager")
            if eager is not None:
                lines.append(
                    f"  - N = {r['n']}: stage-major / eager wall "
                    f"{m['wall_seconds'] / eager['wall_seconds']:.2f}, CPU "
                    f"{_ratio(m['cpu_seconds'], eager, 'cpu_seconds')} (goal <= 1.05 at N = 8)"
                )
    return "\n".join(lines)


def write(runs: list[dict[str, Any]]) -> bool:
    rows = summarize(runs)
    (OUT / "results.json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=2) + "\n")
    md = table(rows) + "\n\n" + goals(rows)
    (OUT / "results.md").write_text(md + "\n")
    print(md)
    return all(row["identical"] for row in rows)  # False: a mode's output differs


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        workload, mode, n, trace, result, threads = sys.argv[2:8]
        worker(workload, mode, int(n), Path(trace), Path(result), int(threads))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--ns", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; medians reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--qwen-gb", type=float, default=1.0, help="GB per large Qwen model (default 1)")
    p.add_argument(
        "--tables-only",
        action="store_true",
        help="rebuild results.md/json from every run in bench/results/batch/traces/",
    )
    args = p.parse_args()
    if args.tables_only:
        runs = [json.loads(f.read_text()) for f in sorted((OUT / "traces").glob("*.json"))]
        if not runs:  # traces/ is not committed (results.json holds every run): keep the tables
            sys.exit(f"no runs in {OUT / 'traces'}: nothing to rebuild the tables from")
        write(runs)
        return
    (OUT / "traces").mkdir(parents=True, exist_ok=True)
    if "qwen" in args.workloads:
        path = Path(f"/tmp/stageload-bench/qwen21-{args.qwen_gb:g}g")
        os.environ["STAGELOAD_BENCH_QWEN"] = str(path)  # for the workers
        build_qwen(path, args.qwen_gb)
    runs = []
    for workload in args.workloads:
        for n in args.ns:
            for rep in range(args.repeats):
                for mode in args.modes:  # interleaved, so machine load hits every mode alike
                    runs.append(run_one(workload, mode, n, rep, args.threads))
    if not write(runs):
        sys.exit("outputs DIFFER between modes (the tables say where): the figures do not stand")


if __name__ == "__main__":
    main()
