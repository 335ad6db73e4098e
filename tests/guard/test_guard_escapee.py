"""No descendant outlives the guard, however it forks (issue 33 item 7).

The escapee: a child of the command calls ``setsid()``, ignores SIGTERM, and every 20 ms
forks itself anew and lets the old process exit, so its pid changes fifty times a second
and every listing of /proc races it. On main it outlived the guard in 7 of 10 runs. Both
ways the guard holds it are tested, 6 runs each: a cgroup v2 of the command's own (where
the guard may make one; root here) and the subreaper sweep (``STAGELOAD_GUARD_CGROUP=0``).
The control puts main's single psutil listing back, and the escapee survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from stageload.guard import EXIT_STOPPED, Guard, GuardConfig, contain, process
from stageload.guard.process import CommandGroup

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="subreaper and cgroups are Linux only"
)

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
RUNS = 6

# argv: SID-FILE MODE. The escapee writes its session id (its first pid) to SID-FILE, then
# lives on as described above. MODE "exit": the command exits once the escapee runs;
# "stay": the command sleeps (the guard stops it, or is killed).
ESCAPEE = """
import os, signal, sys, time
sid_file, mode = sys.argv[1], sys.argv[2]
period = float(sys.argv[3]) if len(sys.argv) > 3 else 0.02
if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(sid_file + ".tmp", "w") as f:
        f.write(f"{os.getsid(0)}\\n")
    os.rename(sid_file + ".tmp", sid_file)
    while True:
        time.sleep(period)
        if os.fork() != 0:
            os._exit(0)
        with open(sid_file + ".log", "a") as log:  # the new one says it lives on
            log.write(f"{os.getpid()}\\n")
while not os.path.exists(sid_file):
    time.sleep(0.005)
if mode == "stay":
    time.sleep(120)
"""


def _size(log: Path) -> int:
    try:
        return log.stat().st_size
    except FileNotFoundError:
        return 0


def survives(log: Path, quiet: float = 1.0, within: float = 5.0) -> bool:
    """Whether the escapee writing ``log`` still lives: it adds a line every 20 ms, so a
    log that keeps growing is a survivor, and one that stays the same for ``quiet``
    seconds (fifty periods) has no writer left. Its pids cannot tell: a scan of /proc
    races the forks exactly as the guard's listing does."""
    start = changed = time.monotonic()
    size = _size(log)
    while time.monotonic() - changed < quiet:
        time.sleep(0.02)
        now_size = _size(log)
        if now_size != size:
            size, changed = now_size, time.monotonic()
            if changed - start > within:
                return True
    return False


def kill_session(sid: int, log: Path) -> None:
    """Cleanup: SIGKILL the escapee's process group (its pgid is its sid) while its log
    still grows; never a group of someone else that reused the number afterwards."""
    for _ in range(50):
        if not survives(log, quiet=0.3, within=0.3):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sid, signal.SIGKILL)


@pytest.fixture
def sessions() -> Iterator[list[tuple[int, Path]]]:
    """(session, log) of the escapees a test started, killed at teardown whatever happened."""
    started: list[tuple[int, Path]] = []
    yield started
    for sid, log in started:
        kill_session(sid, log)


def running_with(argument: str) -> list[psutil.Process]:
    """The live processes whose command line holds ``argument`` (not zombies)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and argument in proc.cmdline():
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


#: Guarded runs tried for one in which the escapee gets to start.
ATTEMPTS = 5


def guarded_run(
    tmp_path: Path, i: int, mode: str, sessions: list[tuple[int, Path]]
) -> tuple[Path, object]:
    """One guarded run in which the escapee started; (its log, the group's cgroup or None).

    In "stay" mode the guard stops the command at its first samples. On a busy machine
    that can come before the escapee has forked and written its file (seen beside two CPU
    hogs, with two test workers): such a run tests nothing, so it is run again, once no
    process of it is left (one left would be an escapee the guard missed: a failure)."""
    for attempt in range(ATTEMPTS):
        sid_file = tmp_path / (f"sid{i}" if attempt == 0 else f"sid{i}-{attempt}")
        seen: dict[str, object] = {}

        def on_start(group: CommandGroup, seen: dict[str, object] = seen) -> None:
            seen["cgroup"] = group.cgroup

        flags = {"kill_free": "100%"} if mode == "stay" else {}
        config = GuardConfig(
            [PY, "-c", ESCAPEE, str(sid_file), mode], wait_free="0", grace="0.2s", **flags
        )  # type: ignore[arg-type]
        result = Guard(config, stderr=None, on_start=on_start).run()
        log = Path(f"{sid_file}.log")
        if sid_file.exists():
            sessions.append((int(sid_file.read_text()), log))
            assert result.exit_code == (EXIT_STOPPED if mode == "stay" else 0)
            return log, seen.get("cgroup")
        assert mode == "stay", "the command exits only once its escapee wrote its file"
        assert result.exit_code == EXIT_STOPPED
        left = running_with(str(sid_file))
        assert not left, f"stopped before its escapee wrote its file, yet {left} live on"
    pytest.fail(f"the guard stopped the command before its escapee started, {ATTEMPTS} times")


def need_cgroup() -> None:
    probe = contain.CommandCgroup.create()
    if probe is None:
        pytest.skip(f"the guard may not make a cgroup v2 here: {contain.why_not}")
    probe.remove()


@pytest.mark.parametrize("mode", ["exit", "stay"])
def test_the_escapee_never_outlives_the_guard_in_a_cgroup(
    mode: str, tmp_path: Path, sessions: list[tuple[int, Path]]
) -> None:
    need_cgroup()
    for i in range(RUNS):
        log, cgroup = guarded_run(tmp_path, i, mode, sessions)
        assert cgroup is not None
        assert not survives(log), f"run {i + 1}: the escapee outlived the guard"
        assert not cgroup.path.exists(), "the guard left its cgroup behind"  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["exit", "stay"])
def test_the_escapee_never_outlives_the_subreaper_sweep(
    mode: str, tmp_path: Path, sessions: list[tuple[int, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(contain.CGROUP_ENV, "0")
    for i in range(RUNS):
        log, cgroup = guarded_run(tmp_path, i, mode, sessions)
        assert cgroup is None
        assert not survives(log), f"run {i + 1}: the escapee outlived the guard"


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def race_the_first_listing(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Make the first listing after the command exits the one that raced a fork.

    Whether a listing of /proc races the escapee's fork is timing (main lost 7 of 10 on
    the machine of the issue, fewer on this one), so a test that waits for it to happen
    proves nothing either way. This makes it happen at a chosen moment, for real: the
    listing waits until a generation of the escapee has forked its successor and exited
    (its log names a new pid), and then reports what a listing taken across that moment
    can: nothing alive. The escapee, its fork and its death are real."""
    real = CommandGroup.escaped
    raced: list[bool] = []

    def escaped(self: CommandGroup) -> list[object]:
        if raced or not self.leader_exited():
            return real(self)
        raced.append(True)
        before = log.read_text() if log.exists() else ""
        deadline = time.monotonic() + 10
        while (log.read_text() if log.exists() else "") == before:
            assert time.monotonic() < deadline, "the escapee did not fork on"
            time.sleep(0.002)
        return []

    monkeypatch.setattr(CommandGroup, "escaped", escaped)


def test_the_sweep_holds_the_escapee_when_a_listing_raced_its_fork(
    tmp_path: Path, sessions: list[tuple[int, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing that found nothing because it raced a fork is not taken for "nothing
    left": a generation died since the round before, so the sweep lists again."""
    monkeypatch.setenv(contain.CGROUP_ENV, "0")
    race_the_first_listing(monkeypatch, tmp_path / "sid0.log")
    log, _ = guarded_run(tmp_path, 0, "exit", sessions)
    assert not survives(log), "the escapee got out through the raced listing"


def test_control_one_listing_taken_as_the_answer_lets_the_escapee_out(
    tmp_path: Path, sessions: list[tuple[int, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: main's rule (one listing is the answer) and the same raced listing: the
    escapee outlives the guard."""
    monkeypatch.setenv(contain.CGROUP_ENV, "0")
    race_the_first_listing(monkeypatch, tmp_path / "sid0.log")
    monkeypatch.setattr(CommandGroup, "escaped_settled", lambda self: self.escaped())
    monkeypatch.setattr(CommandGroup, "anything_left", lambda self: False)
    log, _ = guarded_run(tmp_path, 0, "exit", sessions)
    assert survives(log), "the escapee was stopped without the sweep's second look"


def test_a_cgroup_holds_the_escapee_when_a_listing_raced_its_fork(
    tmp_path: Path, sessions: list[tuple[int, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a cgroup the listing is not the answer: the cgroup is, and cgroup.kill."""
    need_cgroup()
    race_the_first_listing(monkeypatch, tmp_path / "sid0.log")
    monkeypatch.setattr(CommandGroup, "escaped_settled", lambda self: self.escaped())
    log, cgroup = guarded_run(tmp_path, 0, "stay", sessions)
    assert cgroup is not None
    assert not survives(log), "the escapee got out of the cgroup"


def test_the_cli_guard_holds_the_escapee_both_ways(
    tmp_path: Path, sessions: list[tuple[int, Path]]
) -> None:
    """The same runs as the control through ``stageload guard`` as users start it, with
    the fix: a cgroup where it may make one, the sweep where told not to."""
    for i, value in enumerate(["1", "0"] * 3):
        sid_file = tmp_path / f"sid{i}"
        subprocess.run(
            [PY, "-m", "stageload", "guard", "--wait-free", "0", "--grace", "0.2s", "--",
             PY, "-c", ESCAPEE, str(sid_file), "exit"],
            env=cli_env(**{contain.CGROUP_ENV: value}),
            stderr=subprocess.DEVNULL,
            timeout=60,
        )  # fmt: skip
        log = Path(f"{sid_file}.log")
        sessions.append((int(sid_file.read_text()), log))
        assert not survives(log), f"{contain.CGROUP_ENV}={value}: the escapee got out"


def test_a_guard_killed_with_sigkill_takes_the_escapee_with_it(
    tmp_path: Path, sessions: list[tuple[int, Path]]
) -> None:
    """With a cgroup the watchdog empties it (cgroup.kill) when the guard dies, so not even
    a descendant that left the group outlives a ``kill -9`` of the guard."""
    need_cgroup()
    sid_file = tmp_path / "sid"
    guard = subprocess.Popen(
        [PY, "-m", "stageload", "guard", "--wait-free", "0", "--", PY, "-c", ESCAPEE,
         str(sid_file), "stay"],
        env=cli_env(),
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not sid_file.exists():
            assert time.monotonic() < deadline, "the escapee never started"
            time.sleep(0.01)
        log = Path(f"{sid_file}.log")
        sessions.append((int(sid_file.read_text()), log))
        guard.kill()
        guard.wait(10)
        assert not survives(log), "the escapee outlived its guard's SIGKILL"
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.wait()


def test_a_cgroup_left_by_a_dead_guard_is_swept(tmp_path: Path) -> None:
    """A guard killed with -9 leaves its (emptied) cgroup folder; the next guard removes
    it, and leaves alone one whose guard still runs."""
    need_cgroup()
    home_cgroup = contain.CommandCgroup.create()
    assert home_cgroup is not None
    home = home_cgroup.path.parent
    home_cgroup.remove()
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    stale = home / f"{contain.PREFIX}{dead.pid}-0"
    live = home / f"{contain.PREFIX}{os.getppid()}-0"  # our parent runs
    stale.mkdir()
    live.mkdir()
    try:
        contain.sweep(home)
        assert not stale.exists()
        assert live.exists()
    finally:
        for path in (stale, live):
            with contextlib.suppress(OSError):
                path.rmdir()


def test_the_command_and_all_it_forks_run_in_the_cgroup(tmp_path: Path) -> None:
    """The move happens before exec: the command's first process is in the cgroup."""
    need_cgroup()
    out = tmp_path / "cgroup"
    script = f"open({str(out)!r}, 'w').write(open('/proc/self/cgroup').read())"
    names: list[str] = []

    def on_start(group: CommandGroup) -> None:
        assert group.cgroup is not None
        names.append(group.cgroup.name)

    config = GuardConfig([PY, "-c", script], wait_free="0")
    assert Guard(config, stderr=None, on_start=on_start).run().exit_code == 0
    assert f"0::{names[0]}" in out.read_text().splitlines()


@pytest.fixture
def exiting_child(monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[bytes]]:
    """A real child of this process that reads as a process inside exit() does: an empty
    environment (the kernel has released its memory) while it is not yet a zombie.

    The state itself lasts microseconds, so it is simulated by its one visible sign (the
    environment read); the child, the listing and the sweep are real."""
    child = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    real_environ = psutil.Process.environ

    def environ(self: psutil.Process) -> dict[str, str]:
        return {} if self.pid == child.pid else real_environ(self)

    monkeypatch.setattr(psutil.Process, "environ", environ)
    monkeypatch.setattr(process, "_SWEEP_SETTLE", 0.3)
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def sleeping_group() -> CommandGroup:
    return CommandGroup([PY, "-c", "import time; time.sleep(60)"], contain=False)


def test_a_child_inside_exit_keeps_the_sweep_looking(
    exiting_child: subprocess.Popen[bytes],
) -> None:
    """An escapee caught between its fork and its death reads an empty environment, and its
    child is reparented to the guard only when it is a zombie: a round that met one is not
    "nothing left" (CI lost one generation this way in 1 of 3 CLI runs)."""
    group = sleeping_group()
    try:
        assert group.escaped_settled() == []
        assert group.unsettled, "a round that met a process inside exit() was taken as final"
    finally:
        group.kill()
        group.reap()


def test_control_an_unreadable_child_taken_as_not_ours_settles_at_once(
    exiting_child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: main's rule (a child whose environment lacks the guard id is not ours,
    readable or not) settles on the first round and says nothing is left."""
    real = CommandGroup.escaped

    def old_rule(self: CommandGroup) -> list[object]:
        found = real(self)
        self._unsure = False
        return found

    monkeypatch.setattr(CommandGroup, "escaped", old_rule)
    group = sleeping_group()
    try:
        assert group.escaped_settled() == []
        assert not group.unsettled
    finally:
        group.kill()
        group.reap()
