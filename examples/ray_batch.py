"""Run a batch of prompts of a staged diffusers pipeline on Ray workers.

Without --model it builds a tiny Qwen-Image 2.1 with random weights here (no download), so
it runs on any machine: ``python examples/ray_batch.py --n 4 --check --local``. On a real cluster
(``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the others), run
it on the head with --model pointing at a folder that exists on every machine. See
docs/ray.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

# Keep a local Ray on 127.0.0.1 as given (Ray reads this when it is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def load_pipeline(path: str, dtype: str, tiny: bool = False):
    """Runs on each worker (cloudpickle sends this function by value from __main__)."""
    import torch
    from diffusers import QwenImage21Pipeline

    if tiny:  # the tiny fixture's processor class lives here; diffusers must see it imported
        import stageload.testing.diffusers  # noqa: F401

    from stageload.diffusers import staged_pipeline

    return staged_pipeline(QwenImage21Pipeline, path, torch_dtype=getattr(torch, dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a diffusers Qwen-Image 2.1 folder (default: tiny)")
    parser.add_argument("--n", type=int, default=4, help="how many prompts")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", type=int, default=64, help="image side, pixels")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--memory", default="auto", help="per worker: bytes, '6G' or auto")
    parser.add_argument("--trace-dir", default="ray-traces")
    parser.add_argument("--out", default="ray-images")
    parser.add_argument("--check", action="store_true", help="also run locally and compare")
    parser.add_argument("--local", action="store_true",
                        help="start a new local Ray on 127.0.0.1 even if a cluster is running "
                             "(on a shared machine: not someone else's)")
    args = parser.parse_args(argv)
    if args.local:
        import ray

        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)

    from stageload.ray import call_kwargs, report, run_batch, worker_threads

    path = args.model
    if path is None:
        from stageload.testing.diffusers import build

        path = str(build("qwen-image-2.1", "/tmp/stageload-qwen-tiny"))
    size = args.size
    calls = [
        {
            "prompt": f"a capybara reading book number {i} by candlelight",
            "height": size,
            "width": size,
            "output_resolution": size,
            "num_inference_steps": args.steps,
            "seed": i,
        }
        for i in range(args.n)
    ]
    make = partial(load_pipeline, path, args.dtype, args.model is None)
    t0 = time.monotonic()
    outputs = run_batch(make, calls, memory=args.memory, workers=args.workers,
                        trace_dir=args.trace_dir)
    print(f"{len(calls)} calls on Ray in {time.monotonic() - t0:.1f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, result in enumerate(outputs):
        result.images[0].save(out / f"{i:03d}.png")
    print(report(args.trace_dir))
    if args.local:
        ray.shutdown()
    if args.check:
        import numpy as np

        pipe = make()
        for i, call in enumerate(calls):
            with worker_threads(1):  # a 1-CPU Ray worker's torch threads: same rounding
                local = pipe(**call_kwargs(call)).images[0]
            if not np.array_equal(np.asarray(local), np.asarray(outputs[i].images[0])):
                print(f"call {i}: the Ray result differs from the local run", file=sys.stderr)
                return 1
        print(f"all {len(calls)} images equal a local run, pixel for pixel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
