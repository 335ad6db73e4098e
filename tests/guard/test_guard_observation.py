"""Observation never kills what it observes (issue 33): a trace on a full file system stops
being written with one line on stderr, a stderr nobody reads changes no exit code, and
``guard``, ``meter`` and ``run`` exit with the command's own code either way.

Everything is real: a tmpfs mounted small and filled (root only, as CI runs; skipped with
the reason elsewhere), ``/dev/full``, pipes whose reader has gone. Each claim has a control
that puts the old behaviour back inside the same subprocess and must fail the claim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
FAILED = "is not written any more"

# Puts the old behaviour back, for the controls: a trace write that fails raises again
# (as TraceWriter did before), the guard's status lines raise on a broken stream, and no
# command gets the quiet stderr.
# Each patch also keeps ``stageload run`` in this interpreter: its client otherwise hands
# over (an exec, hiding the command from --busy patterns, issue 36), and the exec'd process
# would run without the patch.
KEEP_RUN_HERE = """
import stageload.cli.run as run_cli
run_cli._shown_in_own_command_line = lambda command: False
"""
BREAK_TRACE = (
    KEEP_RUN_HERE
    + """
import errno
from stageload.meter.tracefile import TraceWriter
_write = TraceWriter.write
def write(self, record):
    if not _write(self, record) and self.failure is not None:
        raise OSError(errno.ENOSPC, self.failure)
    return True
TraceWriter.write = write
"""
)
BREAK_STDERR = (
    KEEP_RUN_HERE
    + """
import stageload.cli as cli
from stageload.guard.watch import _Status
cli._COMMAND_RUNNERS = frozenset()
def put(self, text):
    if self.stream is not None:
        self.stream.write(text)
        self.stream.flush()
_Status._put = put
"""
)


def env(tmp_path: Path) -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = SRC + os.pathsep + out.get("PYTHONPATH", "")
    out["STAGELOAD_HOME"] = str(tmp_path / "home")  # `stageload run`'s state, on a real disk
    out["STAGELOAD_QUEUE_POLL"] = "0.05"
    return out


def stageload(*args: str, patch: str = "") -> list[str]:
    """argv for the ``stageload`` CLI in a fresh interpreter, with ``patch`` run first."""
    code = f"{patch}\nimport sys\nfrom stageload.cli import main\nsys.exit(main(sys.argv[1:]))"
    return [PY, "-c", code, *args]


# -- a real, nearly full file system ----------------------------------------------------


@pytest.fixture
def nearly_full(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs filled to its last page: a trace there takes a few records, then
    ENOSPC. Needs root (mount); skipped, saying so, where it cannot be mounted."""
    where = tmp_path / "full"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        filler = where / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        os.truncate(filler, max(0, filler.stat().st_size - 4096))  # one page left
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def command_until(go: Path, code: int) -> list[str]:
    """A command that runs until ``go`` exists, then exits with ``code``."""
    script = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        f"sys.exit({code})\n"
    )
    return [PY, "-c", script]


def run_until_trace_fails(argv: list[str], go: Path, tmp_path: Path) -> tuple[int, str]:
    """Start ``argv``; once its stderr says the trace failed, let the command end. Returns
    (exit code, all of stderr). A run that dies first returns what it had."""
    proc = subprocess.Popen(argv, env=env(tmp_path), stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        for line in proc.stderr:  # a state, not a sleep: the line that says it failed
            lines.append(line)
            if FAILED in line:
                go.touch()
                break
        go.touch()  # the guard died before saying it (the controls): let the command go
        lines.extend(proc.stderr)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines)


def assert_trace_failed_once(code: int, err: str) -> None:
    assert "Traceback" not in err, err
    assert code == 5, err  # the command's own code: it ran to its end, nothing killed it
    assert err.count(FAILED) == 1, err
    assert "No space left on device" in err


def guard_argv(trace: Path, go: Path) -> list[str]:
    return ["guard", "--wait-free", "0", "--poll", "0.02s", "--trace", str(trace), "--",
            *command_until(go, 5)]  # fmt: skip


def meter_argv(trace: Path, go: Path) -> list[str]:
    return ["meter", "--interval", "10ms", "-o", str(trace), "--", *command_until(go, 5)]


def run_argv(trace: Path, go: Path) -> list[str]:
    return ["run", "--memory", "1M", "--wait-free", "0", "--poll", "0.02s", "--trace",
            str(trace), "--", *command_until(go, 5)]  # fmt: skip


@pytest.mark.parametrize("argv", [guard_argv, meter_argv, run_argv], ids=["guard", "meter", "run"])
def test_a_trace_on_a_full_disk_stops_and_the_command_runs_to_its_own_exit_code(
    argv, nearly_full: Path, tmp_path: Path
) -> None:
    trace, go = nearly_full / "trace.jsonl", tmp_path / "go"
    code, err = run_until_trace_fails(stageload(*argv(trace, go)), go, tmp_path)
    assert_trace_failed_once(code, err)
    assert "still guarding" in err or argv is meter_argv
    first = trace.read_bytes().split(b"\n", 1)[0]
    assert json.loads(first)["type"] == "start"  # what fitted is there
    if argv is run_argv:  # the queue's history has the run, with the command's code
        history = tmp_path / "home" / "lanes" / "ram" / "history.jsonl"
        record = json.loads(history.read_text().splitlines()[-1])
        assert (record["exit_code"], record["outcome"]) == (5, "exited")


@pytest.mark.parametrize("argv", [guard_argv, meter_argv, run_argv], ids=["guard", "meter", "run"])
def test_control_a_failing_trace_write_that_raises_ends_the_run(
    argv, nearly_full: Path, tmp_path: Path
) -> None:
    """Control: with trace writes raising again, as before, the same run ends in a
    traceback and not with the command's code."""
    trace, go = nearly_full / "trace.jsonl", tmp_path / "go"
    code, err = run_until_trace_fails(stageload(*argv(trace, go), patch=BREAK_TRACE), go, tmp_path)
    assert code != 5 and "Traceback" in err, err


def test_a_trace_on_dev_full_is_given_up_at_its_first_record(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    for args in (["guard", "--wait-free", "0", "--trace"], ["meter", "-o"]):
        proc = subprocess.run(
            stageload(*args, "/dev/full", "--", "sh", "-c", "exit 5"),
            env=env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode == 5, proc.stderr
        assert proc.stderr.count(FAILED) == 1, proc.stderr


# -- nobody reads stderr -----------------------------------------------------------------


def closed_pipe_run(argv: list[str], tmp_path: Path) -> int:
    """Run ``argv`` with stderr a pipe whose reader is gone before anything is written
    (``2>&1 | true``): every write to it fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen(argv, env=env(tmp_path), stderr=write, stdout=write)
    finally:
        os.close(write)
    return proc.wait(60)


def runner_argvs(tmp_path: Path) -> dict[str, list[str]]:
    trace = str(tmp_path / f"m-{uuid.uuid4().hex[:6]}.jsonl")
    command = ["--", "sh", "-c", "exit 9"]
    return {
        "guard": ["guard", "--wait-free", "0", *command],
        "meter": ["meter", "-o", trace, *command],
        "run": ["run", "--wait-free", "0", *command],
    }


@pytest.mark.parametrize("name", ["guard", "meter", "run"])
def test_nobody_reading_stderr_leaves_the_exit_code_the_commands(name: str, tmp_path: Path) -> None:
    assert closed_pipe_run(stageload(*runner_argvs(tmp_path)[name]), tmp_path) == 9


@pytest.mark.parametrize("name", ["guard", "meter", "run"])
def test_control_without_the_quiet_stderr_the_exit_code_is_lost(name: str, tmp_path: Path) -> None:
    code = closed_pipe_run(stageload(*runner_argvs(tmp_path)[name], patch=BREAK_STDERR), tmp_path)
    assert code != 9


def test_a_full_stderr_leaves_the_exit_code_the_commands(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    for name, argv in runner_argvs(tmp_path).items():
        with open("/dev/full", "w") as full:
            proc = subprocess.run(stageload(*argv), env=env(tmp_path), stderr=full, timeout=60)
        assert proc.returncode == 9, name


def test_a_report_whose_reader_went_away_is_a_success(tmp_path: Path) -> None:
    """``report``'s output is the point: a reader that took what it wanted (``| head``)
    leaves it a success. ``meter`` makes the trace first."""
    trace = tmp_path / "t.jsonl"
    subprocess.run(stageload("meter", "-o", str(trace), "--", "true"), env=env(tmp_path),
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    assert closed_pipe_run(stageload("report", str(trace)), tmp_path) == 0
