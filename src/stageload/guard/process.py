"""Process-group control for the guard: start a command in its own group, signal only that group.

Pid reuse: the group id is the leader's pid, and the kernel does not hand out a pid while a
process, zombie included, still carries it as a pid or group id. So the leader is never reaped
until the guard has finished signalling: its exit is detected with ``waitid(WNOWAIT)`` (or by
its zombie state where ``waitid`` is missing), which leaves the zombie in place and the group id
ours. The leader's create time is checked as well before each signal, as a second line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

import psutil

from ..errors import StageloadError
from ..units import format_duration

#: The command could not be started (not found, not executable), as a shell exits.
EXIT_CANNOT_START = 127

# Sampling while the group winds down after SIGTERM.
_STOP_POLL = 0.05
# How long to wait for the group to vanish after SIGKILL before giving up on it.
_KILL_WAIT = 5.0


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
        self.create_time: float | None
        try:
            self.create_time = psutil.Process(self.pid).create_time()
        except psutil.Error:  # already a zombie that psutil cannot read; still unreaped
            self.create_time = None
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):  # Linux >= 5.3: readable when the leader exits
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self.pid)

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
        enough, else the SIGKILL's reason) and how many processes the SIGKILL met."""
        self.terminate()
        deadline = clock() + grace
        killed = ""
        while self.members():
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
        count = len(self.members())
        self.kill()
        end = clock() + _KILL_WAIT
        while self.members() and clock() < end:
            time.sleep(_STOP_POLL)
        return killed, count

    def reap(self, timeout: float | None = None) -> int:
        """Wait for the leader, release its pid, and return its exit status as Popen gives it.

        Negative values mean the leader died from that signal.
        """
        code = self.popen.wait(timeout)
        self._reaped = True
        self.close()
        return code

    def close(self) -> None:
        """Close the exit descriptor."""
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
