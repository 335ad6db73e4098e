"""Tests for ``stageload guard`` with real processes, process groups and signals.

Every process a test starts is registered for cleanup the moment it exists. The CLI runs
in-process through ``stageload.cli.main`` where no signal is sent to the guard, and as a
real ``python -m stageload guard`` subprocess where one is.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from stageload.cli import main
from stageload.guard import (
    EXIT_CANNOT_START,
    EXIT_NO_ROOM,
    EXIT_STOPPED,
    Amount,
    Guard,
    GuardConfig,
    GuardResult,
    Probes,
    StopRule,
    _Status,
    run_guard,
)
from stageload.guard.watch import list_processes
from stageload.memory import SystemMemory, read_process
from stageload.memory._linux import read_system as read_linux_system
from stageload.meter.tracefile import read_records

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
GiB = 1 << 30
MiB = 1 << 20

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads recorded Linux /proc files"
)


# -- helpers ---------------------------------------------------------------------------


def _kill_if_ours(pid: int, create_time: float) -> None:
    """SIGKILL ``pid`` if it is still the process we started (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.create_time() == create_time:
            proc.kill()
    except psutil.Error:
        pass


@pytest.fixture
def track(request: pytest.FixtureRequest) -> Callable[[int], None]:
    """Register a pid for a SIGKILL at teardown, remembered by create time."""

    def add(pid: int) -> None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return
        request.addfinalizer(lambda: _kill_if_ours(pid, created))

    return add


@pytest.fixture
def spawn(request: pytest.FixtureRequest) -> Callable[..., subprocess.Popen[bytes]]:
    """Start a real process, registering its kill (and reap) as it starts."""

    def start(argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, **kwargs)  # type: ignore[call-overload]

        def cleanup() -> None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

        request.addfinalizer(cleanup)
        return proc

    return start


def guard_cli(*args: str) -> list[str]:
    """argv for ``python -m stageload guard ARGS`` with this checkout importable."""
    return [PY, "-m", "stageload", "guard", *args]


def guard_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def wait_for(path: Path, timeout: float = 15.0) -> str:
    """Wait until ``path`` holds a whole line; return its text."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text()
            if text.endswith("\n"):
                return text
        time.sleep(0.02)
    raise AssertionError(f"{path} was not written within {timeout} s")


def wait_line(proc: subprocess.Popen[bytes], text: str, timeout: float = 30.0) -> bytes:
    """Read ``proc``'s stderr until a line holds ``text``; what was read. A state to wait
    for (the guard said it), never a sleep for a guess."""
    assert proc.stderr is not None
    fd, seen = proc.stderr.fileno(), b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no line with {text!r} within {timeout} s: {seen!r}")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"stderr closed before a line with {text!r}: {seen!r}")
        seen += chunk
    return seen


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (exited, or a zombie waiting for its reaper)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.02)
    return gone(pid)


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text


def available_bytes() -> int:
    reading = read_linux_system() if sys.platform.startswith("linux") else None
    if reading is None or reading.available is None:
        return psutil.virtual_memory().available
    return reading.available


# A command that starts a grandchild, writes "child grandchild" pids, then grows by 16 MiB
# every 50 ms up to a cap, touching every page so the memory is really taken.
ALLOCATOR = """
import os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {grandchild.pid}\\n")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
chunks = []
for _ in range(int(sys.argv[2]) // 16):
    chunks.append(b"x" * (16 << 20))
    time.sleep(0.05)
time.sleep(10)
"""

# Writes its pid, then sleeps; optional "ignore-term" makes it ignore SIGTERM, "note-term"
# writes a marker file when SIGTERM arrives and exits from it.
SLEEPER = """
import os, signal, sys, time
pidfile, mode = sys.argv[1], sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif mode == "note-term":
    def on_term(signum, frame):
        open(pidfile + ".term", "w").write("TERM\\n")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_term)
with open(pidfile + ".tmp", "w") as f:
    f.write(f"{os.getpid()}\\n")
os.rename(pidfile + ".tmp", pidfile)
time.sleep(60)
"""


# -- stopping --------------------------------------------------------------------------


@pytest.mark.alone  # reads the machine's available memory
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="floor from /proc/meminfo")
def test_stop_and_reach_stops_the_whole_group_at_the_floor(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], track: Callable[[int], None]
) -> None:
    """A child that allocates step by step, with a grandchild, is stopped (both of them) when
    available memory crosses a floor set 300 MiB under what the machine has now."""
    pids, trace = tmp_path / "pids", tmp_path / "trace.jsonl"
    floor = available_bytes() - 300 * MiB
    started: list[int] = []

    # The command's pids are tracked for cleanup as soon as it writes them.
    def track_when_written() -> None:
        for pid in wait_for(pids).split():
            track(int(pid))
            started.append(int(pid))

    watcher = threading.Thread(target=track_when_written, daemon=True)
    watcher.start()
    code = main(
        [
            "guard",
            "--wait-free", "0",
            "--kill-free", f"{floor}B",
            "--grace", "5s",
            "--trace", str(trace),
            "--", PY, "-c", ALLOCATOR, str(pids), "1500",
        ]
    )  # fmt: skip
    watcher.join(15)
    err = capfd.readouterr().err
    no_traceback(err)
    assert code == EXIT_STOPPED, err
    child, grandchild = started
    assert wait_gone(child) and wait_gone(grandchild), "the command's group outlived the stop"
    last = err.strip().splitlines()[-1]
    assert last.startswith("stageload guard: waited ") and "stopped by the guard" in last
    assert "available" in last and "2 samples in a row" in last

    records = read_records(trace)
    assert records[0]["type"] == "start" and records[0]["pid"] == child
    notes = [r["note"] for r in records if r["type"] == "event" and r["kind"] == "guard"]
    assert notes[0].startswith("start:") and any(n.startswith("stop:") for n in notes)
    assert records[-1] == {**records[-1], "type": "end", "exit_code": EXIT_STOPPED}
    samples = [r for r in records if r["type"] == "sample"]
    # The two samples that decided it are under the floor, and the tree grew on the way.
    under = [s for s in samples if s["available"] is not None and s["available"] < floor]
    assert len(under) >= 2
    assert max(s["footprint"] or 0 for s in samples) > 100 * MiB
    assert main(["report", str(trace)]) == 0  # the report reads the guard's trace


# A command whose child double-forks and calls setsid() (the way a daemon detaches): the
# grandchild leaves the command's group and tree at once, and sleeps on, ignoring SIGTERM
# when asked. Writes "command escaped" pids.
DAEMONIZER = """
import os, signal, sys, time
pids, mode = sys.argv[1], sys.argv[2]
command = os.getpid()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        if mode == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(pids + ".tmp", "w") as f:
            f.write(f"{command} {os.getpid()}\\n")
        os.rename(pids + ".tmp", pids)
        time.sleep(60)
    os._exit(0)
os.wait()
time.sleep(60)
"""


def test_no_collateral_sibling_survives_and_a_setsid_child_is_stopped(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    spawn: Callable[..., subprocess.Popen[bytes]],
    track: Callable[[int], None],
) -> None:
    """Only what the command started is stopped: a sibling the test started runs on, while
    a child that left the group with setsid() (reparented to the guard when the command's
    group goes) is stopped with it."""
    sibling = spawn([PY, "-c", "import time; time.sleep(60)"])
    pids = tmp_path / "pids"
    escaper = f"""
import os, subprocess, sys, time
out = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                       start_new_session=True)
open({str(pids)!r} + ".tmp", "w").write(f"{{os.getpid()}} {{out.pid}}\\n")
os.rename({str(pids)!r} + ".tmp", {str(pids)!r})
time.sleep(60)
"""

    def on_start(group: object) -> None:
        for pid in wait_for(pids).split():
            track(int(pid))

    # --kill-free 100%: available is always under it, so the guard stops after two samples.
    config = GuardConfig([PY, "-c", escaper], wait_free="0", kill_free="100%", grace="3s")
    result = Guard(config, stderr=sys.stderr, on_start=on_start).run()
    err = capfd.readouterr().err
    no_traceback(err)
    assert result.exit_code == EXIT_STOPPED
    child, escaped = (int(p) for p in pids.read_text().split())
    assert wait_gone(child)
    assert sibling.poll() is None, "the sibling was signalled"
    if sys.platform.startswith("linux"):  # a subreaper: Linux only (docs/guard.md)
        assert wait_gone(escaped), "the child that called setsid() outlived the stop"
        assert result.escaped == 1
        assert "1 processes that had left its group (setsid) stopped" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper is Linux only")
@pytest.mark.parametrize("mode", ["plain", "ignore-term"])
def test_a_double_forked_setsid_daemon_is_stopped_with_the_command(
    mode: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], track: Callable[[int], None]
) -> None:
    """The daemon leaves the group and the tree before the guard ever sees it; reparented
    to the guard (a subreaper), it is stopped: SIGTERM, or SIGKILL after the grace."""
    pids = tmp_path / "pids"

    def on_start(group: object) -> None:
        for pid in wait_for(pids).split():
            track(int(pid))

    config = GuardConfig(
        [PY, "-c", DAEMONIZER, str(pids), mode], wait_free="0", kill_free="100%", grace="0.5s"
    )
    result = Guard(config, stderr=sys.stderr, on_start=on_start).run()
    err = capfd.readouterr().err
    no_traceback(err)
    assert result.exit_code == EXIT_STOPPED
    command, daemon = (int(p) for p in pids.read_text().split())
    assert wait_gone(command) and wait_gone(daemon, 5.0), "the daemon outlived the stop"
    assert result.escaped == 1, err
    assert "1 processes that had left its group (setsid) stopped" in err.splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper is Linux only")
def test_a_daemon_left_by_a_command_that_exits_is_stopped_unless_leave_group(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], track: Callable[[int], None]
) -> None:
    """The command exits by itself after detaching a daemon: stopped like a leftover;
    with --leave-group it runs on and the summary says so."""
    for flags, stopped in (([], True), (["--leave-group"], False)):
        pids = tmp_path / f"pids{len(flags)}"
        script = DAEMONIZER.replace(
            "os.wait()\ntime.sleep(60)",
            "os.wait()\n" + (f"while not os.path.exists({str(pids)!r}): time.sleep(0.02)"),
        )
        code = main(["guard", "--wait-free", "0", "--grace", "0.5s", *flags, "--",
                     PY, "-c", script, str(pids), "plain"])  # fmt: skip
        daemon = int(pids.read_text().split()[1])
        track(daemon)
        err = capfd.readouterr().err
        no_traceback(err)
        assert code == 0
        last = err.strip().splitlines()[-1]
        if stopped:
            assert wait_gone(daemon, 5.0)
            assert "1 processes that had left its group (setsid) stopped" in last
        else:
            assert not gone(daemon)
            assert "1 processes that had left its group (setsid) left running" in last


def _stop_when_ready(
    command: list[str], pidfile: Path, track: Callable[[int], None], **config: object
) -> GuardResult:
    """Run ``command`` under a guard that stops it at its first samples (--kill-free 100%),
    once it has written ``pidfile``: a stop before it set up its signals would prove nothing."""

    def on_start(group: object) -> None:
        track(int(wait_for(pidfile)))

    cfg = GuardConfig(command, wait_free="0", kill_free="100%", **config)  # type: ignore[arg-type]
    return Guard(cfg, stderr=sys.stderr, on_start=on_start).run()


def test_sigkill_after_grace_when_sigterm_is_ignored(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], track: Callable[[int], None]
) -> None:
    pidfile = tmp_path / "pid"
    command = [PY, "-c", SLEEPER, str(pidfile), "ignore-term"]
    result = _stop_when_ready(command, pidfile, track, grace="0.5s")
    err = capfd.readouterr().err
    no_traceback(err)
    assert result.exit_code == EXIT_STOPPED
    assert wait_gone(int(pidfile.read_text()))
    assert "SIGKILL after 500 ms grace" in err.strip().splitlines()[-1]


def test_group_member_outliving_the_leader_gets_sigkill(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], track: Callable[[int], None]
) -> None:
    """The leader dies on SIGTERM, a grandchild in its group ignores it: the group is still
    ours (the leader stays unreaped), so SIGKILL after the grace reaches the grandchild."""
    pidfile = tmp_path / "pid"
    leader = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}, {str(pidfile)!r}, 'ignore-term'])\n"
        "time.sleep(60)\n"
    )
    result = _stop_when_ready([PY, "-c", leader], pidfile, track, grace="0.5s")
    err = capfd.readouterr().err
    no_traceback(err)
    assert result.exit_code == EXIT_STOPPED
    assert wait_gone(int(pidfile.read_text()))
    assert "SIGKILL after 500 ms grace" in err.strip().splitlines()[-1]


# A shell that backgrounds two children in its own group (one notes SIGTERM, one ignores
# it), waits until both run, and exits by itself with code 3.
BACKGROUNDER = (
    '"$0" -c "$1" "$2" note-term & "$0" -c "$1" "$3" ignore-term & '
    'while [ ! -e "$2" ] || [ ! -e "$3" ]; do sleep 0.05; done; exit 3'
)


def _leave_behind(tmp_path: Path, *flags: str) -> tuple[int, list[int]]:
    """Run BACKGROUNDER under ``stageload guard``; (exit code, the children's pids)."""
    first, second = tmp_path / "first", tmp_path / "second"
    command = ["sh", "-c", BACKGROUNDER, PY, SLEEPER, str(first), str(second)]
    code = main(["guard", "--wait-free", "0", "--grace", "0.5s", *flags, "--", *command])
    return code, [int(first.read_text()), int(second.read_text())]


def test_processes_the_command_left_in_its_group_are_stopped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], track: Callable[[int], None]
) -> None:
    """As a supervisor does: SIGTERM, then SIGKILL after --grace for the one ignoring it."""
    code, children = _leave_behind(tmp_path)
    for pid in children:
        track(pid)
    err = capfd.readouterr().err
    no_traceback(err)
    assert code == 3  # the command's own exit code
    assert all(wait_gone(pid) for pid in children)
    assert (tmp_path / "first.term").exists()  # it got SIGTERM first
    last = err.strip().splitlines()[-1]
    assert "command exited with code 3; 2 processes it left in its group stopped" in last
    assert last.endswith("(exit 3)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper is Linux only")
def test_the_guard_reaps_what_was_reparented_to_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], track: Callable[[int], None]
) -> None:
    """As a subreaper the guard adopts the children its command left when it exited; once
    it has stopped them it reaps them, so a process that runs guards (this one) does not
    collect zombies."""
    code, children = _leave_behind(tmp_path)
    for pid in children:
        track(pid)
    no_traceback(capfd.readouterr().err)
    assert code == 3
    mine = {c.pid: c for c in psutil.Process().children()}
    zombies = [
        pid for pid in children if pid in mine and mine[pid].status() == psutil.STATUS_ZOMBIE
    ]
    assert zombies == [], "stopped children were left as zombies of the guard's process"


def test_leave_group_keeps_what_the_command_left_running(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], track: Callable[[int], None]
) -> None:
    """Control: with --leave-group the same children run on, and the summary says so."""
    code, children = _leave_behind(tmp_path, "--leave-group")
    for pid in children:
        track(pid)
    err = capfd.readouterr().err
    no_traceback(err)
    assert code == 3
    assert not any(gone(pid) for pid in children)
    assert not (tmp_path / "first.term").exists()
    assert "2 processes it left in its group left running (--leave-group)" in err


# -- admission -------------------------------------------------------------------------


def test_busy_pattern_waits_for_the_process_then_for_quiet(
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """The guard waits while a real process whose command line matches --busy runs, and
    starts the command only once that process has been gone for --quiet-for."""
    marker = f"stageload-busy-{uuid.uuid4().hex[:8]}"
    busy = spawn([PY, "-c", "import time; time.sleep(60)", marker])
    started = tmp_path / "started"
    guard = spawn(
        guard_cli("--wait-free", "0", "--busy", marker, "--quiet-for", "1s", "--poll", "0.1s",
                  "--start-timeout", "60s", "--", PY, "-c",
                  f"import time; open({str(started)!r}, 'w').write(repr(time.monotonic()))"),
        env=guard_env(),
        stderr=subprocess.PIPE,
    )  # fmt: skip
    # The guard has seen it running (a state it says), then it goes.
    seen = wait_line(guard, f"busy {marker!r} running")
    busy.terminate()
    busy.wait(10)
    gone_at = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process here
    _, rest = guard.communicate(timeout=60)
    err = (seen + rest).decode()
    no_traceback(err)
    assert guard.returncode == 0, err
    start_time = float(started.read_text())
    # Last seen at most one poll (0.1 s) before it was gone, then 1 s of quiet.
    assert start_time >= gone_at + 1.0 - 0.1 - 0.02
    running = [line for line in err.splitlines() if f"busy {marker!r} running" in line]
    # Not a terminal: one line per change of state, not one per poll.
    assert len(running) == 1, err
    assert any(f"busy {marker!r} seen" in line for line in err.splitlines()), err


def test_busy_pattern_ignores_the_guard_and_its_ancestors(
    spawn: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """The pattern is in the guard's own command line and in its parent shell's: neither
    counts, so the guard starts at once instead of timing out."""
    marker = f"stageload-self-{uuid.uuid4().hex[:8]}"
    script = (
        f"{' '.join(guard_cli('--wait-free', '0', '--busy', marker, '--quiet-for', '0'))} "
        f"--start-timeout 5s -- {PY} -c 'print(123)'; echo {marker} >/dev/null"
    )
    proc = spawn(["sh", "-c", script], env=guard_env(), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)  # fmt: skip
    out, err = proc.communicate(timeout=30)
    no_traceback(err.decode())
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "123"


def test_start_timeout_gives_exit_4_and_never_starts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ran = tmp_path / "ran"
    code = main(
        ["guard", "--wait-free", "100%", "--start-timeout", "0.5s", "--",
         PY, "-c", f"open({str(ran)!r}, 'w')"]
    )  # fmt: skip
    err = capfd.readouterr().err
    no_traceback(err)
    assert code == EXIT_NO_ROOM == 4
    assert not ran.exists()
    assert "waiting: available" in err and "< 100%" in err
    assert "no room after" in err.strip().splitlines()[-1]


@linux_only
def test_swap_limit_blocks_admission(tmp_path: Path) -> None:
    """Swap used is replayed from a recorded /proc/meminfo (this machine has no swap):
    2 GiB used + a 1 GiB budget is not under a 3 GiB limit, so the command never starts."""
    import io

    marker = tmp_path / "ran"
    config = GuardConfig(
        [PY, "-c", f"open({str(marker)!r}, 'w')"],
        wait_free="0",
        swap_limit="3G",
        swap_budget="1G",
        start_timeout="0.3s",
    )
    probes = _recorded_probes(_replay([_meminfo(tmp_path / "p", 2 * GiB)]))
    err = io.StringIO()
    result = run_guard(config, probes=probes, stderr=err)
    assert result.exit_code == EXIT_NO_ROOM and not marker.exists()
    assert "swap 2.0 GiB + budget 1.0 GiB >= limit 3.0 GiB" in err.getvalue()


def test_swap_limit_not_above_the_budget_is_a_usage_error(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Swap used (0 or more) plus the default 8G budget can never be under a 1G limit."""
    code = main(["guard", "--wait-free", "0", "--swap-limit", "1G", "--", PY, "-c", "pass"])
    err = capfd.readouterr().err
    assert code == 2
    assert "--swap-limit 1.0 GiB is not above --swap-budget 8.0 GiB" in err
    no_traceback(err)
    with pytest.raises(ValueError, match="could never start"):
        GuardConfig([PY], swap_limit="4G", swap_budget="4G")


def test_no_trace_file_when_the_command_never_started(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    code = main(
        ["guard", "--wait-free", "100%", "--start-timeout", "0.2s", "--trace", str(trace),
         "--", PY, "-c", "pass"]
    )  # fmt: skip
    assert code == EXIT_NO_ROOM
    assert not trace.exists()
    no_traceback(capfd.readouterr().err)


# -- exit codes, bad input -------------------------------------------------------------


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("import sys; sys.exit(0)", 0),
        ("import sys; sys.exit(7)", 7),
        ("import os, signal; os.kill(os.getpid(), signal.SIGUSR1)", 128 + signal.SIGUSR1),
    ],
)
def test_command_exit_code_passes_through(
    snippet: str, expected: int, capfd: pytest.CaptureFixture[str]
) -> None:
    code = main(["guard", "--wait-free", "0", "--", PY, "-c", snippet])
    err = capfd.readouterr().err
    no_traceback(err)
    assert code == expected
    assert err.strip().splitlines()[-1].endswith(f"(exit {expected})")


def test_missing_command_exits_127(capfd: pytest.CaptureFixture[str]) -> None:
    missing = f"/nonexistent/stageload-{uuid.uuid4().hex[:6]}"
    code = main(["guard", "--wait-free", "0", "--", missing, "--flag"])
    err = capfd.readouterr().err
    no_traceback(err)
    assert code == EXIT_CANNOT_START == 127
    assert f"cannot start {missing!r}: No such file or directory" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--wait-free", "lots"], "invalid amount 'lots'"),
        (["--kill-free", "120%"], "invalid percentage '120%'"),
        (["--swap-budget", "8X"], "invalid size '8X'"),
        (["--swap-limit=-1G"], "invalid size '-1G'"),
        (["--quiet-for", "soon"], "invalid duration 'soon'"),
        (["--grace", "-1"], "duration must not be negative, got '-1'"),
        (["--poll", "0"], "poll interval must be above 0, got '0'"),
        (["--busy", "(ffmpeg"], "invalid --busy pattern '(ffmpeg'"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["guard", *args, "--", PY, "-c", "pass"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert message in err
    no_traceback(err)


@pytest.mark.parametrize("refused", [True, False], ids=["fixed", "control"])
def test_an_empty_busy_pattern_exits_2(
    refused: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--busy ''`` matches every process, so the command waited for ever. Control: with
    the pattern compiled as given, the guard waits until --start-timeout (exit 4)."""
    import re

    import stageload.guard.config

    if not refused:
        monkeypatch.setattr(stageload.guard, "compile_busy", re.compile)  # the flag's check
        monkeypatch.setattr(stageload.guard.config, "compile_busy", re.compile)  # GuardConfig's
    ran = tmp_path / "ran"
    argv = ["guard", "--wait-free", "0", "--busy", "", "--start-timeout", "0.3s", "--",
            PY, "-c", f"open({str(ran)!r}, 'w')"]  # fmt: skip
    if refused:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "an empty --busy pattern matches every process" in err and "--busy ffmpeg" in err
        with pytest.raises(ValueError, match="empty --busy pattern"):
            GuardConfig(["true"], busy=[""])
    else:
        assert main(argv) == EXIT_NO_ROOM
        err = capsys.readouterr().err
    no_traceback(err)
    assert not ran.exists()


@pytest.mark.parametrize("refused", [True, False], ids=["fixed", "control"])
def test_a_plain_string_for_a_list_is_a_type_error(
    refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``busy='ffmpeg'`` was the patterns 'f', 'f', 'm', ... (matching nearly every
    process) and ``GuardConfig('true')`` ran ``t``. Control: without the check, letters."""
    import stageload.guard.config as config_module

    if not refused:
        monkeypatch.setattr(config_module, "_not_a_string", lambda name, value: value)
    if refused:
        with pytest.raises(TypeError, match=r"busy must be a list of strings, got the plain "
                           r"string 'ffmpeg' .*give a list: busy=\['ffmpeg'\]"):  # fmt: skip
            GuardConfig(["true"], busy="ffmpeg")
        with pytest.raises(TypeError, match=r"command=\['python', 'run.py'\]"):
            GuardConfig("python run.py")
    else:
        assert GuardConfig(["true"], busy="ffmpeg").busy == tuple("ffmpeg")
        assert GuardConfig("true").command == ["t", "r", "u", "e"]


def test_no_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["guard", "--wait-free", "0"]) == 2
    assert "no command given; put it after '--'" in capsys.readouterr().err


def test_unwritable_trace_exits_2_before_starting(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ran, trace = tmp_path / "ran", tmp_path / "missing-folder" / "trace.jsonl"
    code = main(
        ["guard", "--wait-free", "0", "--trace", str(trace),
         "--", PY, "-c", f"open({str(ran)!r}, 'w')"]
    )  # fmt: skip
    err = capfd.readouterr().err
    no_traceback(err)
    assert code == 2
    assert f"cannot open trace file {str(trace)!r} for writing" in err
    assert not ran.exists()


def test_a_failing_guard_stops_the_command_before_raising(
    tmp_path: Path, track: Callable[[int], None]
) -> None:
    """If a probe breaks mid-run, the guard does not leave the command running unwatched."""
    pidfile = tmp_path / "pid"
    calls = [0]
    real = Probes.real()

    def system() -> SystemMemory:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("counter broke")
        return real.system()

    def on_start(group: object) -> None:
        track(int(wait_for(pidfile)))

    probes = Probes(system=system, process=real.process, processes=real.processes)
    config = GuardConfig([PY, "-c", SLEEPER, str(pidfile), "plain"], wait_free="0", poll="0.05s")
    with pytest.raises(RuntimeError, match="counter broke"):
        Guard(config, probes=probes, stderr=None, on_start=on_start).run()
    assert wait_gone(int(pidfile.read_text()))


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["guard", "--help"])
    out = capsys.readouterr().out
    for line in ("3  ", "4  ", "127  ", "128+N"):
        assert line in out


def _option_help(out: str, option: str) -> str:
    """The help of ``option`` in a rendered ``--help``, on one line."""
    import re

    found = re.search(rf"^  {re.escape(option)} .*?(?=^  -|^\S|\Z)", out, re.M | re.S)
    assert found, f"{option} not in --help"
    return " ".join(found.group(0).split())


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
@pytest.mark.parametrize("command", ["guard", "run"])
def test_help_says_what_a_bare_number_means(monkeypatch, capsys, fixed, command) -> None:
    """`--wait-free 50` is 50 % and `--swap-budget 50` is 50 bytes; each flag's help now
    says which, and that 2GB is GiB. Control: the help without those words."""
    import stageload.cli.guard as guard_cli
    import stageload.cli.run as run_cli

    if not fixed:
        for module in (guard_cli, run_cli):
            monkeypatch.setattr(module, "SIZE_HELP", "a size")
        monkeypatch.setattr(guard_cli, "AMOUNT_HELP", "a percent or a size")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    percent = ("a bare number is one (40 is 40%)", "12G, 12GB, 12GiB: 12 GiB")
    size = ("a bare number is bytes (50 is 50 B)", "8G, 8GB, 8GiB: 8 GiB")
    options = {"--wait-free": percent, "--kill-free": percent}
    options |= {"--swap-budget": size, "--swap-limit": size}
    if command == "run":
        options["--memory"] = size
    for option, (bare, units) in options.items():
        said = _option_help(out, option)
        assert (bare in said and units in said) is fixed, said


def test_config_rejects_bad_values_like_the_flags() -> None:
    with pytest.raises(ValueError, match="invalid amount 'lots'"):
        GuardConfig(["true"], wait_free="lots")
    with pytest.raises(ValueError, match="no command given"):
        GuardConfig([])
    with pytest.raises(ValueError, match="poll interval must be above 0"):
        GuardConfig(["true"], poll=0)


def test_config_fields_hold_their_final_types() -> None:
    """Converted at construction: what the guard reads is bytes, seconds and Amounts,
    whatever form they were given in, and ``dataclasses.replace`` takes them back."""
    import dataclasses

    config = GuardConfig(
        ("true",), wait_free="12G", kill_free=Amount.parse("5%"), swap_limit=16 * GiB,
        swap_budget="1G", quiet_for="1m", start_timeout=5, poll="100ms", grace="2s",
        busy=["ffmpeg"],
    )  # fmt: skip
    assert config.command == ["true"]
    assert config.wait_free == Amount("bytes", 12 * GiB) and config.kill_free.kind == "percent"
    assert (config.swap_limit, config.swap_budget) == (16 * GiB, GiB)
    assert (config.quiet_for, config.start_timeout, config.poll, config.grace) == (
        60.0, 5.0, 0.1, 2.0,
    )  # fmt: skip
    assert isinstance(config.start_timeout, float)
    assert [p.pattern for p in config.busy_patterns] == ["ffmpeg"]
    again = dataclasses.replace(config, start_timeout=1.5, trace="t.jsonl")
    assert (again.start_timeout, again.trace, again.swap_budget) == (1.5, "t.jsonl", GiB)
    assert again.busy_patterns == config.busy_patterns


# -- signals (the guard as a real subprocess) -------------------------------------------


def _start_guard(
    spawn: Callable[..., subprocess.Popen[bytes]],
    track: Callable[[int], None],
    pidfile: Path,
    mode: str,
    *flags: str,
    **kwargs: object,
) -> tuple[subprocess.Popen[bytes], int]:
    guard = spawn(
        guard_cli("--wait-free", "0", *flags, "--", PY, "-c", SLEEPER, str(pidfile), mode),
        env=guard_env(),
        stderr=subprocess.PIPE,
        **kwargs,
    )
    child = int(wait_for(pidfile))
    track(child)
    return guard, child


def test_sigterm_to_the_guard_stops_the_command_and_exits_143(
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[bytes]],
    track: Callable[[int], None],
) -> None:
    pidfile = tmp_path / "pid"
    guard, child = _start_guard(spawn, track, pidfile, "note-term")
    guard.send_signal(signal.SIGTERM)
    _, err = guard.communicate(timeout=30)
    no_traceback(err.decode())
    assert guard.returncode == 128 + signal.SIGTERM == 143
    assert (tmp_path / "pid.term").read_text() == "TERM\n", "SIGTERM did not reach the command"
    assert wait_gone(child)
    assert "guard got SIGTERM" in err.decode().strip().splitlines()[-1]


def test_signal_while_waiting_exits_128_plus_signal_without_starting(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[bytes]]
) -> None:
    ran = tmp_path / "ran"
    guard = spawn(
        guard_cli("--wait-free", "100%", "--", PY, "-c", f"open({str(ran)!r}, 'w')"),
        env=guard_env(),
        stderr=subprocess.PIPE,
    )
    assert guard.stderr is not None
    assert b"waiting: available" in guard.stderr.readline()
    guard.send_signal(signal.SIGHUP)
    _, err = guard.communicate(timeout=20)
    no_traceback(err.decode())
    assert guard.returncode == 128 + signal.SIGHUP
    assert "guard got SIGHUP while waiting; command not started" in err.decode()
    assert not ran.exists()


def test_second_signal_sends_sigkill_at_once(
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[bytes]],
    track: Callable[[int], None],
) -> None:
    """The command ignores SIGTERM and the grace is 60 s: a second SIGINT kills it now."""
    pidfile = tmp_path / "pid"
    guard, child = _start_guard(spawn, track, pidfile, "ignore-term", "--grace", "60s")
    guard.send_signal(signal.SIGINT)
    # The guard says when it starts the stop: from then on a signal is the second one,
    # however busy the machine (two SIGINTs both pending would merge into one).
    seen = wait_line(guard, "stageload guard: stopping: guard got SIGINT")
    assert not gone(child)
    guard.send_signal(signal.SIGINT)
    _, err = guard.communicate(timeout=60)  # far less than the 60 s grace from its start
    err = seen + err
    no_traceback(err.decode())
    assert guard.returncode == 128 + signal.SIGINT == 130
    assert wait_gone(child)
    assert "SIGKILL at once on a second signal" in err.decode()


@pytest.mark.parametrize("paused", [False, True], ids=["sent", "pending-together"])
def test_two_signals_back_to_back_send_sigkill_at_once(
    paused: bool,
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[bytes]],
    track: Callable[[int], None],
) -> None:
    """Two signals sent in a row, with no pause: both may be in before the guard starts its
    stop, and the second must still count as the second (it waited the 60 s grace).

    SIGINT then SIGTERM: two SIGINTs this close may be merged into one by the kernel (a
    standard signal pending twice is delivered once), and one signal is not two."""
    pidfile = tmp_path / "pid"
    # The command wrote its pid: the guard started it, so its handlers are in (they are
    # installed before the command starts); whether its loop has begun does not matter.
    guard, child = _start_guard(spawn, track, pidfile, "ignore-term", "--grace", "60s")
    if paused:  # the closest two can come: both pending when the guard next runs
        os.kill(guard.pid, signal.SIGSTOP)
    os.kill(guard.pid, signal.SIGINT)
    os.kill(guard.pid, signal.SIGTERM)
    if paused:
        os.kill(guard.pid, signal.SIGCONT)
    _, err = guard.communicate(timeout=50)  # less than the 60 s grace
    no_traceback(err.decode())
    assert guard.returncode == 128 + signal.SIGINT == 130
    assert wait_gone(child)
    assert "SIGKILL at once on a second signal" in err.decode()


# Puts back the race the guard avoids: the signals counted when the wind-down begins,
# not when the stop was decided, so a second signal already in is taken for the first.
LATE_COUNT = """
import sys
from stageload.guard import Guard
_wind_down = Guard._wind_down
Guard._wind_down = lambda self, group, before: _wind_down(
    self, group, len(self._signals.received))
from stageload.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_control_signals_counted_late_miss_the_second_of_two_back_to_back(
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[bytes]],
    track: Callable[[int], None],
) -> None:
    """Control for the test above: counting at the wind-down instead of at the decision,
    two signals already in read as one, and the grace (2 s here) runs out instead."""
    pidfile = tmp_path / "pid"
    guard = spawn(
        [PY, "-c", LATE_COUNT, "guard", "--wait-free", "0", "--grace", "2s", "--",
         PY, "-c", SLEEPER, str(pidfile), "ignore-term"],
        env=guard_env(),
        stderr=subprocess.PIPE,
    )  # fmt: skip
    track(int(wait_for(pidfile)))
    # Both in before the guard acts on the first: stop the guard between the two sends.
    os.kill(guard.pid, signal.SIGSTOP)
    os.kill(guard.pid, signal.SIGINT)
    os.kill(guard.pid, signal.SIGTERM)
    os.kill(guard.pid, signal.SIGCONT)
    _, err = guard.communicate(timeout=60)
    no_traceback(err.decode())
    assert guard.returncode == 130
    assert "SIGKILL after 2.0 s grace" in err.decode(), err.decode()


def test_a_guard_killed_with_sigkill_takes_its_command_group_with_it(
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[bytes]],
    track: Callable[[int], None],
) -> None:
    """SIGKILL to the guard (nothing of it runs any more): its watchdog sees the pipe close
    and SIGKILLs the command's group, the command and a child it started (ignoring SIGTERM)."""
    pidfile, member = tmp_path / "pid", tmp_path / "member"
    script = (
        f"import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}, {str(member)!r}, 'ignore-term'])\n"
        f"exec(compile({SLEEPER!r}, 'sleeper', 'exec'))\n"
    )
    guard = spawn(
        guard_cli("--wait-free", "0", "--", PY, "-c", script, str(pidfile), "ignore-term"),
        env=guard_env(),
        stderr=subprocess.PIPE,
    )
    command = int(wait_for(pidfile))
    track(command)
    child = int(wait_for(member))
    track(child)
    assert os.getpgid(child) == os.getpgid(command) == command
    guard.kill()
    guard.wait(10)
    assert wait_gone(command, 5.0), "the command outlived its guard"
    assert wait_gone(child, 5.0), "the command's group outlived its guard"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_signal_ignored_at_start_stays_ignored(
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[bytes]],
    track: Callable[[int], None],
) -> None:
    """Under nohup (SIGHUP ignored) a SIGHUP neither stops the command nor the guard."""
    pidfile = tmp_path / "pid"
    script = (
        "import os, sys, time\n"
        f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}}\\n')\n"
        f"while not os.path.exists({str(pidfile)!r} + '.go'): time.sleep(0.02)\n"
        "sys.exit(5)\n"
    )
    guard = spawn(
        ["nohup", *guard_cli("--wait-free", "0", "--", PY, "-c", script)],
        env=guard_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    track(int(wait_for(pidfile)))
    # The command runs, so the guard (nohup exec'd it) has set up its signals. SIGHUP is
    # still ignored there, which the kernel says: an ignored signal is dropped when sent,
    # so the SIGHUP below can neither stop the command nor end the guard, at any delay.
    assert _sig_mask(guard.pid, "SigIgn") & (1 << (signal.SIGHUP - 1))
    assert not _sig_mask(guard.pid, "SigCgt") & (1 << (signal.SIGHUP - 1))
    guard.send_signal(signal.SIGHUP)
    (tmp_path / "pid.go").touch()
    _, err = guard.communicate(timeout=20)
    no_traceback(err.decode())
    assert guard.returncode == 5


def _sig_mask(pid: int, field: str) -> int:
    """A signal mask of ``pid`` from /proc/PID/status (SigIgn, SigCgt, ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


# -- swap growth -----------------------------------------------------------------------


def _meminfo(folder: Path, swap_used: int, *, swap_total: int = 16 * GiB) -> Path:
    """A recorded /proc/meminfo with plenty of memory available and ``swap_used`` in swap."""
    folder.mkdir(parents=True)
    kib = 1024
    (folder / "meminfo").write_text(
        f"MemTotal:       {32 * GiB // kib} kB\n"
        f"MemFree:        {20 * GiB // kib} kB\n"
        f"MemAvailable:   {24 * GiB // kib} kB\n"
        f"SwapTotal:      {swap_total // kib} kB\n"
        f"SwapFree:       {(swap_total - swap_used) // kib} kB\n"
    )
    return folder


def _replay(folders: list[Path]) -> Callable[[], SystemMemory]:
    """read_system over recorded procfs folders, one per call, then the last one again."""
    it: Iterator[Path] = iter(folders)
    last: list[Path] = []

    def read() -> SystemMemory:
        folder = next(it, None)
        if folder is not None:
            last[:] = [folder]
        return read_linux_system(procfs=str(last[0]))

    return read


def _recorded_probes(system: Callable[[], SystemMemory]) -> Probes:
    return Probes(
        system=system, process=lambda pid: read_process(pid, tree=True), processes=list_processes
    )


@linux_only
def test_swap_growth_rule_through_the_readers_on_a_recorded_series(tmp_path: Path) -> None:
    """This machine has no swap, so swap growth is replayed from recorded /proc/meminfo
    files through the real Linux reader; the command, its group and the stop are real."""
    series = [2048, 2048, 2355, 2662, 2970, 3124, 3277]  # MiB used; budget 1 GiB over 2048
    folders = [_meminfo(tmp_path / f"p{i}", mib * MiB) for i, mib in enumerate(series)]
    config = GuardConfig(
        [PY, "-c", "import time; time.sleep(60)"],
        wait_free="10%",
        swap_budget="1G",
        kill_free="0",
        poll="0.05s",
        grace="2s",
        trace=tmp_path / "trace.jsonl",
    )
    result = run_guard(config, probes=_recorded_probes(_replay(folders)), stderr=None)
    assert result.exit_code == EXIT_STOPPED
    assert result.swap_growth == (3124 - 2048) * MiB
    assert "swap grew 1.1 GiB since start, over the budget of 1.0 GiB" in result.reason
    assert wait_gone(result.pid or 0)
    records = read_records(tmp_path / "trace.jsonl")
    swap = [r["swap_used"] for r in records if r["type"] == "sample"]
    # Stopped at the first sample over the budget (3124 MiB), not before.
    assert swap == [mib * MiB for mib in series[1:6]]


@linux_only
def test_swap_growth_within_budget_lets_the_command_finish(tmp_path: Path) -> None:
    """Recorded swap (no swap on this machine) that grows 0.9 GiB of a 1 GiB budget."""
    folders = [_meminfo(tmp_path / f"p{i}", mib * MiB) for i, mib in enumerate([2048, 2970])]
    config = GuardConfig(
        [PY, "-c", "import time, sys; time.sleep(0.5); sys.exit(9)"],
        wait_free="10%",
        swap_budget="1G",
        kill_free="0",
        poll="0.05s",
    )
    result = run_guard(config, probes=_recorded_probes(_replay(folders)), stderr=None)
    assert (result.exit_code, result.outcome) == (9, "exited")
    assert result.swap_growth is not None and 0.89 * GiB < result.swap_growth < GiB


def test_stop_rule_swap_budget_and_two_samples_under_the_floor() -> None:
    """The rule alone, on readings recorded as values (no machine has to produce them)."""

    def reading(available_gib: float, swap_gib: float) -> SystemMemory:
        return SystemMemory(
            total=32 * GiB,
            available=int(available_gib * GiB),
            available_percent=100 * available_gib / 32,
            swap_used=int(swap_gib * GiB),
            swap_total=16 * GiB,
            pressure=None,
        )

    rule = StopRule(Amount.parse("4G"), swap_budget=GiB, swap_at_start=2 * GiB)
    assert rule.observe(reading(10, 3.0)) is None  # growth == budget: not over it
    assert rule.observe(reading(3, 2.0)) is None  # first sample under the floor
    assert rule.observe(reading(5, 2.0)) is None  # back over it: the count restarts
    assert rule.observe(reading(3, 2.0)) is None
    assert "for 2 samples in a row" in (rule.observe(reading(3, 2.0)) or "")
    assert "swap grew" in (rule.observe(reading(10, 3.01)) or "")
    # Adaptive poll: 0.5 s with a wide margin, faster as it shrinks, 0.1 s at the floor.
    wide, near = StopRule(Amount.parse("4G"), GiB, 0), StopRule(Amount.parse("4G"), GiB, 0)
    assert wide.next_poll(reading(20, 0), None) == 0.5
    assert 0.1 < near.next_poll(reading(4 + 1.5, 0), None) < 0.5
    assert near.next_poll(reading(4.1, 0), None) == 0.1
    assert near.next_poll(reading(20, 0), 2.0) == 2.0


@pytest.mark.skipif(psutil.swap_memory().total == 0, reason="this machine has no swap")
def test_real_swap_is_read_and_within_budget(tmp_path: Path) -> None:
    """Where the machine has swap: the guard's samples match psutil's swap figure, and a
    short quiet command does not trip the budget."""
    trace = tmp_path / "trace.jsonl"
    config = GuardConfig(
        [PY, "-c", "import time; time.sleep(0.5)"], wait_free="0", kill_free="0", trace=trace
    )
    result = run_guard(config, stderr=None)
    assert result.exit_code == 0
    used = [r["swap_used"] for r in read_records(trace) if r["type"] == "sample"]
    assert abs(used[-1] - psutil.swap_memory().used) < 256 * MiB


# -- status line -----------------------------------------------------------------------


def test_status_updates_in_place_on_a_terminal() -> None:
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as stream:
            status = _Status(stream)
            assert status.tty
            status.show(("free",), "waiting: available 31% < 40%")
            status.show(("free",), "waiting: available 32% < 40%")
            status.line("done")
        text = ""
        while not text.endswith("done\r\n") and select.select([master], [], [], 5)[0]:
            text += os.read(master, 4096).decode()  # a pty hands over writes piecemeal
    finally:
        os.close(master)
        os.close(slave)
    assert text.count("\r\x1b[K") == 2 and text.endswith("done\r\n")


@pytest.mark.parametrize("how", ["meter", "guard", "run"])
def test_the_end_record_names_the_signal_the_command_died_from(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trace-format.md: ``signal`` in the end record when the command died from one.
    ``meter`` wrote it; ``guard --trace`` and ``run --trace`` left it out."""
    monkeypatch.setenv("STAGELOAD_HOME", str(tmp_path / "state"))
    trace = tmp_path / "t.jsonl"
    flag = {"meter": ["-o"], "guard": ["--wait-free", "0", "--trace"]}
    flags = flag.get(how, ["--wait-free", "0", "--quiet-for", "0", "--trace"])
    kill = ["--", "sh", "-c", "kill -KILL $$"]
    assert main([how, *flags, str(trace), *kill]) == 128 + signal.SIGKILL
    end = read_records(trace)[-1]
    assert (end["type"], end["exit_code"], end.get("signal")) == ("end", 137, "SIGKILL")
