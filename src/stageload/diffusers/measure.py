"""Run a diffusers pipeline once in this process under a MemoryMeter, in one loading mode.

The memory test and ``bench/diffusers_qwen.py`` start one process per mode, so that each
run's footprint is its own::

    python -m stageload.diffusers.measure staged QwenImage21Pipeline PATH trace.jsonl \\
        --call '{"prompt": "a cat", "height": 64, "width": 64}' --result result.json

Modes: ``eager`` (``from_pretrained``, everything loaded), ``staged``
(:func:`stageload.diffusers.staged_pipeline`), ``auto`` (plain ``from_pretrained`` under
:func:`stageload.auto`, with ``--budget``), ``model_offload``
(``enable_model_cpu_offload``), ``group_offload`` (``enable_group_offload``, block level,
offloaded to disk when ``--offload-dir`` is given). All modes record the same stage events
(the first use of each stage's component), so their traces split into comparable windows.
``baseline`` builds the pipeline with every model component ``None`` and makes no call:
what a process holds before any weight (interpreter, torch, diffusers, tokenizer).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODES = ("eager", "staged", "auto", "model_offload", "group_offload", "baseline")


class StageMarks:
    """Emits a ``stage`` event when a component of the next stage is first used, without
    loading or releasing anything: stage windows for the modes that do not stage."""

    def __init__(self, pipe: Any, plan: dict[str, tuple[str, ...]], sink: Any) -> None:
        from ..core.events import STAGE, Event
        from ..hooks.on_call import on_call

        self._sink, self._stage, self._event = sink, None, lambda s: Event(STAGE, stage=s)
        for stage, names in plan.items():
            for name in names:
                module = getattr(pipe, name, None)
                if module is None:
                    continue
                module.register_forward_pre_hook(lambda *_, s=stage: self._enter(s))
                for method in ("encode", "decode"):
                    if callable(getattr(module, method, None)):
                        on_call(module, method, before=lambda *a, s=stage, **k: self._enter(s))

    def _enter(self, stage: str) -> None:
        if stage != self._stage:
            self._stage = stage
            self._sink.emit(self._event(stage))


def run(
    mode: str,
    pipeline: str,
    path: str,
    trace: str,
    *,
    call: dict[str, Any],
    torch_dtype: str | None = None,
    seed: int = 0,
    interval: float = 0.05,
    offload_dir: str | None = None,
    materialize: bool = False,
    device: str = "cpu",
    meta: dict[str, Any] | None = None,
    budget: int | str | None = None,
) -> dict[str, Any]:
    """Build the pipeline in ``mode``, call it once, and return what happened.

    ``materialize`` reads weights into process memory (``disable_mmap``) instead of mapping
    the safetensors files. Mapped weights whose dtype needs no conversion stay in the page
    cache, which a process footprint does not count; on an accelerator or a Mac the
    weights are copied either way, which is what this reproduces on a CPU.
    """
    import diffusers
    import torch
    from diffusers.utils import logging

    from ..autostage import auto
    from ..hooks.release import module_bytes
    from ..meter import MemoryMeter

    # qwen_processor: loading the Qwen fixtures needs their processor class imported.
    from . import _dtype_kwarg, _plan, qwen_processor, staged_pipeline  # noqa: F401

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    cls = getattr(diffusers, pipeline)
    dtype = getattr(torch, torch_dtype) if torch_dtype else None
    result: dict[str, Any] = {
        "mode": mode,
        "pipeline": pipeline,
        "path": path,
        "threads": torch.get_num_threads(),
        "call": call,
    }
    with contextlib.ExitStack() as stack:
        meter = stack.enter_context(
            MemoryMeter(trace, interval, meta={"label": mode, **(meta or {})})
        )
        if mode == "auto":  # its loads and releases in the trace; stages as eager's below
            stack.enter_context(auto(budget=budget, events=meter, stages=False))
        start = time.perf_counter()
        models = _plan.model_components(Path(path))
        if mode == "baseline":
            pipe = cls.from_pretrained(path, **dict.fromkeys(models))
            time.sleep(4 * interval)  # a few samples of the settled process
            meter.mark("built")
            result["build_seconds"] = time.perf_counter() - start
            return result
        if mode == "staged":
            extra = {"disable_mmap": True} if materialize else {}
            pipe = staged_pipeline(
                cls, path, device=device, torch_dtype=dtype, events=meter, **extra
            )
        else:
            extra = _materialized(models, path, dtype) if materialize else {}
            pipe = cls.from_pretrained(path, **_dtype_kwarg(dtype), **extra)
            if mode == "eager" and device != "cpu":
                pipe.to(device)
            plan = _plan.default_plan(cls.model_cpu_offload_seq, models)
            StageMarks(pipe, {s: tuple(n) for s, n in plan.items()}, meter)
            if mode == "model_offload":
                pipe.enable_model_cpu_offload(device=device)
            elif mode == "group_offload":
                pipe.enable_group_offload(
                    onload_device=torch.device(device),
                    offload_device=torch.device("cpu"),
                    offload_type="block_level",
                    num_blocks_per_group=1,
                    offload_to_disk_path=offload_dir,
                )
        result["build_seconds"] = time.perf_counter() - start
        result["model_bytes"] = {
            name: module_bytes(module)
            for name, module in pipe.components.items()
            if isinstance(module, torch.nn.Module)
        }
        meter.mark("built")
        generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        out = pipe(generator=generator, output_type="pt", **call)[0]
        result["call_seconds"] = time.perf_counter() - start
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            result["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        meter.mark("called")
    image = out.float().contiguous()
    result["image_sha256"] = hashlib.sha256(image.numpy().tobytes()).hexdigest()
    result["image_shape"] = list(image.shape)
    return result


def _materialized(models: dict[str, type], path: str, dtype: Any) -> dict[str, Any]:
    """Model components read fully into memory; the pipeline's loader passes
    ``disable_mmap`` to diffusers models only, so transformers models are loaded here."""
    out: dict[str, Any] = {"disable_mmap": True}
    for name, cls in models.items():
        if cls.__module__.startswith("transformers."):
            kwargs = {"dtype": dtype if dtype is not None else "auto", "disable_mmap": True}
            out[name] = cls.from_pretrained(str(Path(path) / name), **kwargs)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stageload.diffusers.measure")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("pipeline", help="diffusers pipeline class name, e.g. FluxPipeline")
    parser.add_argument("path", help="pipeline folder (save_pretrained layout)")
    parser.add_argument("trace", help="JSONL trace to write")
    parser.add_argument("--call", default="{}", help="JSON object of pipeline call arguments")
    parser.add_argument("--dtype", default=None, help="torch dtype name, e.g. bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    parser.add_argument("--offload-dir", default=None, help="disk folder for group offloading")
    parser.add_argument("--result", default=None, help="write the result JSON here")
    parser.add_argument("--device", default="cpu", help="where the models run, e.g. cuda")
    parser.add_argument(
        "--materialize", action="store_true", help="read weights into memory (no mmap)"
    )
    parser.add_argument("--budget", default=None, help="auto mode's budget: bytes, 12G, 80%%")
    args = parser.parse_args(argv)
    if args.budget is not None:
        from ..memory.budget import parse_budget

        try:
            parse_budget(args.budget)
        except ValueError as exc:
            parser.error(f"--budget: {exc}")
    try:
        call = json.loads(args.call)
    except json.JSONDecodeError as exc:
        print(f"error: --call is not JSON ({exc}): {args.call!r}", file=sys.stderr)
        return 2
    result = run(
        args.mode,
        args.pipeline,
        args.path,
        args.trace,
        call=call,
        torch_dtype=args.dtype,
        seed=args.seed,
        interval=args.interval,
        offload_dir=args.offload_dir,
        materialize=args.materialize,
        device=args.device,
        budget=args.budget,
    )
    text = json.dumps(result, indent=2)
    if args.result:
        Path(args.result).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
