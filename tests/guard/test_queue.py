"""Tests for the machine-wide queue (``stageload run``, ``stageload queue``) with real clients.

Every client is a real ``python -m stageload run`` process in a state directory of its own
(``STAGELOAD_HOME`` in ``tmp_path``), polling every 50 ms (``STAGELOAD_QUEUE_POLL``). The
commands are ``sh`` one-liners that append to a log and wait for a file to appear, so the
tests order events by files, never by timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from fixtures.full_disk import fill, small_tmpfs
from stageload.cli import main
from stageload.guard.board import snapshot
from stageload.guard.history import check_record, learned_need, read_history, read_records
from stageload.guard.queue import Ticket, default_owner, resolve_owner
from stageload.guard.rules import Running, decide, fair_order
from stageload.memory import read_system
from stageload.units import format_size

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
GiB = 1 << 30
MiB = 1 << 20
# Guard flags for every run: no extra floor (the queue's memory rule is under test), quick
# samples, a short grace.
FLAGS = ["--wait-free", "0", "--poll", "0.05", "--grace", "1"]

Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh state directory, also for the in-process ``main`` and ``snapshot`` calls."""
    path = tmp_path / "state"
    monkeypatch.setenv("STAGELOAD_HOME", str(path))
    monkeypatch.setenv("STAGELOAD_QUEUE_POLL", "0.05")
    return path


@pytest.fixture
def spawn(request: pytest.FixtureRequest, home: Path) -> Callable[..., subprocess.Popen[bytes]]:
    """Start ``stageload run ARGS`` as a real client; kill its whole session at teardown."""

    def start(
        *args: str, env: dict[str, str] | None = None, cli: list[str] | None = None
    ) -> subprocess.Popen[bytes]:
        """``env``: variables to add; ``cli``: the program instead of ``python -m stageload``
        (e.g. ``patched(...)``, the CLI with a mechanism broken, for a control)."""
        full = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        full.update(env or {})
        proc = subprocess.Popen(
            [*(cli or [PY, "-m", "stageload"]), "run", *FLAGS, *args],
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

        def cleanup() -> None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

        request.addfinalizer(cleanup)
        return proc

    return start


def wait_until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``check`` until it is true; ``timeout`` only bounds a hang (2 cores, ~7 helpers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def lane(home: Path, name: str = "ram") -> dict[str, Any]:
    return snapshot(home, name)["lanes"][0]


def finish(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    text = err.decode()
    assert "Traceback" not in text, text
    return proc.returncode, text


def log_lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def gate(log: Path, name: str, go: Path) -> list[str]:
    """A command that logs ``name``, waits for ``go`` to exist, then logs ``name-end``."""
    wait = f"while [ ! -e {go} ]; do sleep 0.02; done"
    script = f"echo {name} >> {log}; {wait}; echo {name}-end >> {log}"
    return ["--", "sh", "-c", script]


def echo(log: Path, name: str) -> list[str]:
    return ["--", "sh", "-c", f"echo {name} >> {log}"]


# -- the rules as functions ------------------------------------------------------------


def _ticket(seq: int, owner: str, need: int | None = None) -> Ticket:
    return Ticket(seq, owner, ["x", str(seq)], need, "declared", 1, 0.0)


def test_fair_order_takes_turns_by_oldest_start_and_keeps_each_owners_order() -> None:
    waiting = [_ticket(1, "a"), _ticket(2, "a"), _ticket(3, "b"), _ticket(4, "c"),
               _ticket(5, "b"), _ticket(6, "c")]  # fmt: skip
    order = fair_order(waiting, {"c": 100.0})
    # a and b never started: first, by their oldest ticket; c started at 100.
    assert [t.seq for t in order] == [1, 3, 4, 2, 5, 6]
    # Control: the latest starts decide, not the tickets: c oldest now.
    order = fair_order(waiting, {"a": 300.0, "b": 200.0, "c": 100.0})
    assert [t.seq for t in order] == [4, 3, 1, 6, 5, 2]


def test_memory_rule_counts_what_running_commands_may_still_take() -> None:
    running = [Running(_ticket(1, "a", need=6 * GiB), use=4 * GiB)]
    # available 5G already excludes a's 4G; a may take 2G more: room 3G.
    assert decide(3 * GiB, running, 5 * GiB).ok
    no = decide(3 * GiB + 1, running, 5 * GiB)
    assert (no.ok, no.why, no.room) == (False, "memory", 3 * GiB)
    # A command over its need reserves nothing more (its excess is already not available).
    assert decide(5 * GiB, [Running(_ticket(1, "a", need=GiB), use=2 * GiB)], 5 * GiB).ok
    # Unknown needs run alone, both ways; an empty lane admits anything.
    assert decide(None, running, 100 * GiB).why == "busy"
    assert decide(MiB, [Running(_ticket(1, "a"), use=0)], 100 * GiB).why == "busy"
    assert decide(None, [], None).ok


def test_learned_need_is_the_highest_recent_peak_of_the_same_argv() -> None:
    runs = [{"command": ["a"], "peak_footprint": p} for p in (900, 100, 200, 300, 400, 500)]
    runs.append({"command": ["a", "x"], "peak_footprint": 10**9})
    runs.append({"command": ["a"], "peak_footprint": 0})  # no reading: ignored
    assert learned_need(runs, ["a"]) == 500  # 900 is older than the last 5
    assert learned_need(runs, ["b"]) is None


# -- real clients ----------------------------------------------------------------------


def test_three_owners_take_fair_turns_in_a_one_at_a_time_lane(
    home: Path, tmp_path: Path, spawn: Spawn
) -> None:
    """Commands never seen run alone, so the lane holds one at a time. c's gate runs; then
    a1, then {a2 b1 c1}, then {b2 c2} queue (in any order within a batch): a and b never
    started, so they go first (a's ticket is older), then c, whose start is older than
    theirs, then a's second. (The FIFO control is in the fair_order test above.)"""
    log, go = tmp_path / "log", tmp_path / "go"
    held = spawn("--who", "c", *gate(log, "gate", go))
    wait_until(lambda: log_lines(log) == ["gate"], "the gate to start")
    clients, queued = [], 0
    for batch in (["a1"], ["a2", "b1", "c1"], ["b2", "c2"]):
        clients += [spawn("--who", name[0], *echo(log, name)) for name in batch]
        queued += len(batch)
        wait_until(lambda n=queued: len(lane(home)["waiting"]) == n, f"{queued} waiting")
    waiting = lane(home)["waiting"]
    assert [w["why"] for w in waiting] == ["busy"] + ["turn"] * 5
    expected = ["a1", "b1", "c1", "a2", "b2", "c2"]
    assert [w["command"][-1].split()[1] for w in waiting] == expected  # positions shown
    go.touch()
    for proc in [held, *clients]:
        assert finish(proc)[0] == 0
    assert log_lines(log) == ["gate", "gate-end", *expected]
    assert [r["owner"] for r in read_records(home / "lanes/ram/history.jsonl")] == list("cabcabc")


def test_declared_needs_run_together_when_they_fit(
    home: Path, tmp_path: Path, spawn: Spawn
) -> None:
    """Two commands declaring 1G each: each waits for the other to have started."""
    available = read_system().available
    if available is None or available < 3 * GiB:
        pytest.skip(f"needs 3 GiB available, have {available}")
    a, b, log = tmp_path / "a", tmp_path / "b", tmp_path / "log"
    meet = "touch {me}; while [ ! -e {other} ]; do sleep 0.02; done; echo {name} >> {log}"
    first = spawn("--memory", "1G", "--", "sh", "-c", meet.format(me=a, other=b, name="a", log=log))
    second = spawn(
        "--memory", "1G", "--", "sh", "-c", meet.format(me=b, other=a, name="b", log=log)
    )
    assert finish(first)[0] == 0 and finish(second)[0] == 0
    assert sorted(log_lines(log)) == ["a", "b"]


@pytest.mark.alone  # reads the machine's available memory
def test_needs_over_half_of_available_run_one_after_the_other(
    home: Path, tmp_path: Path, spawn: Spawn
) -> None:
    available = read_system().available
    assert available is not None
    need = str(int(available * 0.6))
    log, go = tmp_path / "log", tmp_path / "go"
    first = spawn("--memory", need, *gate(log, "first", go))
    wait_until(lambda: log_lines(log) == ["first"], "the first to start")
    second = spawn("--memory", need, *echo(log, "second"))
    waiting = wait_until(lambda: lane(home)["waiting"], "the second to queue")
    assert waiting[0]["why"] == "memory", waiting
    assert log_lines(log) == ["first"]
    go.touch()
    assert finish(first)[0] == 0 and finish(second)[0] == 0
    assert log_lines(log) == ["first", "first-end", "second"]


def test_learned_need_is_used_on_the_second_run(home: Path, tmp_path: Path, spawn: Spawn) -> None:
    """First run: never seen, alone. Second run: its learned peak fits beside a running 1G
    command, so it starts there; a command never seen waits ('busy') beside the same one."""
    log, go = tmp_path / "log", tmp_path / "go"
    learn = ["--", "sh", "-c", f"sleep 0.3; echo learned >> {log}"]
    assert finish(spawn(*learn))[0] == 0
    (first,) = read_records(home / "lanes/ram/history.jsonl")
    assert first["need_source"] == "unknown" and first["peak_footprint"] > 0
    held = spawn("--memory", "1G", *gate(log, "held", go))
    wait_until(lambda: "held" in log_lines(log), "the 1G command to start")
    assert finish(spawn(*learn))[0] == 0  # done while 'held' still runs
    assert held.poll() is None
    second = read_records(home / "lanes/ram/history.jsonl")[-1]
    assert (second["need_source"], second["need"]) == ("learned", first["peak_footprint"])
    # Control: a command line never seen before does not start beside 'held'.
    unseen = spawn(*echo(log, "unseen"))
    waiting = wait_until(lambda: lane(home)["waiting"], "the unseen command to queue")
    assert (waiting[0]["why"], waiting[0]["need_source"]) == ("busy", "unknown")
    go.touch()
    assert finish(held)[0] == 0 and finish(unseen)[0] == 0
    assert log_lines(log) == ["learned", "held", "learned", "held-end", "unseen"]


def test_sigkill_of_clients_leaves_nothing_stale(
    home: Path, tmp_path: Path, spawn: Spawn, request: pytest.FixtureRequest
) -> None:
    """A waiting client killed with SIGKILL disappears from the lane and the next one goes
    on; a client killed while its command runs takes that command with it (its watchdog
    SIGKILLs the group), and its place goes."""
    log, go = tmp_path / "log", tmp_path / "go"
    held = spawn("--who", "a", *gate(log, "held", go))
    wait_until(lambda: log_lines(log) == ["held"], "the first to start")
    doomed = spawn("--who", "b", *echo(log, "doomed"))
    after = spawn("--who", "c", *echo(log, "after"))
    wait_until(lambda: len(lane(home)["waiting"]) == 2, "b and c to queue")
    # Control: live clients' tickets stay, however often the lane is read.
    assert sorted(w["owner"] for w in lane(home)["waiting"]) == ["b", "c"]
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    assert [w["owner"] for w in lane(home)["waiting"]] == ["c"]
    (running,) = lane(home)["running"]
    command = psutil.Process(running["pid"])
    request.addfinalizer(lambda: _kill_session(command))
    held.send_signal(signal.SIGKILL)
    held.wait(10)
    wait_until(lambda: _gone(command), "the command to go with its client", timeout=5)
    assert finish(after)[0] == 0
    assert log_lines(log) == ["held", "after"]
    assert os.listdir(home / "lanes/ram/tickets") == []


def test_a_command_whose_client_and_watchdog_died_keeps_its_place_until_it_ends(
    home: Path, tmp_path: Path, spawn: Spawn, request: pytest.FixtureRequest
) -> None:
    """The safety net under the watchdog: if both the client and its watchdog are killed,
    the command runs on unguarded; its ticket stays, 'orphaned', with its need counted,
    until it ends; then the next starts."""
    log, go = tmp_path / "log", tmp_path / "go"
    held = spawn("--who", "a", *gate(log, "held", go))
    wait_until(lambda: log_lines(log) == ["held"], "the first to start")
    after = spawn("--who", "c", *echo(log, "after"))
    wait_until(lambda: len(lane(home)["waiting"]) == 1, "c to queue")
    (running,) = lane(home)["running"]
    orphan = psutil.Process(running["pid"])
    request.addfinalizer(lambda: _kill_session(orphan))
    (watchdog,) = [
        p for p in psutil.Process(held.pid).children()
        if "stageload-guard-watchdog" in " ".join(p.cmdline())
    ]  # fmt: skip
    watchdog.kill()
    wait_until(lambda: _gone(watchdog), "the watchdog to die")
    held.send_signal(signal.SIGKILL)
    held.wait(10)
    now = lane(home)
    assert [r["state"] for r in now["running"]] == ["orphaned"]
    assert [(w["owner"], w["why"]) for w in now["waiting"]] == [("c", "busy")]
    go.touch()
    assert finish(after)[0] == 0
    assert log_lines(log) == ["held", "held-end", "after"]
    assert os.listdir(home / "lanes/ram/tickets") == []


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_session(proc: psutil.Process) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def test_exit_codes_pass_through(
    home: Path, tmp_path: Path, spawn: Spawn, capfd: pytest.CaptureFixture[str]
) -> None:
    run = ["run", *FLAGS, "--"]
    assert main([*run, "sh", "-c", "exit 7"]) == 7
    assert main([*run, "sh", "-c", "kill -9 $$"]) == 128 + 9
    assert main([*run, str(tmp_path / "no-such-command")]) == 127
    assert main(["run", *FLAGS, "--kill-free", "100%", "--", "sleep", "5"]) == 3
    # --start-timeout covers the wait in the queue: 4, and the command never ran.
    log, go = tmp_path / "log", tmp_path / "go"
    held = spawn(*gate(log, "held", go))
    wait_until(lambda: log_lines(log) == ["held"], "the first to start")
    assert main(["run", *FLAGS, "--start-timeout", "0.3", *echo(log, "late")]) == 4
    go.touch()
    assert finish(held)[0] == 0
    assert log_lines(log) == ["held", "held-end"]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "no turn after" in err
    outcomes = [r["exit_code"] for r in read_records(home / "lanes/ram/history.jsonl")]
    assert outcomes == [7, 137, 3, 0]  # runs that started; 127 and 4 never did


def test_the_command_gets_stdin_stdout_and_stderr(home: Path) -> None:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [PY, "-m", "stageload", "run", *FLAGS, "--", "sh", "-c", "cat; echo to-stderr >&2"],
        input=b"from stdin\n",
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0
    assert proc.stdout == b"from stdin\n"
    assert b"to-stderr\n" in proc.stderr and b"Traceback" not in proc.stderr


def test_queue_json_shows_running_and_waiting(
    home: Path, tmp_path: Path, spawn: Spawn, capsys: pytest.CaptureFixture[str]
) -> None:
    log, go = tmp_path / "log", tmp_path / "go"
    held = spawn("--who", "alice", "--memory", "1G", *gate(log, "held", go))
    wait_until(lambda: log_lines(log) == ["held"], "alice's command to start")
    waiter = spawn("--who", "bob", *echo(log, "bob"))
    wait_until(lambda: lane(home)["waiting"], "bob to queue")
    assert main(["queue", "--json", "--history", "5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (the_lane,) = doc["lanes"]
    (running,) = the_lane["running"]
    assert (running["owner"], running["need"], running["need_source"]) == ("alice", GiB, "declared")
    assert running["state"] == "running" and running["memory_now"] > 0
    assert running["command"][:2] == ["sh", "-c"]
    (waiting,) = the_lane["waiting"]
    assert (waiting["position"], waiting["owner"], waiting["why"]) == (1, "bob", "busy")
    assert main(["queue"]) == 0
    text = capsys.readouterr().out
    assert "running  alice" in text and "#1 waiting (busy)  bob" in text
    go.touch()
    assert finish(held)[0] == 0 and finish(waiter)[0] == 0
    assert main(["queue", "--json", "--history", "5"]) == 0
    done = json.loads(capsys.readouterr().out)["lanes"][0]
    assert done["running"] == [] and done["waiting"] == []
    assert [h["owner"] for h in done["history"]] == ["alice", "bob"]
    assert all(Path(h["trace"]).is_file() for h in done["history"])


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_a_command_with_a_newline_or_an_escape_is_shown_escaped(
    home: Path,
    tmp_path: Path,
    spawn: Spawn,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fixed: bool,
) -> None:
    """A queued command's newline or ESC was printed raw by `stageload queue`: one user's
    command broke the table and wrote terminal escapes into another user's view. Now shown
    as \\n, \\x1b, running and in the history; --json keeps the argv. Control: unescaped."""
    import stageload.guard.board as board

    if not fixed:
        monkeypatch.setattr(board, "printable", lambda text: text)
    log, go = tmp_path / "log", tmp_path / "go"
    odd = "X=x\n\x1b[2J"  # a variable for env to set: first, so the table shows it whole
    held = spawn("--who", "alice", "--memory", "1M", "--", "env", odd, *gate(log, "held", go)[1:])
    wait_until(lambda: log_lines(log) == ["held"], "alice's command to start")
    assert main(["queue"]) == 0
    running = capsys.readouterr().out
    go.touch()
    assert finish(held)[0] == 0
    assert main(["queue", "--history", "1"]) == 0
    history = capsys.readouterr().out
    for out in (running, history):
        shown = "\x1b" not in out and len(out.splitlines()) == (2 if out is running else 3)
        assert shown is fixed, out
        assert ("env X=x\\n\\x1b[2J sh -c" in out) is fixed, out
    assert main(["queue", "--json", "--history", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["lanes"][0]["history"][0]["command"][1] == odd


def test_the_runs_trace_receives_the_commands_own_events(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's trace is the outer trace (stageload.core.outer, the path StagedModels sends its
    events to) of the command. Control: --no-events keeps them out."""
    monkeypatch.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    emit = (
        "from stageload.core.events import Event; from stageload.core.outer import outer_trace; "
        "trace = outer_trace(); trace and trace.emit(Event('stage', stage='denoise'))"
    )
    assert main(["run", *FLAGS, "--", PY, "-c", emit]) == 0
    assert main(["run", *FLAGS, "--no-events", "--", PY, "-c", emit]) == 0
    with_events, without = read_records(home / "lanes/ram/history.jsonl")
    records = [json.loads(line) for line in Path(with_events["trace"]).read_text().splitlines()]
    (event,) = [r for r in records if r["type"] == "event" and r.get("stage") == "denoise"]
    assert event["pid"] == records[0]["pid"]  # the command's own process wrote it
    records = [json.loads(line) for line in Path(without["trace"]).read_text().splitlines()]
    assert not [r for r in records if r.get("stage") == "denoise"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lane", "a/b"], "invalid lane name 'a/b'"),
        (["--memory", "12Q"], "invalid --memory '12Q'"),
        (["--who", ""], "invalid --who ''"),
        (["--owner", "x" * 65], "invalid --owner 'xxx"),
    ],
)
def test_bad_input_gives_one_clear_line(
    args: list[str], message: str, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", *args, "--", "true"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert [line for line in err.splitlines() if "error:" in line] == [
        line for line in err.splitlines() if message in line
    ]
    assert "Traceback" not in err


def test_bad_poll_and_history_values_give_one_clear_line(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STAGELOAD_QUEUE_POLL", "soon")
    assert main(["run", *FLAGS, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "stageload run: error: STAGELOAD_QUEUE_POLL: invalid duration 'soon': use e.g. "
        "'30s', '1m', '500ms' or '2.5'"
    ]
    with pytest.raises(SystemExit):
        main(["queue", "--history", "-1"])
    err = capsys.readouterr().err
    assert "invalid --history '-1'" in err and "Traceback" not in err


def test_unusable_state_directory_gives_one_line_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("STAGELOAD_HOME", str(blocker / "state"))
    ran = tmp_path / "ran"
    assert main(["run", *FLAGS, "--", "touch", str(ran)]) == 2
    assert main(["queue", "--lane", "ram"]) == 2
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and all("cannot use state folder" in line for line in err), err
    assert "STAGELOAD_HOME" in err[0]
    assert not ran.exists()


def test_help_states_the_rules(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    assert "least" in text or "oldest" in text
    assert "need <= available" in text and "runs alone" in text and "--swap-budget" in text


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_a_who_that_starts_with_a_dash_is_said_how_to_give(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fixed: bool
) -> None:
    """`--who -x` (a name docs/queue.md allows) got only argparse's "expected one argument";
    the error now says to write --who=-x, which gives '-x'. Control: without the hint."""
    import re

    import stageload.cli as cli

    if not fixed:
        monkeypatch.setattr(cli, "_ONE_ARGUMENT", re.compile("(?!)"))
    with pytest.raises(SystemExit) as exited:
        main(["run", "--who", "-x", "--", "true"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err
    assert "argument --who: expected one argument" in err, err
    assert ("e.g. --who=-x" in err) is fixed, err
    assert cli.build_parser().parse_args(["run", "--who=-x", "--", "true"]).who == "-x"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory cgroups are Linux only")
def test_memory_admission_under_a_real_cgroup_limit(
    home: Path, tmp_path: Path, spawn: Spawn, request: pytest.FixtureRequest
) -> None:
    """Clients inside a 1 GiB memory cgroup see its limit as their available memory: one
    600M need fits, a second waits ('memory'). Control: the same two outside run together."""
    from stageload.testing.cgroup import cgroup_or_skip

    cg = cgroup_or_skip(GiB)
    request.addfinalizer(cg.remove)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def inside(*args: str) -> subprocess.Popen[bytes]:
        argv = [PY, "-m", "stageload", "run", *FLAGS, "--lane", "small", *args]
        proc = cg.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        request.addfinalizer(lambda: (proc.poll() is None and proc.kill(), proc.wait(10)))
        return proc

    log, go = tmp_path / "log", tmp_path / "go"
    first = inside("--memory", "600M", *gate(log, "first", go))
    wait_until(lambda: log_lines(log) == ["first"], "the first to start in the cgroup")
    second = inside("--memory", "600M", *echo(log, "second"))
    assert second.stderr is not None
    line = second.stderr.readline().decode()
    assert "waiting in lane 'small' (memory): need 600.0 MiB" in line, line
    go.touch()
    assert finish(first)[0] == 0 and finish(second)[0] == 0
    assert log_lines(log) == ["first", "first-end", "second"]
    # Control: outside the cgroup the machine has room for both.
    log, go = tmp_path / "log2", tmp_path / "go2"
    held = spawn("--memory", "600M", *gate(log, "first", go))
    wait_until(lambda: log_lines(log) == ["first"], "the first to start outside")
    assert finish(spawn("--memory", "600M", *echo(log, "second")))[0] == 0
    go.touch()
    assert finish(held)[0] == 0
    assert log_lines(log) == ["first", "second", "first-end"]


# -- state files that are not what the queue wrote -------------------------------------


@pytest.mark.parametrize("content", ["null", "[1, 2]", '"x"', '{"a": "soon", "b": null}'])
def test_owners_json_of_the_wrong_type_counts_as_no_starts(
    content: str, home: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Valid JSON that is not owner -> time: the runs and the board go on, and the next
    start rewrites the file whole."""
    assert main(["run", *FLAGS, "--who", "a", "--", "true"]) == 0  # creates the lane
    owners = home / "lanes/ram/owners.json"
    owners.write_text(content)
    assert main(["queue", "--lane", "ram"]) == 0
    assert main(["run", *FLAGS, "--who", "b", "--", "true"]) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "error:" not in err, err
    assert list(json.loads(owners.read_text())) == ["b"]


@pytest.mark.parametrize("name", ["owners.json", "seq", "lock", "history.jsonl"])
def test_a_folder_in_place_of_a_state_file_is_one_line_naming_it(
    name: str, home: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *FLAGS, "--", "true"]) == 0  # creates the lane and its files
    path = home / "lanes/ram" / name
    path.unlink(missing_ok=True)
    path.mkdir()
    (path / "keep").write_text("")  # a folder with something in it: never removed for you
    capfd.readouterr()
    ran = tmp_path / "ran"
    assert main(["run", *FLAGS, "--", "touch", str(ran)]) == 2
    codes = [main(["queue", "--history", "1"])]
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line]
    assert lines[0].startswith("stageload run: error: ") and str(path) in lines[0], lines
    assert not ran.exists()
    if name == "seq":  # read only to queue a command
        assert codes == [0] and len(lines) == 1
    else:
        assert codes == [2] and len(lines) == 2 and str(path) in lines[1], lines
    assert path.is_dir() and (path / "keep").exists()


@pytest.mark.parametrize("said", [True, False], ids=["fixed", "control"])
@pytest.mark.parametrize("name", ["lanes/ram/tickets", "lanes/ram/traces", "lanes/ram"])
def test_a_file_in_place_of_a_state_folder_is_one_line_naming_it(
    name: str,
    said: bool,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``lanes/ram/tickets`` a file: ``stageload queue`` raised NotADirectoryError (a
    traceback) and ``stageload run`` said 'File exists; set STAGELOAD_HOME ...', a fix
    that does not help. Both now name the file and say to move it. Control: without the
    file found, the old advice is back (the messages are all that changes there)."""
    import stageload.guard.queue as queue_module

    if not said:
        monkeypatch.setattr(queue_module, "_file_in_the_way", lambda folder: None)
    path = home / name
    path.parent.mkdir(parents=True)
    path.write_text("not a folder\n")
    ran = tmp_path / "ran"
    assert main(["run", *FLAGS, "--", "touch", str(ran)]) == 2
    code = main(["queue"])
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line]
    assert not ran.exists() and path.read_text() == "not a folder\n"
    if name.endswith("traces"):  # only a run makes and uses it
        assert code == 0 and len(lines) == 1, lines
    else:
        assert code == 2 and len(lines) == 2, lines
    fixed = f"{str(path)!r} is a file, not a folder; move it away or remove it"
    for line in lines:
        assert (fixed in line) is said and ("STAGELOAD_HOME" not in line) is said, line


def test_emptying_seq_while_a_ticket_lives_keeps_numbers_and_order(
    home: Path, tmp_path: Path, spawn: Spawn
) -> None:
    """seq emptied by hand while one client runs and one waits: the next client gets a
    number above both (no clash with a live ticket), and so its place behind them."""
    log, go = tmp_path / "log", tmp_path / "go"
    held = spawn("--who", "a", *gate(log, "held", go))
    wait_until(lambda: log_lines(log) == ["held"], "the first to start")
    second = spawn("--who", "a", *echo(log, "second"))
    wait_until(lambda: len(lane(home)["waiting"]) == 1, "the second to queue")
    (home / "lanes/ram/seq").write_text("")
    third = spawn("--who", "a", *echo(log, "third"))
    wait_until(lambda: len(lane(home)["waiting"]) == 2, "the third to queue")
    assert sorted(os.listdir(home / "lanes/ram/tickets")) == [f"{n:012d}.json" for n in (1, 2, 3)]
    go.touch()
    for proc in (held, second, third):
        assert finish(proc)[0] == 0
    assert log_lines(log) == ["held", "held-end", "second", "third"]


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_stageload_home_is_refused(
    value: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Set but empty (STAGELOAD_HOME=$UNSET) is an error, not a silent ~/.stageload."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("STAGELOAD_HOME", value)
    ran = tmp_path / "ran"
    assert main(["run", *FLAGS, "--", "touch", str(ran)]) == 2
    assert main(["queue"]) == 2
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and all("STAGELOAD_HOME is set but empty" in e for e in err), err
    assert "unset it to use ~/.stageload" in err[0]
    assert not ran.exists() and not (tmp_path / ".stageload").exists()


# -- the earlier stageload's documented behaviour (issue 36) ---------------------------


def cli(
    *args: str, env: dict[str, str] | None = None, prog: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``stageload ARGS`` as a real process (or ``prog ARGS``), to its end."""
    full = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full.update(env or {})
    return subprocess.run(
        [*(prog or [PY, "-m", "stageload"]), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def patched(*patch: str) -> list[str]:
    """The ``stageload`` program with the Python lines ``patch`` run first, and the
    hand-over off (its exec would start a fresh, unpatched process): for the controls."""
    code = "\n".join(
        [
            "import sys",
            "import stageload.cli.run as _run",
            "_run._hand_over = lambda args: None",
            *patch,
            "from stageload.cli import main",
            "sys.exit(main(sys.argv[1:]))",
        ]
    )
    return [PY, "-c", code]


class Lines:
    """A running client's stderr, read line by line on a thread, so a test can wait for a
    line (a state the client reports) instead of sleeping."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc, self.lines = proc, []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            with self._cv:
                self.lines.append(raw.decode())
                self._cv.notify_all()

    def wait_for(self, needle: str, timeout: float = 30.0) -> str:
        with self._cv:
            found = self._cv.wait_for(
                lambda: next((line for line in self.lines if needle in line), None), timeout
            )
        assert found, f"no line with {needle!r} in {timeout} s: {self.lines}"
        return found

    def finish(self, timeout: float = 60.0) -> tuple[int, str]:
        code = self.proc.wait(timeout)
        self._thread.join(timeout)
        text = "".join(self.lines)
        assert "Traceback" not in text, text
        return code, text


def engine(request: pytest.FixtureRequest, mark: str, stop: Path) -> subprocess.Popen[bytes]:
    """A process started outside the queue whose command line holds ``mark``, until ``stop``."""
    proc = subprocess.Popen(["sh", "-c", f"while [ ! -e {stop} ]; do sleep 0.02; done", mark])
    request.addfinalizer(lambda: (proc.poll() is None and proc.kill(), proc.wait(10)))
    return proc


def unique_mark() -> str:
    return f"engine-{uuid.uuid4().hex[:12]}"  # matches nothing else on a shared machine


@pytest.mark.parametrize("split", [True, False], ids=["who-split", "control-owner-given"])
def test_the_owner_is_the_part_of_who_before_its_first_dash(
    split: bool, home: Path, tmp_path: Path, spawn: Spawn
) -> None:
    """sayu-ltx and sayu-rife are one owner, so haraiya-ltx goes between them. Control:
    each given as its own --owner, three owners who never started go in ticket order."""
    log, go = tmp_path / "log", tmp_path / "go"
    held = spawn("--who", "c", *gate(log, "gate", go))
    wait_until(lambda: log_lines(log) == ["gate"], "the gate to start")
    clients = []
    for n, (who, name) in enumerate(
        [("sayu-ltx", "s1"), ("sayu-rife", "s2"), ("haraiya-ltx", "h1")], start=1
    ):
        owner = [] if split else ["--owner", who]
        clients.append(spawn("--who", who, *owner, *echo(log, name)))
        wait_until(lambda n=n: len(lane(home)["waiting"]) == n, f"{n} waiting")
    go.touch()
    for proc in [held, *clients]:
        assert finish(proc)[0] == 0
    records = read_records(home / "lanes/ram/history.jsonl")
    if split:
        assert log_lines(log) == ["gate", "gate-end", "s1", "h1", "s2"]
        assert [(r["owner"], r["who"]) for r in records] == [
            ("c", "c"), ("sayu", "sayu-ltx"), ("haraiya", "haraiya-ltx"), ("sayu", "sayu-rife")
        ]  # fmt: skip
    else:
        assert log_lines(log) == ["gate", "gate-end", "s1", "s2", "h1"]
        assert [r["owner"] for r in records] == ["c", "sayu-ltx", "sayu-rife", "haraiya-ltx"]


def test_owner_and_who_come_from_the_variables_unless_given(
    home: Path, spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--owner, else STAGELOAD_OWNER, else --who's part before its dash; --who, else
    STAGELOAD_WHO. Control: with neither, the whole user name is owner and who."""
    monkeypatch.delenv("STAGELOAD_OWNER", raising=False)
    monkeypatch.delenv("STAGELOAD_WHO", raising=False)
    cases = [
        ({"STAGELOAD_WHO": "sayu-ltx"}, [], ("sayu", "sayu-ltx")),
        ({"STAGELOAD_WHO": "sayu-ltx", "STAGELOAD_OWNER": "team"}, [], ("team", "sayu-ltx")),
        ({"STAGELOAD_OWNER": "team"}, ["--who", "x-y"], ("team", "x-y")),
        ({"STAGELOAD_WHO": "a-b", "STAGELOAD_OWNER": "o"}, ["--who", "x-y", "--owner", "z"],
         ("z", "x-y")),
        ({}, ["--who=-lead"], ("-lead", "-lead")),  # nothing before the dash: all of it
        ({}, [], (default_owner(), default_owner())),
    ]  # fmt: skip
    for env, flags, _ in cases:
        assert finish(spawn(*flags, "--", "true", env=env))[0] == 0
    records = read_records(home / "lanes/ram/history.jsonl")
    assert [(r["owner"], r["who"]) for r in records] == [want for _, _, want in cases]
    bad = finish(spawn("--", "true", env={"STAGELOAD_WHO": ""}))
    assert bad[0] == 2 and "STAGELOAD_WHO is set but empty" in bad[1]


def test_resolve_owner_in_the_library() -> None:
    assert resolve_owner(None, None, {"STAGELOAD_WHO": "sayu-rife"}) == ("sayu", "sayu-rife")
    assert resolve_owner("me", "sayu-rife", {"STAGELOAD_OWNER": "x"}) == ("me", "sayu-rife")
    with pytest.raises(ValueError, match="invalid STAGELOAD_OWNER 'x{65}'"):
        resolve_owner(None, None, {"STAGELOAD_OWNER": "x" * 65})


def test_busy_txt_patterns_hold_every_run_of_the_ram_lane(
    home: Path, tmp_path: Path, spawn: Spawn, request: pytest.FixtureRequest
) -> None:
    """A pattern in STAGELOAD_HOME/busy.txt holds a ram-lane run while a process it matches
    runs, though the run gave no --busy. Control: a run in another lane starts beside it."""
    mark, stop, log = unique_mark(), tmp_path / "stop", tmp_path / "log"
    home.mkdir(parents=True)
    (home / "busy.txt").write_text(f"# engines started by hand\n\n  {mark}  \n")
    engine(request, mark, stop)
    ram = Lines(spawn("--quiet-for", "0", *echo(log, "ram")))
    ram.wait_for(f"busy {mark!r} running (pid")
    assert finish(spawn("--lane", "other", "--quiet-for", "0", *echo(log, "other")))[0] == 0
    assert log_lines(log) == ["other"]
    stop.touch()
    code, text = ram.finish()
    assert code == 0 and f"busy.txt patterns '{mark}'" in text
    assert log_lines(log) == ["other", "ram"]


def test_a_bad_pattern_in_busy_txt_is_one_line_naming_file_and_line(
    home: Path, tmp_path: Path, spawn: Spawn
) -> None:
    home.mkdir(parents=True)
    (home / "busy.txt").write_text("# ok\n([\n")
    ran = tmp_path / "ran"
    code, err = finish(spawn("--", "touch", str(ran)))
    assert code == 2 and not ran.exists()
    (line,) = [line for line in err.splitlines() if line]
    assert f"{home / 'busy.txt'}:2: invalid --busy pattern '(['" in line, line
    # Control: another lane does not read busy.txt.
    assert finish(spawn("--lane", "other", "--", "touch", str(ran)))[0] == 0 and ran.exists()


@pytest.mark.parametrize("said", [True, False], ids=["fixed", "control"])
def test_busy_txt_as_a_folder_is_called_the_users_file(
    said: bool,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """busy.txt is the user's list, never made by the queue: a folder in its place is to be
    made a file or removed, not 'the queue makes a new one'. Control: the message of the
    queue's own files."""
    import stageload.guard.queue as queue_module

    if not said:
        monkeypatch.setattr(queue_module, "_busy_file_error", queue_module._file_error)
    (home / "busy.txt").mkdir(parents=True)
    ran = tmp_path / "ran"
    assert main(["run", *FLAGS, "--", "touch", str(ran)]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and not ran.exists()
    (line,) = [line for line in err.splitlines() if line]
    assert str(home / "busy.txt") in line
    fixed = "your list of --busy patterns, cannot be read (Is a directory); make it a file"
    assert (fixed in line) is said and ("makes a new one" in line) is not said, line


@pytest.mark.parametrize("said", [True, False], ids=["fixed", "control"])
def test_a_full_disk_says_to_free_space_not_to_remove_the_file(
    said: bool,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A real full disk (a 64 KiB tmpfs, filled; skipped where it cannot be mounted): the
    write of the lane's seq fails with ENOSPC, and the line said 'remove it and the queue
    makes a new one', which frees nothing. Control: with ENOSPC not told apart, that line."""
    import types

    import stageload.guard.queue as queue_module

    if not said:
        monkeypatch.setattr(queue_module, "errno", types.SimpleNamespace(ENOSPC=-1, EDQUOT=-1))
    ran = tmp_path / "ran"
    with small_tmpfs(tmp_path / "disk") as disk:
        monkeypatch.setenv("STAGELOAD_HOME", str(disk / "state"))
        assert main(["run", *FLAGS, "--no-trace", "--", "true"]) == 0  # the lane, made
        fill(disk)
        capfd.readouterr()
        code = main(["run", *FLAGS, "--no-trace", "--", "touch", str(ran)])
        err = capfd.readouterr().err
    assert code == 2 and not ran.exists()
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line]
    assert str(disk / "state" / "lanes" / "ram" / "seq") in line
    assert "No space left on device" in line
    assert ("free space on its disk" in line) is said and ("remove it" in line) is not said, line


@pytest.mark.parametrize("hidden", [True, False], ids=["handed-over", "control-visible"])
def test_a_waiting_client_is_not_taken_for_the_engine(
    hidden: bool, home: Path, tmp_path: Path, spawn: Spawn
) -> None:
    """A client waits in the queue with a command that holds MARK; `stageload guard --busy
    MARK` elsewhere starts (0), since the client handed over to a process whose command
    line does not hold it. Control: without the hand-over the guard takes the waiting
    client for the engine and gives up (4), as in issue 36."""
    mark, log, go = unique_mark(), tmp_path / "log", tmp_path / "go"
    held = spawn(*gate(log, "held", go))
    wait_until(lambda: log_lines(log) == ["held"], "the first to start")
    waiter = spawn(*echo(log, mark), cli=None if hidden else patched())
    wait_until(lambda: lane(home)["waiting"], "the client to queue")
    assert (mark in " ".join(psutil.Process(waiter.pid).cmdline())) is not hidden
    guard = ["guard", "--wait-free", "0", "--busy", mark, "--quiet-for", "0"]
    probe = cli(*guard, "--start-timeout", "3", "--", "true")
    assert probe.returncode == (0 if hidden else 4), probe.stderr
    if not hidden:
        assert f"busy {mark!r} running (pid {waiter.pid})" in probe.stderr
    go.touch()
    assert finish(held)[0] == 0 and finish(waiter)[0] == 0
    assert log_lines(log) == ["held", "held-end", mark]


@pytest.mark.parametrize("hidden", [True, False], ids=["handed-over", "control-visible"])
def test_the_deadlock_of_a_busy_run_and_a_waiting_engine_is_gone(
    hidden: bool, home: Path, tmp_path: Path, spawn: Spawn, request: pytest.FixtureRequest
) -> None:
    """Run a holds its turn and waits (its guard) for no MARK process; run b, queued behind
    a, is the engine: its command holds MARK. Once the first engine stops, a starts, then b.
    Control: without the hand-over a takes b's waiting client for the engine, and b waits
    for a: a gives up at its --start-timeout (4), only then b runs."""
    mark, stop, log = unique_mark(), tmp_path / "stop", tmp_path / "log"
    engine(request, mark, stop)
    timeout = [] if hidden else ["--start-timeout", "20"]
    a = Lines(spawn("--who", "a", "--busy", mark, "--quiet-for", "0", *timeout, *echo(log, "a")))
    a.wait_for(f"busy {mark!r} running (pid")
    b = spawn("--who", "b", *echo(log, f"b-{mark}"), cli=None if hidden else patched())
    wait_until(lambda: lane(home)["waiting"], "b to queue behind a")
    stop.touch()
    code, text = a.finish()
    assert finish(b)[0] == 0
    if hidden:
        assert code == 0 and log_lines(log) == ["a", f"b-{mark}"]
    else:
        assert code == 4, text
        assert log_lines(log) == [f"b-{mark}"]


@pytest.mark.parametrize("where", ["missing folder", "written by the running command"])
def test_an_unusable_trace_is_refused_before_queueing(
    where: str, home: Path, tmp_path: Path, spawn: Spawn
) -> None:
    """--trace that cannot be written was found only when the turn came (after hours of
    waiting, and counted as a start of its owner): now at once, with the guard's message,
    while the lane is still held by another command."""
    log, go, busy = tmp_path / "log", tmp_path / "go", tmp_path / "busy.jsonl"
    held = spawn("--who", "alice", "--trace", str(busy), *gate(log, "gate", go))
    wait_until(lambda: log_lines(log) == ["gate"], "the gate to start")
    trace = str(tmp_path / "no/such/t.jsonl") if where == "missing folder" else str(busy)
    late = spawn("--who", "carol", "--trace", trace, "--", "touch", str(tmp_path / "ran"))
    code, err = finish(late)  # the gate still runs: on the previous code this timed out
    assert code == 2
    message = err.strip().removeprefix("stageload run: error: ")
    assert err.count("\n") == 1 and message != err.strip(), err
    guard = subprocess.run(
        [PY, "-m", "stageload", "guard", "--trace", trace, "--", "true"],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )  # fmt: skip
    assert (guard.returncode, guard.stderr) == (2, f"stageload guard: error: {message}\n")
    assert lane(home)["waiting"] == []
    assert "carol" not in json.loads((home / "lanes/ram/owners.json").read_text())
    go.touch()
    assert finish(held)[0] == 0
    assert not (tmp_path / "ran").exists() and not (tmp_path / "no").exists()
    last = json.loads(busy.read_text().splitlines()[-1])
    assert last["type"] == "end"  # the running command's trace is whole


@pytest.mark.parametrize("checked", [True, False], ids=["fixed", "control"])
def test_run_queued_refuses_a_path_as_trace(
    checked: bool, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_queued(trace='/tmp')`` was taken as trace=True: the command ran, its trace
    under the lane. Now a ValueError that shows where a trace file goes, nothing run.
    Control: with the flag unchecked, the command runs and the lane gets the trace."""
    from stageload.guard import GuardConfig, runner

    if not checked:
        monkeypatch.setattr(runner, "_trace_flag", lambda trace: trace)
    ran = tmp_path / "ran"
    config = GuardConfig(["touch", str(ran)], wait_free="0", poll="0.05", grace="1")
    if checked:
        with pytest.raises(ValueError, match=r"trace=\.\.\.\) is True or False .*got '/tmp'"):
            runner.run_queued(config, trace="/tmp", stderr=None)  # type: ignore[arg-type]
        assert not ran.exists() and not (home / "lanes/ram/traces").exists()
    else:
        result = runner.run_queued(config, trace="/tmp", stderr=None)  # type: ignore[arg-type]
        assert result.exit_code == 0 and ran.exists()
        assert len(list((home / "lanes/ram/traces").iterdir())) == 1


def test_no_trace_writes_no_trace(home: Path, spawn: Spawn) -> None:
    """Control: the same run without --no-trace leaves its trace under traces/."""
    assert finish(spawn("--no-trace", "--", "true"))[0] == 0
    assert finish(spawn("--", "true"))[0] == 0
    without, with_trace = read_records(home / "lanes/ram/history.jsonl")
    assert without["trace"] is None and Path(with_trace["trace"]).is_file()
    assert os.listdir(home / "lanes/ram/traces") == [Path(with_trace["trace"]).name]
    code, err = finish(spawn("--no-trace", "--trace", str(home / "t.jsonl"), "--", "true"))
    assert code == 2 and "--no-trace and --trace" in err


def test_quiet_for_is_20_s_for_run_and_1_min_for_guard(home: Path) -> None:
    """A --busy pattern nothing matches: run waits its 20 s quiet period (then its 1 s
    --start-timeout ends it, 4). Controls: --quiet-for 0 starts; the guard's stays 1 min."""
    mark = unique_mark()
    waits = cli("run", *FLAGS, "--busy", mark, "--start-timeout", "1", "--", "true")
    assert waits.returncode == 4 and "(need 20.0 s)" in waits.stderr, waits.stderr
    assert cli("run", *FLAGS, "--busy", mark, "--quiet-for", "0", "--", "true").returncode == 0
    guard = cli("guard", "--wait-free", "0", "--busy", mark, "--start-timeout", "1", "--", "true")
    assert guard.returncode == 4 and "(need 1 min 00 s)" in guard.stderr, guard.stderr
    assert "--quiet-for DURATION" in cli("run", "--help").stdout
    assert "(default: 20 s)" in " ".join(cli("run", "--help").stdout.split())


def test_an_unknown_flag_of_run_prints_runs_usage(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Control: with the subcommand parser's check taken away, the top level's usage."""
    ran = tmp_path / "ran"
    proc = cli("run", "--no-such-flag", "--", "touch", str(ran))
    assert proc.returncode == 2 and not ran.exists()
    assert proc.stderr.startswith("usage: stageload run ")
    assert "stageload run: error: unrecognized arguments: --no-such-flag" in proc.stderr
    from stageload import cli as cli_package

    monkeypatch.setattr(
        cli_package._CommandParser, "parse_known_args", argparse.ArgumentParser.parse_known_args
    )
    with pytest.raises(SystemExit):
        main(["run", "--no-such-flag", "--", "touch", str(ran)])
    assert capsys.readouterr().err.startswith("usage: stageload [-h]")


def test_the_version_is_above_the_earlier_packages_and_defined_once() -> None:
    """0.1.1 is the earlier package's; pip -U must not replace ours with it. The build
    reads the version from stageload.__version__ (no second copy in pyproject.toml)."""
    from packaging.version import Version
    from setuptools.config.pyprojecttoml import read_configuration

    import stageload

    assert Version(stageload.__version__) > Version("0.1.1")
    root = Path(SRC).parent
    config = read_configuration(root / "pyproject.toml", expand=False)
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "stageload._version.__version__"
    }
    expanded = read_configuration(root / "pyproject.toml", expand=True)
    assert expanded["project"]["version"] == stageload.__version__
    assert cli("--version").stdout.strip() == f"stageload {stageload.__version__}"


# -- damaged state is data, not a code path (issue 33, item 5) -------------------------

Q = "import stageload.guard.queue as q"
H = "import stageload.guard.history as h"
ACCEPT_ANY_LINE = f"{H}; h.check_record = lambda record, now=None: isinstance(record, dict)"


def _history_line(**values: Any) -> str:
    record = {
        "command": ["true"], "owner": "z", "lane": "ram", "start": 1.0, "wait": 0.0,
        "duration": 0.1, "peak_footprint": 1, "swap_growth": 0, "exit_code": 0,
        "outcome": "exited", "need": None, "need_source": "unknown", "trace": None,
    }  # fmt: skip
    record.update(values)
    return json.dumps(record) + "\n"


def _hold_ticket(request: pytest.FixtureRequest, path: Path, ticket: dict[str, Any]) -> None:
    """A live client's ticket, damaged: a real process holds its lock."""
    path.write_text(json.dumps(ticket))
    code = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, "
    code += "fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [PY, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    request.addfinalizer(lambda: (holder.kill(), holder.wait(10)))
    assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"


#: case -> (what to write into lane ram, the kind skipped, the patch that takes the check
#: away for the control). Each writer gets the lane's folder and the request.
DAMAGE: dict[str, tuple[Callable[[Path, pytest.FixtureRequest], None], str, str]] = {
    "seq-of-400-digits": (
        lambda d, r: (d / "seq").write_text("9" * 400),
        "seq",
        f"import re; {Q}; q._TICKET_NUMBER = re.compile('[0-9]+'); q.SEQ_MAX = 10**1000",
    ),
    "owners-nested-deeply": (
        lambda d, r: (d / "owners.json").write_text("[" * 100_000 + "]" * 100_000),
        "owners",
        f"import json; {Q}; q.parse_json = json.loads",
    ),
    "peak-of-400-digits": (
        lambda d, r: (
            (d / "history.jsonl").open("a").write(_history_line(peak_footprint=int("9" * 400)))
        ),
        "history",
        ACCEPT_ANY_LINE,
    ),
    "peak-not-a-number": (
        lambda d, r: (d / "history.jsonl").open("a").write(_history_line(peak_footprint="x")),
        "history",
        ACCEPT_ANY_LINE,
    ),
    "start-1e300": (
        lambda d, r: (d / "history.jsonl").open("a").write(_history_line(start=1e300)),
        "history",
        ACCEPT_ANY_LINE,
    ),
    "live-ticket-enqueued-1e300": (
        lambda d, r: _hold_ticket(
            r,
            d / "tickets" / "000000000007.json",
            {
                "seq": 7,
                "owner": "z",
                "command": ["x"],
                "need": 1,
                "need_source": "declared",
                "client_pid": 1,
                "enqueued": 1e300,
            },  # fmt: skip
        ),
        "tickets",
        f"{Q}; q.Ticket._check = lambda self: None",
    ),
}


@pytest.mark.parametrize("control", [False, True], ids=["checked", "control-unchecked"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_state_is_skipped_and_counted_never_a_traceback(
    case: str, control: bool, home: Path, request: pytest.FixtureRequest
) -> None:
    """Each damaged value once in lane ram: `stageload run` still runs (one warning line
    counting what it skipped) and `stageload queue --history` still shows the lane, with the
    count. Control: with that check taken away, one of them ends in a traceback (or, for
    the live ticket, the run waits behind it until its --start-timeout)."""
    assert cli("run", *FLAGS, "--who", "z", "--", "true").returncode == 0  # makes the lane
    write, kind, patch = DAMAGE[case]
    write(home / "lanes/ram", request)
    prog = patched(patch) if control else None
    board = cli("queue", "--history", "5", prog=prog)
    doc = cli("queue", "--json", "--history", "5", prog=prog)
    run = cli("run", *FLAGS, "--start-timeout", "5", "--", "true", prog=prog)  # rewrites owners
    if control:
        outcomes = [run.stderr, board.stderr, doc.stderr]
        broken = any("Traceback" in text for text in outcomes) or run.returncode == 4
        assert broken, outcomes
        return
    for proc in (run, board, doc):
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    noun = {"seq": "seq", "owners": "owners.json", "history": "history line", "tickets": "ticket"}
    (warning,) = [line for line in run.stderr.splitlines() if "damaged" in line]
    assert f"skipped: 1 {noun[kind]}" in warning, warning
    (the_lane,) = json.loads(doc.stdout)["lanes"]
    if kind != "seq":  # only queueing a command reads seq
        assert the_lane["skipped"] == {kind: 1}
        assert f"skipped as damaged: 1 {kind}" in board.stdout
    assert all(check_record(record) for record in the_lane["history"])
    assert read_records(home / "lanes/ram/history.jsonl")[-1]["owner"] == default_owner()


@pytest.mark.parametrize("control", [False, True], ids=["checked", "control-unchecked"])
def test_a_start_of_1e300_in_owners_json_does_not_put_an_owner_last_forever(
    control: bool, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Owner z 'started' at 1e300: the entry is skipped, so z (as never started) goes before
    y, who started at 5. Control: unchecked, z would come after every real start forever."""
    from stageload.guard import queue

    if control:
        monkeypatch.setattr(queue, "is_wall_time", lambda v, now=None: math.isfinite(v))
    the_lane = queue.Lane(home, "ram").create()
    (the_lane.dir / "owners.json").write_text('{"z": 1e300, "y": 5}')
    with the_lane.locked():
        starts = the_lane.owner_starts()
    order = [t.owner for t in fair_order([_ticket(1, "y"), _ticket(2, "z")], starts)]
    if control:
        assert order == ["y", "z"] and starts["z"] == 1e300
    else:
        assert order == ["z", "y"] and starts == {"y": 5.0}
        assert the_lane.skipped == {"owners": 1}


@pytest.mark.parametrize("control", [False, True], ids=["checked", "control-unchecked"])
def test_a_learned_need_of_1e26_bytes_is_not_taken_as_real(control: bool, home: Path) -> None:
    """History lines say the command peaked at 3 MiB, then at 10^26 bytes: the 10^26 line
    is skipped (above SIZE_MAX) and the need learned is 3 MiB. Control: unchecked, the
    run is admitted with a need of 10^26 bytes, shown as a figure."""
    lane_dir = home / "lanes/ram"
    assert cli("run", *FLAGS, "--", "true").returncode == 0
    with (lane_dir / "history.jsonl").open("a") as f:
        f.write(_history_line(peak_footprint=3 * MiB))
        f.write(_history_line(peak_footprint=10**26))
    # The control takes the ticket's range check away too: it would refuse its own need.
    prog = patched(ACCEPT_ANY_LINE, f"{Q}; q.Ticket._check = lambda self: None")
    run = cli("run", *FLAGS, "--", "true", prog=prog if control else None)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    last = read_history(lane_dir / "history.jsonl")
    if control:
        assert f"need {format_size(10**26)} (learned)" in run.stderr, run.stderr
        written = (lane_dir / "history.jsonl").read_text().splitlines()[-1]
        assert json.loads(written)["need"] == 10**26  # and recorded as if real
        return
    assert last.records[-1]["need"] == 3 * MiB and last.skipped == 1
    assert "need 3.0 MiB (learned)" in run.stderr and "skipped: 1 history line" in run.stderr


def test_tickets_keep_the_keys_clients_of_0_1_0_read() -> None:
    """A 0.1.0 client takes a ticket with a key it does not know for no ticket and would
    not count it; lanes are shared between venvs, so 0.2.0 writes only 0.1.0's keys."""
    keys_0_1_0 = {"seq", "owner", "command", "need", "need_source", "client_pid", "enqueued",
                  "state", "admitted", "started", "pid", "pid_created", "orphaned"}  # fmt: skip
    assert set(json.loads(_ticket(1, "a").to_bytes())) == keys_0_1_0


@pytest.mark.parametrize(("runs", "heading"), [(1, "  last run:"), (3, "  last 3 runs:")])
def test_the_history_heading_counts_its_runs(runs, heading):
    """'--history 3' with one run finished said 'last 1 runs' (a helper's trial)."""
    from stageload.guard.board import format_text

    run = {"start": 0, "owner": "me", "command": ["true"], "wait": 0.0, "seconds": 1.0}
    lane = {"lane": "default", "running": [], "waiting": [], "available": 1 << 30}
    lane |= {"skipped": {}, "history": [dict(run) for _ in range(runs)]}
    lines = format_text({"lanes": [lane], "state_dir": "/tmp"}).splitlines()
    assert lines[1] == heading, lines
