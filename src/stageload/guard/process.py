"""Process-group control for the guard: start a command in its own group, signal only that group.

Pid reuse: the group id is the leader's pid, and the kernel does not hand out a pid while a
process, zombie included, still carries it as a pid or group id. So the leader is never reaped
until the guard has finished signalling: its exit is detected with ``waitid(WNOWAIT)`` (or by
its zombie state where ``waitid`` is missing), which leaves the zombie in place and the group id
ours. The leader's create time is checked as well before each signal, as a second line.

A guard that dies (SIGKILL, OOM killer) must not leave its command running unwatched: each
group has a watchdog, a ``sh`` in its own session reading a pipe only the guard can write.
The guard writes ``done`` once it has reaped the command; if the guard dies first, the
pipe reaches end of file and the watchdog SIGKILLs the group (at once: with the guard gone
nobody holds the leader's zombie, so a grace period would let the group id be reused).

Descendants that leave the group (``setsid``, ``setpgid``): on Linux the guard is a child
subreaper while a command runs (``PR_SET_CHILD_SUBREAPER``), so they are reparented to it
when their parent exits rather than to init. They carry ``STAGELOAD_GUARD_ID`` in their
environment, which tells them from other children of the guard's process; ``escaped()``
lists them and ``wind_down`` stops them with the group.

However they fork: where the guard may make a cgroup v2 (``contain``), the command starts
inside one of its own, and everything it ever forks stays there; the stop ends with
``cgroup.kill``, which leaves no window for a fork. Elsewhere the subreaper sweep is
repeated until a round finds nothing alive and nothing that died since the round before
(a death is the only way an orphan appears, so a listing that raced a fork shows up as one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import psutil

from ..errors import StageloadError
from ..units import format_duration
from .contain import CommandCgroup

#: The command could not be started (not found, not executable), as a shell exits.
EXIT_CANNOT_START = 127

# Sampling while the group winds down after SIGTERM.
_STOP_POLL = 0.05
# How long to wait for the group to vanish after SIGKILL before giving up on it.
_KILL_WAIT = 5.0

#: Set in the command's environment to a value unique to the run; descendants inherit it.
GUARD_ID_ENV = "STAGELOAD_GUARD_ID"

# The watchdog: "done" on its stdin lets it go; end of file (the guard died) SIGKILLs the
# group $1. It ignores the signals a terminal or a "kill" sends, so only the guard's end
# (or SIGKILL) ends it. $0 names it in ps.
# With a cgroup ($2) the watchdog empties it too, forks in flight included.
_WATCHDOG = (
    "trap '' INT HUP TERM QUIT; read _ || "
    '{ kill -9 -"$1"; [ -z "$2" ] || echo 1 > "$2/cgroup.kill"; }'
)
# How long the subreaper sweep may take to settle before it says it could not.
_SWEEP_SETTLE = 2.0

_PR_SET_CHILD_SUBREAPER = 36
_subreaper_lock = threading.Lock()
_subreaper_users = 0


def _prctl_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (Linux >= 3.4), or stop being one; success."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def subreaper() -> Iterator[bool]:
    """This process is a child subreaper inside the block (Linux; False elsewhere).

    Counted, so that guards running in several threads of one process keep it on until the
    last one ends. Orphans of other process trees of this process are reparented to it too
    while it is on; the guard reaps only its own (``GUARD_ID_ENV``).
    """
    global _subreaper_users
    with _subreaper_lock:
        on = _subreaper_users > 0 or _prctl_subreaper(True)
        if on:
            _subreaper_users += 1
    try:
        yield on
    finally:
        if on:
            with _subreaper_lock:
                _subreaper_users -= 1
                if _subreaper_users == 0:
                    _prctl_subreaper(False)


class CannotStartError(StageloadError):
    """The command could not be started (not found, not executable, ...); ``cause`` says why."""

    def __init__(self, argv: Sequence[str], cause: OSError) -> None:
        self.argv = list(argv)
        self.cause = cause
        reason = cause.strerror or str(cause)
        super().__init__(f"cannot start {self.argv[0]!r}: {reason}")


class CommandGroup:
    """A command started in a new session, so that it leads its own process group.

    ``signal()`` goes to that group and nowhere else; ``members()`` lists the live processes
    in it; ``leader_exited()`` tells whether the command has ended, without reaping it.
    """

    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, *, contain: bool = True
    ) -> None:
        if not argv:
            raise ValueError("empty command: give the command after '--', e.g. -- python run.py")
        self.guard_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        env = dict(os.environ if env is None else env)
        env[GUARD_ID_ENV] = self.guard_id
        #: The cgroup v2 the command runs in (``contain``), or None: the subreaper sweep.
        self.cgroup = CommandCgroup.create() if contain else None
        try:
            self.popen = self._start(list(argv), env)
        except OSError as exc:
            self._drop_cgroup()
            raise CannotStartError(argv, exc) from exc
        self.argv = list(argv)
        self.pid = self.popen.pid
        self.pgid = self.pid
        self._reaped = False
        #: Pids of the processes seen outside the group with our guard id (``escaped()``).
        self.escapers: set[int] = set()
        self._reaped_escapers: set[int] = set()
        # Sessions and groups of escapers seen alive (not the guard's own).
        self._escaper_sids: set[int] = set()
        self._escaper_groups: set[int] = set()
        #: The last sweep could not settle (see ``escaped_settled``).
        self.unsettled = False
        # The last listing met a child of ours it could not read (exiting): look again.
        self._unsure = False
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._watchdog_fd: int | None = None
        self._start_watchdog()
        self.create_time: float | None
        try:
            self.create_time = psutil.Process(self.pid).create_time()
        except psutil.Error:  # already a zombie that psutil cannot read; still unreaped
            self.create_time = None
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):  # Linux >= 5.3: readable when the leader exits
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self.pid)

    def _start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        # start_new_session: setsid() in the child, so pgid == sid == pid, the group gets
        # no terminal signals (the guard relays them), and the group id cannot be joined
        # from outside this session.
        if self.cgroup is not None:
            fd = self.cgroup.procs_fd()
            try:
                # In the child before exec: "0" moves the writer, so the command is in the
                # cgroup before its first instruction, and so is all it forks.
                return subprocess.Popen(
                    argv, start_new_session=True, env=env, preexec_fn=lambda: os.write(fd, b"0")
                )
            except subprocess.SubprocessError:  # the move was refused: sweep instead
                self._drop_cgroup()
            finally:
                os.close(fd)
        return subprocess.Popen(argv, start_new_session=True, env=env)

    def _drop_cgroup(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None

    def _start_watchdog(self) -> None:
        read_fd, write_fd = os.pipe()  # not inheritable: the command never holds the end
        cgroup = "" if self.cgroup is None else str(self.cgroup.path)
        try:
            self._watchdog = subprocess.Popen(
                ["/bin/sh", "-c", _WATCHDOG, "stageload-guard-watchdog", str(self.pgid), cgroup],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # no terminal signals, out of the guard's group
            )
        except OSError:  # no /bin/sh: the guard still works, without the protection
            os.close(write_fd)
        else:
            self._watchdog_fd = write_fd
        finally:
            os.close(read_fd)

    def _release_watchdog(self, done: bool) -> None:
        """Tell the watchdog the guard is done with the group (``done``) or, without it,
        let it SIGKILL the group now; then reap it."""
        if self._watchdog_fd is not None:
            with contextlib.suppress(OSError):
                if done:
                    os.write(self._watchdog_fd, b"done\n")
            os.close(self._watchdog_fd)
            self._watchdog_fd = None
        if self._watchdog is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(_KILL_WAIT)
            self._watchdog = None

    @property
    def watchdog_pid(self) -> int | None:
        """The watchdog's pid while it runs."""
        return None if self._watchdog is None else self._watchdog.pid

    def exit_fd(self) -> int | None:
        """A file descriptor that becomes readable when the leader exits, if the OS has one."""
        return self._pidfd

    def leader_exited(self) -> bool:
        """Whether the command (the group leader) has ended, leaving it unreaped."""
        if self._reaped:
            return True
        if hasattr(os, "waitid") and hasattr(os, "WNOWAIT"):
            try:
                info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return True
            return info is not None and info.si_pid == self.pid
        try:
            return psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def _still_ours(self) -> bool:
        """The group id still names our group: leader unreaped, and the same process."""
        if self._reaped:
            return False
        if self.create_time is None:
            return True
        try:
            return psutil.Process(self.pid).create_time() == self.create_time
        except psutil.ZombieProcess:
            return True  # our unreaped leader
        except psutil.NoSuchProcess:
            return False

    def members(self) -> list[int]:
        """Pids of live (non-zombie) processes in the command's group."""
        if not self._still_ours():
            return []
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) != self.pgid:
                    continue
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
            except (OSError, psutil.Error):
                continue  # gone while we looked
        return found

    def escaped(self) -> list[psutil.Process]:
        """Live processes that left the command's group: in its cgroup, or (without one)
        carrying its guard id, reparented to this (subreaper) process, and their
        descendants. Reaps those that ended. One listing: ``escaped_settled`` for the
        answer to "is anything left"."""
        self._reap_escapers()
        self._unsure = False
        if self.cgroup is not None:
            return self._escaped_in_cgroup()
        found: dict[int, psutil.Process] = {}
        skip = {self.pid, self.watchdog_pid}
        for pid in child_pids(os.getpid()):
            if pid in skip or pid in found:
                continue
            try:
                child = psutil.Process(pid)
                environ = child.environ()
            except psutil.ZombieProcess:
                continue  # dead: reaped next time if it is ours, and a death to the sweep
            except psutil.Error:
                # Gone, or exiting and unreadable: its children may not be ours yet.
                self._unsure = self._unsure or _state(pid) not in ("", "Z")
                continue
            if environ.get(GUARD_ID_ENV) != self.guard_id and not self._known_session(pid):
                # A process inside exit() has no memory left, so its environment reads
                # empty, and its children are reparented to us only once it is a zombie:
                # an escapee that forks and exits, caught in between, is unsure, not gone.
                if not environ and _state(pid) not in ("", "Z"):
                    self._unsure = True
                continue
            for tree_pid in [pid, *_descendants(pid)]:
                try:
                    proc = child if tree_pid == pid else psutil.Process(tree_pid)
                    if os.getpgid(tree_pid) == self.pgid:
                        continue  # still in the group: the group's stop reaches it
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        continue
                    self._note_escaper(tree_pid)
                except (OSError, psutil.Error):
                    continue
                found[tree_pid] = proc
        return list(found.values())

    def _known_session(self, pid: int) -> bool:
        """Whether ``pid`` is in the session of an escaper seen before."""
        try:
            return os.getsid(pid) in self._escaper_sids
        except OSError:
            return False

    def _note_escaper(self, pid: int) -> None:
        self.escapers.add(pid)
        with contextlib.suppress(OSError):
            if (sid := os.getsid(pid)) != os.getsid(0):
                self._escaper_sids.add(sid)
            if (group := os.getpgid(pid)) != os.getpgrp():
                self._escaper_groups.add(group)

    def _escaped_in_cgroup(self) -> list[psutil.Process]:
        assert self.cgroup is not None
        found = []
        for pid in self.cgroup.pids():
            if pid == self.pid:
                continue
            try:
                if os.getpgid(pid) == self.pgid:
                    continue  # still in the group: the group's stop reaches it
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except (OSError, psutil.Error):
                continue  # gone while we looked
            self._note_escaper(pid)
            found.append(proc)
        return found

    def _deaths(self) -> tuple[frozenset[int], int]:
        """What shows that a process of ours died: the zombie children of this process,
        and how many escapers were reaped. Unchanged between two looks: nobody died."""
        zombies = {pid for pid in child_pids(os.getpid()) if _state(pid) == "Z"}
        return frozenset(zombies), len(self._reaped_escapers)

    def escaped_settled(self) -> list[psutil.Process]:
        """``escaped()``, listed again until it finds some, or until a round finds none and
        nothing of ours died since the round before.

        One listing of /proc is not atomic: an escapee that forks and exits while the
        listing runs (one that forks itself anew every 20 ms) can be missed, its child
        not yet listed and itself already a zombie. But an orphan only appears when a
        process dies, and ours die as zombies of this (subreaper) process or reaped by
        ``escaped()``: so a round with nothing alive and no new death means nothing is left,
        unless it met a child it could not read: one inside exit(), whose children are
        reparented to us only when it is a zombie (an empty environment; this missed one
        generation in 1 of 3 CLI runs under load). In a cgroup one listing is the answer
        (nothing leaves it)."""
        self.unsettled = False
        if self.cgroup is not None:
            return self.escaped()
        before = self._deaths()
        end = time.monotonic() + _SWEEP_SETTLE
        while time.monotonic() < end:
            found = self.escaped()
            if found:
                return found
            after = self._deaths()
            if after == before and not self._unsure:
                return []
            if self._unsure:
                time.sleep(0.001)  # a process inside exit(): give it the moment it needs
            before = after
        self.unsettled = True  # deaths all along and nothing caught alive: not "none left"
        return []

    def anything_left(self) -> bool:
        """Whether any process of the command still runs (the leader aside): in its
        cgroup, or found by the group listing and the settled sweep."""
        if self.cgroup is not None:
            return self.cgroup.populated()
        return bool(self.members() or self.escaped_settled() or self.unsettled)

    def _reap_escapers(self) -> None:
        """Release the pids of processes of the command reparented to us (a subreaper) that
        ended: escapers we saw, and members of the group (those are ours by their group id,
        while the leader is unreaped). Only ours: another child of this process may have a
        parent that wants its status."""
        zombies = set(self.escapers - self._reaped_escapers)
        for pid in child_pids(os.getpid()):
            if pid in (self.pid, self.watchdog_pid) or _state(pid) != "Z":
                continue
            # Ours by their group (while the leader is unreaped), by the session of an
            # escaper seen alive (an escapee that forks itself anew leaves one zombie per
            # generation, most never seen alive), or by the cgroup they died in.
            try:
                group = os.getpgid(pid)
                ours = (
                    (not self._reaped and group == self.pgid)
                    or group in self._escaper_groups
                    or os.getsid(pid) in self._escaper_sids
                )
            except OSError:
                continue
            if ours or (self.cgroup is not None and self.cgroup.holds(pid)):
                zombies.add(pid)
        for pid in zombies:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # not our child (its own parent reaps it) or already reaped
            if done:
                self._reaped_escapers.add(pid)

    def _signal_escaped(self, sig: int) -> int:
        """Send ``sig`` to each escaped process (``escaped_settled``); how many it reached."""
        count = 0
        for proc in self.escaped_settled():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)  # psutil checks the create time: no reused pid
                count += 1
        return count or int(self.unsettled)  # unsettled: maybe some left, look again

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the command's process group; False when there is nothing to signal."""
        if not self._still_ours():
            return False
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        return True

    def terminate(self) -> bool:
        """SIGTERM to the group."""
        return self.signal(signal.SIGTERM)

    def kill(self) -> bool:
        """SIGKILL to the group."""
        return self.signal(signal.SIGKILL)

    def wind_down(
        self,
        grace: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], None] = time.sleep,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> tuple[str, int]:
        """SIGTERM the group, then SIGKILL what is left after ``grace`` seconds (at once
        when ``interrupted()`` turns true). Returns how it ended (``""`` when SIGTERM was
        enough, else the SIGKILL's reason) and how many processes the SIGKILL met.

        Escaped processes (``escaped()``) are stopped alike, each with its own signal; one
        that shows up during the wait (reparented when its parent in the group died) gets
        its SIGTERM then."""
        self.terminate()
        termed: set[int] = set()

        def remaining() -> bool:
            members = self.members()
            escaped = self.escaped_settled()
            for proc in escaped:
                if proc.pid not in termed:
                    termed.add(proc.pid)
                    with contextlib.suppress(psutil.Error):
                        proc.send_signal(signal.SIGTERM)
            if self.cgroup is not None:  # the cgroup is the answer, not a listing
                return self.cgroup.populated()
            return bool(members or escaped or self.unsettled)

        deadline = clock() + grace
        killed = ""
        while remaining():
            if interrupted():
                killed = "SIGKILL at once on a second signal"
                break
            left = deadline - clock()
            if left <= 0:
                killed = f"SIGKILL after {format_duration(grace)} grace"
                break
            wait(min(_STOP_POLL, left))
        if not killed:
            return "", 0
        count = len(self.members()) + len(self.escaped())
        self.kill()
        if self.cgroup is not None:  # the kernel kills all of it, forks in flight too
            self.cgroup.kill(_KILL_WAIT)
        self._signal_escaped(signal.SIGKILL)
        end = clock() + _KILL_WAIT
        while (self.members() or self._signal_escaped(signal.SIGKILL)) and clock() < end:
            time.sleep(_STOP_POLL)
        return killed, count

    def reap(self, timeout: float | None = None) -> int:
        """Wait for the leader, release its pid, and return its exit status as Popen gives it.

        Negative values mean the leader died from that signal.
        """
        self._reap_escapers()  # before the leader: its group id tells the members
        code = self.popen.wait(timeout)
        self._reaped = True
        self._reap_escapers()
        self.close()
        return code

    def close(self) -> None:
        """Close the exit descriptor and let the watchdog go: quietly once the command was
        reaped, else with a SIGKILL to the group (the guard is giving up on it)."""
        self._release_watchdog(done=self._reaped)
        if self.cgroup is not None and not self.cgroup.populated():
            self._drop_cgroup()  # one left populated (--leave-group) goes with a later sweep
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None


def child_pids(pid: int) -> list[int]:
    """The children of ``pid`` (zombies included), from /proc/PID/task/*/children on Linux:
    a read of a few bytes per thread, where psutil reads the stat file of every process on
    the machine. A descendant that forks itself anew every 20 ms lives shorter than that
    scan on a busy machine, and would be a zombie by the time it was looked at."""
    tasks = f"/proc/{pid}/task"
    try:
        found: list[int] = []
        for tid in os.listdir(tasks):
            # FileNotFoundError: a thread ended meanwhile
            with (
                contextlib.suppress(FileNotFoundError),
                open(f"{tasks}/{tid}/children", encoding="ascii") as f,
            ):
                found.extend(int(p) for p in f.read().split())
        return found
    except OSError:  # not Linux, or no CONFIG_PROC_CHILDREN
        try:
            return [c.pid for c in psutil.Process(pid).children()]
        except psutil.Error:
            return []


def _descendants(pid: int) -> list[int]:
    out, todo = [], child_pids(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(child_pids(child))
    return out


def _state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc/PID/stat ("Z": a zombie), "" if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        try:
            return "Z" if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE else "R"
        except psutil.Error:
            return ""


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def end_fields(returncode: int) -> dict[str, Any]:
    """The keys of a trace's ``end`` record for a command that ended with ``returncode``
    (a Popen return code): ``exit_code`` as ``exit_status`` has it, and ``signal``
    (``"SIGKILL"``; ``"SIG34"`` for a signal with no name) when it died from one."""
    fields: dict[str, Any] = {"exit_code": exit_status(returncode)}
    if returncode < 0:
        try:
            fields["signal"] = signal.Signals(-returncode).name
        except ValueError:  # a real-time signal has no name
            fields["signal"] = f"SIG{-returncode}"
    return fields


def exit_reason(returncode: int) -> str:
    """How a command ended, in words, from its return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"command died from {name}"
    return f"command exited with code {returncode}"
