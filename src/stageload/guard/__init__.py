"""The guard: start a heavy command only when there is room, and stop it before it swaps the
machine down.

``run_guard(GuardConfig([...]))`` waits for admission (free memory, swap headroom, no busy
processes), starts the command in its own process group, samples memory while it runs, and
stops the group (SIGTERM, then SIGKILL after a grace period) when swap grows past its budget
or available memory stays under the floor. It touches nothing the command did not start:
its group, and on Linux the descendants that left the group (``process``).
Thresholds, configuration and result live in ``config``, the probes and the stop rule in
``watch``, process-group control in ``process``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from ..core.events import Event
from ..core.outer import command_env
from ..memory import SystemMemory, sample_errors, sample_sources, to_sample
from ..units import format_duration, format_size
from .config import (
    Amount,
    GuardConfig,
    GuardResult,
    GuardSetupError,
    Outcome,
    compile_busy,
    floors_warning,
)
from .process import (
    EXIT_CANNOT_START,
    CannotStartError,
    CommandGroup,
    end_fields,
    exit_reason,
    exit_status,
    subreaper,
)
from .watch import (
    POLL_MAX,
    Probes,
    StopRule,
    _SignalCatcher,
    _Status,
    guard_and_ancestors,
    room_note,
)

if TYPE_CHECKING:
    from ..meter.tracefile import TraceWriter

#: The guard stopped the command (swap budget or memory floor).
EXIT_STOPPED = 3
#: The guard never found room to start the command before ``--start-timeout``.
EXIT_NO_ROOM = 4

#: Event kind of the guard's decisions in a trace.
GUARD = "guard"

# How long to wait for the leader to be reaped once its group is gone.
_KILL_WAIT = 5.0


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
                if (warning := floors_warning(cfg, reading)) is not None:
                    self.status.line(warning)
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
        quiet_for = self.config.quiet_for
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

    def _trace_failed(self, message: str) -> None:
        self.status.line(f"stageload guard: warning: {message}; still guarding")

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
        # The command's StagedModels append their events to the trace (stageload.outer);
        # the file exists and is empty since run() opened it.
        trace = None if self._trace is None else self._trace.path
        # A subreaper while the command runs (Linux): what leaves its group is reparented
        # here, not to init, and is stopped with it.
        with subreaper():
            try:
                group = CommandGroup(cfg.command, env=command_env(trace, events=cfg.events))
            except CannotStartError as exc:
                return GuardResult(EXIT_CANNOT_START, "cannot_start", str(exc), waited)
            return self._watch_group(group, admitted, waited)

    def _watch_group(
        self, group: CommandGroup, admitted: SystemMemory, waited: float
    ) -> GuardResult:
        cfg = self.config
        clock = self.probes.clock
        started = clock()
        rule = StopRule(cfg.kill_free, cfg.swap_budget, admitted.swap_used)
        peak: int | None = None
        reading = admitted
        try:
            if self._trace is not None:
                self._start_trace(group, admitted)
            self._emit(
                f"start: pid {group.pid} after waiting {format_duration(waited)}; "
                + room_note(admitted)
            )
            if self.on_start is not None:
                self.on_start(group)
            code: int
            outcome: Outcome
            # processes the command left in its group; whether left running; escaped ones
            leftovers = (0, False, 0)
            while True:
                reading, footprint = self._sample(group.pid)
                if footprint is not None and (peak is None or footprint > peak):
                    peak = footprint
                if group.leader_exited():
                    leftovers = self._leftovers(group)
                    returncode = group.reap()
                    code, outcome = exit_status(returncode), "exited"
                    end = end_fields(returncode)  # with the signal it died from, as meter's
                    reason = exit_reason(returncode)
                    self._emit(f"exit: {reason}")
                    break
                stop_reason = rule.observe(reading)
                if stop_reason is not None:
                    code, outcome = EXIT_STOPPED, "stopped"
                    reason = "stopped by the guard: " + self._stop(
                        group, stop_reason, len(self._signals.received)
                    )
                    break
                if self._signals.received:
                    sig = self._signals.received[0]
                    code, outcome = 128 + sig, "signalled"
                    why = f"guard got {signal.Signals(sig).name}"
                    # Only the first signal started this stop; any after it is the second.
                    reason = self._stop(group, why, 1) + "; command stopped"
                    break
                self._sleep(rule.next_poll(reading, cfg.poll), group)
            ran = clock() - started
            growth = rule.swap_growth(reading)
            left, left_running, escaped = leftovers
            result = GuardResult(
                code,
                outcome,
                reason,
                waited,
                ran,
                peak,
                growth,
                group.pid,
                left,
                left_running,
                max(escaped, len(group.escapers)),
            )
            if self._trace is not None:
                self._trace.end(**(end if outcome == "exited" else {"exit_code": code}))
            return result
        except BaseException:
            # A guard that fails must not leave a heavy command running unwatched.
            if not group.leader_exited() or group.members() or group.escaped():
                self._stop(group, "the guard failed", len(self._signals.received))
            raise
        finally:
            group.close()

    def _wind_down(self, group: CommandGroup, signals_before: int) -> str:
        """SIGTERM the group, SIGKILL what is left after the grace period (or at once on a
        further signal to the guard); return the SIGKILL's reason, or ``""``.

        ``signals_before`` is how many signals the guard had taken in when it decided to
        stop: any beyond them is a further one. It is counted by the caller at the decision,
        not here, because a second signal may already be in by now (two back to back)."""
        killed, count = group.wind_down(
            self.config.grace,
            clock=self.probes.clock,
            # No exit fd here: once the leader is gone it stays readable, and the wait is
            # for the rest of the group.
            wait=self._sleep,
            interrupted=lambda: len(self._signals.received) > signals_before,
        )
        if killed:
            self._emit(f"kill: {killed}; {count} processes left in the group")
        return killed

    def _leftovers(self, group: CommandGroup) -> tuple[int, bool, int]:
        """After the command exited by itself: how many processes of its group it left
        running, and how many that left the group; stopped as a supervisor would unless
        ``leave_group``; (in the group, left running, escaped)."""
        count, escaped = len(group.members()), len(group.escaped_settled())
        if not (count or escaped) and group.anything_left():
            escaped = 1  # a listing missed it (it forked meanwhile); the cgroup did not
        if (count or escaped) and not self.config.leave_group:
            self._emit(
                f"stop: the command exited, leaving {count} processes in its group and "
                f"{escaped} that left it running; SIGTERM to process group {group.pgid}"
            )
            self._wind_down(group, len(self._signals.received))
        return count, bool((count or escaped) and self.config.leave_group), escaped

    def _stop(self, group: CommandGroup, why: str, signals_before: int) -> str:
        """Stop the group (``_wind_down``) and reap the command; the reason for the result."""
        self._emit(f"stop: {why}; SIGTERM to process group {group.pgid}")
        # Said before the wait, so whoever watches (a user, a test) knows the stop began
        # and that a signal from now on is the second one.
        self.status.line(
            f"stageload guard: stopping: {why}; SIGTERM to process group {group.pgid}, "
            f"SIGKILL after {format_duration(self.config.grace)} or at once on a "
            "further signal"
        )
        killed = self._wind_down(group, signals_before)
        with contextlib.suppress(Exception):
            returncode = group.reap(timeout=_KILL_WAIT)
            self._emit(f"exit: {exit_reason(returncode)}")
        return why + (f" ({killed})" if killed else "")

    # entry point -----------------------------------------------------------------------

    def run(self) -> GuardResult:
        """Admit, run, watch and stop; returns how it ended. Status lines go to ``stderr``."""
        if self.config.trace is not None:
            # Opened before waiting: an unwritable path fails now, not after the command
            # started. A write that fails later (a full disk) stops the trace, never the guard.
            self._trace = open_trace(self.config.trace, on_fail=self._trace_failed)
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
                if started:
                    self._trace.close()
                else:  # nothing ran: a trace that was there before stays as it was
                    self._trace.discard()
        self.status.line(result.summary())
        return result


def open_trace(
    path: str | os.PathLike[str], on_fail: Callable[[str], None] | None = None
) -> TraceWriter:
    """The ``TraceWriter`` of a ``--trace`` file, holding its lock; ``GuardSetupError``
    saying why when it cannot be written (no folder, not writable, another run's).
    ``stageload run`` opens it and ``discard()`` s it before it queues, for the same
    message at once instead of after its wait."""
    from ..meter.tracefile import TraceWriter

    try:
        return TraceWriter(path, on_fail=on_fail)
    except OSError as exc:
        raise GuardSetupError(exc.strerror or str(exc)) from exc


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
    "compile_busy",
    "run_guard",
]
