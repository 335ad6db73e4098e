"""What the guard watches and how it decides: the probes it reads, the stop rule, signals.

``Probes`` is the seam to the machine (memory counters, the process list, the clock);
``StopRule`` decides from one sample at a time whether the running command must stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

from ..memory import ProcessMemory, SystemMemory
from ..units import format_size
from .config import Amount

# Adaptive polling, after earlyoom: sleep for the time memory would take to fill the
# remaining margin at a fast but plausible rate, clamped. earlyoom assumes 6000 MiB/s for RAM
# and 800 MiB/s for swap (earlyoom main.c, sleep_time_ms); we keep those rates and clamp
# to [0.1 s, 0.5 s], so a crossing is seen within one poll and an idle watch costs little.
POLL_MIN = 0.1
POLL_MAX = 0.5
RAM_FILL_RATE = 6000 * 2**20
SWAP_FILL_RATE = 800 * 2**20
# How many consecutive samples under --kill-free stop the command.
KILL_SAMPLES = 2

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# -- the seam: what the guard reads from the machine ----------------------------------


@dataclass(frozen=True)
class Probes:
    """The uncontrollable inputs of the guard: memory counters, the process list, the clock.

    Everything else (the command, its group, signals, the trace file) is real. Tests swap a
    probe to replay recorded counters, e.g. swap growth on a machine without swap.
    """

    system: Callable[[], SystemMemory]  # memory of the machine (or cgroup)
    process: Callable[[int], ProcessMemory]  # footprint of a pid's process tree
    processes: Callable[[], Iterable[tuple[int, str]]]  # (pid, full command line)
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def real(cls) -> Probes:
        """The machine's own counters, through the ``stageload.memory`` readers."""
        from ..memory import read_system

        return cls(system=read_system, process=TreeFootprint(), processes=list_processes)


class TreeFootprint:
    """Footprint of a process tree, listing the tree at most every ``relist`` seconds.

    ``read_process(pid, tree=True)`` lists descendants with psutil, which reads every
    process's stat file: about 4 ms per call with 90 processes on this machine, 1% of a core
    at two samples a second, and more on a busy machine. The guard samples often, so it
    keeps the list of pids and reads only their own footprints (0.1 ms each) between
    relistings; a child started since the last listing counts from the next one. A pid that
    vanished triggers a relisting at once.
    """

    def __init__(self, relist: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.relist = relist
        self.clock = clock
        self._root: int | None = None
        self._pids: list[int] = []
        self._listed_at = float("-inf")

    def _list(self, pid: int) -> None:
        import psutil

        try:
            children = [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            children = []
        self._root, self._pids, self._listed_at = pid, [pid, *children], self.clock()

    def __call__(self, pid: int) -> ProcessMemory:
        from ..memory import read_process

        if pid != self._root or self.clock() - self._listed_at >= self.relist:
            self._list(pid)
        readings = [read_process(p) for p in self._pids]
        if any(r.footprint is None for r in readings[1:]):
            self._list(pid)  # a child exited (or its pid was reused): list the tree again
            readings = [read_process(p) for p in self._pids]
        root = readings[0]
        sources = {k: f"{v} summed over the process tree" for k, v in root.sources.items()}
        if root.footprint is None:
            return ProcessMemory(None, 0, sources, dict(root.errors))
        found = [r.footprint for r in readings if r.footprint is not None]
        return ProcessMemory(sum(found), len(found), sources, {})


def list_processes() -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process whose command line can be read."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline")
        if cmdline:  # kernel threads and processes we may not read have none
            yield proc.pid, " ".join(cmdline)


def guard_and_ancestors() -> frozenset[int]:
    """This process and its ancestors: a --busy pattern that names them must not match."""
    import psutil

    me = psutil.Process()
    return frozenset([me.pid, *(p.pid for p in me.parents())])


# -- rules -----------------------------------------------------------------------------


class StopRule:
    """Decides, one sample at a time, whether the running command must be stopped.

    Swap growth over the value at start beyond ``swap_budget`` stops at once; available
    memory under ``kill_free`` stops after ``KILL_SAMPLES`` consecutive samples.
    """

    def __init__(self, kill_free: Amount, swap_budget: int, swap_at_start: int | None) -> None:
        self.kill_free = kill_free
        self.swap_budget = swap_budget
        self.swap_at_start = swap_at_start
        self.below = 0  # consecutive samples under the floor

    def swap_growth(self, reading: SystemMemory) -> int | None:
        if reading.swap_used is None or self.swap_at_start is None:
            return None
        return reading.swap_used - self.swap_at_start

    def observe(self, reading: SystemMemory) -> str | None:
        """The reason to stop after this sample, or None to keep running."""
        growth = self.swap_growth(reading)
        if growth is not None and growth > self.swap_budget:
            return (
                f"swap grew {format_size(growth)} since start, "
                f"over the budget of {format_size(self.swap_budget)}"
            )
        short = self.kill_free.shortfall(reading)
        if short is None:
            self.below = 0
            return None
        self.below += 1
        if self.below >= KILL_SAMPLES:
            return f"{short} for {self.below} samples in a row"
        return None

    def next_poll(self, reading: SystemMemory, fixed: float | None) -> float:
        """Seconds to the next sample: ``fixed``, or shorter as the margins shrink."""
        if fixed is not None:
            return fixed
        if self.below:
            return POLL_MIN  # the confirming sample comes at once
        waits = [POLL_MAX]
        floor = self.kill_free.floor(reading.total)
        if reading.available is not None and floor is not None:
            waits.append((reading.available - floor) / RAM_FILL_RATE)
        growth = self.swap_growth(reading)
        if growth is not None:
            waits.append((self.swap_budget - growth) / SWAP_FILL_RATE)
        return min(POLL_MAX, max(POLL_MIN, min(waits)))


# -- signals, waiting, status line -----------------------------------------------------


class _SignalCatcher:
    """Catches SIGINT/SIGTERM/SIGHUP while the guard runs; ignored ones stay ignored.

    Each signal is recorded and wakes the guard's ``select`` through a pipe. Outside the
    main thread Python cannot install handlers, so none are (the caller owns signals then).
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.fd: int | None = None
        self._write_fd: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalCatcher:
        if threading.current_thread() is not threading.main_thread():
            return self
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        for sig in _SIGNALS:
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN:
                continue  # started under nohup (or similar): the user asked to ignore it
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self._write_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                while os.read(self.fd, 512):
                    pass

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        for fd in (self.fd, self._write_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self._write_fd = None


class _Status:
    """The waiting line on stderr: updated in place on a terminal, one line per change else."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._key: object = None
        self._open = False  # a TTY line without its newline yet

    def _put(self, text: str) -> None:
        # A stream nobody reads any more (a closed pipe, a full disk) is given up, never
        # raised from: the guard's messages must not stop the command it guards.
        if self.stream is None:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.stream = None

    def show(self, key: object, text: str) -> None:
        if self.stream is None:
            return
        if self.tty:
            self._put(f"\r\x1b[K{text}")
            self._open = True
        elif key != self._key:
            self._put(text + "\n")
        self._key = key

    def line(self, text: str) -> None:
        """A line of its own, after ending any in-place line."""
        if self.stream is None:
            return
        self.end()
        self._put(text + "\n")

    def end(self) -> None:
        if self._open:
            self._put("\n")
        self._open = False


def room_note(reading: SystemMemory) -> str:
    """The room a reading shows, for the trace's start note."""
    parts = []
    if reading.available_percent is not None:
        parts.append(f"available {reading.available_percent:.0f}%")
    if reading.available is not None:
        parts.append(f"{format_size(reading.available)}")
    if reading.swap_used is not None:
        parts.append(f"swap used {format_size(reading.swap_used)}")
    return ", ".join(parts) or "memory unreadable"
