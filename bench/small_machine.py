"""A machine too small for eager, for real: Qwen-Image 2.1 in a memory cgroup whose limit lies
between the staged peak and the eager peak.

Builds (once) the Qwen-Image 2.1 fixture with about 1 GB per large model (float16 checkpoint,
run in bfloat16, as bench/diffusers_qwen.py does), then:

1. runs eager and staged unconstrained (in a cgroup with a limit far above both, so that
   their charged peaks are read the same way) for the reference image and the two peaks;
2. sets the limit halfway between the staged and the eager footprint peak, unless --limit;
3. runs each mode in a fresh cgroup with that limit, each in its own process under the
   meter: did it finish, its exit status and the kernel's OOM-kill count, the peak charged
   to the cgroup, its footprint peak, wall time, and whether its image equals the
   unconstrained eager image bit for bit.

Before every run the fixture's files are dropped from the page cache (posix_fadvise
DONTNEED), so the pages a run reads are charged to its own cgroup, as on a machine of that
size. Needs root (it creates memory cgroups); see stageload.testing.cgroup.

    python bench/small_machine.py                 # ~5 minutes on 2 busy cores
    python bench/small_machine.py --limit 1.7G --modes eager staged
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusers_qwen import build_fixture  # noqa: E402 (one definition of the fixture)

from stageload.testing.cgroup import MemoryCgroup  # noqa: E402
from stageload.units import format_size, parse_size  # noqa: E402

#: Stage-major batches of 4 calls: mode -> budget (None: release what the next stage does
#: not list). "80%" is of the cgroup's limit, as the budget reads it; "8G" is what a budget
#: sized from the host's 23 GiB would allow, the control. Both prefetch.
BATCHES = {"staged_map4": None, "staged_map4_budget": "80%", "staged_map4_budget_8G": "8G"}
MODES = ("eager", "model_offload", "staged", *BATCHES)
GIB = 1 << 30
MIB = 1 << 20
UNCONSTRAINED = 16 * GIB  # far above every run here: a cgroup only to read the charged peak


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
    )


def drop_cache(folder: Path) -> None:
    """Drop the fixture's files from the page cache, so the next run reads them cold."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def trace_peak(path: Path) -> int | None:
    """The largest footprint sample in a trace, also one cut short by a kill."""
    peak = None
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the half-written last line of a killed run
        value = record.get("footprint") if record.get("type") == "sample" else None
        if value is not None and (peak is None or value > peak):
            peak = value
    return peak


def trace_loads(path: Path) -> list[str]:
    """The models a staged run loaded, in order, from its trace's load and prefetch events."""
    loads = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("type") == "event" and record.get("kind") == "load":
            loads.append(record["model"])
        elif record.get("type") == "event" and record.get("kind") == "prefetch":
            loads.append(f"{record['model']} (prefetched in {record.get('stage')})")
    return loads


def run_map(fixture: str, trace: str, result: str, call: dict[str, Any], mode: str) -> None:
    """A ``BATCHES`` child: 4 calls (seeds 0..3) through ``pipe.stageload.map``, stage-major,
    under the meter; writes the image hashes, seed 0 first."""
    n, budget = 4, BATCHES[mode]
    extra: dict[str, Any] = {} if budget is None else {"budget": budget, "prefetch": True}
    import hashlib

    import diffusers
    import torch
    from diffusers.utils import logging

    import stageload.diffusers.qwen_processor  # noqa: F401 (the fixture saves its processor)
    from stageload.diffusers import staged_pipeline
    from stageload.meter import MemoryMeter

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with MemoryMeter(trace, 0.1, meta={"label": mode, "budget": budget}) as meter:
        pipe = staged_pipeline(
            diffusers.QwenImage21Pipeline,
            fixture,
            torch_dtype=torch.bfloat16,
            events=meter,
            **extra,
        )
        calls = [
            {**call, "output_type": "pt", "generator": torch.Generator().manual_seed(i)}
            for i in range(n)
        ]
        outs = pipe.stageload.map(calls)
        meter.mark("called")
    hashes = [hashlib.sha256(o[0].float().contiguous().numpy().tobytes()).hexdigest() for o in outs]
    Path(result).write_text(json.dumps({"image_sha256": hashes[0], "all_sha256": hashes}))


def run_mode(
    mode: str, limit: int, fixture: Path, out: Path, call: dict[str, Any], label: str
) -> dict[str, Any]:
    """One mode in a fresh cgroup of ``limit`` bytes, measured; the row of the table."""
    trace, result = out / f"{label}.jsonl", out / f"{label}.json"
    for path in (trace, result):
        path.unlink(missing_ok=True)
    if mode in BATCHES:
        cmd = [sys.executable, __file__, "--child", mode, str(fixture), str(trace), str(result),
               json.dumps(call)]  # fmt: skip
    else:
        cmd = [
            sys.executable, "-m", "stageload.diffusers.measure", mode, "QwenImage21Pipeline",
            str(fixture), str(trace), "--call", json.dumps(call), "--dtype", "bfloat16",
            "--interval", "0.1", "--result", str(result),
        ]  # fmt: skip
    drop_cache(fixture)
    with MemoryCgroup(limit) as cg:
        run = cg.run(cmd, env=_env())
    row: dict[str, Any] = {
        "label": label,
        "mode": mode,
        "limit": limit,
        "finished": run.returncode == 0,
        "returncode": run.returncode,
        "oom_kills": run.usage.oom_kills,
        "limit_hits": run.usage.failcnt,
        "cgroup_peak": run.usage.peak,
        "footprint_peak": trace_peak(trace),
        "wall_seconds": run.seconds,
        "cgroup": run.usage.version,
    }
    if run.returncode == 0:
        measured = json.loads(result.read_text())
        row["image_sha256"] = measured["image_sha256"]
        if "all_sha256" in measured:
            row["all_sha256"] = measured["all_sha256"]
        row["loads"] = trace_loads(trace)
    else:
        row["stderr_tail"] = run.stderr.strip().splitlines()[-3:]
    print(f"{label}: exit {run.returncode}, {run.seconds:.0f} s", flush=True)
    return row


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _status(row: dict[str, Any]) -> str:
    if row["finished"]:
        return "finished"
    if row["returncode"] == -9 and row["oom_kills"]:
        return f"**OOM-killed** ({row['oom_kills']} kill)"
    return f"failed (exit {row['returncode']})"


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = ["eager-unconstrained", "staged-unconstrained", *MODES]
    return sorted(rows, key=lambda r: order.index(r["label"]) if r["label"] in order else 99)


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    rows = _ordered(rows)
    reference = next(r.get("image_sha256") for r in rows if r["label"] == "eager-unconstrained")
    lines = [
        f"Limit: **{_gib(meta['limit'])} GiB** ({meta['cgroup']} memory cgroup, no swap), "
        f"between the staged and the eager footprint peak. Fixture: Qwen-Image 2.1, "
        f"{meta['gb_per_model']} GB per large model, fp16 checkpoint run in bf16, "
        f"{meta['call']['height']} px, {meta['call']['num_inference_steps']} steps.",
        "",
        "| run | limit GiB | result | cgroup peak GiB | footprint peak GiB | limit hits "
        "| wall s | image = unconstrained eager |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        limit = "none" if row["limit"] == UNCONSTRAINED else _gib(row["limit"])
        same = "-"
        if row.get("image_sha256"):
            same = "yes, bit for bit" if row["image_sha256"] == reference else "**NO**"
            if "all_sha256" in row:  # a batch: only seed 0 has an eager run to compare with
                same = f"seed 0 of {len(row['all_sha256'])}: {same}"
        lines.append(
            f"| {row['label']} | {limit} | {_status(row)} | {_gib(row['cgroup_peak'])} | "
            f"{_gib(row['footprint_peak'])} | {row['limit_hits']} | "
            f"{row['wall_seconds']:.0f} | {same} |"
        )
    text = "\n".join(lines) + "\n"
    for row in rows:
        if row["label"] in BATCHES:
            budget = BATCHES[row["label"]]
            how = "no budget" if budget is None else f"budget={budget!r}, prefetch on"
            text += f"\n{row['label']}: 4 calls (seeds 0..3) through `pipe.stageload.map`, {how}"
            if "all_sha256" in row:
                text += (
                    f"; loads in the whole batch, in order: {', '.join(row['loads'])}; "
                    f"{len(set(row['all_sha256']))} distinct images"
                )
            text += ".\n"
    text += (
        "\ncgroup peak: the kernel's peak charge (memory.max_usage_in_bytes or memory.peak), "
        "which counts page cache; footprint peak: the meter's largest sample (anonymous "
        "memory, 0.1 s samples; for a killed run, up to its last sample). Limit hits: times "
        "a charge met the limit and the kernel had to reclaim (memory.failcnt / "
        "memory.events max). Each run starts with the fixture dropped from the page cache. "
        "Wall times are single runs on a busy shared 2-core machine (load average 10-21 "
        "from other jobs), rows measured at different moments: read them as rough.\n"
    )
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"rows": rows, "meta": meta}, indent=2) + "\n")
    return text


def plot(out: Path, rows: list[dict[str, Any]]) -> None:
    """memory.png: the traces of the runs under the limit, one panel each."""
    traces = [out / f"{r['label']}.jsonl" for r in _ordered(rows) if r["limit"] != UNCONSTRAINED]
    try:
        from stageload.report.plot import plot_traces

        plot_traces([t for t in traces if t.exists()], out / "memory.png")
    except Exception as exc:  # the table stands without the plot
        print(f"no plot: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # inside the cgroup: --child MODE FIXTURE TRACE RESULT CALL
        mode, fixture, trace, result, call = argv[1:]
        run_map(fixture, trace, result, json.loads(call), mode)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=Path("/tmp/stageload-bench/qwen21-1g"))
    parser.add_argument("--gb", type=float, default=1.0, help="bf16 GB per large model")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/small-machine")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--limit",
        type=parse_size,
        default=None,
        help="cgroup limit (default: halfway between staged and eager peaks)",
    )
    parser.add_argument("--size", type=int, default=128, help="image side, pixels")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--update",
        action="store_true",
        help="run only --modes at the limit in OUT/results.json, keeping its other rows",
    )
    parser.add_argument(
        "--tables-only", action="store_true", help="rewrite results.md and the plot from OUT"
    )
    args = parser.parse_args(argv)
    if args.tables_only:
        stored = json.loads((args.out / "results.json").read_text())
        for row in stored["rows"]:
            if "loads" in row and (args.out / f"{row['label']}.jsonl").exists():
                row["loads"] = trace_loads(args.out / f"{row['label']}.jsonl")
        print(write_results(args.out, stored["rows"], stored["meta"]))
        plot(args.out, stored["rows"])
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    call = {
        "prompt": "a capybara wearing a wizard hat, reading a book by candlelight",
        "height": args.size,
        "width": args.size,
        "num_inference_steps": args.steps,
        "output_resolution": args.size,
    }
    fixture = build_fixture(args.fixture, args.gb)
    if args.update:  # same fixture, call and limit as the stored rows (the reference too)
        stored = json.loads((args.out / "results.json").read_text())
        rows, meta = stored["rows"], stored["meta"]
        if meta["call"] != call:
            print(f"the stored rows are for {meta['call']}, not {call}", file=sys.stderr)
            return 2
        for mode in args.modes:
            row = run_mode(mode, meta["limit"], fixture, args.out, call, mode)
            rows = [r for r in rows if r["label"] != mode] + [row]
        print(write_results(args.out, rows, meta))
        plot(args.out, rows)
        return 0
    rows = [
        run_mode(m, UNCONSTRAINED, fixture, args.out, call, f"{m}-unconstrained")
        for m in ("eager", "staged")
    ]
    eager, staged = rows
    if not (eager["finished"] and staged["finished"]):
        print(f"an unconstrained run failed: {rows}", file=sys.stderr)
        return 1
    limit = args.limit
    if limit is None:  # halfway, rounded down to 64 MiB
        limit = (eager["footprint_peak"] + staged["footprint_peak"]) // 2 // (64 * MIB) * 64 * MIB
    print(f"limit {format_size(limit)}", flush=True)
    rows += [run_mode(m, limit, fixture, args.out, call, m) for m in args.modes]
    meta = {
        "limit": limit,
        "cgroup": eager["cgroup"],
        "gb_per_model": args.gb,
        "call": call,
        "cpus": os.cpu_count(),
        "checkpoint_dtype": "float16",
        "run_dtype": "bfloat16",
    }
    print(write_results(args.out, rows, meta))
    plot(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
