"""The one-command demo: a three-stage pipeline run eager and staged, metered and compared.

``stageload demo`` (``run_demo``) builds real weights once (three models, generated from
a fixed seed and saved as safetensors in a cache folder), then runs the same pipeline
twice, each time in a fresh Python process under ``MemoryMeter``:

- eager: every model is loaded at setup and kept to the end, as most pipelines do;
- staged: ``StagedModels`` loads each model when its stage first asks for it and releases
  it when a stage that does not list it begins.

The pipeline seeds once and draws noise in every stage right after fetching that stage's
model. A model's random init draws from the same generator, so a lazily built model would
shift every later draw; ``StagedModels`` builds it inside ``preserved_rng()``, and the demo
checks that both runs produce bit-identical outputs. Then it prints the per-stage report
and writes the plot.

The models, their weights and the pipeline are in ``pipeline``; the worker half of this module
runs as ``python -m stageload.demo worker ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import StageloadError
from ..units import format_duration, format_size
from .pipeline import (
    MODELS,
    MODES,
    SIZES,
    DemoSize,
    default_cache_dir,
    ensure_weights,
    make_models,
    run_pipeline,
    weights_dir,
)

#: Exit codes of ``stageload demo``.
EXIT_OK = 0
EXIT_DIFFERENT = 1  # the staged output differs from the eager output
EXIT_RUN_FAILED = 3  # a run's process failed

# -- worker: one run in its own process --------------------------------------------------


class _ProgressSink:
    """Prints loads and releases as they happen, for the parent to relay."""

    def emit(self, event: Any) -> None:
        if event.kind in ("load", "reload", "release"):
            verb = {"load": "loaded", "reload": "reloaded", "release": "released"}[event.kind]
            _say(
                f"{verb} {event.model} ({format_size(event.bytes)}, "
                f"{format_duration(event.seconds)})"
            )


def _say(line: str) -> None:
    print(line, flush=True)


def worker_main(argv: list[str] | None = None) -> int:
    """Run the pipeline once, in this process, under MemoryMeter; save the output."""
    parser = argparse.ArgumentParser(prog="python -m stageload.demo worker")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    size = SIZES[args.size]

    import torch
    from safetensors.torch import save_file

    from ..core.events import TeeSink
    from ..meter import MemoryMeter

    # The same thread count in both runs: BLAS may sum in a different order otherwise.
    torch.set_num_threads(args.threads)
    # Like with like: on a VM the host backs a guest page at its first touch (fresh memory
    # then fills at a fraction of its later speed), and eager runs first. Each worker
    # touches its working size once before the meter starts, so neither run pays it timed.
    touch = torch.empty(sum(size.model_bytes(m) for m in MODELS), dtype=torch.uint8)
    touch.fill_(0)
    del touch
    trace = args.out / f"{args.mode}.jsonl"
    meta = {"label": args.mode, "demo": size.name, "threads": args.threads}
    with MemoryMeter(trace, args.interval, meta=meta) as meter:
        models = make_models(args.mode, size, args.weights, TeeSink(meter, _ProgressSink()))
        if args.mode == "eager":
            for name in MODELS:  # everything up front, kept to the end
                models[name]
        out = run_pipeline(models, size, models.enter, _say)
    save_file({"out": out.contiguous()}, str(args.out / f"{args.mode}-output.safetensors"))
    return 0


# -- parent: the demo command ------------------------------------------------------------


@dataclass
class DemoResult:
    """What the demo found; ``to_dict()`` is its ``--json`` output."""

    size: str
    identical: bool
    max_abs_diff: float | None
    threads: int
    interval: float
    out_dir: str
    weights: str
    weights_generated: bool
    wall_seconds: float
    run_seconds: dict[str, float]
    traces: dict[str, str]
    plot: str | None
    report: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DemoRunError(StageloadError, RuntimeError):
    """One of the two runs failed; the message holds the end of its output."""


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # The child must import this very stageload, even when it is not installed.
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def _run_worker(
    mode: str,
    size: DemoSize,
    folder: Path,
    out_dir: Path,
    interval: float,
    threads: int,
    progress: Callable[[str], None],
) -> float:
    cmd = [
        sys.executable, "-m", "stageload.demo", "worker", mode,
        "--size", size.name, "--weights", str(folder), "--out", str(out_dir),
        "--interval", str(interval), "--threads", str(threads),
    ]  # fmt: skip
    started = time.perf_counter()
    code, tail = _relay(cmd, _child_env(threads), lambda line: progress(f"  {mode}: {line}"))
    if code != 0:
        raise DemoRunError(f"the {mode} run failed (exit code {code}):\n" + "\n".join(tail))
    return time.perf_counter() - started


def _relay(
    cmd: list[str], env: dict[str, str], progress: Callable[[str], None]
) -> tuple[int, list[str]]:
    """Run ``cmd``, pass each line of its output to ``progress``; its exit code and last
    20 lines. Interrupted on the way (Ctrl-C, a broken pipe), it kills the command."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    tail: list[str] = []
    try:
        for line in proc.stdout or ():
            line = line.rstrip("\n")
            tail = (tail + [line])[-20:]
            progress(line)
        return proc.wait(), tail
    finally:
        if proc.poll() is None:  # interrupted: don't leave it running
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def compare_outputs(out_dir: Path) -> tuple[bool, float | None]:
    """Whether the eager and staged outputs are equal bit for bit, and their largest gap
    (``None`` when their shapes differ)."""
    import torch
    from safetensors.torch import load_file

    eager = load_file(str(out_dir / "eager-output.safetensors"))["out"]
    staged = load_file(str(out_dir / "staged-output.safetensors"))["out"]
    if eager.shape != staged.shape:
        return False, None
    return torch.equal(eager, staged), float((eager - staged).abs().max())


def run_demo(
    out_dir: Path,
    *,
    size: str = "default",
    interval: float = 0.1,
    threads: int | None = None,
    cache: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> DemoResult:
    """Generate or reuse the weights, run eager and staged, compare, report and plot."""
    from ..report.plot import PlotUnavailableError, plot_traces
    from ..report.tables import report_dict
    from ..report.trace import load_summary

    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}: use one of {', '.join(sorted(SIZES))}")
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval!r}")
    spec = SIZES[size]
    threads = threads or min(2, os.cpu_count() or 1)
    cache = cache or default_cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    total = sum(spec.model_bytes(m) for m in MODELS)
    progress(
        f"stageload demo ({spec.name}): encoder -> denoiser x{spec.steps} -> decoder, "
        f"{format_size(total)} of weights; torch threads pinned to {threads} in both runs"
    )
    progress(f"[1/4] weights in {weights_dir(spec, cache)}")
    folder, generated = ensure_weights(spec, cache, lambda line: progress(f"  {line}"))
    if not generated:
        progress("  reusing the cached weights")

    run_seconds: dict[str, float] = {}
    for step, mode in enumerate(MODES, start=2):
        what = "all models loaded up front" if mode == "eager" else "each model only in its stage"
        progress(f"[{step}/4] {mode} run ({what}), in its own process under MemoryMeter")
        run_seconds[mode] = _run_worker(mode, spec, folder, out_dir, interval, threads, progress)
        progress(f"  {mode}: finished in {format_duration(run_seconds[mode])}")

    identical, diff = compare_outputs(out_dir)
    progress(
        "[4/4] outputs: "
        + ("bit-identical (torch.equal)" if identical else f"DIFFER (max abs diff {diff})")
    )
    traces = {mode: str(out_dir / f"{mode}.jsonl") for mode in MODES}
    summaries = [load_summary(traces[mode]) for mode in MODES]
    plot: str | None = None
    try:
        plot = str(plot_traces([traces[m] for m in MODES], out_dir / "demo.png"))
    except PlotUnavailableError as exc:
        progress(f"  no plot: {exc}")

    result = DemoResult(
        size=spec.name,
        identical=identical,
        max_abs_diff=diff,
        threads=threads,
        interval=interval,
        out_dir=str(out_dir),
        weights=str(folder),
        weights_generated=generated,
        wall_seconds=time.perf_counter() - started,
        run_seconds=run_seconds,
        traces=traces,
        plot=plot,
        report=report_dict(summaries),
    )
    (out_dir / "demo.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def format_result(result: DemoResult) -> str:
    """The demo's closing text: per-stage report, peaks compared, where the files are."""
    from ..report.tables import format_report
    from ..report.trace import load_summary

    eager, staged = (load_summary(result.traces[m]) for m in MODES)
    lines = [format_report([eager, staged]), ""]
    if eager.peak_footprint and staged.peak_footprint:
        saved = eager.peak_footprint - staged.peak_footprint
        lines.append(
            f"peak footprint: eager {format_size(eager.peak_footprint)}, staged "
            f"{format_size(staged.peak_footprint)} ({format_size(saved)} less, "
            f"{100 * saved / eager.peak_footprint:.0f} %)"
        )
    verdict = (
        "identical bit for bit"
        if result.identical
        else f"DIFFERENT (max abs diff {result.max_abs_diff})"
    )
    lines.append(f"outputs: {verdict}")
    lines.append(f"traces: {result.traces['eager']}, {result.traces['staged']}")
    if result.plot:
        lines.append(f"plot: {result.plot}")
    lines.append(f"demo took {format_duration(result.wall_seconds)}")
    return "\n".join(lines)
