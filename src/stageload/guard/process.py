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

import psutil

from ..errors import StageloadError
from ..units import format_duration

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
_WATCHDOG = "trap '' INT HUP TERM QUIT; read _ || kill -9 -\"$1\""

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

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        if not argv:
            raise ValueError("empty command: give the command after '--', e.g. -- python run.py")
        self.guard_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        env = dict(os.environ if env is None else env)
        env[GUARD_ID_ENV] = self.guard_id
        try:
            # start_new_session: setsid() in the child, so pgid == sid == pid, the group gets
            # no terminal signals (the guard relays them), and the group id cannot be joined
            # from outside this session.
            self.popen = subprocess.Popen(list(argv), start_new_session=True, env=env)
        except OSError as exc:
            raise CannotStartError(argv, exc) from exc
        self.argv = list(argv)
        self.pid = self.popen.pid
        self.pgid = self.pid
        self._reaped = False
        #: Pids of the processes seen outside the group with our guard id (``escaped()``).
        self.escapers: set[int] = set()
        self._reaped_escapers: set[int] = set()
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

    def _start_watchdog(self) -> None:
        read_fd, write_fd = os.pipe()  # not inheritable: the command never holds the end
        try:
            self._watchdog = subprocess.Popen(
                ["/bin/sh", "-c", _WATCHDOG, "stageload-guard-watchdog", str(self.pgid)],
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
        """Live processes that left the command's group but carry its guard id: reparented
        to this (subreaper) process, and their descendants. Reaps those that ended."""
        self._reap_escapers()
        found: dict[int, psutil.Process] = {}
        skip = {self.pid, self.watchdog_pid}
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return []
        for child in children:
            if child.pid in skip or child.pid in found:
                continue
            try:
                if child.environ().get(GUARD_ID_ENV) != self.guard_id:
                    continue
                tree = [child, *child.children(recursive=True)]
            except psutil.Error:
                continue  # a zombie (reaped next time if it is ours) or gone
            for proc in tree:
                try:
                    if os.getpgid(proc.pid) == self.pgid:
                        continue  # still in the group: the group's stop reaches it
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        continue
                    self.escapers.add(proc.pid)
                except (OSError, psutil.Error):
                    continue
                found[proc.pid] = proc
        return list(found.values())

    def _reap_escapers(self) -> None:
        """Release the pids of processes of the command reparented to us (a subreaper) that
        ended: escapers we saw, and members of the group (those are ours by their group id,
        while the leader is unreaped). Only ours: another child of this process may have a
        parent that wants its status."""
        zombies = set(self.escapers - self._reaped_escapers)
        if not self._reaped:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process().children():
                    with contextlib.suppress(OSError, psutil.Error):
                        if (
                            child.pid != self.pid
                            and child.status() == psutil.STATUS_ZOMBIE
                            and os.getpgid(child.pid) == self.pgid
                        ):
                            zombies.add(child.pid)
        for pid in zombies:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # not our child (its own parent reaps it) or already reaped
            if done:
                self._reaped_escapers.add(pid)

    def _signal_escaped(self, sig: int) -> int:
        """Send ``sig`` to each escaped process; how many it reached."""
        count = 0
        for proc in self.escaped():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)  # psutil checks the create time: no reused pid
                count += 1
        return count

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
            escaped = self.escaped()
            for proc in escaped:
                if proc.pid not in termed:
                    termed.add(proc.pid)
                    with contextlib.suppress(psutil.Error):
                        proc.send_signal(signal.SIGTERM)
            return bool(members or escaped)

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
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def exit_reason(returncode: int) -> str:
    """How a command ended, in words, from its return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"command died from {name}"
    return f"command exited with code {returncode}"
