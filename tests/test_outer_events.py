"""Events of a command's own StagedModels reach the outer trace (STAGELOAD_TRACE).

In-process tests check the writer against a real trace file; the tests with real
processes run a script that builds StagedModels with no sink under the real commands.
"""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch
from torch import nn

from stageload import ListSink, StagedModels
from stageload.events import Event
from stageload.meter.tracefile import TraceWriter, read_records
from stageload.outer import EVENTS_ENV, TRACE_ENV, OuterTrace, export_trace, outer_trace

STAGES = {"encode": ["encoder"], "decode": ["decoder"]}


def tiny_models(**kwargs) -> StagedModels:
    loaders = {"encoder": lambda: nn.Linear(8, 8), "decoder": lambda: nn.Linear(8, 4)}
    return StagedModels(loaders, stages=STAGES, **kwargs)


def run_tiny(models: StagedModels) -> None:
    models.enter("encode")
    h = models["encoder"](torch.zeros(1, 8))
    models.enter("decode")
    models["decoder"](h)
    models.close()


def started_trace(path, monotonic0=None) -> TraceWriter:
    writer = TraceWriter(path, monotonic0=monotonic0)
    writer.start(pid=os.getpid(), interval=0.5, sampler="process", meta={"label": "outer"})
    return writer


def events_of(path) -> list[dict]:
    return [r for r in read_records(path) if r["type"] == "event"]


@pytest.fixture
def outer(tmp_path, monkeypatch):
    path = tmp_path / "outer.jsonl"
    writer = started_trace(path)
    monkeypatch.setenv(TRACE_ENV, str(path))
    monkeypatch.delenv(EVENTS_ENV, raising=False)
    yield path
    writer.close()


def test_events_of_a_sinkless_staged_models_reach_the_outer_trace(outer):
    run_tiny(tiny_models())
    events = events_of(outer)
    assert [(e["kind"], e.get("model"), e.get("stage")) for e in events] == [
        ("stage", None, "encode"),
        ("load", "encoder", "encode"),
        ("stage", None, "decode"),
        ("release", "encoder", "decode"),
        ("load", "decoder", "decode"),
        ("release", "decoder", "decode"),
    ]
    assert all(e["pid"] == os.getpid() for e in events)
    start = read_records(outer)[0]
    # t is measured against the start record's monotonic time, as the meter's own events.
    assert all(0 <= e["t"] <= time.monotonic() - start["monotonic"] for e in events)
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    load = events[1]
    assert load["bytes"] == (8 * 8 + 8) * 4 and load["seconds"] >= 0


def test_events_go_to_the_own_sink_as_well(outer):
    sink = ListSink()
    run_tiny(tiny_models(events=sink))
    assert [e.kind for e in sink.events] == [e["kind"] for e in events_of(outer)]
    assert len(sink.events) == 6


def test_without_the_variable_nothing_is_written(outer, monkeypatch):
    """Control: the same run with STAGELOAD_TRACE unset leaves the trace as it was."""
    monkeypatch.delenv(TRACE_ENV)
    before = outer.read_bytes()
    models = tiny_models()
    run_tiny(models)
    assert models._outer is None
    assert outer.read_bytes() == before


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_stageload_events_0_opts_out(outer, monkeypatch, value):
    monkeypatch.setenv(EVENTS_ENV, value)
    before = outer.read_bytes()
    run_tiny(tiny_models())
    assert outer.read_bytes() == before


def test_a_missing_trace_is_never_created(tmp_path, monkeypatch):
    path = tmp_path / "gone.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    with pytest.warns(RuntimeWarning, match="cannot open it for appending"):
        run_tiny(tiny_models())
    assert not path.exists()


def test_a_file_that_is_not_a_trace_is_left_alone(tmp_path, monkeypatch):
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    monkeypatch.setenv(TRACE_ENV, str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_tiny(tiny_models())
    assert path.read_text() == "my notes\n"
    # Warned once for the whole run, not once per event.
    assert len([w for w in caught if "not a stageload 'start' record" in str(w.message)]) == 1


def test_events_before_the_start_record_wait_for_it(tmp_path):
    """The tool starts the command, then writes the start record: early events are held."""
    path = tmp_path / "early.jsonl"
    path.touch()  # the tool created the file before starting the command
    trace = OuterTrace(path)
    early = Event("stage", stage="encode")
    trace.emit(early)
    assert path.read_bytes() == b""  # nothing may precede the start record
    writer = started_trace(path, monotonic0=early.time - 1.0)
    trace.emit(Event("stage", stage="decode"))
    records = read_records(path)
    assert [r["type"] for r in records] == ["start", "event", "event"]
    assert records[1]["stage"] == "encode" and records[1]["t"] == pytest.approx(1.0)
    writer.close()


def test_held_events_are_written_at_flush(tmp_path):
    path = tmp_path / "early.jsonl"
    path.touch()
    trace = OuterTrace(path)
    trace.emit(Event("note", note="early"))
    writer = started_trace(path)
    trace.flush()  # what atexit does
    assert [r.get("note") for r in read_records(path)] == [None, "early"]
    writer.close()


def test_one_outer_trace_per_path_per_process(outer):
    assert outer_trace() is outer_trace()
    assert outer_trace({TRACE_ENV: str(outer), EVENTS_ENV: "0"}) is None
    assert outer_trace({}) is None


def test_export_trace_sets_an_absolute_path_and_removes_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = export_trace({}, "run.jsonl")
    assert env == {TRACE_ENV: str(tmp_path / "run.jsonl")}
    assert export_trace(env, None) == {}


def test_each_record_is_one_line(outer):
    """A long note stays one line: json escapes the newlines inside it."""
    trace = outer_trace()
    assert trace is not None
    trace.emit(Event("note", note="two\nlines " + "x" * 10000))
    last = outer.read_text().splitlines()[-1]
    assert json.loads(last)["note"].startswith("two\nlines")
