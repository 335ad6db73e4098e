"""Events written by TraceWriter read back whole, and the report says why models were released."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from fixtures.traces import MIB
from stageload.core.events import (
    REASON_BUDGET,
    REASON_CLOSE,
    REASON_EVICT,
    REASON_NOT_IN_PLAN,
    Event,
)
from stageload.meter.tracefile import TraceWriter
from stageload.report.trace import read_trace


def test_every_field_of_an_event_survives_a_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path)
    # Every field set to a value that is not its default, so a field the reader drops shows.
    event = Event(
        kind="release",
        model="unet",
        stage="decode",
        bytes=3 * MIB,
        seconds=0.25,
        note="a note",
        reason=REASON_BUDGET,
        compute=1.5,
        time=time.monotonic(),
    )
    assert all(getattr(event, f.name) is not None for f in fields(Event))
    with writer:
        writer.start(pid=1)
        writer.event(event)
    (read,) = read_trace(path).events
    for f in fields(Event):
        if f.name == "time":  # written as t, rounded to microseconds
            assert abs(read.time - event.time) < 1e-5
        else:
            assert getattr(read, f.name) == getattr(event, f.name), f.name
    assert isinstance(read, Event) and read.pid is not None and read.t >= 0


def test_the_report_splits_releases_by_reason(tmp_path: Path) -> None:
    path = tmp_path / "reasons.jsonl"
    with TraceWriter(path) as writer:
        writer.start(pid=1, meta={"label": "run"})
        writer.event(Event("stage", stage="encode"))
        for reason, count in [
            (REASON_BUDGET, 2),
            (REASON_NOT_IN_PLAN, 1),
            (REASON_EVICT, 1),
            (REASON_CLOSE, 3),
        ]:
            for _ in range(count):
                writer.event(Event("release", model="m", bytes=MIB, seconds=0.1, reason=reason))
        writer.event(Event("release", model="old", bytes=MIB))  # no reason: an older writer
        writer.end()
    result = subprocess.run(
        [sys.executable, "-m", "stageload", "report", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    assert rows["releases"] == ["8: 8.0 MiB in 700 ms"]
    assert rows["budget"] == ["2: 2.0 MiB in 200 ms"]
    assert rows["not in plan"] == ["1: 1.0 MiB in 100 ms"]
    assert rows["evict"] == ["1: 1.0 MiB in 100 ms"]
    assert rows["close"] == ["3: 3.0 MiB in 300 ms"]
    assert rows["no reason"] == ["1: 1.0 MiB in 0 ms"]

    data = json.loads(
        subprocess.run(
            [sys.executable, "-m", "stageload", "report", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    by_reason = data["traces"][0]["releases_by_reason"]
    assert list(by_reason) == ["budget", "not in plan", "evict", "close", "no reason"]
    assert by_reason["close"]["count"] == 3


def test_no_reason_rows_when_no_release_says_why(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    with TraceWriter(path) as writer:
        writer.start(pid=1)
        writer.event(Event("release", model="m", bytes=MIB))
        writer.end()
    out = subprocess.run(
        [sys.executable, "-m", "stageload", "report", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "no reason" not in out and "| releases" in out
