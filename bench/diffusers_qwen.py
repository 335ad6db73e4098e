"""Qwen-Image 2.1 on a CPU: eager, diffusers' offload modes and staged loading, each measured.

Builds (once) a QwenImage21Pipeline with random weights whose text encoder and transformer
hold about 3 GB each in bf16, then runs one image per mode, each in its own process under
MemoryMeter, and writes to bench/results/diffusers-qwen/: the traces, a table (peak per
stage, total time, load seconds, bytes loaded), the plot, and the ratio of the staged peak
to a lower bound: the process baseline plus, over stages, the largest of (the weights the
stage needs + the working memory it adds on top of them, measured in the eager run).

The checkpoint is float16 and runs in bfloat16, so every weight is converted, i.e. copied
into process memory, as it is on an accelerator or a Mac. A bf16 checkpoint run in bf16
on a CPU would stay mapped from the file: page cache, which the footprint does not count.

    python bench/diffusers_qwen.py                  # all modes, ~10 minutes on 2 cores
    python bench/diffusers_qwen.py --gb 0.5 --modes eager staged   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("eager", "model_offload", "group_offload", "staged")
STAGES = ("setup", "encode", "denoise", "decode")
GIB = 1 << 30


def build_fixture(path: Path, gb: float) -> Path:
    """The scaled pipeline, built in a child process (it holds ~2 x gb while saving)."""
    if (path / "model_index.json").exists():
        return path
    code = (
        "import sys, torch; from stageload.testing import diffusers as f; "
        f"f.build('qwen-image-2.1', {str(path)!r}, dtype=torch.float16, "
        f"size=f.Size.for_bytes({int(gb * 1e9)}, bytes_per_param=2), vae_dim=16)"
    )
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    print(f"built {path} in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))


def run_mode(mode: str, fixture: Path, out: Path, call: dict[str, Any], offload: Path) -> dict:
    cmd = [
        sys.executable, "-m", "stageload.diffusers.measure", mode, "QwenImage21Pipeline",
        str(fixture), str(out / f"{mode}.jsonl"), "--call", json.dumps(call),
        "--dtype", "bfloat16", "--interval", "0.1", "--result", str(out / f"{mode}.json"),
        "--offload-dir", str(offload),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return {"mode": mode, "error": proc.stderr.strip().splitlines()[-1], "wall_seconds": wall}
    result = json.loads((out / f"{mode}.json").read_text())
    result["wall_seconds"] = wall
    (out / f"{mode}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{mode}: {wall:.0f} s", flush=True)
    return result


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def analyse(out: Path, results: dict[str, dict]) -> dict[str, Any]:
    """Per-mode figures from the traces, and the staged peak against its lower bound."""
    from stageload.report.trace import load_summary, read_trace

    rows: dict[str, dict[str, Any]] = {}
    for mode, result in results.items():
        if "error" in result:
            rows[mode] = {"error": result["error"]}
            continue
        summary = load_summary(out / f"{mode}.jsonl")
        events = read_trace(out / f"{mode}.jsonl").events
        loads = [e for e in events if e.kind in ("load", "reload")]
        stage_peaks = {
            s: (summary.stage(s).peak_footprint if summary.stage(s) else None) for s in STAGES
        }
        # Staged loads during the call; the other modes load everything in from_pretrained.
        load_seconds = sum(e.seconds or 0 for e in loads) if loads else result["build_seconds"]
        loaded = sum(e.bytes or 0 for e in loads) if loads else sum(result["model_bytes"].values())
        rows[mode] = {
            "peak": summary.peak_footprint,
            "stage_peaks": stage_peaks,
            "total_seconds": result["build_seconds"] + result["call_seconds"],
            "call_seconds": result["call_seconds"],
            "load_seconds": load_seconds,
            "bytes_loaded": loaded,
            "image_sha256": result["image_sha256"],
        }
    bound = lower_bound(out, results) if {"eager", "staged"} <= rows.keys() else None
    return {"rows": rows, "lower_bound": bound}


def lower_bound(out: Path, results: dict[str, dict]) -> dict[str, Any] | None:
    """baseline + max over stages of (weights the stage needs + eager's working memory).

    baseline: the staged run's footprint before any weight is loaded (interpreter, torch,
    diffusers, tokenizer, skeletons). Working memory of a stage: how far the eager run's
    footprint rose in that stage above where it stood when the stage began (all weights
    were resident then, so the rise is activations and temporaries).
    """
    from stageload.report.trace import read_trace, stage_windows

    if "error" in results["eager"] or "error" in results["staged"]:
        return None
    eager = read_trace(out / "eager.jsonl")
    staged = read_trace(out / "staged.jsonl")
    working: dict[str, int] = {}
    for window in stage_windows(eager):
        inside = [
            s.footprint for s in eager.samples if window.start <= s.t < window.end and s.footprint
        ]
        before = [s.footprint for s in eager.samples if s.t < window.start and s.footprint]
        if window.stage == "setup" or not inside or not before:
            continue
        working[window.stage] = max(working.get(window.stage, 0), max(inside) - before[-1])
    # An event's t is when it finished: the first load began `seconds` earlier.
    starts = [e.t - (e.seconds or 0) for e in staged.events if e.kind == "load"]
    first_load = min(starts, default=None)
    base = [
        s.footprint
        for s in staged.samples
        if first_load is not None and s.t < first_load and s.footprint
    ]
    baseline = max(base) if base else None
    sizes = {e.model: e.bytes for e in staged.events if e.kind == "load"}
    plan = {e.stage: [] for e in staged.events if e.kind == "stage"}
    for e in staged.events:
        if e.kind == "load" and e.stage in plan:
            plan[e.stage].append(e.model)
    need = {s: sum(sizes[m] for m in names) + working.get(s, 0) for s, names in plan.items()}
    if baseline is None or not need:
        return None
    bound = baseline + max(need.values())
    peak = max(s.footprint for s in staged.samples if s.footprint)
    return {
        "baseline": baseline,
        "working": working,
        "weights": {s: sum(sizes[m] for m in names) for s, names in plan.items()},
        "bound": bound,
        "staged_peak": peak,
        "ratio": peak / bound,
    }  # fmt: skip


def write_results(out: Path, analysis: dict[str, Any], meta: dict[str, Any]) -> str:
    rows, bound = analysis["rows"], analysis["lower_bound"]
    lines = [
        "| mode | peak GiB | setup | encode | denoise | decode | total s | call s | load s "
        "| GiB loaded |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, row in rows.items():
        if "error" in row:
            lines.append(f"| {mode} | failed: {row['error']} |" + " |" * 8)
            continue
        peaks = [_gib(row["stage_peaks"][s]) for s in STAGES]
        lines.append(
            f"| {mode} | {_gib(row['peak'])} | {' | '.join(peaks)} | {row['total_seconds']:.0f} | "
            f"{row['call_seconds']:.0f} | {row['load_seconds']:.1f} | {_gib(row['bytes_loaded'])} |"
        )
    hashes = {row.get("image_sha256") for row in rows.values() if "error" not in row}
    text = "\n".join(lines) + "\n"
    text += f"\nSame image bit for bit in every mode: {'yes' if len(hashes) == 1 else 'NO'}.\n"
    if bound:
        parts = ", ".join(
            f"{s} {_gib(w)} + {_gib(bound['working'].get(s, 0))}"
            for s, w in bound["weights"].items()
        )
        text += (
            f"\nStaged peak {_gib(bound['staged_peak'])} GiB vs lower bound "
            f"{_gib(bound['bound'])} GiB (baseline {_gib(bound['baseline'])} GiB + the largest "
            f"over stages of weights + working memory, GiB: {parts}): "
            f"ratio **{bound['ratio']:.2f}**.\n"
        )
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({**analysis, "meta": meta}, indent=2) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=Path("/tmp/stageload-bench/qwen21-3g"))
    parser.add_argument("--gb", type=float, default=3.0, help="bf16 GB per large model")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/diffusers-qwen")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--size", type=int, default=128, help="image side, pixels")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--analyse-only", action="store_true", help="re-read existing traces")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    call = {
        "prompt": "a capybara wearing a wizard hat, reading a book by candlelight",
        "height": args.size,
        "width": args.size,
        "num_inference_steps": args.steps,
        "output_resolution": args.size,
    }
    results: dict[str, dict] = {}
    if args.analyse_only:
        for mode in args.modes:
            if (args.out / f"{mode}.json").exists():
                results[mode] = json.loads((args.out / f"{mode}.json").read_text())
    else:
        fixture = build_fixture(args.fixture, args.gb)
        offload = args.fixture.parent / "group-offload"
        for mode in args.modes:
            results[mode] = run_mode(mode, fixture, args.out, call, offload)
    meta = {
        "gb_per_model": args.gb,
        "call": call,
        "cpus": os.cpu_count(),
        "checkpoint_dtype": "float16",
        "run_dtype": "bfloat16",
    }
    analysis = analyse(args.out, results)
    print(write_results(args.out, analysis, meta))
    try:
        from stageload.report.plot import plot_traces

        traces = [args.out / f"{m}.jsonl" for m in results if "error" not in results[m]]
        plot_traces(traces, args.out / "memory.png")
    except Exception as exc:  # the table stands without the plot
        print(f"no plot: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
