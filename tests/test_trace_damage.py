"""Reading damaged or hostile trace files (issue 23.9): skip and count, never crash or hang.

Every case writes a real file and runs the real ``stageload report`` where the output matters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.traces import MIB, staged_records, write_trace
from stageload.report.records import TraceError
from stageload.report.trace import read_trace, stage_windows, summarize


def _report(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stageload", "report", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _with_line(tmp_path: Path, line: str, at: int = 3) -> Path:
    """The staged fixture trace with ``line`` put in as line ``at + 1``."""
    records = staged_records()
    lines = [json.dumps(r) for r in records]
    lines.insert(at, line)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_cut_line_in_the_middle_is_skipped_and_reported(tmp_path: Path) -> None:
    whole = read_trace(write_trace(tmp_path / "whole.jsonl", staged_records()))
    path = _with_line(tmp_path, '{"type": "sample", "t": 0.7, "footpr')
    trace = read_trace(path)
    assert trace.bad_lines == [4] and trace.skipped_lines == 1
    assert trace.samples == whole.samples and trace.events == whole.events
    result = _report(str(path))
    assert result.returncode == 0, result.stderr
    assert "skipped staged: 1 line(s) that are not a JSON record" in result.stdout
    assert "(line 4)" in result.stdout


def test_dev_zero_is_refused_at_once_with_bounded_memory() -> None:
    result = _report("/dev/zero")
    assert result.returncode == 2
    assert "/dev/zero: line 1 is longer than 16 MiB" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_endless_line_after_the_start_is_skipped(tmp_path: Path) -> None:
    path = _with_line(tmp_path, "x" * (20 * MIB))
    trace = read_trace(path)
    assert trace.bad_lines == [4]
    assert len(trace.samples) == len(
        read_trace(write_trace(tmp_path / "w", staged_records())).samples
    )


def test_a_record_nested_100k_deep_is_skipped(tmp_path: Path) -> None:
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000
    assert read_trace(_with_line(tmp_path, deep)).bad_lines == [4]
    first = tmp_path / "first.jsonl"
    first.write_text(deep + "\n")
    with pytest.raises(TraceError, match="line 1 is not JSON"):
        read_trace(first)


def test_an_integer_of_5000_digits_is_skipped(tmp_path: Path) -> None:
    line = '{"type": "sample", "t": 1.0, "footprint": ' + "9" * 5000 + "}"
    assert read_trace(_with_line(tmp_path, line)).bad_lines == [4]


def test_a_huge_footprint_is_dropped_and_counted_in_the_text_report(tmp_path: Path) -> None:
    line = json.dumps({"type": "sample", "t": 0.7, "footprint": 10**400, "available": 5})
    path = _with_line(tmp_path, line)
    trace = read_trace(path)
    assert trace.dropped == {"footprint": 1}
    result = _report(str(path))
    assert result.returncode == 0, result.stderr
    assert (
        "dropped staged: 1 value(s) of the wrong type or out of range (footprint 1)"
        in result.stdout
    )
    data = json.loads(_report("--json", str(path)).stdout)
    assert data["traces"][0]["skipped"]["dropped_values"] == {"footprint": 1}


def test_values_of_the_wrong_type_are_counted_not_silently_dropped(tmp_path: Path) -> None:
    records = [
        {"type": "start", "meta": {"label": "x"}},
        {"type": "sample", "t": 0.1, "footprint": "big", "available": True, "swap_used": None},
        {"type": "event", "t": 0.2, "kind": "load", "model": 5, "bytes": "x", "reason": None},
        {"type": "mark", "t": 0.3, "label": ["not", "text"]},
    ]
    path = write_trace(tmp_path / "t.jsonl", records)
    trace = read_trace(path)
    # null is a value the writer could not read, not a wrong type: not counted.
    assert trace.dropped == {"footprint": 1, "available": 1, "model": 1, "bytes": 1, "label": 1}
    result = _report(str(path))
    assert "dropped x: 5 value(s) of the wrong type or out of range" in result.stdout


def test_a_record_at_a_negative_or_impossible_time_is_skipped(tmp_path: Path) -> None:
    records = [
        {"type": "start", "meta": {"label": "x"}},
        {"type": "event", "t": -100.0, "kind": "stage", "stage": "early"},
        {"type": "sample", "t": 1e12, "footprint": MIB},
        {"type": "sample", "t": "soon", "footprint": MIB},
        {"type": "event", "t": 1.0, "kind": "stage", "stage": "work"},
        {"type": "sample", "t": 2.0, "footprint": MIB},
        {"type": "end", "t": 3.0, "samples": 1},
    ]
    path = write_trace(tmp_path / "t.jsonl", records)
    trace = read_trace(path)
    assert trace.bad_times == 3
    assert [w.stage for w in stage_windows(trace)] == ["setup", "work"]
    assert summarize(trace).duration == 3.0
    result = _report(str(path))
    assert result.returncode == 0, result.stderr
    assert "skipped x: 3 record(s) whose t is missing, not a number, negative" in result.stdout
    assert "early" not in result.stdout
