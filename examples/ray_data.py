"""Batch inference the Ray Data way: a Dataset of prompts, map_batches with StagedPredictor.

Reads the prompts from a JSON Lines file (one row per image: prompt, seed, size, steps),
runs them through a staged diffusers pipeline on an actor pool (each actor builds the
pipeline once, runs each batch stage-major, asks Ray for memory= the measured peak), and
writes the rows with an ``images`` column as Parquet. Without --model it builds a tiny
Qwen-Image 2.1 with random weights here (no download), so it runs on any machine::

    python examples/ray_data.py --n 4 --check --local

``--check`` reads the Parquet files back and compares every image with the same staged
pipeline run locally on the same row (torch with the threads of a 1-CPU Ray worker), pixel
for pixel.
On a cluster, the prompts file, --out and --trace-dir must be on storage every node sees.
See docs/ray.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

# Keep a local Ray on 127.0.0.1 as given (Ray reads this when it is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


# A new local Ray: loopback only, no dashboard.
LOCAL = {"address": "local", "_node_ip_address": "127.0.0.1", "include_dashboard": False}


def load_pipeline(path: str, dtype: str, tiny: bool = False):
    """Runs once in each actor (cloudpickle sends this function by value from __main__)."""
    import torch
    from diffusers import QwenImage21Pipeline

    if tiny:  # the tiny fixture's processor class lives here; diffusers must see it imported
        import stageload.testing.diffusers  # noqa: F401

    from stageload.diffusers import staged_pipeline

    return staged_pipeline(QwenImage21Pipeline, path, torch_dtype=getattr(torch, dtype))


def write_prompts(path: Path, n: int, size: int, steps: int) -> None:
    rows = [
        {"prompt": f"a capybara reading book number {i} by candlelight", "seed": i,
         "height": size, "width": size, "output_resolution": size,
         "num_inference_steps": steps}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a diffusers Qwen-Image 2.1 folder (default: tiny)")
    parser.add_argument("--prompts", help="a JSON Lines file of rows (default: written here)")
    parser.add_argument("--n", type=int, default=4, help="rows to write without --prompts")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", type=int, default=64, help="image side, pixels")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=2, help="rows per stage-major batch")
    parser.add_argument("--concurrency", type=int, default=1, help="actors in the pool")
    parser.add_argument("--trace-dir", default="ray-data-traces")
    parser.add_argument("--out", default="ray-data-out", help="a folder for the Parquet files")
    parser.add_argument("--check", action="store_true", help="also run locally and compare")
    parser.add_argument("--local", action="store_true",
                        help="start a new local Ray on 127.0.0.1 even if a cluster is running "
                             "(on a shared machine: not someone else's)")
    args = parser.parse_args(argv)

    import ray

    from stageload.ray import StagedPredictor, connect, peak_memory, report

    path = args.model
    if path is None:
        from stageload.testing.diffusers import build

        path = str(build("qwen-image-2.1", "/tmp/stageload-qwen-tiny"))
    prompts = Path(args.prompts or "ray-data-prompts.jsonl").absolute()
    if args.prompts is None:
        write_prompts(prompts, args.n, args.size, args.steps)
    trace_dir, out = Path(args.trace_dir).absolute(), Path(args.out).absolute()
    for old in [*trace_dir.glob("*.jsonl"), *out.glob("*.parquet")]:
        old.unlink()  # this run's traces and files only
    make = partial(load_pipeline, path, args.dtype, args.model is None)

    if args.local:
        ray.init(**LOCAL)
        started = True
    else:
        started = connect()  # the running cluster, or a new local Ray on 127.0.0.1
    try:
        t0 = time.monotonic()
        ds = ray.data.read_json(str(prompts))
        peak = peak_memory(make, ds.take(1)[0], trace_dir=trace_dir)
        print(f"measured peak per actor: {peak / 2**20:.0f} MiB ({time.monotonic() - t0:.1f} s)")
        t1 = time.monotonic()
        ds.map_batches(
            StagedPredictor,
            fn_constructor_args=(make,),
            fn_constructor_kwargs={"trace_dir": str(trace_dir)},
            batch_size=args.batch_size,
            concurrency=args.concurrency,
            num_cpus=1,
            memory=peak,
        ).write_parquet(str(out))
        rows = sum(1 for line in prompts.open(encoding="utf-8") if line.strip())
        print(f"{rows} rows through map_batches in {time.monotonic() - t1:.1f} s, "
              f"written to {out}")
        print(report(trace_dir))
        if args.check:
            return check(make, ray.data.read_parquet(str(out)).take_all())
        return 0
    finally:
        if started:
            ray.shutdown()


def check(make, rows: list[dict]) -> int:
    """Each row's image against the same staged pipeline run here, with a 1-CPU worker's
    threads."""
    import numpy as np

    from stageload.ray import call_kwargs, worker_threads

    pipe = make()
    with worker_threads(1):
        for row in rows:
            call = {k: v for k, v in row.items() if k != "images"}
            local = np.stack([np.asarray(im) for im in pipe(**call_kwargs(call)).images])
            if not np.array_equal(local, row["images"]):
                print(f"seed {row['seed']}: the Ray Data image differs from the local run",
                      file=sys.stderr)
                return 1
    print(f"all {len(rows)} images equal a local run, pixel for pixel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
