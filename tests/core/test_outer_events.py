"""Events of a command's own StagedModels reach the outer trace (STAGELOAD_TRACE).

In-process tests check the writer against a real trace file; the tests with real
processes run a script that builds StagedModels with no sink under the real commands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from stageload import ListSink, StagedModels
from stageload.cli import main
from stageload.core.events import Event
from stageload.core.outer import EVENTS_ENV, TRACE_ENV, OuterTrace, command_env, outer_trace
from stageload.meter.tracefile import TraceWriter, read_records
from stageload.report.processes import PIPELINE_KINDS, by_process
from stageload.report.trace import load_summary, read_trace, summarize

STAGES = {"encode": ["encoder"], "decode": ["decoder"]}
PY = sys.executable


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
    """The event records, less the ``process`` start/exit that bracket them."""
    return [r for r in read_records(path) if r["type"] == "event" and r["kind"] != "process"]


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
    # This process announced itself once, when its first StagedModels was built.
    (hello,) = [r for r in read_records(outer) if r.get("kind") == "process"]
    assert hello["note"] == "start" and hello["pid"] == os.getpid()
    assert hello["t"] <= events[0]["t"]
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


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_a_device_as_the_trace_is_said_at_once(monkeypatch, checked):
    """``STAGELOAD_TRACE=/dev/full`` (a device that reads as zeros for ever and cannot be
    written): one warning at the first event, naming what it is, and nothing more is
    tried. Control: without the file-type check, only the first line's length tells
    (after reading 1 MiB of zeros); before that check too, the events waited for a start
    record that never came, and nothing was said while the pipeline ran."""
    import stageload.core.outer as outer_module

    if not os.path.exists("/dev/full"):
        pytest.skip("this system has no /dev/full")
    if not checked:
        monkeypatch.setattr(outer_module.stat, "S_ISREG", lambda mode: True)
    trace = OuterTrace("/dev/full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace.emit(Event("stage", stage="encode"))
        trace.emit(Event("stage", stage="decode"))
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    why = "not a regular file" if checked else "longer than any 'start' record"
    assert len(said) == 1 and why in said[0] and not trace.active
    trace.close()


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_a_named_pipe_as_the_trace_is_said_not_waited_on(tmp_path, checked):
    """``STAGELOAD_TRACE`` naming a named pipe no one reads: its open for writing waits
    for a reader for ever, under the trace's lock (every emitting thread and the exit hung
    behind it, helper-55). Its type is read before the open: one warning, and the event
    returns. In a child process, 5 s allowed. Control: the type check undone, it hangs."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    script = (
        "import warnings, stageload.core.outer as o\n"
        + ("" if checked else "o.stat.S_ISREG = lambda mode: True\n")
        + "warnings.simplefilter('always')\n"
        + f"o.OuterTrace({str(fifo)!r}).emit(o.Event('stage', stage='encode'))\n"
        + "print('returned')\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=5
        )
    except subprocess.TimeoutExpired:
        assert not checked
        return
    assert checked and done.stdout.strip() == "returned"
    assert "not a regular file" in done.stderr


def test_a_first_line_longer_than_a_start_record_is_not_a_trace(tmp_path):
    """A file whose first line never ends within the size of any start record (a log of
    zeros) is said to be no trace, not waited on. Control: the same file, a newline within
    the limit, is read as a start record still to come."""
    import stageload.core.outer as outer_module
    from stageload.core.outer import read_start

    path = tmp_path / "zeros.jsonl"
    path.write_bytes(b"\0" * outer_module._START_MAX)
    with pytest.raises(ValueError, match="longer than any 'start' record"):
        read_start(path)
    path.write_bytes(b"\0" * (outer_module._START_MAX - 1))
    assert read_start(path) is None


@pytest.mark.parametrize("said", [True, False], ids=["said", "control"])
def test_events_lost_for_a_start_record_that_never_came_are_said_at_exit(
    tmp_path, monkeypatch, said
):
    """An empty file named as the trace that no tool ever starts: the events held for its
    start record are dropped at exit, after the bounded wait, with one warning that
    counts them. Control: with that warning undone, they went without a word."""
    import stageload.core.outer as outer_module

    monkeypatch.setattr(outer_module, "EXIT_WAIT", 0.05)
    if not said:
        monkeypatch.setattr(OuterTrace, "_give_up", lambda self, why: None)
    path = tmp_path / "empty.jsonl"
    path.touch()
    trace = OuterTrace(path)
    trace.emit(Event("stage", stage="encode"))
    trace.emit(Event("stage", stage="decode"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace._exit()  # what atexit runs
    # The two, and the exit event _exit adds.
    lost = [str(w.message) for w in caught if "3 events held for it were lost" in str(w.message)]
    assert len(lost) == (1 if said else 0)
    assert path.read_bytes() == b""
    trace.close()


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


def test_command_env_points_to_the_trace_or_opts_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.jsonl").touch()  # the tool creates it before the command starts
    env = command_env("run.jsonl", environ={"PATH": "/bin"})
    assert env == {"PATH": "/bin", TRACE_ENV: str(tmp_path / "run.jsonl")}
    trace = outer_trace(env)
    assert trace is not None
    trace.close()  # no tool writes its start record: its exit would wait and warn
    off = command_env("run.jsonl", events=False, environ=env)
    assert off[EVENTS_ENV] == "0" and outer_trace(off) is None


def test_each_record_is_one_line(outer):
    """A long note stays one line: json escapes the newlines inside it."""
    trace = outer_trace()
    assert trace is not None
    trace.emit(Event("note", note="two\nlines " + "x" * 10000))
    last = outer.read_text().splitlines()[-1]
    assert json.loads(last)["note"].startswith("two\nlines")


def test_by_process_splits_interleaved_pipelines_and_keeps_shared_events(tmp_path):
    """Two processes' stage events interleave in time: one process's windows would be cut
    by the other's stage events; per process they are whole."""
    path = tmp_path / "mixed.jsonl"
    records = [
        {"type": "start", "monotonic": 0.0, "pid": 1, "meta": {"label": "mixed"}},
        {"type": "event", "t": 1.3, "kind": "guard", "note": "start", "pid": 1},
        {"type": "event", "t": 1.0, "kind": "stage", "stage": "a", "pid": 10},
        {"type": "event", "t": 1.2, "kind": "process", "note": "start", "pid": 20},
        {"type": "event", "t": 1.5, "kind": "stage", "stage": "x", "pid": 20},
        {"type": "event", "t": 2.0, "kind": "stage", "stage": "b", "pid": 10},
        {"type": "event", "t": 2.5, "kind": "load", "model": "m", "bytes": 5, "pid": 20},
        {"type": "sample", "t": 2.6, "footprint": 100},
        {"type": "event", "t": 2.8, "kind": "process", "note": "exit", "pid": 20},
        {"type": "sample", "t": 3.5, "footprint": 900},
        {"type": "end", "t": 4.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    trace = read_trace(path)
    first, second = by_process(trace)
    assert (first.pid, second.pid) == (10, 20)
    assert [w.stage for w in summarize(first).windows] == ["setup", "a", "b"]
    assert [w.stage for w in summarize(second).windows] == ["setup", "x"]
    assert summarize(second).loads.bytes == 5 and summarize(first).loads.count == 0
    # The guard's decision (pid 1, no pipeline events) stays in both views.
    assert all(any(e.kind == "guard" for e in v.events) for v in (first, second))
    assert first.label == "mixed [pid 10]" and summarize(second).to_dict()["pid"] == 20
    # pid 20 began at 1.2 and exited at 2.8: its view holds only the samples of that span.
    assert (second.first_t, second.last_t) == (1.2, 2.8) and (first.first_t, first.last_t) == (0, 4)
    assert summarize(second).windows[0].start == 1.2 and summarize(second).peak_footprint == 100
    assert summarize(second).duration == pytest.approx(1.6)
    assert summarize(first).peak_footprint == 900  # the sample at 3.5, after pid 20 exited
    # Control: read as one, the stage windows of both processes mix.
    assert [w.stage for w in summarize(trace).windows] == ["setup", "a", "x", "b"]

    pytest.importorskip("matplotlib")
    from stageload.report.plot import draw_traces

    titles = [ax.get_title(loc="left") for ax in draw_traces([path]).axes]
    assert [t.split(":")[0] for t in titles if "[pid" in t] == [
        "mixed [pid 10]",
        "mixed [pid 20]",
    ]


def test_one_emitting_process_gives_the_trace_itself(tmp_path):
    """Events of another process that are not a pipeline's (a guard's) split nothing."""
    path = tmp_path / "one.jsonl"
    writer = started_trace(path)
    writer.event(Event("stage", stage="a"))
    writer.event({"kind": "guard", "time": writer.monotonic0 + 1, "pid": os.getpid() + 1})
    writer.close()
    trace = read_trace(path)
    assert len({e.pid for e in trace.events}) == 2
    assert by_process(trace) == [trace] and trace.label == "outer"


# -- real processes under the real commands ---------------------------------------------

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A pipeline script that knows nothing of meters: StagedModels with no sink. argv: rounds,
# then optionally the round after whose encoder load it SIGKILLs itself.
PIPELINE = """
import os, signal, sys
import torch
from torch import nn
from stageload import StagedModels

rounds = int(sys.argv[1])
kill_in = int(sys.argv[2]) if len(sys.argv) > 2 else -1
models = StagedModels(
    {"encoder": lambda: nn.Linear(64, 64), "decoder": lambda: nn.Linear(64, 16)},
    stages={"encode": ["encoder"], "decode": ["decoder"]},
)
for i in range(rounds):
    models.enter("encode")
    h = models["encoder"](torch.zeros(1, 64))
    if i == kill_in:
        os.kill(os.getpid(), signal.SIGKILL)
    models.enter("decode")
    models["decoder"](h)
models.close()
"""


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("outer") / "pipeline.py"
    path.write_text(PIPELINE)
    return str(path)


@pytest.fixture
def child_env(monkeypatch):
    """The commands pass this process's environment on: make the script find stageload."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv(TRACE_ENV, raising=False)
    monkeypatch.delenv(EVENTS_ENV, raising=False)


def raw_lines(path) -> list[dict]:
    """Every line of the trace parsed as JSON: a mixed-up line fails here."""
    text = Path(path).read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def pipeline_events(path) -> list[dict]:
    return [r for r in raw_lines(path) if r["type"] == "event" and r["kind"] in PIPELINE_KINDS]


def process_notes(path) -> list[str]:
    return [r["note"] for r in raw_lines(path) if r["type"] == "event" and r["kind"] == "process"]


def test_meter_report_shows_the_stages_of_a_script_that_has_no_meter(
    pipeline, child_env, tmp_path, capsys
):
    trace = tmp_path / "run.jsonl"
    assert main(["meter", "-o", str(trace), "--interval", "0.05", "--", PY, pipeline, "1"]) == 0
    events = pipeline_events(trace)
    start = raw_lines(trace)[0]
    # The command itself emitted them: its pid is the measured one in the start record.
    assert {e["pid"] for e in events} == {start["pid"]}
    summary = load_summary(trace)
    assert [s.stage for s in summary.stages] == ["setup", "encode", "decode"]
    assert (summary.loads.count, summary.reloads.count, summary.releases.count) == (2, 0, 2)
    assert process_notes(trace) == ["start", "exit"]
    assert summary.loads.bytes == (64 * 64 + 64 + 64 * 16 + 16) * 4
    capsys.readouterr()
    assert main(["report", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "| encode" in out and "| decode" in out and "2: " in out


def test_no_events_flag_leaves_the_events_out(pipeline, child_env, tmp_path):
    """Control for the test above: the same run without the events has only setup.

    The flag works by STAGELOAD_EVENTS=0 in the command's environment; that the variable
    turns the writer off is tested in-process above.
    """
    trace = tmp_path / "off.jsonl"
    argv = ["meter", "-o", str(trace), "--interval", "0.05", "--no-events", "--", PY, pipeline, "1"]
    assert main(argv) == 0
    assert pipeline_events(trace) == []
    assert [s.stage for s in load_summary(trace).stages] == ["setup"]


def test_guard_trace_gets_the_command_events_beside_its_own(pipeline, child_env, tmp_path):
    trace = tmp_path / "guard.jsonl"
    argv = ["guard", "--wait-free", "0", "--trace", str(trace), "--", PY, pipeline, "1"]
    assert main(argv) == 0
    records = raw_lines(trace)
    assert any(r["type"] == "event" and r["kind"] == "guard" for r in records)
    assert {e["pid"] for e in pipeline_events(trace)} == {records[0]["pid"]}
    summary = load_summary(trace)
    assert [s.stage for s in summary.stages] == ["setup", "encode", "decode"]
    assert (summary.loads.count, summary.releases.count) == (2, 2)


def test_two_processes_at_once_keep_every_line_whole_and_apart(
    pipeline, child_env, tmp_path, capsys
):
    rounds = 40
    trace = tmp_path / "two.jsonl"
    both = f"{PY} {pipeline} {rounds} & {PY} {pipeline} {rounds} & wait"
    argv = ["meter", "-o", str(trace), "--interval", "0.05", "--", "sh", "-c", both]
    assert main(argv) == 0
    records = raw_lines(trace)  # every line is whole JSON, samples and both children's
    events = [r for r in records if r["type"] == "event"]
    pids = sorted({e["pid"] for e in events})
    assert len(pids) == 2 and records[0]["pid"] not in pids  # the children, not sh
    # Per process: 2 stage events, a load or reload and a release per round; start, exit.
    assert all(sum(e["pid"] == p for e in events) == 6 * rounds + 2 for p in pids)
    views = by_process(read_trace(trace))
    assert sorted(v.pid for v in views) == pids
    for view in views:
        summary = summarize(view)
        assert summary.label.endswith(f"[pid {view.pid}]")
        assert [s.stage for s in summary.stages] == ["setup", "encode", "decode"]
        assert summary.stage("encode").windows == rounds
        assert (summary.loads.count, summary.reloads.count) == (2, 2 * (rounds - 1))
        assert summary.releases.count == 2 * rounds
    capsys.readouterr()
    assert main(["report", str(trace)]) == 0
    header = capsys.readouterr().out.splitlines()[2]
    assert all(f"two [pid {p}]" in header for p in pids)


def test_a_trace_cut_by_sigkill_of_the_command_is_readable(pipeline, child_env, tmp_path):
    trace = tmp_path / "killed.jsonl"
    argv = ["meter", "-o", str(trace), "--interval", "0.05", "--", PY, pipeline, "3", "1"]
    assert main(argv) == 128 + signal.SIGKILL
    raw_lines(trace)
    summary = load_summary(trace)
    # Round 0 whole, then killed in round 1 after the encoder's reload.
    assert [e["kind"] for e in pipeline_events(trace)][-3:] == ["stage", "release", "reload"]
    assert process_notes(trace) == ["start"]  # no exit: killed
    assert [s.stage for s in summary.stages] == ["setup", "encode", "decode"]
    assert summary.exit_code == 128 + signal.SIGKILL
    assert read_trace(trace).end["signal"] == "SIGKILL"


def test_a_release_that_frees_nothing_says_so_in_the_outer_trace_too(outer):
    """With no sink of its own (under ``stageload meter`` only), the release event still
    says which model holds the weights on (a helper found the note computed only for a
    sink)."""
    backbone = nn.Linear(64, 64)
    models = StagedModels(
        {"backbone": lambda: backbone, "head": lambda: nn.Sequential(backbone, nn.Linear(64, 4))},
        stages={"both": ["backbone", "head"], "head": ["head"]},
    )
    models.enter("both")
    models["backbone"], models["head"]
    models.enter("head")
    (kept,) = [e for e in events_of(outer) if e["kind"] == "release"]
    assert kept["model"] == "backbone" and kept["bytes"] == 0
    assert kept["note"] == "16.2 KiB of its weights stay, still held by 'head'"
