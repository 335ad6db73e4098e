"""Ray workers against one process: N calls of a Qwen-Image 2.1 fixture, stage-major.

Cases, each once (the machine is shared; one run per case, figures are indicative):
  local    one process, pipe.stageload.map(calls) under MemoryMeter (the reference);
  ray-1    stageload.ray.run_batch with 1 worker;
  ray-2    the same with 2 workers;
  probe    stageload.ray.peak_memory on the first call (run twice: a load, then a reload);
  data-K   Ray Data: map_batches(StagedPredictor) over the same calls as rows, K actors,
           batch_size = calls / K, one batch in flight per actor (ActorPoolStrategy(size=K,
           max_tasks_in_flight_per_actor=1); by default the first actor up queues them all);
  data-1x2 one actor, two batches of calls / 2 (the second reloads), memory= the probe's.
Ray workers and the data-K actors ask for memory= the local run's peak (read from its trace, as
memory="run.jsonl" does). Wall time of a Ray case is the whole run_batch or map_batches:
actor start (a Python process that imports torch and diffusers, builds the pipeline) plus
the calls; the local Ray itself is started before the clock. Results: bench/results/ray-batch/.

    python bench/ray_batch.py --gb 0.25 --n 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")
OUT = Path(__file__).parent / "results" / "ray-batch"
ROOT = Path(__file__).resolve().parents[1]


def load_pipeline(path: str):
    import torch
    from diffusers import QwenImage21Pipeline

    import stageload.testing.diffusers  # noqa: F401  (the fixture's processor class)
    from stageload.diffusers import staged_pipeline

    torch.set_num_threads(1)
    return staged_pipeline(QwenImage21Pipeline, path, torch_dtype=torch.float16)


def calls(n: int) -> list[dict]:
    return [
        {
            "prompt": f"a capybara, picture {i}",
            "height": 64,
            "width": 64,
            "output_resolution": 64,
            "num_inference_steps": 2,
            "seed": i,
        }
        for i in range(n)
    ]


def local(path: str, n: int, trace: Path) -> dict:
    """The single-process stage-major reference, in a fresh process under the meter."""
    here = str(Path(__file__).parent)
    code = "\n".join(
        [
            f"import json, os, sys, time; sys.path.insert(0, {here!r})",
            "from ray_batch import load_pipeline, calls",
            "from stageload import MemoryMeter",
            "from stageload.ray import call_kwargs",
            "from stageload.core.outer import TRACE_ENV",
            f"m = MemoryMeter({str(trace)!r}, 0.05, meta={{'label': 'local'}}).start()",
            f"os.environ[TRACE_ENV] = {str(trace)!r}",
            f"t = time.monotonic(); pipe = load_pipeline({path!r})",
            f"pipe.stageload.map([call_kwargs(c) for c in calls({n})])",
            "w = time.monotonic() - t; m.stop(); print(json.dumps({'wall': w}))",
        ]
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def loads_in(trace: Path) -> int:
    from stageload.report.records import read_trace

    return sum(e.kind in ("load", "reload") for e in read_trace(trace).events)


def batches_in(trace: Path) -> int:
    from stageload.report.records import read_trace

    return sum(m.label.startswith("batch ") for m in read_trace(trace).marks)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=0.25, help="fixture size (issue: 1)")
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()
    import ray
    import ray.data
    import torch
    from ray.data import ActorPoolStrategy

    from stageload.ray import StagedPredictor, peak_from, peak_memory, stream_batch
    from stageload.report.trace import load_summary
    from stageload.testing import diffusers as f

    path = Path(f"/tmp/ray-bench-qwen-{args.gb}")
    if not (path / "model_index.json").exists():
        f.build(
            "qwen-image-2.1",
            path,
            dtype=torch.float16,
            vae_dim=16,
            size=f.Size.for_bytes(int(args.gb * 1e9), bytes_per_param=2),
        )
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    ref = local(str(path), args.n, OUT / "local.jsonl")
    peak = peak_from(OUT / "local.jsonl")
    rows.append(
        {
            "case": "local",
            "workers": 1,
            "wall_s": round(ref["wall"], 1),
            "loads": [loads_in(OUT / "local.jsonl")],
            "peaks_mib": [peak >> 20],
        }
    )
    print(rows[-1], flush=True)
    ray.init(
        address="local",
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "src")}},
    )
    try:
        for workers in (1, 2):
            tdir = OUT / f"ray-{workers}"
            for old in tdir.glob("*.jsonl"):
                old.unlink()
            t = time.monotonic()
            stream = stream_batch(
                partial(load_pipeline, str(path)),
                calls(args.n),
                memory=peak,
                workers=workers,
                trace_dir=tdir,
            )
            dict(stream)
            wall = time.monotonic() - t
            traces = sorted(tdir.glob("worker-*.jsonl"))
            rows.append(
                {
                    "case": f"ray-{workers}",
                    "workers": len(traces),
                    "wall_s": round(wall, 1),
                    "loads": [loads_in(p) for p in traces],
                    "peaks_mib": [load_summary(p).peak_footprint >> 20 for p in traces],
                    "chunks": [len(c) for c in stream.chunks],
                }
            )
            print(rows[-1], flush=True)
        t = time.monotonic()
        probe_peak = peak_memory(
            partial(load_pipeline, str(path)), calls(1)[0], trace_dir=OUT / "probe"
        )
        rows.append(
            {
                "case": "probe",
                "workers": 1,
                "wall_s": round(time.monotonic() - t, 1),
                "loads": [loads_in(OUT / "probe" / "probe.jsonl")],
                "peaks_mib": [probe_peak >> 20],
            }
        )
        print(rows[-1], flush=True)
        # (case, actors, batch size, memory=): one batch per actor with the local peak;
        # then one actor running two batches (the second reloads) with the probe's peak.
        half = -(-args.n // 2)
        for case, actors, size, memory in [
            ("data-1", 1, args.n, peak),
            ("data-2", 2, half, peak),
            ("data-1x2", 1, half, probe_peak),
        ]:
            tdir = OUT / case
            for old in tdir.glob("*.jsonl"):
                old.unlink()
            t = time.monotonic()
            out = (
                ray.data.from_items(calls(args.n))
                .map_batches(
                    StagedPredictor,
                    fn_constructor_args=(partial(load_pipeline, str(path)),),
                    fn_constructor_kwargs={"trace_dir": str(tdir)},
                    batch_size=size,
                    compute=ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
                    num_cpus=1,
                    memory=memory,
                )
                .take_all()
            )
            wall = time.monotonic() - t
            assert sorted(r["seed"] for r in out) == list(range(args.n))
            traces = sorted(tdir.glob("actor-*.jsonl"))
            rows.append(
                {
                    "case": case,
                    "workers": len(traces),
                    "wall_s": round(wall, 1),
                    "loads": [loads_in(p) for p in traces],
                    "peaks_mib": [load_summary(p).peak_footprint >> 20 for p in traces],
                    "batches": [batches_in(p) for p in traces],
                    "memory_mib": memory >> 20,
                }
            )
            print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    (OUT / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "| case | workers | wall s | loads per worker | peak MiB per worker |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['workers']} | {r['wall_s']} | {r['loads']} | {r['peaks_mib']} |"
        )
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
