"""TraceWriter: one whole JSON line per record, from threads and processes, surviving a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from stageload.core.events import Event
from stageload.meter.tracefile import FORMAT_VERSION, TraceWriter, read_records

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_records_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as trace:
        start = trace.start(
            pid=os.getpid(),
            interval=0.25,
            sampler="thread",
            total=1 << 30,
            sources={"footprint": "here"},
            meta={"label": "x"},
            sampler_pid=7,
        )
        trace.sample({"footprint": 10, "available": None})
        trace.event(Event("load", model="vae", bytes=5, seconds=0.5, time=trace.monotonic0 + 2))
        trace.mark("half way")
        trace.end(exit_code=3)
    records = read_records(path)
    assert [r["type"] for r in records] == ["start", "sample", "event", "mark", "end"]
    assert records[0] == start
    assert start["version"] == FORMAT_VERSION
    assert start["pid"] == os.getpid() and start["sampler_pid"] == 7
    assert start["platform"] == sys.platform and start["meta"] == {"label": "x"}
    assert start["versions"]["python"] and "stageload" in start["versions"]
    assert records[1]["footprint"] == 10 and records[1]["available"] is None
    # t of an event is the event's own time, not the time it was written.
    assert records[2] == {
        "type": "event",
        "t": 2.0,
        "kind": "load",
        "model": "vae",
        "bytes": 5,
        "seconds": 0.5,
        "pid": os.getpid(),
    }
    assert records[3]["label"] == "half way"
    assert records[4]["samples"] == 1 and records[4]["exit_code"] == 3
    ts = [r["t"] for r in records[1:]]
    assert all(isinstance(t, float) for t in ts)


def test_end_without_command_has_no_exit_code(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.jsonl") as trace:
        trace.end()
    (end,) = read_records(tmp_path / "t.jsonl")
    assert end["type"] == "end" and "exit_code" not in end and end["samples"] == 0


def test_errors_are_written_once_until_recovered(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as trace:
        assert trace.error("swap_used", "no /proc/meminfo")
        assert not trace.error("swap_used", "no /proc/meminfo")
        trace.track_errors(["swap_used", "footprint"], {"swap_used": "still"})
        assert trace.failing() == {"swap_used"}
        assert not trace.recovered("footprint")  # never failed: nothing to recover
        trace.track_errors(["swap_used", "footprint"], {})
        assert trace.failing() == frozenset()
        trace.track_errors(["swap_used"], {"swap_used": "again"})
    errors = read_records(path)
    assert [(r["field"], r.get("message"), r.get("recovered")) for r in errors] == [
        ("swap_used", "no /proc/meminfo", None),
        ("swap_used", None, True),
        ("swap_used", "again", None),
    ]


def test_not_a_number_is_written_as_null(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.jsonl") as trace:
        trace.sample({"pressure": float("nan"), "footprint": float("inf")})
    line = (tmp_path / "t.jsonl").read_text()
    assert json.loads(line) == {
        "type": "sample",
        "t": json.loads(line)["t"],
        "pressure": None,
        "footprint": None,
    }


def test_append_keeps_what_is_there_and_truncate_does_not(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as first:
        first.mark("a")
        with TraceWriter(path, append=True, monotonic0=first.monotonic0) as second:
            second.mark("b")
    assert [r["label"] for r in read_records(path)] == ["a", "b"]
    with TraceWriter(path) as again:
        again.mark("c")
    assert [r["label"] for r in read_records(path)] == ["c"]


def test_closed_writer_and_bad_path_say_what_is_wrong(tmp_path: Path) -> None:
    trace = TraceWriter(tmp_path / "t.jsonl")
    trace.close()
    trace.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        trace.mark("late")
    with pytest.raises(OSError, match="cannot open trace file .*no-such-dir"):
        TraceWriter(tmp_path / "no-such-dir" / "t.jsonl")


def test_threads_never_interleave_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    payload = "x" * 5000  # longer than a pipe's atomic size, to make a torn line likely
    with TraceWriter(path) as trace:

        def work(n: int) -> None:
            for i in range(300):
                trace.mark(f"{n}:{i}:{payload}")

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    labels = [r["label"] for r in read_records(path)]
    assert len(labels) == 1200
    assert all(label.endswith(payload) for label in labels)


_WRITER = textwrap.dedent(
    """
    import sys
    from stageload.meter.tracefile import TraceWriter
    path, name, m0 = sys.argv[1], sys.argv[2], float(sys.argv[3])
    with TraceWriter(path, append=True, monotonic0=m0) as trace:
        for i in range(1500):
            trace.mark(f"{name}:{i}:" + name * 3000)
    """
)


def test_two_processes_appending_never_interleave(tmp_path: Path) -> None:
    """The meter's sampler process and the metered process write one file at once."""
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as trace:
        trace.start(pid=os.getpid())
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _WRITER, str(path), name, str(trace.monotonic0)], env=_env()
            )
            for name in "ab"
        ]
        for p in procs:
            assert p.wait(timeout=60) == 0
    records = read_records(path)
    assert records[0]["type"] == "start"
    marks = records[1:]
    assert len(marks) == 3000
    for name in "ab":
        mine = [int(r["label"].split(":")[1]) for r in marks if r["label"].startswith(name)]
        assert mine == list(range(1500))  # every line whole and in order
    assert all(r["label"].endswith(r["label"][0] * 3000) for r in marks)


_KILLED = textwrap.dedent(
    """
    import sys, time
    from stageload.meter.tracefile import TraceWriter
    trace = TraceWriter(sys.argv[1])
    trace.start(pid=0)
    for i in range(5):
        trace.sample({"footprint": i})
    print("written", flush=True)
    time.sleep(60)
    """
)


def test_records_survive_sigkill_of_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(path)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "written\n"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    records = read_records(path)
    assert [r["type"] for r in records] == ["start"] + ["sample"] * 5
    assert [r["footprint"] for r in records[1:]] == [0, 1, 2, 3, 4]


def test_read_records_skips_only_a_half_last_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"type": "start"}\n{"type": "sample", "t": 1}\n{"type": "sam')
    assert [r["type"] for r in read_records(path)] == ["start", "sample"]
    path.write_text('{"type": "start"}\n{"type": "sam\n{"type": "end"}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_records(path)


def test_t_is_seconds_since_start_on_the_monotonic_clock(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.jsonl", monotonic0=time.monotonic() - 10) as trace:
        assert 10 <= trace.t() < 70
        assert trace.t(trace.monotonic0 + 1.5) == 1.5
