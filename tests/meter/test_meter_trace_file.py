"""What `stageload meter` does to the file at -o: an existing trace is not lost to a run
that cannot start, and two runs never write one file. Real processes and files throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stageload.meter import MemoryMeter
from stageload.meter.tracefile import NotATraceError, TraceBusyError, TraceWriter, read_records
from stageload.report.trace import read_trace

SRC = str(Path(__file__).resolve().parents[2] / "src")
OLD = '{"type":"start","version":1,"monotonic":1.0,"pid":1,"meta":{"label":"old"}}\n'


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    return env


def _meter(
    *argv: str, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stageload", "meter", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=cwd,
    )


def test_a_command_that_cannot_start_leaves_an_existing_trace_whole(tmp_path: Path) -> None:
    path = tmp_path / "existing.jsonl"
    path.write_text(OLD)
    result = _meter("-o", str(path), "--", str(tmp_path / "nonexistent"))
    assert result.returncode == 127, result.stderr
    assert "cannot run" in result.stderr and "Traceback" not in result.stderr
    assert path.read_text() == OLD


def test_a_command_that_cannot_start_leaves_no_new_file(tmp_path: Path) -> None:
    path = tmp_path / "new.jsonl"
    assert _meter("-o", str(path), "--", str(tmp_path / "nonexistent")).returncode == 127
    assert not path.exists()


def test_a_run_that_starts_replaces_the_older_trace(tmp_path: Path) -> None:
    path = tmp_path / "existing.jsonl"
    path.write_text(OLD * 3)
    result = _meter("-o", str(path), "--label", "new", "--", "true")
    assert result.returncode == 0, result.stderr
    records = read_records(path)
    assert [r["type"] for r in records].count("start") == 1
    assert records[0]["meta"] == {"label": "new"} and records[-1]["type"] == "end"


def test_without_o_a_taken_default_name_gets_a_number_and_is_not_replaced(
    tmp_path: Path,
) -> None:
    """The default name is by the second: a run in the same second as another replaced its
    trace (or was refused while the other ran). Every name the next minute could give is
    taken here, so the run must find its own, whatever second it starts in."""
    now = time.time()
    taken = {
        time.strftime("meter-%Y%m%d-%H%M%S.jsonl", time.localtime(now + i)) for i in range(-1, 60)
    }
    for name in taken:
        (tmp_path / name).write_text(OLD)
    result = _meter("--label", "new", "--", "true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all((tmp_path / name).read_text() == OLD for name in taken)
    [new] = sorted({p.name for p in tmp_path.iterdir()} - taken)
    assert new.startswith("meter-") and new.endswith("-2.jsonl"), new
    assert read_records(tmp_path / new)[0]["meta"] == {"label": "new"}
    assert f"samples in {new}" in result.stderr


def test_without_o_a_command_that_cannot_start_leaves_no_file(tmp_path: Path) -> None:
    result = _meter("--", str(tmp_path / "nonexistent"), cwd=tmp_path)
    assert result.returncode == 127, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_second_meter_on_the_same_trace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    # The first run's command appends an event of its own (stageload.core.outer) while the
    # first meter holds the lock: such appenders are part of the run, not a second writer.
    # It runs until the test says go (a file), not for a guessed time: the second meter
    # must meet the first one still running however slow the machine is.
    go = tmp_path / "go"
    child = (
        "import os, time\n"
        "from stageload.core.events import Event\n"
        "from stageload.core.outer import emit_outer\n"
        "emit_outer(Event('note', note='from the command'))\n"
        "deadline = time.monotonic() + 120\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    first = subprocess.Popen(
        [sys.executable, "-m", "stageload", "meter", "-o", str(path), "--label", "first",
         "--", sys.executable, "-c", child],
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (path.exists() and path.read_text().endswith("\n")):
            assert time.monotonic() < deadline, "the first meter wrote no start record"
            time.sleep(0.05)
        second = _meter("-o", str(path), "--label", "second", "--", "true")
        assert second.returncode == 2
        assert "-o" in second.stderr and "another run" in second.stderr
        assert "Traceback" not in second.stderr
        go.touch()
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    records = read_records(path)
    assert [r["type"] for r in records].count("start") == 1
    assert records[0]["meta"] == {"label": "first"} and records[-1]["type"] == "end"
    trace = read_trace(path)
    assert [e.note for e in trace.events if e.kind == "note"] == ["from the command"]
    assert trace.skipped_lines == 0


def test_writer_lock_refuses_a_second_writer_and_lets_appenders_in(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(OLD)
    first = TraceWriter(path)
    assert path.read_text() == OLD  # kept until the first record
    with pytest.raises(TraceBusyError, match="another run"):
        TraceWriter(path)
    # The refused writer emptied nothing either.
    assert path.read_text() == OLD
    first.start(pid=os.getpid())
    with TraceWriter(path, append=True, monotonic0=first.monotonic0) as appender:
        appender.mark("appended")
    first.close()
    assert [r["type"] for r in read_records(path)] == ["start", "mark"]
    with TraceWriter(path) as again:  # the lock went with the first writer
        again.mark("next run")
    assert [json.loads(line)["label"] for line in path.read_text().splitlines()] == ["next run"]


SCRIPT = "import torch\nprint('a user script, not a trace')\n"


@pytest.mark.parametrize("refused", [True, False], ids=["fixed", "control"])
def test_a_file_that_is_not_a_trace_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """``MemoryMeter(gen.py)`` (a script mixed up with the trace) is refused and the script
    stays whole. Control: without the check, the first record empties the script."""
    if not refused:
        monkeypatch.setattr(TraceWriter, "_refuse_other_files", lambda self: None)
    path = tmp_path / "gen.py"
    path.write_text(SCRIPT)
    if refused:
        with pytest.raises(NotATraceError) as raised:
            MemoryMeter(path, sampler="thread").start()
        assert str(path) in str(raised.value) and "is not a stageload trace" in str(raised.value)
        assert "give another file name, or delete the file" in str(raised.value)
        assert path.read_text() == SCRIPT
        with TraceWriter(path, append=True) as appender:  # appenders add, never empty
            appender.mark("x")
        assert path.read_text().startswith(SCRIPT)
    else:
        MemoryMeter(path, sampler="thread").start().stop()
        assert read_records(path)[0]["type"] == "start"


@pytest.mark.parametrize(
    "content",
    ["", OLD, '{"type":"mark","t":0.1,"label":"a"}\n', '{"type":"start","version":1,"mon'],
    ids=["empty", "trace", "trace-without-start", "start-cut-short"],
)
def test_an_empty_file_or_a_trace_is_still_overwritten(tmp_path: Path, content: str) -> None:
    """What docs/meter.md promised stays: an existing trace (or an empty file, or a trace
    killed while writing its first line) is replaced by the new run's."""
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with TraceWriter(path) as trace:
        trace.mark("new")
    assert [r["label"] for r in read_records(path)] == ["new"]


def test_meter_and_guard_refuse_a_file_that_is_not_a_trace(tmp_path: Path) -> None:
    """``stageload meter -o gen.py`` and ``guard --trace gen.py``: one line, exit 2, the
    command not run, the script whole."""
    path = tmp_path / "gen.py"
    path.write_text(SCRIPT)
    ran = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    guard = subprocess.run(
        [sys.executable, "-m", "stageload", "guard", "--trace", str(path), *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    for result, tool in ((_meter("-o", str(path), *command), "meter"), (guard, "guard")):
        assert result.returncode == 2, result.stderr
        assert f"stageload {tool}: error:" in result.stderr
        assert "is not a stageload trace" in result.stderr and "Traceback" not in result.stderr
        assert path.read_text() == SCRIPT and not ran.exists()


def test_discard_keeps_an_older_file_and_removes_a_created_one(tmp_path: Path) -> None:
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text(OLD)
    TraceWriter(old).discard()
    TraceWriter(new).discard()
    assert old.read_text() == OLD and not new.exists()


@pytest.mark.parametrize("value", ["0.000000001", "0.005", "99999999999", "2h"])
def test_an_interval_out_of_range_is_a_usage_error(tmp_path: Path, value: str) -> None:
    path = tmp_path / "t.jsonl"
    result = _meter("-o", str(path), "--interval", value, "--", "true")
    assert result.returncode == 2
    assert "--interval" in result.stderr and "from 0.01 s (10 ms) to 3600 s" in result.stderr
    assert "Traceback" not in result.stderr and not path.exists()


@pytest.mark.parametrize("value", [1e-9, float("inf"), float("nan"), 1e11])
def test_memory_meter_refuses_an_interval_out_of_range(tmp_path: Path, value: float) -> None:
    with pytest.raises(ValueError, match=r"interval must be from 0.01 s \(10 ms\)"):
        MemoryMeter(tmp_path / "t.jsonl", interval=value)
    assert not (tmp_path / "t.jsonl").exists()


def test_the_sampler_process_refuses_an_interval_out_of_range(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stageload.meter", "--path", str(tmp_path / "t.jsonl"),
         "--watch", str(os.getpid()), "--interval", "inf", "--no-detach"],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert result.returncode == 2 and "--interval" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_shortest_interval_stops_promptly(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    began = time.monotonic()
    result = _meter("-o", str(path), "--interval", "10ms", "--", "sleep", "0.5")
    took = time.monotonic() - began
    assert result.returncode == 0, result.stderr
    # The sampler answers "stop" at once; a hang would wait out the 10 s stop timeout.
    assert took < 8, f"took {took:.1f} s"
    errors = [r for r in read_records(path) if r["type"] == "error"]
    assert not [e for e in errors if e["field"] == "sampler"], errors
    assert sum(r["type"] == "sample" for r in read_records(path)) >= 5


def test_a_file_name_too_long_is_a_usage_error_naming_the_flag(tmp_path: Path) -> None:
    name = "a" * 300 + ".jsonl"
    result = _meter("-o", str(tmp_path / name), "--", "true")
    assert result.returncode == 2
    assert result.stderr.startswith("stageload meter: error: -o '")
    assert "file name is too long" in result.stderr and "give a shorter one" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_a_command_over_at_once_still_gets_total_and_available(
    tmp_path: Path, sampler: str
) -> None:
    # On cgroup v1 a process that is exiting shows no cgroup: 'meter -- true' wrote total
    # and available as null in 10 of 10 runs. The meter's own cgroup stands in, and the
    # start record's sources say so.
    for run in range(5):
        path = tmp_path / f"t{run}.jsonl"
        result = _meter("--sampler", sampler, "-o", str(path), "--", "true")
        assert result.returncode == 0, result.stderr
        records = read_records(path)
        start = records[0]
        assert isinstance(start["total"], int) and start["total"] > 0, start
        assert "total" in start["sources"] and "available" in start["sources"]
        if "not process" in start["sources"]["total"]:
            assert f"not process {start['pid']}" in start["sources"]["available"]
        samples = [r for r in records if r["type"] == "sample"]
        assert samples and all(s["available"] is not None for s in samples), samples
        assert not [r for r in records if r["type"] == "error" and r["field"] == "available"]


def test_a_guarded_command_that_cannot_start_leaves_an_existing_trace_whole(
    tmp_path: Path,
) -> None:
    """The guard's --trace goes through the same writer: the same guarantee."""
    path = tmp_path / "existing.jsonl"
    path.write_text(OLD)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "stageload",
            "guard",
            "--trace",
            str(path),
            "--wait-free",
            "0",
            "--",
            str(tmp_path / "nonexistent"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 127, result.stderr
    assert "Traceback" not in result.stderr
    assert path.read_text() == OLD


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_trace_on_a_device_is_written_not_truncated() -> None:
    """The writer emptied the file with ftruncate, which a device refuses: 'Invalid
    argument' at the first record, for /dev/full (meter.md promises 'No space left on
    device') and for /dev/null (which takes anything)."""
    full = _meter("-o", "/dev/full", "--", "true")
    assert full.returncode == 0, full.stderr
    assert "not written any more: No space left on device (after 0 records)" in full.stderr
    assert "Invalid argument" not in full.stderr
    null = _meter("-o", "/dev/null", "--", "true")
    assert null.returncode == 0, null.stderr
    assert "warning" not in null.stderr and "Invalid argument" not in null.stderr
    assert "stageload meter: exit 0 after" in null.stderr


# -- a named pipe at -o: refused at once, never waited on ---------------------------------

# The check as it was: it opened the path for append, and the open of a named pipe with no
# reader waits for one for ever.
OLD_CHECK = """
import stageload.cli.args as args

def old(path):
    if path.is_dir():
        return "a folder"
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return str(exc)
    if not existed:
        path.unlink(missing_ok=True)
    return None

args._unwritable_file = old
"""


def _stageload(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stageload", *argv],
        capture_output=True,
        text=True,
        timeout=120,  # a bound on a hang, not a time the test expects
        env=_env(),
    )


def _opens_for_writing(fifo: Path, code: str) -> tuple[bool, str]:
    """Run ``code`` in a child while the test holds ``fifo`` open for reading: whether the
    child opened it for writing, and the child's stderr. Linux reports POLLHUP on a pipe's
    read end only once a writer has come and gone since the reader opened (fs/pipe.c,
    pipe_poll); the test's reader keeps the child from waiting, which with none it would,
    for ever (open(2): O_WRONLY without O_NONBLOCK blocks until a reader opens the FIFO)."""
    import select

    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        child = subprocess.run(
            [sys.executable, "-c", code],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,  # a bound on a hang, not a time the test expects
        )
        poll = select.poll()
        poll.register(reader, select.POLLIN)
        events = dict(poll.poll(0)).get(reader, 0)
    finally:
        os.close(reader)
    return bool(events & select.POLLHUP), child.stderr


def test_meter_guard_and_plot_refuse_a_named_pipe_at_once(tmp_path: Path) -> None:
    """``stageload meter -o FIFO -- true`` hung for ever in its check of -o (an open for
    append waits for the pipe's reader), and ``guard --trace FIFO`` in the trace writer's
    open. Now each exits 2 with one line naming the path and the fix, runs nothing, and
    leaves the pipe a pipe. A trace cannot be a pipe (each process of the run opens it, and
    it is read back), and plot's PNG writer seeks. With no reader, so nothing may open it."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    ran = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    trace = tmp_path / "t.jsonl"
    assert _meter("-o", str(trace), "--", "true").returncode == 0
    results = {
        "meter": _meter("-o", str(fifo), *command),
        "guard": _stageload("guard", "--trace", str(fifo), *command),
        "plot": _stageload("plot", str(trace), "-o", str(fifo)),
    }
    for tool, result in results.items():
        assert result.returncode == 2, (tool, result.stderr)
        assert f"stageload {tool}: error:" in result.stderr, result.stderr
        assert f"{str(fifo)!r} is a named pipe (FIFO), not a regular file" in result.stderr
        assert "give the path of a regular file" in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1
    assert not ran.exists() and fifo.is_fifo()


@pytest.mark.skipif(sys.platform != "linux", reason="POLLHUP on a FIFO as Linux gives it")
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_control_the_old_check_opens_the_pipe_for_writing(tmp_path: Path, fixed: bool) -> None:
    """What made the hang: the old check opened the pipe for writing (for append), which
    with no reader waits for one for ever. Fixed, the check never opens it: the meter
    refuses the pipe without a writer's open. Control: the old check put back, in a
    child, opens it. (The trace writer does open it, with O_NONBLOCK: see below.)"""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    meter = (
        ("" if fixed else OLD_CHECK)
        + "from stageload.cli import main\n"
        + f"main(['meter', '-o', {str(fifo)!r}, '--', 'true'])\n"
    )
    opened, err = _opens_for_writing(fifo, meter)
    assert opened is not fixed, err
    assert "is a named pipe (FIFO), not a regular file" in err, err


@pytest.mark.parametrize("nonblocking", [True, False], ids=["fixed", "control"])
def test_the_trace_writer_refuses_a_pipe_with_no_reader_instead_of_waiting(
    tmp_path: Path, nonblocking: bool
) -> None:
    """``guard --trace FIFO`` (and MemoryMeter(FIFO)) hung in the trace writer's open. It
    opens with O_NONBLOCK now: ENXIO, said as a named pipe. Control: without O_NONBLOCK
    the child's open is still waiting when the test, as the pipe's reader, lets it go
    (a blocking open for reading returns only once a writer has opened the pipe). With
    the fix undone, the fixed case waits in the child until its 120 s bound runs out."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    code = (
        "import stageload.meter.tracefile as t\n"
        + ("" if nonblocking else "t.NONBLOCK = 0\n")
        + f"t.TraceWriter({str(fifo)!r})\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=_env(), stderr=subprocess.PIPE, text=True
    )
    if not nonblocking:  # it waits in the open: come as its reader, so that it goes on
        reader = os.open(fifo, os.O_RDONLY)
        os.close(reader)
    try:
        _, err = child.communicate(timeout=120)  # a bound on a hang, not an expected time
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 1 and "NotAFileError" in err, err
    assert f"trace file {str(fifo)!r} is a named pipe (FIFO), not a regular file" in err


def test_a_symbolic_link_to_a_trace_not_yet_made_stays_a_link(tmp_path: Path) -> None:
    """``-o latest.jsonl``, a link to a file not made yet: the check of -o created the
    target through the link and then removed the link, leaving an empty file. Now the
    trace is written at the target, and a run that cannot start leaves the link as it was
    and no target."""
    link = tmp_path / "latest.jsonl"
    link.symlink_to("run-1.jsonl")
    missing = _meter("-o", str(link), "--", str(tmp_path / "nonexistent"))
    assert missing.returncode == 127, missing.stderr
    assert link.is_symlink() and not (tmp_path / "run-1.jsonl").exists()
    result = _meter("-o", str(link), "--label", "one", "--", "true")
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == "run-1.jsonl"
    assert read_records(tmp_path / "run-1.jsonl")[0]["meta"] == {"label": "one"}
