"""A diffusers pipeline on a CPU: eager, diffusers' offload modes, staged loading and auto.

Builds (once) a pipeline with random weights whose text encoder and denoiser hold about
``--gb`` GB each in bf16: Qwen-Image 2.1 by default, or ``--family`` flux, sd3, wan2.2,
pixart-sigma (the scalable fixtures of :mod:`stageload.testing.diffusers`). Then runs one
image per mode, each in its own process under MemoryMeter, and writes to
bench/results/diffusers-qwen/ (other families: diffusers-FAMILY/): the traces, a table
(peak per stage, total time, load seconds, bytes loaded), the plot, and the staged peak
against a reference computed without the staged run:

    reference = baseline + max over stages of (stage weights + stage working memory)

- baseline: the peak footprint of a separate process that builds the pipeline with no
  model component (``measure.py baseline``): interpreter, torch, diffusers, tokenizer;
- stage weights: from the checkpoint's safetensors headers, every floating tensor at the
  run's dtype (float32 where the class keeps modules in float32), for the models the
  default plan lists in the stage plus the small ones staged loading keeps resident;
- working memory: how far the eager run's footprint rose inside each stage above where it
  stood when the stage began (all weights resident, so the rise is activations).

The script exits 1, loudly, if the staged peak comes out under the reference (then the
reference is not a floor and something in it is wrong), or if the modes' images differ.

The checkpoint is float16 and runs in bfloat16, so every weight is converted, i.e. copied
into process memory, as it is on an accelerator or a Mac. A bf16 checkpoint run in bf16
on a CPU would stay mapped from the file: page cache, which the footprint does not count.

    python bench/diffusers_qwen.py                  # all modes, ~10 minutes on 2 cores
    python bench/diffusers_qwen.py --gb 0.5 --modes eager staged   # a quick look
    python bench/diffusers_qwen.py --family flux --gb 0.5 --modes eager staged auto
    python bench/diffusers_qwen.py --analyse-only   # the recorded traces, a new baseline
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
MODES = ("eager", "model_offload", "group_offload", "staged", "auto")
GIB = 1 << 30
PROMPT = "a capybara wearing a wizard hat, reading a book by candlelight"


def _call(family: str, side: int, steps: int) -> dict[str, Any]:
    """One call of ``family``'s pipeline: an image (Wan: 5 frames) ``side`` pixels wide."""
    call: dict[str, Any] = {
        "prompt": PROMPT,
        "height": side,
        "width": side,
        "num_inference_steps": steps,
    }
    if family == "qwen-image-2.1":
        call["output_resolution"] = side
    else:  # the text encoders' sequence, short as the tests': the T5 fixtures are small
        call["max_sequence_length"] = 16
    if family == "pixart-sigma":  # its bins assume a real model's sample size
        call["use_resolution_binning"] = False
    if family == "wan2.2":
        call["num_frames"] = 5
        call["num_inference_steps"] = max(steps, 4)  # both transformers get steps
    return call


#: Fixture family (stageload.testing.diffusers) -> its diffusers pipeline class.
FAMILIES = {
    "qwen-image-2.1": "QwenImage21Pipeline",
    "flux": "FluxPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "wan2.2": "WanPipeline",
    "pixart-sigma": "PixArtSigmaPipeline",
}


def build_fixture(path: Path, gb: float, family: str) -> Path:
    """The scaled pipeline, built in a child process (it holds ~2 x gb while saving)."""
    if (path / "model_index.json").exists():
        return path
    extra = ", vae_dim=16" if family == "qwen-image-2.1" else ""
    code = (
        "import sys, torch; from stageload.testing import diffusers as f; "
        f"f.build({family!r}, {str(path)!r}, dtype=torch.float16, "
        f"size=f.Size.for_bytes({int(gb * 1e9)}, bytes_per_param=2){extra})"
    )
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    print(f"built {path} in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))


def run_mode(
    mode: str, fixture: Path, out: Path, call: dict[str, Any], offload: Path, pipeline: str
) -> dict:
    cmd = [
        sys.executable, "-m", "stageload.diffusers.measure", mode, pipeline,
        str(fixture), str(out / f"{mode}.jsonl"), "--call", json.dumps(call),
        "--dtype", "bfloat16", "--interval", "0.1", "--result", str(out / f"{mode}.json"),
        "--offload-dir", str(offload),
    ]  # fmt: skip
    if mode == "auto":  # room for the staged plan's largest stage (its weights), + 5 %
        cmd += ["--budget", str(int(1.05 * max(plan_weights(fixture, pipeline)[0].values())))]
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


def stages(fixture: Path, pipeline: str) -> list[str]:
    """setup, then the staged pipeline's default plan's stages: every mode's windows."""
    import diffusers

    from stageload.diffusers import _plan

    models = _plan.model_components(fixture)
    seq = getattr(diffusers, pipeline).model_cpu_offload_seq
    return ["setup", *_plan.default_plan(seq, models)]


def analyse(out: Path, fixture: Path, results: dict[str, dict], pipeline: str) -> dict[str, Any]:
    """Per-mode figures from the traces, and the staged peak against the reference."""
    from stageload.report.trace import load_summary, read_trace

    names = stages(fixture, pipeline)

    rows: dict[str, dict[str, Any]] = {}
    for mode, result in results.items():
        if "error" in result:
            rows[mode] = {"error": result["error"]}
            continue
        summary = load_summary(out / f"{mode}.jsonl")
        events = read_trace(out / f"{mode}.jsonl").events
        loads = [e for e in events if e.kind in ("load", "reload")]
        stage_peaks = {
            s: (summary.stage(s).peak_footprint if summary.stage(s) else None) for s in names
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
    both = {"eager", "staged"} <= rows.keys()
    bound = reference(out, fixture, results, pipeline) if both else None
    return {"rows": rows, "reference": bound, "stages": names}


def baseline_footprint(fixture: Path, out: Path, pipeline: str) -> int:
    """Peak footprint of a separate process that loads no model component."""
    trace = out / "baseline.jsonl"
    cmd = [
        sys.executable, "-m", "stageload.diffusers.measure", "baseline", pipeline,
        str(fixture), str(trace), "--dtype", "bfloat16", "--interval", "0.1",
    ]  # fmt: skip
    subprocess.run(cmd, env=_env(), check=True, capture_output=True)
    from stageload.report.trace import read_trace

    return max(s.footprint for s in read_trace(trace).samples if s.footprint)


def checkpoint_weights(fixture: Path, dtype: str) -> dict[str, int]:
    """Bytes of each model component's weights once loaded at ``dtype``, from the
    safetensors headers: floating tensors at ``dtype`` (float32 in modules the class keeps
    in float32), others as stored."""
    import torch

    from stageload.diffusers import _plan
    from stageload.external import keep_in_fp32_modules, kept_in_float32
    from stageload.load.checkpoint import read_header

    run = getattr(torch, dtype)
    out: dict[str, int] = {}
    for name, cls in _plan.model_components(fixture).items():
        fp32 = keep_in_fp32_modules(cls, run)
        total = 0
        for file in sorted((fixture / name).glob("*.safetensors")):
            for key, entry in read_header(file).items():
                numel = entry.nbytes // entry.itemsize
                if not entry.is_floating:
                    total += entry.nbytes
                elif kept_in_float32(key, fp32):
                    total += numel * 4
                else:
                    total += numel * run.itemsize
        out[name] = total
    return out


def plan_weights(fixture: Path, pipeline: str) -> tuple[dict[str, int], set[str]]:
    """The staged pipeline's default plan: each stage's checkpoint weights at bf16, with
    the components it keeps resident; and those components."""
    import diffusers

    from stageload.diffusers import _plan

    weights = checkpoint_weights(fixture, "bfloat16")
    models = _plan.model_components(fixture)
    plan = _plan.default_plan(getattr(diffusers, pipeline).model_cpu_offload_seq, models)
    staged_names = [n for names in plan.values() for n in names]
    keep = set(_plan.default_keep(_plan.weight_bytes(fixture, staged_names)))
    stage_weights = {
        stage: sum(weights[n] for n in set(names) | keep) for stage, names in plan.items()
    }
    return stage_weights, keep


def reference(
    out: Path, fixture: Path, results: dict[str, dict], pipeline: str
) -> dict[str, Any] | None:
    """baseline + max over stages of (stage weights + eager working memory); see the top."""
    from stageload.report.trace import read_trace, stage_windows

    if "error" in results["eager"] or "error" in results["staged"]:
        return None
    eager = read_trace(out / "eager.jsonl")
    working: dict[str, int] = {}
    for window in stage_windows(eager):
        inside = [
            s.footprint for s in eager.samples if window.start <= s.t < window.end and s.footprint
        ]
        before = [s.footprint for s in eager.samples if s.t < window.start and s.footprint]
        if window.stage == "setup" or not inside or not before:
            continue
        working[window.stage] = max(working.get(window.stage, 0), max(inside) - before[-1])
    stage_weights, keep = plan_weights(fixture, pipeline)
    baseline = baseline_footprint(fixture, out, pipeline)
    need = {s: stage_weights[s] + working.get(s, 0) for s in stage_weights}
    bound = baseline + max(need.values())
    staged = read_trace(out / "staged.jsonl")
    peak = max(s.footprint for s in staged.samples if s.footprint)
    return {
        "baseline": baseline,
        "working": working,
        "weights": stage_weights,
        "keep": sorted(keep),
        "reference": bound,
        "staged_peak": peak,
        "ratio": peak / bound,
    }


def write_results(out: Path, analysis: dict[str, Any], meta: dict[str, Any]) -> str:
    rows, bound = analysis["rows"], analysis["reference"]
    names = analysis["stages"]
    lines = [
        f"| mode | peak GiB | {' | '.join(names)} | total s | call s | load s | GiB loaded |",
        "| --- | ---: |" + " ---: |" * (len(names) + 4),
    ]
    for mode, row in rows.items():
        if "error" in row:
            lines.append(f"| {mode} | failed: {row['error']} |" + " |" * (len(names) + 4))
            continue
        peaks = [_gib(row["stage_peaks"].get(s)) for s in names]
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
            f"\nStaged peak {_gib(bound['staged_peak'])} GiB vs reference "
            f"{_gib(bound['reference'])} GiB = baseline {_gib(bound['baseline'])} GiB (a separate "
            f"process with no model component) + the largest over stages of checkpoint weights "
            f"at bf16 (kept resident: {', '.join(bound['keep']) or 'none'}) + eager working "
            f"memory, GiB: {parts}. Staged peak / reference: **{bound['ratio']:.2f}**.\n"
        )
    if meta.get("analysed_on"):
        text += (
            f"\nRe-analysed on {meta['analysed_on']} from the recorded traces and results (the "
            "rows are from the run that wrote them); the baseline process ran anew then.\n"
        )
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({**analysis, "meta": meta}, indent=2) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen-image-2.1", choices=FAMILIES)
    parser.add_argument(
        "--fixture", type=Path, help="default: /tmp/stageload-bench/FAMILY-GBg (qwen: qwen21-3g)"
    )
    parser.add_argument("--gb", type=float, default=3.0, help="bf16 GB per large model")
    parser.add_argument(
        "--out", type=Path, help="default: bench/results/diffusers-qwen (other families: -FAMILY)"
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--size", type=int, default=128, help="image side, pixels")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--analyse-only", action="store_true", help="re-read existing traces")
    args = parser.parse_args(argv)
    qwen = args.family == "qwen-image-2.1"
    if args.fixture is None:
        name = "qwen21" if qwen else args.family
        args.fixture = Path(f"/tmp/stageload-bench/{name}-{args.gb:g}g")
    if args.out is None:
        folder = "diffusers-qwen" if qwen else f"diffusers-{args.family}"
        args.out = ROOT / "bench/results" / folder
    pipeline = FAMILIES[args.family]

    args.out.mkdir(parents=True, exist_ok=True)
    call = _call(args.family, args.size, args.steps)
    results: dict[str, dict] = {}
    if args.analyse_only:
        for mode in args.modes:
            if (args.out / f"{mode}.json").exists():
                results[mode] = json.loads((args.out / f"{mode}.json").read_text())
    else:
        fixture = build_fixture(args.fixture, args.gb, args.family)
        offload = args.fixture.parent / "group-offload"
        for mode in args.modes:
            results[mode] = run_mode(mode, fixture, args.out, call, offload, pipeline)
    meta = {
        "family": args.family,
        "pipeline": pipeline,
        "gb_per_model": args.gb,
        "call": call,
        "cpus": os.cpu_count(),
        "checkpoint_dtype": "float16",
        "run_dtype": "bfloat16",
    }
    if args.analyse_only:
        # the checkpoint headers and the baseline need it
        build_fixture(args.fixture, args.gb, args.family)
        meta["analysed_on"] = time.strftime("%Y-%m-%d")
    analysis = analyse(args.out, args.fixture, results, pipeline)
    print(write_results(args.out, analysis, meta))
    ref = analysis["reference"]
    if ref is not None and ref["ratio"] < 1:
        print(
            f"ERROR: the staged peak ({_gib(ref['staged_peak'])} GiB) is under the reference "
            f"({_gib(ref['reference'])} GiB): the reference is not a floor; check its parts "
            f"(baseline, weights per stage, working memory) before using the ratio",
            file=sys.stderr,
        )
        return 1
    hashes = {row.get("image_sha256") for row in analysis["rows"].values() if "error" not in row}
    if len(hashes) > 1:
        print("ERROR: the modes made different images: the figures do not stand", file=sys.stderr)
        return 1
    try:
        from stageload.report.plot import plot_traces

        traces = [args.out / f"{m}.jsonl" for m in results if "error" not in results[m]]
        plot_traces(traces, args.out / "memory.png")
    except Exception as exc:  # the table stands without the plot
        print(f"no plot: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
