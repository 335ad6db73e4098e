"""The outer trace: where every StagedModels of a metered command sends its events.

``stageload meter``, ``stageload guard --trace`` (and whatever runs a command and writes a
trace for it) export the trace's path in ``STAGELOAD_TRACE``. A ``StagedModels`` built
anywhere in that command's process tree finds the variable and appends its events to the
trace, alongside its own sink if it has one, so the per-stage report needs no code
changes. ``STAGELOAD_EVENTS=0`` opts out. The contract is in ``docs/trace-format.md``
("Events from the command's processes"); this module is its one definition.

How a record gets there: one ``os.write`` of one whole line on a file opened with
``O_APPEND`` and without ``O_CREAT`` (no trace is ever created here), so the outer tool's
writer, its sampler and any number of these processes never interleave within a line.
``t`` is measured against the ``monotonic`` of the trace's own ``start`` record, read from
its first line: ``time.monotonic()`` is system-wide (Linux ``CLOCK_MONOTONIC``, macOS
``mach_absolute_time``), so a child's ``t`` compares with the outer tool's. Each record
carries the writing process's ``pid``.

Only the standard library is imported: ``stageload.staged`` imports this module.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import stat
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

from ..traceformat import EVENT, START, T_KEY, TYPE_KEY
from .events import Event

#: Path of the trace that an outer tool writes; set by that tool for its command.
TRACE_ENV = "STAGELOAD_TRACE"
#: ``0`` (or ``false``, ``no``, ``off``) keeps events out of the outer trace.
EVENTS_ENV = "STAGELOAD_EVENTS"
#: Values of ``STAGELOAD_EVENTS`` that turn the outer trace off.
OFF_VALUES = frozenset({"0", "false", "no", "off"})
#: Event kind that brackets a process's events: ``note`` is ``start`` (its first
#: StagedModels was built) or ``exit`` (the interpreter exited normally). The report
#: bounds that process's view by them.
PROCESS = "process"
#: The key of an event record that names the process that emitted it (every writer sets
#: it; traces written before it existed lack it).
PID_KEY = "pid"

# Events held while the trace has no start record yet (its tool starts the command a few
# milliseconds before it writes the record); more than this in that time is not a pipeline.
_PENDING_MAX = 1000
#: How long a process exiting waits for its outer trace's start record (seconds), at most,
#: holding events for it: the guard writes it just after the command starts.
EXIT_WAIT = 5.0
# The start record is one line; the command's argv in it could be long, not this long.
_START_MAX = 1 << 20


def events_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``STAGELOAD_EVENTS`` says ``0``/``false``/``no``/``off``."""
    env = os.environ if environ is None else environ
    return env.get(EVENTS_ENV, "").strip().lower() not in OFF_VALUES


def command_env(
    trace: str | os.PathLike[str] | None,
    *,
    events: bool = True,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment for a command that a tool runs while writing ``trace``.

    A copy of ``environ`` (default: this process's) with ``STAGELOAD_TRACE`` set to the
    trace's absolute path, so the command's StagedModels append their events to it
    (``trace=None``: left as inherited); with ``events=False``, ``STAGELOAD_EVENTS=0``
    instead, so they write to no outer trace at all.
    The tool must create the trace file before it starts the command (processes append to
    it, never create it) and write the ``start`` record soon after; events that come
    before the start record wait for it.
    """
    env = dict(os.environ if environ is None else environ)
    if not events:
        env[EVENTS_ENV] = "0"
    elif trace is not None:
        env[TRACE_ENV] = os.path.abspath(os.fspath(trace))
    return env


def event_record(
    event: Event | Mapping[str, Any], monotonic0: float, *, pid: int | None = None
) -> dict[str, Any]:
    """The trace's ``event`` record: ``t`` is the event's ``time`` less ``monotonic0``, and
    ``pid`` the process that emitted it (default: this one). Every writer uses this."""
    data = event.to_dict() if isinstance(event, Event) else dict(event)
    when = data.pop("time", None)
    t = None if when is None else round(when - monotonic0, 6)
    record = {TYPE_KEY: EVENT, T_KEY: t, **data}
    record.setdefault(PID_KEY, os.getpid() if pid is None else pid)
    return record


def encode(record: Mapping[str, Any]) -> bytes:
    """One record as one JSON line; a float that is not finite becomes ``null``."""
    clean = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    line = json.dumps(clean, separators=(",", ":"), allow_nan=False, default=str)
    return (line + "\n").encode()


def read_start(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The trace's ``start`` record, or None while its first line is not complete yet.

    Raises ``ValueError`` when the first line is there and is not a start record with a
    ``monotonic`` time, and ``OSError`` when the file cannot be read.
    """
    with open(path, "rb") as f:
        first = f.readline(_START_MAX)
    if not first.endswith(b"\n"):
        if len(first) >= _START_MAX:
            raise ValueError("its first line is longer than any 'start' record")
        return None  # empty, or the start record is still being written
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get(TYPE_KEY) != START:
        raise ValueError("its first line is not a stageload 'start' record")
    monotonic = record.get("monotonic")
    if isinstance(monotonic, bool) or not isinstance(monotonic, (int, float)):
        raise ValueError(f"its start record has no monotonic time (got {monotonic!r})")
    return record


class OuterTrace:
    """An event sink that appends to the trace at ``path``; one per trace per process.

    Thread-safe. Until the trace's start record is there, events wait in memory (written
    with the next event, or at exit); when the file is missing or is not a trace, a
    warning says so once and nothing is written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.monotonic0: float | None = None
        self.written = 0
        self._fd: int | None = None
        self._dead = False
        self._pending: list[Event] = []
        self._lock = threading.Lock()
        self._atexit = False
        self._pid = os.getpid()

    @property
    def active(self) -> bool:
        """False once the trace turned out missing or not a trace (nothing more is written)."""
        return not self._dead

    def emit(self, event: Event) -> None:
        with self._lock:
            if self._dead:
                return
            if self.monotonic0 is None and not self._open():
                if not self._dead and len(self._pending) < _PENDING_MAX:
                    self._pending.append(event)
                    if not self._atexit:
                        self._atexit = True
                        atexit.register(self.flush)
                return
            pending, self._pending = self._pending, []
            for held in [*pending, event]:
                self._write(held)

    def announce(self) -> None:
        """Write a ``process`` ``start`` event now and an ``exit`` event at normal exit."""
        self.emit(Event(PROCESS, note="start"))
        atexit.register(self._exit)

    def _exit(self) -> None:
        pid = os.getpid()
        if pid == self._pid:  # a forked child that exits normally is not this process
            self.emit(Event(PROCESS, note="exit"))
        self.flush()
        # The guard writes the start record right after it starts the command, so a
        # command that ends at once can end before it: wait for that record (bounded),
        # rather than lose the events held for it. A loaded machine showed the race
        # (tests/guard/test_queue.py's trace test, under .ci/run's load check).
        deadline = time.monotonic() + EXIT_WAIT
        while self._pending and not self._dead and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a file another process writes: no event to wait on
            self.flush()
        with self._lock:
            if self._pending and not self._dead:
                n = len(self._pending)
                self._give_up(
                    f"its start record did not come within {EXIT_WAIT:g} s of the exit, so "
                    f"{n} event{'s' * (n != 1)} held for it {'were' if n != 1 else 'was'} lost "
                    "(a trace is a file stageload meter, guard or run started)"
                )

    def flush(self) -> None:
        """Write events held for a start record that has arrived since; at exit too."""
        with self._lock:
            if self._pending and not self._dead and (self.monotonic0 is not None or self._open()):
                pending, self._pending = self._pending, []
                for held in pending:
                    self._write(held)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._dead = True

    def __repr__(self) -> str:
        state = "off" if self._dead else f"{self.written} events"
        return f"OuterTrace({self.path!r}, {state})"

    def _give_up(self, why: str) -> None:
        self._dead = True
        self._pending.clear()
        warnings.warn(
            f"{TRACE_ENV}={self.path!r}: {why}; this process's stageload events are not "
            f"written there (unset {TRACE_ENV}, or set {EVENTS_ENV}=0, to silence this)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _open(self) -> bool:
        """Open the file and read the start record; False while it is not there yet."""
        if self._fd is None:
            try:
                # Before the open: a named pipe's open waits for a reader, for ever.
                regular = stat.S_ISREG(os.stat(self.path).st_mode)
                # No O_CREAT: a trace that is not there is not written, never made.
                self._fd = None if not regular else os.open(self.path, os.O_WRONLY | os.O_APPEND)
            except OSError as exc:
                self._give_up(f"cannot open it for appending ({exc.strerror})")
                return False
            if self._fd is None:
                # /dev/full reads as zeros for ever: the start record would never come.
                self._give_up("it is not a regular file (a device or a pipe)")
                return False
        try:
            start = read_start(self.path)
        except (OSError, ValueError) as exc:
            self._give_up(str(getattr(exc, "strerror", None) or exc))
            return False
        if start is None:
            return False
        self.monotonic0 = float(start["monotonic"])
        return True

    def _write(self, event: Event) -> None:
        assert self._fd is not None and self.monotonic0 is not None
        data = encode(event_record(event, self.monotonic0))
        try:
            # One write: with O_APPEND the kernel puts the whole line at the end, under the
            # inode lock, so lines of concurrent writers never mix.
            os.write(self._fd, data)
        except OSError as exc:
            # A full disk or a removed mount must not stop the pipeline it observes.
            self._give_up(f"writing failed ({exc.strerror})")
            return
        self.written += 1


_traces: dict[str, OuterTrace] = {}
_traces_lock = threading.Lock()


def outer_trace(environ: Mapping[str, str] | None = None) -> OuterTrace | None:
    """The outer trace this process should send events to, or None.

    None when ``STAGELOAD_TRACE`` is unset or empty, or ``STAGELOAD_EVENTS`` is ``0``.
    One ``OuterTrace`` per path per process, shared by every StagedModels in it.
    """
    env = os.environ if environ is None else environ
    path = env.get(TRACE_ENV, "")
    if not path or not events_enabled(env):
        return None
    path = os.path.abspath(path)
    with _traces_lock:
        trace = _traces.get(path)
        if trace is None:
            trace = _traces[path] = OuterTrace(path)
            trace.announce()
        return trace


def emit_outer(event: Event) -> None:
    """Send an event that no StagedModels emits (an adapter's note, an eager run's stage)
    to the outer trace, if this process has one; a StagedModels sends its own."""
    trace = outer_trace()
    if trace is not None:
        trace.emit(event)


def _after_fork_in_child() -> None:
    # A fork may happen while another thread holds a lock; the child has only this thread.
    global _traces_lock
    _traces_lock = threading.Lock()
    for trace in _traces.values():
        trace._lock = threading.Lock()
        trace._pending = []  # the parent still holds them and writes them itself


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
