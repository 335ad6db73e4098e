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

The worker half of this module runs as ``python -m stageload.demo worker ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ..units import format_duration, format_size

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..staged import StagedModels

#: Exit codes of ``stageload demo``.
EXIT_OK = 0
EXIT_DIFFERENT = 1  # the staged output differs from the eager output
EXIT_RUN_FAILED = 3  # a run's process failed

MODELS = ("encoder", "denoiser", "decoder")
STAGES: dict[str, tuple[str, ...]] = {
    "encode": ("encoder",),
    "denoise": ("denoiser",),
    "decode": ("decoder",),
}
MODES = ("eager", "staged")
# Bump when the weight layout or generation changes, so old caches are not reused.
_WEIGHTS_VERSION = 1


@dataclass(frozen=True)
class DemoSize:
    """Shapes of the demo: width, layers per model, batch and denoising steps."""

    name: str
    dim: int
    layers: tuple[int, int, int]  # encoder, denoiser, decoder
    batch: int
    encode_passes: int
    steps: int
    seed: int = 20241004

    def model_layers(self, model: str) -> int:
        return self.layers[MODELS.index(model)]

    def model_bytes(self, model: str) -> int:
        """float32 bytes of one model's weights and biases."""
        return self.model_layers(model) * (self.dim * self.dim + self.dim) * 4

    def fingerprint(self) -> str:
        data = json.dumps({**asdict(self), "v": _WEIGHTS_VERSION}, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:10]


SIZES: dict[str, DemoSize] = {
    # About 268 + 336 + 268 MiB of float32 weights; ~1 min on 2 cores, weights made once.
    "default": DemoSize("default", dim=4096, layers=(4, 5, 4), batch=32, encode_passes=6, steps=8),
    # A few MB per model, for the test suite.
    "small": DemoSize("small", dim=512, layers=(3, 4, 3), batch=8, encode_passes=2, steps=4),
}


# -- weights ----------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/stageload/demo``, or ``~/.cache/stageload/demo``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stageload" / "demo"


def weights_dir(size: DemoSize, cache: Path) -> Path:
    return cache / f"{size.name}-{size.fingerprint()}"


def _expected_shapes(size: DemoSize, model: str) -> dict[str, tuple[int, ...]]:
    # Keys of nn.Sequential(Linear, Tanh, Linear, Tanh, ...): Linears sit at even indices.
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(size.model_layers(model)):
        shapes[f"{2 * i}.weight"] = (size.dim, size.dim)
        shapes[f"{2 * i}.bias"] = (size.dim,)
    return shapes


def weights_valid(size: DemoSize, folder: Path) -> bool:
    """Whether ``folder`` holds complete weights for ``size``: manifest, sizes and headers."""
    from safetensors import safe_open

    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != size.fingerprint():
        return False
    for model in MODELS:
        path = folder / f"{model}.safetensors"
        try:
            if path.stat().st_size != manifest["files"][model]:
                return False
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except Exception:  # a truncated or foreign file: regenerate rather than fail
            return False
        if shapes != _expected_shapes(size, model):
            return False
    return True


def ensure_weights(
    size: DemoSize, cache: Path, progress: Callable[[str], None] = lambda _: None
) -> tuple[Path, bool]:
    """Make sure the demo weights exist in ``cache``; return their folder and whether they
    were generated now (False when a valid cached copy was reused)."""
    folder = weights_dir(size, cache)
    if weights_valid(size, folder):
        return folder, False

    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").unlink(missing_ok=True)  # invalid until every file is written
    files: dict[str, int] = {}
    for index, model in enumerate(MODELS):
        started = time.perf_counter()
        # One generator per model, from a fixed seed: the same weights on every machine.
        gen = torch.Generator().manual_seed(size.seed + index)
        scale = 1.5 / size.dim**0.5  # keeps tanh activations away from saturation
        tensors = {}
        for key, shape in _expected_shapes(size, model).items():
            std = scale if key.endswith("weight") else 0.01
            tensors[key] = torch.randn(shape, generator=gen).mul_(std)
        path = folder / f"{model}.safetensors"
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial))
        del tensors
        partial.replace(path)  # atomic: a killed run never leaves a half file under the name
        files[model] = path.stat().st_size
        progress(
            f"generated {model}: {format_size(files[model])} in "
            f"{format_duration(time.perf_counter() - started)}"
        )
    manifest = {"fingerprint": size.fingerprint(), "size": asdict(size), "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return folder, True


# -- the pipeline -----------------------------------------------------------------------


def build_model(size: DemoSize, model: str) -> nn.Module:
    """An untrained model: Linear+Tanh layers. Its random init draws from torch's global RNG."""
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(size.model_layers(model)):
        layers += [nn.Linear(size.dim, size.dim), nn.Tanh()]
    return nn.Sequential(*layers)


def load_model(size: DemoSize, folder: Path, model: str) -> nn.Module:
    """Build ``model`` and copy its weights in from safetensors, one tensor at a time."""
    import torch
    from safetensors import safe_open

    module = build_model(size, model)  # random init first, as from_pretrained-style code does
    with safe_open(str(folder / f"{model}.safetensors"), framework="pt") as f, torch.no_grad():
        for key, tensor in module.state_dict().items():
            # Copy into the module's own storage: the weights live in anonymous memory,
            # which the footprint counts, not in the file's page cache.
            tensor.copy_(f.get_tensor(key))
    return module.eval().requires_grad_(False)


def run_pipeline(
    models: Mapping[str, nn.Module],
    size: DemoSize,
    enter: Callable[[str], None],
    say: Callable[[str], None] = lambda _: None,
) -> torch.Tensor:
    """Encode, denoise in a loop, decode. Seeds once; every stage draws its own noise right
    after fetching its model, so a model built mid-run must not disturb the RNG."""
    import torch

    torch.manual_seed(size.seed)
    with torch.inference_mode():
        enter("encode")
        encoder = models["encoder"]
        prompt = torch.randn(size.batch, size.dim)
        cond = prompt
        for _ in range(size.encode_passes):
            cond = encoder(cond)
        say("encode done")

        enter("denoise")
        denoiser = models["denoiser"]
        x = torch.randn(size.batch, size.dim)
        for step in range(size.steps):
            x = x - denoiser(x + cond) / size.steps
            if (step + 1) % max(1, size.steps // 4) == 0:
                say(f"denoise step {step + 1}/{size.steps}")

        enter("decode")
        decoder = models["decoder"]
        out = decoder(x + 0.01 * torch.randn(size.batch, size.dim))
        say("decode done")
    return out


def make_models(
    mode: str,
    size: DemoSize,
    folder: Path,
    events: Any | None = None,
    *,
    preserve_rng: bool = True,
) -> StagedModels:
    """The model registry for ``mode``: eager keeps every model (all pinned), staged releases.

    ``preserve_rng=False`` is the control that shows why loads must not touch the RNG.
    """
    from ..staged import StagedModels

    if mode not in MODES:
        raise ValueError(f"unknown demo mode {mode!r}: use 'eager' or 'staged'")
    loaders = {m: (lambda m=m: load_model(size, folder, m)) for m in MODELS}
    pinned = MODELS if mode == "eager" else ()
    return StagedModels(
        loaders, stages=STAGES, pinned=pinned, events=events, preserve_rng=preserve_rng
    )


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

    from ..events import TeeSink
    from ..meter import MemoryMeter

    # The same thread count in both runs: BLAS may sum in a different order otherwise.
    torch.set_num_threads(args.threads)
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


class DemoRunError(RuntimeError):
    """One of the two runs failed; the message holds the end of its output."""


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # The child must import this very stageload, even when it is not installed.
    src = str(Path(__file__).resolve().parent.parent)
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


def _print_to(stream: TextIO) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    return say

