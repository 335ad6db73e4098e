"""Real memory cgroups: the kernel enforces a limit, and the readers, the meter and the guard
are checked against it (``stageload.testing.cgroup``).

These replace fakes where a real cgroup answers the question: a recorded cgroup folder
cannot show that a process inside really sees its limit, that a trace written inside
agrees with what the kernel charged, or that the guard stops a command before the OOM
killer does. What no cgroup here can produce (swap growth, other kernels' file layouts)
keeps its recorded inputs in test_memory.py and test_guard.py. Every test skips, naming the
reason, where no cgroup can be made (not root, read-only cgroupfs); CI runs as root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stageload.memory import read_process, read_system
from stageload.testing.cgroup import (
    PREFIX,
    CgroupUnavailable,
    MemoryCgroup,
    cgroup_or_skip,
    read_usage,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="memory cgroups are Linux only"
)

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
MiB = 1 << 20
GiB = 1 << 30

# Holds N more MiB (touched: bytearray zero-fills) for each line N on stdin, and says so.
HOLDER = (
    "import sys\nheld = []\nfor line in sys.stdin:\n"
    "    held.append(bytearray(int(line) * 2**20))\n"
    "    print('held', sum(map(len, held)) >> 20, flush=True)\n"
)
# Grows by 16 MiB every 40 ms (at most 400 MiB/s) until something stops it.
GROWER = (
    "import time\nheld = []\nwhile True:\n"
    "    held.append(bytearray(16 * 2**20))\n    time.sleep(0.04)\n"
)


@pytest.fixture
def cgroup() -> Iterator[Callable[[int], MemoryCgroup]]:
    """Make cgroups (or skip); each is removed at teardown, whatever the test did."""
    made: list[MemoryCgroup] = []

    def make(limit: int) -> MemoryCgroup:
        cg = cgroup_or_skip(limit)
        made.append(cg)
        return cg

    yield make
    for cg in made:
        cg.remove()


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


def hold(proc: subprocess.Popen[str], mib: int) -> None:
    """Ask a HOLDER process to take ``mib`` more and wait until it has."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{mib}\n")
    proc.stdin.flush()
    assert proc.stdout.readline().startswith("held ")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


# -- the helper itself ------------------------------------------------------------------


def test_over_the_limit_the_oom_killer_fires_and_is_counted(cgroup) -> None:
    over = cgroup(128 * MiB).run([PY, "-S", "-c", "b = bytearray(256 * 2**20)"], timeout=60)
    assert over.returncode == -9 and over.oom_killed, over.stderr
    assert over.usage.oom_kills == 1
    assert over.usage.failcnt and over.usage.failcnt > 0  # charges hit the limit
    assert 120 * MiB < over.usage.peak <= 128 * MiB
    # Control: the same command under the limit finishes, with nothing killed or refused.
    under = cgroup(128 * MiB).run([PY, "-S", "-c", "b = bytearray(64 * 2**20)"], timeout=60)
    assert under.returncode == 0 and not under.oom_killed, under.stderr
    assert under.usage.oom_kills == 0 and under.usage.failcnt == 0
    assert 64 * MiB <= under.usage.peak < 120 * MiB


def test_the_cgroup_goes_with_what_runs_in_it_even_when_the_test_fails() -> None:
    with pytest.raises(ZeroDivisionError):  # noqa: SIM117 (the raise is the point)
        with cgroup_or_skip(64 * MiB) as cg:
            sleeper = cg.popen([PY, "-S", "-c", "import time; time.sleep(60)"])
            assert cg.pids() == [sleeper.pid]
            path = cg.path
            1 / 0  # noqa: B018
    assert sleeper.wait(10) == -9
    assert not path.exists()
    cg.remove()  # a second remove does nothing


def test_a_cgroup_left_by_a_dead_test_run_is_swept() -> None:
    with cgroup_or_skip(64 * MiB) as first:
        parent = first.path.parent
    dead = subprocess.run([PY, "-S", "-c", "import os; print(os.getpid())"], capture_output=True)
    stale = parent / f"{PREFIX}{int(dead.stdout)}-0"
    stale.mkdir()  # as a run killed before its cleanup would leave it
    try:
        with MemoryCgroup(64 * MiB):
            assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()


def test_unavailable_where_the_cgroup_cannot_be_created(tmp_path: Path) -> None:
    with pytest.raises(CgroupUnavailable, match="cannot create a cgroup in"):
        MemoryCgroup(64 * MiB, parent=tmp_path / "missing")
    with pytest.raises(CgroupUnavailable, match="is not in a cgroup filesystem"):
        MemoryCgroup(64 * MiB, parent=tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CgroupUnavailable, match="no cgroup filesystem"):
        MemoryCgroup(64 * MiB, root=str(tmp_path / "none"))


# -- the Linux reader ------------------------------------------------------------------


def test_reader_caps_available_by_the_real_limit(cgroup) -> None:
    """A process in a 256 MiB cgroup sees 256 MiB total, and its available memory falls
    by what it takes. Replaces the recorded-folder case for a live v1/v2 limit."""
    limit = 256 * MiB
    cg = cgroup(limit)
    child = cg.popen([PY, "-S", "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True)  # fmt: skip
    try:
        hold(child, 64)
        before = read_system(pid=child.pid)
        footprint = read_process(child.pid).footprint
        hold(child, 96)
        after = read_system(pid=child.pid)
        charged = cg.read().usage
    finally:
        stop(child)
    assert before.total == limit and after.total == limit
    assert str(cg.path) in before.sources["available"]
    # What it holds is charged to the cgroup: available is at most limit - footprint.
    assert before.available <= limit - footprint
    assert limit - footprint - before.available < 32 * MiB  # interpreter's kernel memory
    assert 88 * MiB < before.available - after.available < 104 * MiB
    assert abs((limit - after.available) - charged) < 8 * MiB  # the kernel's own count
    # Control: this test process is outside that cgroup and sees the machine.
    outside = read_system()
    assert outside.total > limit and outside.available > after.available + GiB


def test_reader_of_an_exited_process_never_reports_the_hosts_memory(cgroup, monkeypatch) -> None:
    """Bug found here: cgroup v1 shows "/" as the cgroup of an exiting task (an OOM-killed
    process freeing its memory, a zombie), so the reader took the host's MemAvailable, and
    traces of OOM-killed runs ended in a jump to 20 GiB available. Now it is unknown."""
    from stageload.memory import _linux

    limit = 128 * MiB
    cg = cgroup(limit)
    child = cg.popen([PY, "-S", "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert read_system(pid=child.pid).total == limit  # running: its cgroup's limit
        child.stdin.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while "Z" not in Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2][:3]:
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.02)
        zombie = read_system(pid=child.pid)  # exited, not yet reaped
        if cg.version == "cgroup2":  # v2 still shows the cgroup of an exiting task
            assert zombie.total == limit
            return
        assert zombie.available is None and zombie.total is None
        assert "exiting" in zombie.errors["available"]
        # Control: without the exiting check the reader falls back to the host's memory.
        monkeypatch.setattr(_linux, "_exiting", lambda pid, procfs: False)
        assert read_system(pid=child.pid).total > 8 * limit
    finally:
        child.wait(10)
    gone = read_system(pid=child.pid)  # reaped: no such process
    assert gone.available is None and f"no process {child.pid}" in gone.errors["available"]


def _live_reading() -> tuple[Any, int, Any]:
    """This process's own reading, MemTotal and cgroup limit (run inside by ``call``)."""
    from stageload.memory import _linux

    meminfo = _linux.parse_kib_fields(Path("/proc/meminfo").read_text())
    return read_system(), meminfo["MemTotal"], _linux.read_cgroup_limit()


def test_reader_of_this_process_inside_a_cgroup_takes_the_tightest_limit(cgroup) -> None:
    """The reader with no pid, from inside: replaces the live test that skipped on
    machines whose own cgroup has no limit."""
    cg = cgroup(192 * MiB)
    system, mem_total, cap = cg.call(_live_reading, timeout=60)
    assert cap is not None and cap.limit == 192 * MiB and str(cg.path) in cap.limit_source
    assert system.total == min(mem_total, cap.limit) == 192 * MiB
    assert system.available <= cap.headroom < 192 * MiB
    assert str(cg.path) in system.sources["available"]


def _budgets() -> tuple[int, int]:
    from stageload.memory.budget import parse_budget

    return parse_budget("80%"), parse_budget("auto")


def test_budget_shares_and_auto_are_of_the_cgroups_limit(cgroup) -> None:
    """The residency budget inside a 1280 MiB cgroup: '80%' is 1 GiB, and 'auto' (available
    minus a 1 GiB reserve) is what is left of the limit. A budget sized from the host's
    memory instead keeps models the cgroup cannot hold (bench/small_machine.py: OOM-killed)."""
    share, auto = cgroup(1280 * MiB).call(_budgets, timeout=60)
    assert share == 1024 * MiB
    assert 0 < auto <= 256 * MiB
    # Control: outside, the same share is of the machine.
    from stageload.memory.budget import parse_budget

    assert parse_budget("80%") == int(read_system().total * 80.0 / 100) > 8 * share


# -- the meter -------------------------------------------------------------------------


def _metered_growth(path: str) -> None:
    """Meter this process while it takes 4 x 32 MiB (run inside a cgroup by ``call``)."""
    from stageload.meter import MemoryMeter, count_samples

    def samples() -> int:
        return count_samples(path) or 0

    def two_more() -> None:  # a state to wait for: two samples after this point
        goal, deadline = samples() + 2, time.monotonic() + 30
        while samples() < goal:
            assert time.monotonic() < deadline, "the meter stopped sampling"
            time.sleep(0.01)

    held = []
    with MemoryMeter(path, 0.05, meta={"label": "growth"}) as meter:
        two_more()
        for step in range(4):
            held.append(bytearray(32 * MiB))
            meter.mark(f"+{32 * (step + 1)} MiB")
            two_more()


def _trace(path: Path) -> tuple[dict, list[dict]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return records[0], [r for r in records if r["type"] == "sample"]


def test_meter_trace_inside_a_cgroup_matches_the_kernel(cgroup, tmp_path: Path) -> None:
    """A meter running inside a 384 MiB cgroup (the meter's sampler process too) writes
    the cgroup's limit as total, and its lowest available agrees with the kernel's peak."""
    limit = 384 * MiB
    cg = cgroup(limit)
    inside = tmp_path / "inside.jsonl"
    cg.call(_metered_growth, str(inside), timeout=60)
    start, samples = _trace(inside)
    assert start["total"] == limit
    assert str(cg.path) in start["sources"]["available"]
    available = [s["available"] for s in samples if s.get("available") is not None]
    assert len(available) >= 10
    assert 112 * MiB < available[0] - min(available) < 160 * MiB  # the 128 MiB it took
    peak = cg.read().peak
    assert abs((limit - min(available)) - peak) < 16 * MiB
    # Control: the same run outside the cgroup writes the machine's memory.
    outside = tmp_path / "outside.jsonl"
    _metered_growth(str(outside))
    start, samples = _trace(outside)
    assert start["total"] > limit and str(cg.path) not in start["sources"]["available"]
    assert min(s["available"] for s in samples if s.get("available")) > limit


def test_call_reports_an_error_inside_with_its_traceback(cgroup) -> None:
    with pytest.raises(ChildProcessError, match="ZeroDivisionError"):
        cgroup(64 * MiB).call(divmod, 1, 0, timeout=60)


# -- the guard ---------------------------------------------------------------------------


def guard(*args: str) -> list[str]:
    return [PY, "-m", "stageload", "guard", *args]


def test_guard_waits_for_room_under_a_real_limit(cgroup) -> None:
    """In a 256 MiB cgroup where a holder takes 160 MiB, a guard asking --wait-free 128M
    waits, and starts the command once the holder is gone."""
    cg = cgroup(256 * MiB)
    holder = cg.popen([PY, "-S", "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      text=True)  # fmt: skip
    args = guard("--wait-free", "128M", "--poll", "0.1s", "--start-timeout", "60s", "--",
                 PY, "-S", "-c", "print('ran')")  # fmt: skip
    try:
        hold(holder, 160)
        # Control: outside the cgroup the same guard finds the machine's room at once.
        free = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=60)
        assert free.returncode == 0 and free.stdout == "ran\n" and "waiting" not in free.stderr
        waiting = cg.popen(args, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)  # fmt: skip
        try:
            assert waiting.stderr is not None
            line = waiting.stderr.readline()
            assert "waiting: available" in line and "< 128" in line, line
            assert waiting.poll() is None
            stop(holder)
            out, err = waiting.communicate(timeout=60)
        finally:
            stop(waiting)
    finally:
        stop(holder)
    assert waiting.returncode == 0 and out == "ran\n", err
    assert "Traceback" not in err


def test_guard_kill_free_stops_a_growing_command_before_the_oom_killer(cgroup) -> None:
    """--kill-free 40% relative to a 384 MiB cgroup: the guard stops the group (exit 3)
    and the kernel kills nothing. Control: without the floor the OOM killer does it."""
    limit = 384 * MiB
    flags = ("--wait-free", "0", "--poll", "0.05s", "--grace", "2s")
    cg = cgroup(limit)
    stopped = cg.run(guard(*flags, "--kill-free", "40%", "--", PY, "-S", "-c", GROWER),
                     env=env(), timeout=120)  # fmt: skip
    assert stopped.returncode == 3, stopped.stderr
    assert "stopped by the guard" in stopped.stderr and "< 40%" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert stopped.usage.oom_kills == 0 and stopped.usage.peak < limit
    assert not cg.pids()
    cg = cgroup(limit)
    killed = cg.run(guard(*flags, "--kill-free", "0", "--", PY, "-S", "-c", GROWER),
                    env=env(), timeout=120)  # fmt: skip
    assert killed.returncode == 128 + 9, killed.stderr  # the command died of SIGKILL
    assert killed.usage.oom_kills == 1 and "died from SIGKILL" in killed.stderr


def test_read_usage_leaves_missing_counters_none(tmp_path: Path) -> None:
    """A kernel without memory.peak (v2 before 5.19) or oom_kill (v1 before 4.13)."""
    (tmp_path / "memory.current").write_text("4096\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\n")
    usage = read_usage(tmp_path, "cgroup2", 8192)
    assert (usage.usage, usage.peak, usage.failcnt, usage.oom_kills) == (4096, None, 3, None)
    assert usage.sources == {"usage": "memory.current", "failcnt": "memory.events:max"}
