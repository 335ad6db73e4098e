"""Reading traces, stage windows by the release rule, and the per-stage summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.traces import MIB, eager_records, staged_records, write_trace
from stageload.core.events import SETUP
from stageload.report.records import TraceError
from stageload.report.trace import Window, read_trace, stage_windows, summarize


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "staged.jsonl", staged_records())


def test_stage_windows_follow_the_release_rule(staged: Path) -> None:
    windows = stage_windows(read_trace(staged))
    assert windows == [
        Window(SETUP, 0.0, 0.6, 0.0),
        Window("encode", 0.6, 1.3, 0.6),  # no release after it: starts at its stage event
        Window("denoise", 1.3, 2.1, 1.2),  # starts when the release of `enc` finished
        Window("decode", 2.1, 3.0, 2.0),  # ends at the last record (the end record)
    ]


def test_memory_still_being_freed_counts_toward_the_stage_before(staged: Path) -> None:
    summary = summarize(read_trace(staged))
    # The 460 MiB sample came after `stage denoise` but before its release finished.
    assert summary.stage("encode").peak_footprint == 460 * MIB
    assert summary.stage("denoise").peak_footprint == 380 * MIB


def test_a_run_of_releases_ends_at_the_last_one(tmp_path: Path) -> None:
    records = [
        {"type": "start", "meta": {}},
        {"type": "event", "t": 1.0, "kind": "stage", "stage": "a"},
        {"type": "event", "t": 2.0, "kind": "stage", "stage": "b"},
        {"type": "event", "t": 2.5, "kind": "release", "model": "x", "stage": "b"},
        {"type": "sample", "t": 2.6, "footprint": 5},
        {"type": "event", "t": 2.9, "kind": "release", "model": "y", "stage": "b"},
        {"type": "event", "t": 3.0, "kind": "load", "model": "z"},
        # Not directly after a stage event: a later release does not move the window.
        {"type": "event", "t": 3.5, "kind": "release", "model": "z", "stage": "b"},
        {"type": "sample", "t": 4.0, "footprint": 7},
    ]
    windows = stage_windows(read_trace(write_trace(tmp_path / "t.jsonl", records)))
    assert [(w.stage, w.start, w.end) for w in windows] == [
        (SETUP, 0.0, 1.0),
        ("a", 1.0, 2.9),
        ("b", 2.9, 4.0),
    ]


def test_summary_numbers(staged: Path) -> None:
    s = summarize(read_trace(staged))
    assert s.label == "staged"
    assert s.complete and s.exit_code is None
    assert s.duration == 3.0
    assert s.samples == 7
    assert [(st.stage, st.peak_footprint, st.samples) for st in s.stages] == [
        (SETUP, 400 * MIB, 2),
        ("encode", 460 * MIB, 2),
        ("denoise", 380 * MIB, 2),
        ("decode", 300 * MIB, 1),
    ]
    assert [st.duration for st in s.stages] == pytest.approx([0.6, 0.7, 0.8, 0.9])
    assert s.peak_footprint == 460 * MIB
    assert (s.swap_start, s.swap_peak, s.swap_end, s.swap_growth) == (
        0,
        50 * MIB,
        20 * MIB,
        50 * MIB,
    )
    assert (s.lowest_available, s.lowest_available_pct) == (500 * MIB, 50.0)
    assert s.total == 1000 * MIB
    assert (s.loads.count, s.loads.bytes) == (2, 500 * MIB)
    assert s.loads.seconds == pytest.approx(0.15)
    assert (s.reloads.count, s.reloads.bytes) == (1, 300 * MIB)
    assert (s.releases.count, s.releases.bytes) == (2, 500 * MIB)
    assert s.releases.seconds == pytest.approx(0.2)
    assert [(m.t, m.label) for m in s.marks] == [(1.6, "half way")]
    assert s.read_errors == {"pressure": "no PSI"}
    json.dumps(s.to_dict())  # JSON-ready all the way down


def test_half_written_last_line_is_skipped(tmp_path: Path) -> None:
    whole = read_trace(write_trace(tmp_path / "a.jsonl", staged_records()))
    cut = read_trace(
        write_trace(
            tmp_path / "b.jsonl", staged_records(), tail='{"type": "sample", "t": 9.0, "foo'
        )
    )
    assert cut.skipped_lines == 1 and whole.skipped_lines == 0
    assert cut.samples == whole.samples and cut.events == whole.events
    assert cut.last_t == whole.last_t == 3.0


def test_a_broken_line_before_the_last_is_skipped_and_counted(tmp_path: Path) -> None:
    records = staged_records()
    text = "".join(json.dumps(r) + "\n" for r in records[:3]) + "{oops\n"
    text += "".join(json.dumps(r) + "\n" for r in records[3:])
    (tmp_path / "t.jsonl").write_text(text)
    trace = read_trace(tmp_path / "t.jsonl")
    assert trace.bad_lines == [4]
    assert trace.samples == read_trace(write_trace(tmp_path / "w.jsonl", records)).samples


def test_unknown_keys_and_record_types_are_ignored(tmp_path: Path) -> None:
    plain = [
        {k: v for k, v in r.items() if k != "future_key"}
        for r in staged_records()
        if r["type"] != "some_future_record"
    ]
    a = summarize(read_trace(write_trace(tmp_path / "a.jsonl", staged_records())))
    b = summarize(read_trace(write_trace(tmp_path / "b.jsonl", plain)))
    assert a.stages == b.stages and a.windows == b.windows


def test_unreadable_values_stay_missing_not_zero(tmp_path: Path) -> None:
    records = [
        {"type": "start", "meta": {}},
        {"type": "sample", "t": 0.5, "footprint": None, "swap_used": None, "available": None},
        {"type": "event", "t": 1.0, "kind": "stage", "stage": "only"},
        {"type": "sample", "t": 1.5, "footprint": 10, "swap_used": None},
    ]
    s = summarize(read_trace(write_trace(tmp_path / "t.jsonl", records)))
    assert s.stage(SETUP).peak_footprint is None
    assert s.stage("only").peak_footprint == 10
    assert (s.swap_start, s.swap_peak, s.swap_growth, s.lowest_available) == (None,) * 4


def test_samples_sort_by_time_and_a_stage_entered_twice_adds_up(tmp_path: Path) -> None:
    records = [
        {"type": "start", "meta": {"label": "x"}},
        {"type": "event", "t": 1.0, "kind": "stage", "stage": "a"},
        {"type": "event", "t": 2.0, "kind": "stage", "stage": "b"},
        # The sampler process wrote this one late: it still belongs to `a`.
        {"type": "sample", "t": 1.5, "footprint": 30},
        {"type": "sample", "t": 2.5, "footprint": 20},
        {"type": "event", "t": 3.0, "kind": "stage", "stage": "a"},
        {"type": "sample", "t": 3.5, "footprint": 40},
        {"type": "end", "t": 4.0, "samples": 3},
    ]
    s = summarize(read_trace(write_trace(tmp_path / "t.jsonl", records)))
    a = s.stage("a")
    assert (a.peak_footprint, a.duration, a.windows, a.samples) == (40, 2.0, 2, 2)
    assert s.stage("b").peak_footprint == 20
    assert [st.stage for st in s.stages] == [SETUP, "a", "b"]
    assert s.stage(SETUP).peak_footprint is None  # no sample before t=1.0


def test_a_trace_without_stages_is_all_setup(tmp_path: Path) -> None:
    records = eager_records()
    records = [r for r in records if r.get("kind") != "stage"]
    s = summarize(read_trace(write_trace(tmp_path / "run.jsonl", records)))
    assert [(st.stage, st.peak_footprint) for st in s.stages] == [(SETUP, 720 * MIB)]
    assert not s.complete


def test_device_peaks_are_kept_per_stage(tmp_path: Path) -> None:
    records = [
        {"type": "start", "meta": {}},
        {"type": "sample", "t": 0.5, "footprint": 1, "cuda_allocated": 100, "cuda_reserved": 200},
        {"type": "sample", "t": 0.7, "footprint": 1, "cuda_allocated": 150, "cuda_reserved": 180},
    ]
    s = summarize(read_trace(write_trace(tmp_path / "t.jsonl", records)))
    assert s.stage(SETUP).device_peak == {"cuda_allocated": 150, "cuda_reserved": 200}


def test_label_falls_back_to_the_file_name(tmp_path: Path) -> None:
    records = [{"type": "start", "meta": {}}, {"type": "sample", "t": 0.1, "footprint": 1}]
    assert read_trace(write_trace(tmp_path / "eager-run.jsonl", records)).label == "eager-run"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "is empty"),
        ("\n\n", "is empty"),
        ('{"type": "sample", "t": 0}\n', "does not begin with a 'start' record"),
        ("[1, 2]\n", "not a JSON object"),
        ("hello\nworld\n", "line 1 is not JSON"),
    ],
)
def test_bad_files_give_a_clear_error(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert str(path) in str(info.value)


def test_a_directory_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(tmp_path)


def test_the_reader_reads_every_sample_key_the_meter_writes() -> None:
    """One definition of the sample keys (``memory.SAMPLE_KEYS``): the reader knows how to
    read each, and a key added there without a reader fails at import (the control)."""
    from stageload.memory import SAMPLE_KEYS
    from stageload.report import records

    assert set(records._sample_readers(SAMPLE_KEYS)) == set(SAMPLE_KEYS)
    with pytest.raises(TypeError, match="teach records._sample_readers the new one"):
        records._sample_readers([*SAMPLE_KEYS, "gpu_temperature"])
