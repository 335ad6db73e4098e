"""Reading traces in bounded memory (issue 33.6): running figures per window, decimated
plot lines, and the same figures as holding every sample.

The figures are checked against a plain reference written here (every sample held, every
window scanned: what the reader did before), on random traces whose samples come out of
order, land exactly on window bounds, and come from several processes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from fixtures.traces import MIB, staged_records, write_trace
from stageload.report import samples as samples_module
from stageload.report.plot import draw_traces
from stageload.report.processes import by_process, load_views
from stageload.report.records import TraceError, TraceFile
from stageload.report.samples import SERIES_BUCKETS, Lines
from stageload.report.trace import (
    Trace,
    load_summary,
    read_trace,
    scan_trace,
    stage_windows,
    summarize,
)


def _random_records(seed: int, samples: int = 400) -> list[dict[str, Any]]:
    """A trace of two processes entering stages (some twice), runs of releases after the
    stage events, samples written late and at the very t of a window's start."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = [{"type": "start", "monotonic": 10.0, "meta": {}}]
    t = 0.0
    bounds: list[float] = []
    for pid in (11, 22):
        records.append({"type": "event", "t": t, "kind": "process", "note": "start", "pid": pid})
        for _ in range(rng.randint(2, 5)):
            t = round(t + rng.choice([0.1, 0.25, 0.5]), 3)
            stage = rng.choice(["a", "b", "c"])
            records.append({"type": "event", "t": t, "kind": "stage", "stage": stage, "pid": pid})
            for _ in range(rng.randint(0, 2)):  # a run of releases moves the window's start
                t = round(t + 0.05, 3)
                records.append(
                    {"type": "event", "t": t, "kind": "release", "model": "m",
                     "bytes": MIB, "seconds": 0.01, "pid": pid}
                )  # fmt: skip
            bounds.append(t)
        t = round(t + 0.2, 3)
        if rng.random() < 0.7:  # some processes exit, others are still running at the end
            records.append({"type": "event", "t": t, "kind": "process", "note": "exit", "pid": pid})
            bounds.append(t)
    for _ in range(samples):
        at = rng.choice(bounds) if rng.random() < 0.1 else round(rng.uniform(0, t + 0.5), 3)
        sample: dict[str, Any] = {"type": "sample", "t": at}
        for key in ("footprint", "available", "swap_used"):
            if rng.random() < 0.9:
                sample[key] = rng.randrange(1, 1000) * MIB
        if rng.random() < 0.8:
            sample["available_pct"] = round(rng.uniform(0, 100), 1)
        if rng.random() < 0.2:
            sample["cuda_allocated"] = rng.randrange(1000)
        records.append(sample)
    rng.shuffle(records[1:])  # file order is not time order
    return records


def _reference(trace: Trace) -> dict[str, Any]:
    """The sample figures of a ``Trace`` that holds every sample, the plain way."""
    samples = sorted(trace.samples, key=lambda s: s.t)
    windows = stage_windows(trace)
    stages: dict[str, dict[str, Any]] = {}
    for k, w in enumerate(windows):
        last = k == len(windows) - 1
        inside = [s for s in samples if w.start <= s.t and (s.t < w.end or (last and s.t <= w.end))]
        stage = stages.setdefault(w.stage, {"peak": None, "samples": 0, "device": {}})
        stage["samples"] += len(inside)
        peaks = [s.footprint for s in inside if s.footprint is not None]
        if stage["peak"] is not None:
            peaks.append(stage["peak"])
        stage["peak"] = max(peaks, default=None)
        for s in inside:
            for key, value in s.device.items():
                stage["device"][key] = max(stage["device"].get(key, value), value)
    swaps = [s.swap_used for s in samples if s.swap_used is not None]
    return {
        "stages": stages,
        "samples": len(samples),
        "peak": max((s.footprint for s in samples if s.footprint is not None), default=None),
        "swap": (swaps[0], max(swaps), swaps[-1]) if swaps else (None, None, None),
        "available": min((s.available for s in samples if s.available is not None), default=None),
        "pct": min((s.available_pct for s in samples if s.available_pct is not None), default=None),
    }


def _figures(trace: Trace) -> dict[str, Any]:
    """The same figures, from the summary."""
    s = summarize(trace)
    return {
        "stages": {
            st.stage: {"peak": st.peak_footprint, "samples": st.samples, "device": st.device_peak}
            for st in s.stages
        },
        "samples": s.samples,
        "peak": s.peak_footprint,
        "swap": (s.swap_start, s.swap_peak, s.swap_end),
        "available": s.lowest_available,
        "pct": s.lowest_available_pct,
    }


SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
def test_running_figures_equal_holding_every_sample(tmp_path: Path, seed: int) -> None:
    path = write_trace(tmp_path / "t.jsonl", _random_records(seed))
    held = read_trace(path)
    views = by_process(held)
    assert len(views) == 2  # two processes: one view each, cut at their start and exit
    streamed = load_views([path])
    assert all(v.samples == [] and v.sampled is not None for v in streamed)
    for plain, running in zip(views, streamed, strict=True):
        assert _figures(running) == _figures(plain) == _reference(plain)
        assert summarize(running).to_dict() == summarize(plain).to_dict()
    assert _figures(scan_trace(path)) == _reference(held)
    assert load_summary(path).to_dict() == summarize(held).to_dict()


def test_control_a_sample_on_a_window_start_counted_in_the_window_before(
    tmp_path: Path, monkeypatch
) -> None:
    """The check above can fail: put the samples at exactly a bound into the segment
    before it, and some seed's figures differ from the reference."""
    real = samples_module.SampleStats.add

    def before(self, t, *values):  # type: ignore[no-untyped-def]
        if t in self.bounds:
            t -= 1e-9
        real(self, t, *values)

    monkeypatch.setattr(samples_module.SampleStats, "add", before)
    differ = 0
    for seed in SEEDS:
        path = write_trace(tmp_path / f"{seed}.jsonl", _random_records(seed))
        views = by_process(read_trace(path))
        differ += sum(_figures(v) != _reference(v) for v in views)
    assert differ > 0


def _pool_records(processes: int) -> list[dict[str, Any]]:
    """A pool: each process starts, enters a stage and runs to the end of the trace; a
    sample after each."""
    records: list[dict[str, Any]] = [{"type": "start", "monotonic": 10.0, "meta": {}}]
    for i in range(processes):
        t, pid = i * 0.01, 1000 + i
        records += [
            {"type": "event", "t": t, "kind": "process", "note": "start", "pid": pid},
            {"type": "event", "t": t, "kind": "stage", "stage": "a", "pid": pid},
            {"type": "sample", "t": t + 0.005, "footprint": (i + 1) * MIB},
        ]
    return records


def test_report_of_thousands_of_processes_takes_seconds(tmp_path: Path) -> None:
    """2,000 processes, 6,000 events: the report took minutes (each view tested every
    event against a list of the processes, and merged every later segment of samples);
    the timeout fails it on that code."""
    path = write_trace(tmp_path / "pool.jsonl", _pool_records(2000))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "stageload", "report", "--json", str(path)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    traces = json.loads(result.stdout)["traces"]
    # One view per process, from its start to the end: process i saw the samples of i on.
    assert [t["pid"] for t in traces] == [1000 + i for i in range(2000)]
    assert [t["samples"] for t in traces] == list(range(2000, 0, -1))
    assert {t["peak_footprint"] for t in traces} == {2000 * MIB}


# Runs ``python -m MODULE ARGS`` (or ``-c CODE``) under tracemalloc and prints its peak of
# Python memory: objects are what would grow with the samples, and unlike the resident
# set this figure does not shrink when a busy machine swaps the child's pages out.
_TRACED = """\
import runpy, sys, tracemalloc
tracemalloc.start()
kind, what, *sys.argv = sys.argv[1:]
try:
    if kind == "-m":
        sys.argv.insert(0, what)
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    else:
        exec(what)
except SystemExit as exit:
    assert not exit.code, exit.code
print(tracemalloc.get_traced_memory()[1], file=sys.stderr)
"""


def _peak(argv: list[str]) -> int:
    """Peak of Python memory of a child running ``argv`` (``-m MODULE ...`` or ``-c CODE
    ...``), in bytes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", _TRACED, *argv], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return int(result.stderr.strip().splitlines()[-1])


def _long_trace(path: Path, samples: int) -> Path:
    """``samples`` samples in 8 stage windows, however many samples (the plot draws a band
    and a label per window: their memory is not the samples')."""
    every = -(-samples // 8)
    with open(path, "w") as f:
        f.write(json.dumps({"type": "start", "meta": {"label": "long"}}) + "\n")
        for i in range(samples):
            if i % every == 0:
                f.write(json.dumps({"type": "event", "t": i / 100, "kind": "stage",
                                    "stage": f"s{i // every % 5}"}) + "\n")  # fmt: skip
            f.write(
                f'{{"type":"sample","t":{i / 100},"footprint":{(i % 997 + 1) * MIB},'
                f'"available":{(2000 - i % 997) * MIB},"available_pct":50.0,"swap_used":0}}\n'
            )
    return path


@pytest.fixture(scope="module")
def long_traces(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("long")
    return _long_trace(folder / "short.jsonl", 2_000), _long_trace(folder / "long.jsonl", 150_000)


REPORT = ["-m", "stageload", "report"]
HOLDING = ["-c", "from stageload.report.trace import read_trace, summarize\n"
           "summarize(read_trace(sys.argv[0]))"]  # fmt: skip


def test_report_memory_does_not_grow_with_the_samples(long_traces) -> None:
    short, long = long_traces
    grew = _peak([*REPORT, str(long)]) - _peak([*REPORT, str(short)])
    assert grew < 2 * MIB, f"report grew {grew / MIB:.1f} MiB for 148,000 more samples"


def test_control_holding_every_sample_grows_with_them(long_traces) -> None:
    """The bound above can fail: reading the same traces into ``Trace.samples`` grows."""
    short, long = long_traces
    grew = _peak([*HOLDING, str(long)]) - _peak([*HOLDING, str(short)])
    assert grew > 20 * MIB, f"holding grew only {grew / MIB:.1f} MiB"


def test_plot_memory_does_not_grow_with_the_samples(long_traces, tmp_path: Path) -> None:
    short, long = long_traces
    plot = ["-m", "stageload", "plot", "-o", str(tmp_path / "p.png")]
    grew = _peak([*plot, str(long)]) - _peak([*plot, str(short)])
    assert grew < 4 * MIB, f"plot grew {grew / MIB:.1f} MiB for 148,000 more samples"


def _spiky(n: int) -> list[tuple[float, int]]:
    points = [(i * 0.01, 100 + i % 7) for i in range(n)]
    points[n // 3] = (points[n // 3][0], 10_000)  # one sample's peak
    points[2 * n // 3] = (points[2 * n // 3][0], 1)  # and one's trough
    return points


def test_decimated_lines_keep_a_few_thousand_points_and_every_peak() -> None:
    lines = Lines()
    points = _spiky(200_000)
    for t, v in reversed(points):  # any order: buckets are by time
        lines.add(t, v, None, v)
    kept = lines.points("footprint")
    assert lines.decimated and SERIES_BUCKETS <= len(kept) <= 4 * SERIES_BUCKETS
    assert max(v for _, v in kept) == 10_000 and min(v for _, v in kept) == 1
    assert (points[200_000 // 3][0], 10_000) in kept
    assert kept == sorted(kept) and set(kept) <= set(points)
    assert lines.points("swap_used") == []
    assert lines.points("available") == kept


def test_control_keeping_one_point_per_bucket_loses_the_peak(monkeypatch) -> None:
    """The check above can fail: a decimation that keeps each bucket's first point misses
    the one-sample peak."""

    def first_only(self, t, *values):  # type: ignore[no-untyped-def]
        if self._raw is not None:
            self._raw.append((t, *values))
            if len(self._raw) > 4 * self._limit:
                self._to_buckets(self._raw)
            return
        key = int(t / self._width)
        if key not in self._buckets:
            self._buckets[key] = [t, values[0], t, values[0]] + [None] * 8
            if len(self._buckets) > 2 * self._limit:
                self._coarsen()

    monkeypatch.setattr(Lines, "add", first_only)
    lines = Lines()
    for t, v in _spiky(200_000):
        lines.add(t, v, None, None)
    assert max(v for _, v in lines.points("footprint")) < 10_000


def test_plot_lines_of_a_short_trace_are_every_sample(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "staged.jsonl", staged_records())
    samples = read_trace(path).samples
    for source in (path, read_trace(path)):  # from the file, and from a held Trace
        panel = draw_traces([source]).axes[0]
        (line,) = [ln for ln in panel.get_lines() if ln.get_label() == "footprint"]
        assert list(line.get_xdata()) == [s.t for s in samples]
        assert list(line.get_ydata()) == [s.footprint / MIB for s in samples]


def test_plot_of_a_long_trace_draws_a_few_thousand_points_with_the_peak(long_traces) -> None:
    _, long = long_traces
    fig = draw_traces([long])
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "footprint"]
    assert len(line.get_ydata()) <= 4 * SERIES_BUCKETS
    assert max(line.get_ydata()) == 997  # MiB: the highest footprint of the trace


def test_a_trace_appended_to_while_read_reads_as_one_moment(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "live.jsonl", staged_records())
    with TraceFile(path) as file:
        with open(path, "a") as f:  # the run goes on writing after the first pass
            f.write(json.dumps({"type": "sample", "t": 9.0, "footprint": 999 * MIB}) + "\n")
        read = list(file.samples())
    assert len(read) == len(read_trace(write_trace(tmp_path / "w", staged_records())).samples)
    assert max(v[1] for v in read) == 460 * MIB


def test_a_trace_cut_while_read_is_an_error_not_a_wrong_figure(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "cut.jsonl", staged_records())
    with TraceFile(path) as file:
        os.truncate(path, 400)  # a new run at the same path emptied it
        with pytest.raises(TraceError, match="was cut to 400 bytes while being read"):
            list(file.samples())


def test_a_trace_from_a_pipe_reads_as_from_a_file(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "staged.jsonl", staged_records())
    read, write = os.pipe()

    def feed() -> None:
        with os.fdopen(write, "wb") as f:
            f.write(path.read_bytes())

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        piped = load_summary(f"/dev/fd/{read}")
    finally:
        feeder.join()
        os.close(read)
    assert piped.to_dict() | {"path": ""} == load_summary(path).to_dict() | {"path": ""}


def test_the_samples_of_an_open_trace_are_read_once(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", staged_records())
    with TraceFile(path) as file:
        assert len(list(file.samples())) == 7
        with pytest.raises(ValueError, match="the samples were read already"):
            list(file.samples())
