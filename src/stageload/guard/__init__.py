"""The guard: start a heavy command only when there is room, and stop it before it swaps the
machine down.

``run_guard(GuardConfig([...]))`` waits for admission (free memory, swap headroom, no busy
processes), starts the command in its own process group, samples memory while it runs, and
stops the group (SIGTERM, then SIGKILL after a grace period) when swap grows past its budget
or available memory stays under the floor. It touches nothing outside the group it started.
Process-group control lives in ``guard_proc``.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal, TextIO

from ..events import Event
from ..memory import ProcessMemory, SystemMemory, sample_errors, sample_sources, to_sample
from ..units import format_duration, format_size, parse_percent_or_size, parse_size
from .process import CannotStartError, CommandGroup, exit_status

#: The guard stopped the command (swap budget or memory floor).
EXIT_STOPPED = 3
#: The guard never found room to start the command before ``--start-timeout``.
EXIT_NO_ROOM = 4
#: The command could not be started (not found, not executable).
EXIT_CANNOT_START = 127

#: Event kind of the guard's decisions in a trace.
GUARD = "guard"

# Adaptive polling, after earlyoom: sleep for the time memory would take to fill the
# remaining margin at a fast but plausible rate, clamped. earlyoom assumes 6000 MiB/s for RAM
# and 800 MiB/s for swap (earlyoom main.c, sleep_time_ms); we keep those rates and clamp
# to [0.1 s, 0.5 s], so a crossing is seen within one poll and an idle watch costs little.
POLL_MIN = 0.1
POLL_MAX = 0.5
RAM_FILL_RATE = 6000 * 2**20
SWAP_FILL_RATE = 800 * 2**20
# Sampling while the group winds down after SIGTERM.
_STOP_POLL = 0.05
# How long to wait for the group to vanish after SIGKILL before giving up on it.
_KILL_WAIT = 5.0
# How many consecutive samples under --kill-free stop the command.
KILL_SAMPLES = 2

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# -- thresholds ------------------------------------------------------------------------


@dataclass(frozen=True)
class Amount:
    """A memory floor: a percentage of total memory or an absolute number of bytes."""

    kind: Literal["percent", "bytes"]
    value: float

    @classmethod
    def parse(cls, text: str | Amount) -> Amount:
        """``"40%"``/``"40"`` -> percent, ``"12G"`` -> bytes (``units.parse_percent_or_size``)."""
        if isinstance(text, Amount):
            return text
        kind, value = parse_percent_or_size(text)
        return cls("percent" if kind == "percent" else "bytes", value)

    def floor(self, total: int | None) -> int | None:
        """The floor in bytes for a machine with ``total`` bytes (None if total is unknown)."""
        if self.kind == "bytes":
            return int(self.value)
        return None if total is None else int(total * self.value / 100)

    def shortfall(self, reading: SystemMemory) -> str | None:
        """``"available 31% < 40%"`` when the reading is under this floor, else None.

        None also when available memory could not be read; callers report that separately.
        """
        if self.kind == "percent":
            pct = reading.available_percent
            if pct is None or pct >= self.value:
                return None
            return f"available {pct:.0f}% < {self}"
        if reading.available is None or reading.available >= self.value:
            return None
        return f"available {format_size(reading.available, precision=2)} < {self}"

    def __str__(self) -> str:
        if self.kind == "percent":
            return f"{self.value:g}%"
        return format_size(self.value, precision=2)


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


# -- configuration and result ----------------------------------------------------------


@dataclass
class GuardConfig:
    """What to run and the rules to admit, watch and stop it. Defaults match the CLI.

    Sizes accept ``units`` strings (``"8G"``), floors a percentage or a size, durations
    seconds or ``units`` strings (``"1m"``). ``poll=None`` polls adaptively.
    """

    command: Sequence[str]
    wait_free: Amount | str = "40%"
    swap_limit: int | str | None = None
    swap_budget: int | str = "8G"
    busy: Sequence[str | re.Pattern[str]] = ()
    quiet_for: float | str = 60.0
    start_timeout: float | str | None = None
    kill_free: Amount | str = "10%"
    poll: float | str | None = None
    grace: float | str = 5.0
    trace: str | os.PathLike[str] | None = None
    busy_patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from ..units import parse_duration

        self.command = list(self.command)
        if not self.command:
            raise ValueError("no command given: put it after '--', e.g. -- python run.py")
        self.wait_free = Amount.parse(self.wait_free)
        self.kill_free = Amount.parse(self.kill_free)
        self.swap_limit = None if self.swap_limit is None else parse_size(self.swap_limit)
        self.swap_budget = parse_size(self.swap_budget)
        if self.swap_limit is not None and self.swap_limit <= self.swap_budget:
            # Admission needs swap used + budget < limit, and swap used is never below 0.
            raise ValueError(
                f"--swap-limit {format_size(self.swap_limit)} is not above --swap-budget "
                f"{format_size(self.swap_budget)}, so the command could never start; raise "
                "--swap-limit or lower --swap-budget (e.g. --swap-limit 16G --swap-budget 4G)"
            )
        self.quiet_for = parse_duration(self.quiet_for)
        self.grace = parse_duration(self.grace)
        if self.start_timeout is not None:
            self.start_timeout = parse_duration(self.start_timeout)
        if self.poll is not None:
            self.poll = parse_duration(self.poll)
            if self.poll <= 0:
                raise ValueError(f"poll interval must be above 0, got {self.poll!r}: e.g. '0.5s'")
        self.busy_patterns = tuple(compile_busy(p) for p in self.busy)


def compile_busy(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    """Compile a --busy pattern, with a message that names it when it is not a regex."""
    if isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(
            f"invalid --busy pattern {pattern!r}: {exc}; it is a Python regular expression "
            r"searched in full command lines, e.g. 'ffmpeg' or 'python .*train\.py'"
        ) from None


class GuardSetupError(Exception):
    """The guard could not set up (e.g. the trace file cannot be written); nothing ran."""


Outcome = Literal["exited", "stopped", "signalled", "no_room", "cannot_start"]


@dataclass
class GuardResult:
    """How a guarded run ended. ``exit_code`` is what ``stageload guard`` exits with."""

    exit_code: int
    outcome: Outcome
    reason: str
    waited: float
    ran: float | None = None
    peak_footprint: int | None = None
    swap_growth: int | None = None
    pid: int | None = None

    def summary(self) -> str:
        """The final stderr line: waited, ran, peak footprint, swap growth, why it ended."""
        ran = "did not run" if self.ran is None else f"ran {format_duration(self.ran)}"
        growth = "-" if self.swap_growth is None else _signed_size(self.swap_growth)
        return (
            f"stageload guard: waited {format_duration(self.waited)}, {ran}, "
            f"peak footprint {format_size(self.peak_footprint)}, swap {growth}; "
            f"{self.reason} (exit {self.exit_code})"
        )


def _signed_size(n: int) -> str:
    return ("+" if n >= 0 else "") + format_size(n)


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

    def show(self, key: object, text: str) -> None:
        if self.stream is None:
            return
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}")
            self._open = True
        elif key != self._key:
            self.stream.write(text + "\n")
        self._key = key
        self.stream.flush()

    def line(self, text: str) -> None:
        """A line of its own, after ending any in-place line."""
        if self.stream is None:
            return
        self.end()
        self.stream.write(text + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self._open and self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
        self._open = False


# -- the guard -------------------------------------------------------------------------


class Guard:
    """One guarded run; see ``run_guard``."""

    def __init__(
        self,
        config: GuardConfig,
        *,
        probes: Probes | None = None,
        stderr: TextIO | None = None,
        on_start: Callable[[CommandGroup], None] | None = None,
    ) -> None:
        self.config = config
        self.probes = probes if probes is not None else Probes.real()
        self.status = _Status(stderr)
        self.on_start = on_start
        self._signals = _SignalCatcher()
        self._trace: Any = None  # a TraceWriter while the command runs with --trace
        self._t0 = 0.0

    # waiting -------------------------------------------------------------------------

    def _sleep(self, seconds: float, group: CommandGroup | None = None) -> None:
        """Sleep up to ``seconds``; wake early on a signal or when the command exits."""
        fds = [fd for fd in (self._signals.fd, group and group.exit_fd()) if fd is not None]
        if seconds <= 0:
            return
        if fds:
            select.select(fds, [], [], seconds)
            self._signals.drain()
        else:
            time.sleep(seconds)

    # admission -------------------------------------------------------------------------

    def _admit(self) -> SystemMemory | GuardResult:
        """Wait until the command may start; the reading that admitted it, or a result."""
        cfg = self.config
        clock = self.probes.clock
        exclude = guard_and_ancestors() if cfg.busy_patterns else frozenset()
        # The guard cannot see what ran before it started, so a quiet period counts from its
        # start: a gap between two jobs of another chain is not mistaken for quiet.
        last_seen = {p.pattern: self._t0 for p in cfg.busy_patterns}
        warned: set[str] = set()
        while True:
            now = clock()
            reading = self.probes.system()
            if "floors" not in warned:
                warned.add("floors")
                self._check_floors(reading)
            blockers: list[tuple[object, str]] = []
            short = cfg.wait_free.shortfall(reading)
            if short:
                blockers.append(("free", short))
            elif reading.available is None and "available" not in warned:
                warned.add("available")
                self.status.line(
                    "stageload guard: warning: available memory unreadable "
                    f"({reading.errors.get('available', 'no reason given')}); "
                    "not waiting for --wait-free"
                )
            if cfg.swap_limit is not None:
                if reading.swap_used is None:
                    if "swap" not in warned:
                        warned.add("swap")
                        self.status.line(
                            "stageload guard: warning: swap use unreadable "
                            f"({reading.errors.get('swap_used', 'no reason given')}); "
                            "not checking --swap-limit"
                        )
                elif reading.swap_used + cfg.swap_budget >= cfg.swap_limit:
                    text = (
                        f"swap {format_size(reading.swap_used)} + budget "
                        f"{format_size(cfg.swap_budget)} >= limit {format_size(cfg.swap_limit)}"
                    )
                    blockers.append(("swap", text))
            if cfg.busy_patterns:
                blockers.extend(self._busy(now, last_seen, exclude))
            if not blockers:
                return reading
            text = "; ".join(text for _, text in blockers)
            self.status.show(tuple(key for key, _ in blockers), f"stageload guard: waiting: {text}")
            waited = now - self._t0
            if cfg.start_timeout is not None and waited >= cfg.start_timeout:
                return GuardResult(
                    EXIT_NO_ROOM,
                    "no_room",
                    f"no room after {format_duration(waited)}: {text}",
                    waited,
                )
            pause = cfg.poll if cfg.poll is not None else POLL_MAX
            if cfg.start_timeout is not None:
                pause = min(pause, cfg.start_timeout - waited)
            self._sleep(pause)
            if self._signals.received:
                sig = self._signals.received[0]
                return GuardResult(
                    128 + sig,
                    "signalled",
                    f"guard got {signal.Signals(sig).name} while waiting; command not started",
                    clock() - self._t0,
                )

    def _check_floors(self, reading: SystemMemory) -> None:
        """Warn when the stop floor is not under the start floor: the command would be
        stopped as soon as it starts, unless memory frees up after admission."""
        wait = self.config.wait_free.floor(reading.total)  # type: ignore[union-attr]
        kill = self.config.kill_free.floor(reading.total)  # type: ignore[union-attr]
        if wait and kill is not None and kill >= wait:
            self.status.line(
                f"stageload guard: warning: --kill-free {self.config.kill_free} is not under "
                f"--wait-free {self.config.wait_free}; the command may be stopped as soon as "
                "it starts"
            )

    def _busy(
        self, now: float, last_seen: dict[str, float], exclude: frozenset[int]
    ) -> list[tuple[object, str]]:
        running: dict[str, int] = {}
        for pid, cmdline in self.probes.processes():
            if pid in exclude:
                continue
            for pattern in self.config.busy_patterns:
                if pattern.pattern not in running and pattern.search(cmdline):
                    running[pattern.pattern] = pid
                    last_seen[pattern.pattern] = now
        quiet_for = float(self.config.quiet_for)  # type: ignore[arg-type]
        blockers: list[tuple[object, str]] = []
        for pattern in self.config.busy_patterns:
            name = pattern.pattern
            ago = now - last_seen[name]
            if name in running:
                blockers.append(
                    (("busy", name, "running"), f"busy {name!r} running (pid {running[name]})")
                )
            elif ago < quiet_for:
                seen_ever = last_seen[name] > self._t0
                if seen_ever:
                    text = f"busy {name!r} seen {format_duration(ago)} ago"
                else:
                    text = f"busy {name!r} quiet for {format_duration(ago)}"
                text += f" (need {format_duration(quiet_for)})"
                blockers.append((("busy", name, "seen" if seen_ever else "quiet"), text))
        return blockers

    # watching --------------------------------------------------------------------------

    def _emit(self, note: str) -> None:
        if self._trace is not None:
            self._trace.event(Event(GUARD, note=note))

    def _start_trace(self, group: CommandGroup, system: SystemMemory) -> None:
        process = self.probes.process(group.pid)
        self._trace.start(
            pid=group.pid,
            interval=self.config.poll if self.config.poll is not None else POLL_MAX,
            sampler="process",  # the guard samples from outside the command's tree
            total=system.total,
            sources=sample_sources(system, process),
            meta={"label": "guard"},
            command=list(self.config.command),
            sampler_pid=os.getpid(),
        )

    def _sample(self, pid: int) -> tuple[SystemMemory, int | None]:
        system = self.probes.system()
        process = self.probes.process(pid)
        if self._trace is not None:
            values = to_sample(system, process)
            self._trace.sample(values)
            self._trace.track_errors(values, sample_errors(system, process))
        return system, process.footprint

    def _watch(self, admitted: SystemMemory, waited: float) -> GuardResult:
        cfg = self.config
        clock = self.probes.clock
        try:
            group = CommandGroup(cfg.command)
        except CannotStartError as exc:
            return GuardResult(EXIT_CANNOT_START, "cannot_start", str(exc), waited)
        started = clock()
        rule = StopRule(cfg.kill_free, int(cfg.swap_budget), admitted.swap_used)  # type: ignore[arg-type]
        peak: int | None = None
        reading = admitted
        try:
            if self._trace is not None:
                self._start_trace(group, admitted)
            self._emit(
                f"start: pid {group.pid} after waiting {format_duration(waited)}; "
                + _room_note(admitted)
            )
            if self.on_start is not None:
                self.on_start(group)
            code: int
            outcome: Outcome
            while True:
                reading, footprint = self._sample(group.pid)
                if footprint is not None and (peak is None or footprint > peak):
                    peak = footprint
                if group.leader_exited():
                    returncode = group.reap()
                    code, outcome = exit_status(returncode), "exited"
                    reason = _exit_reason(returncode)
                    self._emit(f"exit: {reason}")
                    break
                stop_reason = rule.observe(reading)
                if stop_reason is not None:
                    code, outcome = EXIT_STOPPED, "stopped"
                    reason = "stopped by the guard: " + self._stop(group, stop_reason)
                    break
                if self._signals.received:
                    sig = self._signals.received[0]
                    code, outcome = 128 + sig, "signalled"
                    why = f"guard got {signal.Signals(sig).name}"
                    reason = self._stop(group, why) + "; command stopped"
                    break
                self._sleep(rule.next_poll(reading, cfg.poll), group)  # type: ignore[arg-type]
            ran = clock() - started
            result = GuardResult(
                code,
                outcome,
                reason,
                waited,
                ran,
                peak,
                rule.swap_growth(reading),
                group.pid,
            )
            if self._trace is not None:
                self._trace.end(exit_code=code)
            return result
        except BaseException:
            # A guard that fails must not leave a heavy command running unwatched.
            if not group.leader_exited() or group.members():
                self._stop(group, "the guard failed")
            raise
        finally:
            group.close()

    def _stop(self, group: CommandGroup, why: str) -> str:
        """SIGTERM the group, SIGKILL what is left after the grace period (or at once on a
        further signal to the guard); return the reason text for the result."""
        clock = self.probes.clock
        signals_before = len(self._signals.received)
        self._emit(f"stop: {why}; SIGTERM to process group {group.pgid}")
        group.terminate()
        deadline = clock() + float(self.config.grace)  # type: ignore[arg-type]
        killed = ""
        while group.members():
            if len(self._signals.received) > signals_before:
                killed = "SIGKILL at once on a second signal"
                break
            left = deadline - clock()
            if left <= 0:
                killed = f"SIGKILL after {format_duration(float(self.config.grace))} grace"  # type: ignore[arg-type]
                break
            # No exit fd here: once the leader is gone it stays readable, and the wait is for
            # the rest of the group.
            self._sleep(min(_STOP_POLL, left))
        if killed:
            self._emit(f"kill: {killed}; {len(group.members())} processes left in the group")
            group.kill()
            end = clock() + _KILL_WAIT
            while group.members() and clock() < end:
                time.sleep(_STOP_POLL)
        with contextlib.suppress(Exception):
            returncode = group.reap(timeout=_KILL_WAIT)
            self._emit(f"exit: {_exit_reason(returncode)}")
        return why + (f" ({killed})" if killed else "")

    # entry point -----------------------------------------------------------------------

    def run(self) -> GuardResult:
        """Admit, run, watch and stop; returns how it ended. Status lines go to ``stderr``."""
        if self.config.trace is not None:
            from ..meter.tracefile import TraceWriter

            # Opened before waiting: an unwritable path fails now, not after the command
            # started.
            try:
                self._trace = TraceWriter(self.config.trace)
            except OSError as exc:
                raise GuardSetupError(exc.strerror or str(exc)) from exc
        started = False
        try:
            with self._signals:
                self._t0 = self.probes.clock()
                admitted = self._admit()
                if isinstance(admitted, GuardResult):
                    result = admitted
                else:
                    waited = self.probes.clock() - self._t0
                    self.status.end()
                    result = self._watch(admitted, waited)
                    started = result.outcome != "cannot_start"
        finally:
            if self._trace is not None:
                self._trace.close()
                if not started:  # nothing ran: no trace, rather than an empty file
                    with contextlib.suppress(OSError):
                        self._trace.path.unlink()
        self.status.line(result.summary())
        return result


def _room_note(reading: SystemMemory) -> str:
    parts = []
    if reading.available_percent is not None:
        parts.append(f"available {reading.available_percent:.0f}%")
    if reading.available is not None:
        parts.append(f"{format_size(reading.available)}")
    if reading.swap_used is not None:
        parts.append(f"swap used {format_size(reading.swap_used)}")
    return ", ".join(parts) or "memory unreadable"


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"command died from {name}"
    return f"command exited with code {returncode}"


def run_guard(
    config: GuardConfig,
    *,
    probes: Probes | None = None,
    stderr: TextIO | None = sys.stderr,
) -> GuardResult:
    """Run ``config.command`` under the guard and return how it ended.

    Waits until available memory is at least ``wait_free``, swap used plus ``swap_budget``
    stays under ``swap_limit`` (if set) and no ``busy`` pattern matched a command line for
    ``quiet_for``; gives up with ``EXIT_NO_ROOM`` after ``start_timeout``. Then starts the
    command in a new process group and stops that group (``EXIT_STOPPED``) when swap grows
    more than ``swap_budget`` or available memory stays under ``kill_free`` for two samples.
    SIGINT/SIGTERM/SIGHUP to the guard stop the command too (exit 128+signal). Waiting
    messages and the final summary go to ``stderr`` (None for silence).

    Example::

        result = run_guard(GuardConfig(["python", "generate.py"], wait_free="40%"))
        sys.exit(result.exit_code)
    """
    return Guard(config, probes=probes, stderr=stderr).run()


# Public names for ``stageload.__init__``-style imports and the CLI.
__all__ = [
    "EXIT_CANNOT_START",
    "EXIT_NO_ROOM",
    "EXIT_STOPPED",
    "Amount",
    "Guard",
    "GuardConfig",
    "GuardResult",
    "GuardSetupError",
    "Probes",
    "StopRule",
    "run_guard",
]
