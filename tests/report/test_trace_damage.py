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
from stageload.report.trace import load_summary, read_trace, stage_windows, summarize


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


# -- Values out of range (issue 33.5): skipped and counted, never shown as a figure ---------

#: A value that no reading can have, per key; each is put into one record of the staged
#: fixture trace, which must then report the figures of the whole trace.
OUT_OF_RANGE = [
    ("sample", "footprint", 1e300),
    ("sample", "footprint", -5),
    ("sample", "footprint", 1.5),  # half a byte
    ("sample", "footprint", 2**60),
    ("sample", "footprint", 10**400),  # 400 digits: json reads it, no reading has it
    ("sample", "footprint", "NaN"),  # the token, not the string: see _line()
    ("sample", "footprint", "Infinity"),
    ("sample", "footprint", "lots"),
    ("sample", "footprint", True),
    ("sample", "available", -1),
    ("sample", "available", 1e300),
    ("sample", "swap_used", -(2**20)),
    ("sample", "available_pct", -3.0),
    ("sample", "available_pct", 250.0),
    ("sample", "pressure", 1e9),
    ("sample", "cuda_allocated", -1),
    ("event", "bytes", -100),
    ("event", "seconds", -3.0),
    ("event", "seconds", 1e300),
    ("event", "compute", "-Infinity"),
    ("event", "pid", -1),
]
_TOKENS = {"NaN", "Infinity", "-Infinity"}


def _damaged_line(kind: str, key: str, value: object) -> str:
    """A record of ``kind`` at t=0.7 (inside encode) whose ``key`` is ``value``; NaN and
    Infinity go in as bare JSON tokens, as Python's json.dumps writes them."""
    if kind == "sample":
        record = {"type": "sample", "t": 0.7, key: value}
    else:
        record = {"type": "event", "t": 0.7, "kind": "load", "model": "x", key: value}
    text = json.dumps(record)
    if value in _TOKENS:
        text = text.replace(f'"{value}"', str(value))
    return text


def _figures(data: dict) -> dict:
    """A report's JSON for one trace without what one more record changes by itself: the
    sample counts, the load count, what was skipped."""
    data = json.loads(json.dumps(data))
    for key in ("skipped", "samples", "path"):
        data.pop(key)
    for stage in data["stages"]:
        stage.pop("samples")
    data["loads"].pop("count")
    return data


@pytest.mark.parametrize(("kind", "key", "value"), OUT_OF_RANGE)
def test_a_value_out_of_range_is_dropped_and_counted(tmp_path, kind, key, value) -> None:
    clean = summarize(read_trace(write_trace(tmp_path / "clean.jsonl", staged_records())))
    path = _with_line(tmp_path, _damaged_line(kind, key, value))
    damaged = summarize(read_trace(path))
    assert damaged.dropped == {key: 1}
    assert _figures(damaged.to_dict()) == _figures(clean.to_dict())
    # The same through the bounded-memory reader that `stageload report` uses.
    assert load_summary(path).to_dict() == damaged.to_dict()


def test_every_damage_at_once_reports_in_range_figures_and_no_traceback(tmp_path) -> None:
    records = [json.dumps(r) for r in staged_records()]
    records[1:1] = [_damaged_line(*case) for case in OUT_OF_RANGE]
    start = json.loads(records[0])
    start.update(total=1e300, monotonic="soon")
    records[0] = json.dumps(start)
    end = json.loads(records[-1])
    end["exit_code"] = 10**400
    records[-1] = json.dumps(end)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(records) + "\n")
    result = _report("--json", str(path))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    (trace,) = json.loads(result.stdout)["traces"]
    assert sum(trace["skipped"]["dropped_values"].values()) == len(OUT_OF_RANGE) + 3
    assert trace["total"] is None and trace["exit_code"] is None
    sizes = [trace["peak_footprint"], trace["lowest_available"], *trace["swap"].values()]
    sizes += [s["peak_footprint"] for s in trace["stages"]]
    sizes += [trace[k]["bytes"] for k in ("loads", "reloads", "releases")]
    assert all(0 <= v < 2**40 for v in sizes if v is not None), sizes
    assert all(0 <= trace[k]["seconds"] < 10 for k in ("loads", "reloads", "releases"))
    assert 0 <= trace["lowest_available_pct"] <= 100
    text = _report(str(path))
    assert text.returncode == 0 and "Traceback" not in text.stderr
    assert f"dropped staged: {len(OUT_OF_RANGE) + 3} value(s)" in text.stdout


def test_control_without_the_range_checks_the_damage_shows_as_figures(
    tmp_path, monkeypatch
) -> None:
    """The checks above can fail: with the readers accepting any number, a footprint of
    1e300 becomes the peak, and a load of -100 bytes in -3 s goes into the totals."""
    from stageload.report import records

    def any_number(value: object) -> object:
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    monkeypatch.setattr(records, "_size", any_number)
    monkeypatch.setattr(records, "_percent", any_number)
    monkeypatch.setattr(
        records, "_EVENT_FIELDS", [(n, any_number if r is not records._text else r)
                                   for n, r in records._EVENT_FIELDS]
    )  # fmt: skip
    peak = summarize(read_trace(_with_line(tmp_path, _damaged_line("sample", "footprint", 1e300))))
    assert peak.peak_footprint == 1e300 and not peak.dropped
    load = {"type": "event", "t": 0.7, "kind": "load", "model": "x", "bytes": -100, "seconds": -3}
    loads = summarize(read_trace(_with_line(tmp_path, json.dumps(load)))).loads
    assert (loads.bytes, loads.seconds) == (500 * MIB - 100, 0.15 - 3)


def test_a_value_nested_too_deep_to_read_skips_its_line(tmp_path: Path) -> None:
    deep = "[" * 50_000 + "]" * 50_000
    line = '{"type": "sample", "t": 0.7, "footprint": ' + deep + "}"
    path = _with_line(tmp_path, line)
    assert read_trace(path).bad_lines == [4]
    result = _report(str(path))
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "skipped staged: 1 line(s)" in result.stdout
