"""``run_queued``: wait for a turn in a lane of the machine-wide queue, then run the command
under the guard, metered, and append the run to the lane's history.

The queue's state and rules are in ``queue``, the history in ``history``; the guarded run is
``Guard`` itself, with the trace under the state directory.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from typing import TextIO

from ..units import format_duration, format_size, parse_size
from . import EXIT_NO_ROOM, Guard, open_trace
from .config import GuardConfig, GuardResult, GuardSetupError
from .history import append_record, learned_need, read_history
from .process import CommandGroup
from .queue import (
    BUSY_FILE,
    BUSY_LANE,
    DEFAULT_LANE,
    HeldTicket,
    Lane,
    NeedSource,
    QueueSetupError,
    busy_patterns,
    poll_interval,
    resolve_owner,
)
from .rules import Decision, decide, fair_order, finite, running_view
from .watch import _SignalCatcher, _Status


class QueueError(GuardSetupError):
    """``stageload run`` could not queue (state directory unusable); nothing ran."""


def resolve_need(
    memory: int | str | None, lane: Lane, command: list[str]
) -> tuple[int | None, NeedSource]:
    """The need in bytes (None: unknown) and where it comes from: ``memory`` as a size
    (declared), or with ``"auto"``/None the peak learned from the lane's history."""
    if memory is None or (isinstance(memory, str) and memory.strip().lower() == "auto"):
        history = read_history(lane.history_path)
        lane.skipped["history"] = history.skipped
        need = learned_need(history.records, command)
        return need, "unknown" if need is None else "learned"
    return parse_size(memory), "declared"


class QueuedRun:
    """One client of a lane; see ``run_queued``."""

    def __init__(
        self,
        config: GuardConfig,
        lane: Lane,
        owner: str,
        memory: int | str | None,
        poll: float,
        stderr: TextIO | None,
        who: str | None = None,
        keep_trace: bool = True,
    ) -> None:
        self.config, self.lane, self.owner, self.poll = config, lane, owner, poll
        self.who = owner if who is None else who
        self.keep_trace = keep_trace
        self.stderr = stderr
        self.status = _Status(stderr)
        self.need, self.need_source = resolve_need(memory, lane, list(config.command))
        self.held: HeldTicket | None = None
        self._told: dict[str, int] = {}

    def _say(self, text: str) -> None:
        self.status.line(f"stageload run: {text}")

    def _tell_skipped(self) -> None:
        """One line each time what the lane's reads skipped as damaged changes."""
        found = {k: n for k, n in self.lane.skipped.items() if n}
        if found and found != self._told:
            what = ", ".join(f"{n} {_SKIPPED[k][n != 1]}" for k, n in sorted(found.items()))
            self._say(
                f"warning: lane {self.lane.name!r} holds damaged state, skipped: {what} "
                f"(under {str(self.lane.dir)!r})"
            )
        self._told = found

    def _look(self) -> Decision | None:
        """Under the lane lock: admit this ticket if it may start (None), else say why."""
        held = self.held
        assert held is not None
        with self.lane.locked():
            tickets = self.lane.tickets()
            waiting = [t for t in tickets if t.state == "waiting"]
            order = fair_order(waiting, self.lane.owner_starts())
            self._tell_skipped()
            mine = [i for i, t in enumerate(order) if t.seq == held.ticket.seq]
            if not mine:  # only a hand can remove a live ticket
                raise QueueSetupError(f"ticket {str(held.path)!r} was removed while waiting")
            position = mine[0]
            if position > 0:
                ahead = order[position - 1]
                return Decision(
                    False, "turn", f"position {position + 1} of {len(order)}, after {ahead.owner}"
                )
            from ..memory import read_system

            decision = decide(self.need, running_view(tickets), read_system().available)
            if not decision.ok:
                return decision
            now = time.time()
            held.ticket.state, held.ticket.admitted = "admitted", now
            held.save()
            self.lane.record_start(self.owner, now)
            return None

    def _wait_turn(self, signals: _SignalCatcher, t0: float) -> GuardResult | None:
        timeout = self.config.start_timeout
        while True:
            decision = self._look()
            if decision is None:
                self.status.end()
                return None
            text = (
                f"stageload run: waiting in lane {self.lane.name!r} ({decision.why}): "
                f"{decision.detail}"
            )
            # One line per change of reason (on a terminal, updated in place); the memory
            # numbers change at every look and are not a change of reason.
            self.status.show((decision.why, decision.why == "turn" and decision.detail), text)
            waited = time.monotonic() - t0
            if timeout is not None and waited >= timeout:
                reason = f"no turn after {format_duration(waited)}: {decision.detail}"
                return GuardResult(EXIT_NO_ROOM, "no_room", reason, waited)
            pause = self.poll if timeout is None else min(self.poll, timeout - waited)
            if signals.fd is not None:
                import select

                select.select([signals.fd], [], [], max(pause, 0))
                signals.drain()
            else:
                time.sleep(max(pause, 0))
            if signals.received:
                sig = signals.received[0]
                why = f"got {signal.Signals(sig).name} while waiting in the queue; not started"
                return GuardResult(128 + sig, "signalled", why, time.monotonic() - t0)

    def _on_start(self, group: CommandGroup) -> None:
        held = self.held
        assert held is not None
        with self.lane.locked():
            held.ticket.state, held.ticket.pid = "running", group.pid
            held.ticket.pid_created = group.create_time
            held.ticket.started = time.time()
            held.save()

    def run(self) -> GuardResult:
        cfg = self.config
        if cfg.trace is not None:
            # The guard opens it once the turn comes; an unusable path (or one another run
            # writes) is refused now, with the guard's message, not after the wait.
            open_trace(cfg.trace).discard()
        with self.lane.locked():
            self.held = self.lane.enqueue(self.owner, cfg.command, self.need, self.need_source)
        held = self.held
        try:
            t0 = time.monotonic()
            if self.need is None:
                need = "need unknown (never run in this lane), so it runs alone"
            else:
                need = f"need {format_size(self.need)} ({self.need_source})"
            with _SignalCatcher() as signals:
                result = self._wait_turn(signals, t0)
            if result is not None:
                self._say(result.reason + f" (exit {result.exit_code})")
                return result
            queued = time.monotonic() - t0
            self._say(
                f"lane {self.lane.name!r}, {self.owner}: start after "
                f"{format_duration(queued)} in the queue; {need}"
            )
            trace = cfg.trace
            if trace is None and self.keep_trace:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                trace = self.lane.traces_dir / f"{stamp}-{held.ticket.seq}.jsonl"
            left = None
            if cfg.start_timeout is not None:
                left = max(0.0, cfg.start_timeout - queued)  # one timeout for both waits
            run_cfg = dataclasses.replace(cfg, trace=trace, start_timeout=left)
            result = Guard(run_cfg, stderr=self.stderr, on_start=self._on_start).run()
            if result.ran is not None:
                self._record(result, None if trace is None else str(trace))
            return result
        finally:
            with self.lane.locked():
                held.remove()

    def _record(self, result: GuardResult, trace: str | None) -> None:
        t = self.held.ticket if self.held else None
        assert t is not None
        start = t.started if t.started is not None else time.time()
        record = {
            "command": list(self.config.command),
            "owner": self.owner,
            "who": self.who,
            "lane": self.lane.name,
            "start": finite(start),
            "wait": finite(start - t.enqueued),
            "duration": finite(result.ran),
            "peak_footprint": result.peak_footprint,
            "swap_growth": result.swap_growth,
            "exit_code": result.exit_code,
            "outcome": result.outcome,
            "need": self.need,
            "need_source": self.need_source,
            "trace": None if trace is None else os.path.abspath(trace),
        }
        try:
            append_record(self.lane.history_path, record)
        except OSError as exc:  # the run happened; a full disk must not change its exit code
            self._say(f"warning: history not written ({exc.strerror or exc})")


def _trace_flag(trace: object) -> bool:
    """``run_queued``'s ``trace``, a bool: a path there (``trace='/tmp'``) was taken as
    True, its trace written under the lane instead of where it was meant to go."""
    if isinstance(trace, bool):
        return trace
    raise ValueError(
        f"run_queued(trace=...) is True or False (whether to write a trace), got {trace!r}; "
        "give a trace file in the config instead, e.g. GuardConfig([...], trace='run.jsonl')"
    )


#: ``Lane.skipped``'s kinds, as a warning names one of them and several.
_SKIPPED = {
    "tickets": ("ticket file", "ticket files"),
    "owners": ("owners.json entry", "owners.json entries"),
    "seq": ("seq file", "seq files"),
    "history": ("history line", "history lines"),
}


def run_queued(
    config: GuardConfig,
    *,
    lane: str = DEFAULT_LANE,
    owner: str | None = None,
    who: str | None = None,
    memory: int | str | None = "auto",
    home: str | os.PathLike[str] | None = None,
    poll: float | None = None,
    trace: bool = True,
    stderr: TextIO | None = sys.stderr,
) -> GuardResult:
    """Wait for a turn in ``lane``, then run ``config.command`` under the guard, metered.

    ``who`` defaults to ``$STAGELOAD_WHO``, else the user name; ``owner`` (who fairness
    counts) to ``$STAGELOAD_OWNER``, else the part of ``who`` before its first dash, else
    the user name (``resolve_owner``). In lane ``ram``, the patterns of the state
    directory's ``busy.txt`` join ``config.busy``. ``trace=False`` writes no trace (the
    history line's ``trace`` is null). ``memory`` is the command's need (a size), or
    ``"auto"`` to take the peak footprint learned from the lane's history (a command never
    seen runs alone). Fairness and the memory rule are in ``docs/queue.md``. The trace goes
    to ``config.trace`` or under the lane's ``traces/``; a run that started appends one
    line to the lane's history. ``home`` overrides the state directory, ``poll`` the seconds
    between looks while waiting (default ``$STAGELOAD_QUEUE_POLL`` or 0.5).

    Raises ``ValueError`` for a bad lane, owner or size, or a ``trace`` that is not a bool,
    and ``QueueError`` when the state directory cannot be used. Exit codes are the guard's
    (``GuardResult.exit_code``); a ``start_timeout`` covers the wait in the queue and the
    guard's admission together.

    Example::

        result = run_queued(GuardConfig(["python", "gen.py"]), memory="6G", owner="alice")
        sys.exit(result.exit_code)
    """
    trace = _trace_flag(trace)
    owner, who = resolve_owner(owner, who)
    seconds = poll_interval() if poll is None else float(poll)
    if seconds <= 0:
        raise ValueError(f"poll must be above 0 seconds, got {poll!r}")
    if not trace and config.trace is not None:
        raise ValueError(
            f"trace=False and a trace file ({str(config.trace)!r}) together: give one "
            "(--no-trace or --trace FILE)"
        )
    try:
        the_lane = Lane(home, lane).create()
        if the_lane.name == BUSY_LANE:
            extra = [p for p in busy_patterns(home) if p not in config.busy]
            if extra:
                config = dataclasses.replace(config, busy=(*config.busy, *extra))
                if stderr is not None:
                    print(
                        f"stageload run: also waiting for {BUSY_FILE} patterns "
                        f"{', '.join(map(repr, extra))} (lane {BUSY_LANE!r})",
                        file=stderr,
                    )
        run = QueuedRun(config, the_lane, owner, memory, seconds, stderr, who, trace)
        return run.run()
    except QueueSetupError as exc:
        raise QueueError(str(exc)) from None
