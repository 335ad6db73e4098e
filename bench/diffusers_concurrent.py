"""Concurrent requests to one staged pipeline (issue 34, item 4): 8 client threads x 4
requests on the tiny Qwen-Image 2.1, against the same 32 requests run one by one, staged
and eager.

Calls that overlap join one stage-major batch (``pipe.stageload.gather``), so each model
loads once per batch instead of once per request. Reported: wall time, loads (``load`` and
``reload`` events) per model per request, the batch sizes, and whether every output equals
eager's (each request has its own seeded generator). Torch on one thread.

    python bench/diffusers_concurrent.py --threads 8 --requests 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import diffusers  # noqa: E402
import torch  # noqa: E402

from stageload import ListSink  # noqa: E402
from stageload.diffusers import staged_pipeline  # noqa: E402
from stageload.testing.diffusers import build  # noqa: E402


def request(seed: int) -> dict[str, Any]:
    return {
        "prompt": f"a lighthouse at night, variant {seed}",
        "height": 64,
        "width": 64,
        "output_resolution": 64,
        "num_inference_steps": 2,
        "output_type": "pt",
        "generator": torch.Generator().manual_seed(seed),
    }


def loads(sink: ListSink) -> Counter[str]:
    return Counter(e.model for e in sink.events if e.kind in ("load", "reload"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="per thread")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/diffusers-concurrent")
    args = parser.parse_args(argv)
    for flag in ("threads", "requests"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    n = args.threads * args.requests
    with tempfile.TemporaryDirectory() as tmp:
        path = build("qwen-image-2.1", Path(tmp) / "qwen")
        cls = diffusers.QwenImage21Pipeline
        eager = cls.from_pretrained(path)
        start = time.perf_counter()
        want = [eager(**request(seed)).images for seed in range(n)]
        eager_s = time.perf_counter() - start

        sink = ListSink()
        pipe = staged_pipeline(cls, path, keep=(), events=sink)
        start = time.perf_counter()
        one_by_one = [pipe(**request(seed)).images for seed in range(n)]
        sequential_s = time.perf_counter() - start
        sequential_loads = loads(sink)

        sink = ListSink()
        pipe = staged_pipeline(cls, path, keep=(), events=sink)
        got: dict[int, Any] = {}
        errors: list[str] = []
        go = threading.Barrier(args.threads)

        def client(first: int) -> None:
            go.wait()
            for seed in range(first, n, args.threads):
                try:
                    got[seed] = pipe(**request(seed)).images
                except Exception as exc:
                    errors.append(f"{seed}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.threads)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        concurrent_s = time.perf_counter() - start
        concurrent_loads = loads(sink)
        batches = pipe.stageload.gather.batches

    same_sequential = all(torch.equal(a, b) for a, b in zip(one_by_one, want, strict=True))
    same_concurrent = not errors and all(torch.equal(got[s], want[s]) for s in range(n))
    models = sorted(set(sequential_loads) | set(concurrent_loads))

    def per_request(counts: Counter[str]) -> str:
        return ", ".join(f"{m} {counts[m] / n:.2f}" for m in models)

    rows = [
        "| run | wall s | loads per model per request | equal to eager |",
        "| --- | ---: | --- | --- |",
        f"| eager, one by one | {eager_s:.1f} | (loaded once, before) | reference |",
        f"| staged, one by one | {sequential_s:.1f} | {per_request(sequential_loads)} "
        f"| {same_sequential} |",
        f"| staged, {args.threads} threads x {args.requests} | {concurrent_s:.1f} "
        f"| {per_request(concurrent_loads)} | {same_concurrent} |",
    ]
    text = (
        f"# {args.threads} client threads x {args.requests} requests, tiny Qwen-Image 2.1\n\n"
        f"`python bench/diffusers_concurrent.py --threads {args.threads} --requests "
        f"{args.requests}`, torch on one thread, `keep=()`.\n\n" + "\n".join(rows) + "\n\n"
        f"Batches run ({len(batches)}): sizes {batches}, median "
        f"{statistics.median(batches):g}.\n" + (f"\nErrors: {errors}\n" if errors else "")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qwen-image.md").write_text(text)
    print(text)
    return 0 if same_sequential and same_concurrent else 1


if __name__ == "__main__":
    raise SystemExit(main())
