"""Read a JSONL memory trace into a ``Trace``: its samples, events and stage marks.

The format is the contract in ``docs/trace-format.md``. Reading is forgiving within a trace
(a half-written last line, a garbled line, a record at an impossible time and a value of the
wrong type are skipped and counted; unknown keys and record types are ignored) and strict
about its first line, so that a file that is not a trace fails with a clear message.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

from ..core.events import Event
from ..errors import StageloadError
from ..memory import DEVICE_KEYS  # sample keys of device memory, report order

#: The longest line read as a record (16 MiB): a start record with a long command is under
#: 1 MiB; a longer "line" is not a trace (``/dev/zero`` has no end of line at all).
MAX_LINE = 16 << 20
#: The largest ``t`` a record may have (about three years, in seconds).
MAX_T = 1e8
#: The largest integer read as a value (2**63): no size or count in a trace comes near it.
MAX_INT = 1 << 63


class TraceError(StageloadError, ValueError):
    """A file could not be read as a trace; the message says which file and why."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True)
class Sample:
    """One ``sample`` record. Values that could not be read are ``None``."""

    t: float
    footprint: int | None = None
    available: int | None = None
    available_pct: float | None = None
    swap_used: int | None = None
    pressure: float | None = None
    device: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TraceEvent(Event):
    """One ``event`` record: an ``Event`` from StagedModels or the guard, at ``t`` seconds.

    Its fields are ``Event``'s (one definition: a field added there is read back here, see
    ``_EVENT_FIELDS``) plus where the trace put it. ``time`` is the event's own
    ``time.monotonic()``: the start record's ``monotonic`` plus ``t``.
    """

    t: float = 0.0
    #: The process that emitted it (traces written before events carried ``pid``: None).
    pid: int | None = None


@dataclass(frozen=True)
class Mark:
    """One ``mark`` record from ``meter.mark(label)``."""

    t: float
    label: str


@dataclass
class Trace:
    """A parsed trace. Samples and events are in time order; records keep file order."""

    path: Path
    start: dict[str, Any]
    samples: list[Sample] = field(default_factory=list)
    events: list[TraceEvent] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    #: Numbers (from 1) of the lines skipped because they are not a JSON object: a
    #: half-written last line of a killed run, a line cut or garbled in the middle.
    bad_lines: list[int] = field(default_factory=list)
    #: Records skipped because their ``t`` is missing, not a number, negative or over
    #: ``MAX_T``.
    bad_times: int = 0
    #: Values dropped, by key, for being of the wrong type or out of range (``null`` is
    #: not counted: it is a value the writer could not read).
    dropped: dict[str, int] = field(default_factory=dict)
    #: The largest ``t`` of any record: where the last window ends.
    last_t: float = 0.0
    #: Where the first window (``setup``) begins: 0, or in a view of one process of
    #: several, when that process began (``report.processes``).
    first_t: float = 0.0
    #: Set on a view that holds the events of one process of several (``report.processes``).
    pid: int | None = None

    @property
    def skipped_lines(self) -> int:
        """How many lines were skipped as not a JSON object."""
        return len(self.bad_lines)

    @property
    def monotonic0(self) -> float:
        """The ``time.monotonic()`` that ``t = 0`` stands for (0 when the start lacks it)."""
        return _number(self.start.get("monotonic")) or 0.0

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.start.get("meta")
        return meta if isinstance(meta, dict) else {}

    @property
    def label(self) -> str:
        """The trace's ``meta.label``, or the file name without its suffix; a view of one
        process's events (``report.processes.by_process``) adds ``[pid N]``."""
        label = self.meta.get("label")
        if not (isinstance(label, str) and label):
            label = self.path.stem
            for suffix in (".jsonl", ".json", ".trace"):
                if self.path.name.endswith(suffix):
                    label = self.path.name[: -len(suffix)]
                    break
        return label if self.pid is None else f"{label} [pid {self.pid}]"

    @property
    def complete(self) -> bool:
        """Whether the trace has its ``end`` record (absent when the run was killed)."""
        return self.end is not None


def _number(value: Any) -> float | None:
    # bool is an int subclass; a true/false where a number belongs is not a reading.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
        return None  # 10**400 bytes is no reading, and would overflow a float
    return value


def _int(value: Any) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# How each type of an ``Event`` field is read back from JSON.
_READERS = {"str": _text, "str | None": _text, "int | None": _int, "float | None": _number}


def _event_fields() -> list[tuple[str, Any]]:
    """(name, reader) for each field of ``Event`` that an event record carries."""
    found = []
    for f in fields(Event):
        if f.name == "time":  # written as ``t``, relative to the start record
            continue
        reader = _READERS.get(str(f.type))
        if reader is None:  # a new Event field of a new type: teach _READERS to read it
            raise TypeError(f"Event.{f.name} has type {f.type!r}, which the trace reader lacks")
        found.append((f.name, reader))
    return found


#: The fields of an event record, from ``Event`` itself, so writer and reader cannot drift.
_EVENT_FIELDS = _event_fields()


def read_trace(path: str | Path) -> Trace:
    """Read the trace at ``path``.

    Skips lines that are not a JSON object (a half-written last line from a killed run, a
    line cut or garbled in the middle), records whose ``t`` is missing or out of range and
    values of the wrong type, counting each in the ``Trace``; ignores unknown keys and
    record types. Raises ``TraceError`` for a missing, empty or unreadable file, or one
    that does not start with a ``start`` record.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            trace = _read(f, path)
    except FileNotFoundError:
        raise TraceError(
            path,
            "no such file; give the path of a trace written by "
            "'stageload meter -o FILE' or MemoryMeter(FILE)",
        ) from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(path, f"cannot be read: {exc.strerror or exc}") from None
    # Samples come from a sampler process and events from the pipeline, so file order can
    # interleave slightly; sort by time (stable, so events at one t keep their order).
    trace.samples.sort(key=lambda s: s.t)
    trace.events.sort(key=lambda e: e.t)
    trace.marks.sort(key=lambda m: m.t)
    return trace


def _lines(f: BinaryIO, path: Path) -> Iterator[tuple[int, bytes | None]]:
    """(number, line) for each line, with ``None`` for a line longer than ``MAX_LINE``
    (the rest of it is read and dropped in bounded pieces, so memory stays bounded)."""
    number = 0
    while line := f.readline(MAX_LINE + 1):
        number += 1
        if len(line) <= MAX_LINE:
            yield number, line
            continue
        if number == 1:  # no record is this long, least of all the start: not a trace
            raise TraceError(
                path,
                f"line 1 is longer than {MAX_LINE >> 20} MiB, so it is not a trace's start "
                "record; is this a stageload trace?",
            )
        while not line.endswith(b"\n") and (line := f.readline(1 << 20)):
            pass
        yield number, None


def _parse(line: bytes) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None when it is not one (cut, garbled, too deep)."""
    try:
        record = json.loads(line)
    # ValueError: not JSON or not UTF-8, or an integer of over 4,300 digits;
    # RecursionError: nested too deep to read.
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _read(f: BinaryIO, path: Path) -> Trace:
    trace: Trace | None = None
    bad: list[int] = []
    for number, line in _lines(f, path):
        if line is not None and not line.strip():
            continue
        record = None if line is None else _parse(line)
        if trace is None:
            trace = Trace(path=path, start=_start(path, number, line, record))
            continue
        if record is None:
            bad.append(number)
            continue
        _add_record(trace, record)
    if trace is None:
        raise TraceError(path, "is empty; the run may not have started its meter yet")
    trace.bad_lines = bad
    return trace


def _start(path: Path, number: int, line: bytes | None, record: Any) -> dict[str, Any]:
    """The start record (the first one), or ``TraceError`` saying why it is not."""
    if record is None and line is not None:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceError(path, "is not a text file, so not a JSONL trace") from None
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            raise TraceError(
                path, f"line {number} is not JSON ({text[:40]!r}); is this a stageload trace?"
            ) from None
        raise TraceError(path, f"line {number} is {text[:40].strip()}, not a JSON object")
    if not isinstance(record, dict) or record.get("type") != "start":
        first = record.get("type") if isinstance(record, dict) else None
        raise TraceError(
            path,
            f"does not begin with a 'start' record (first record type: {first!r:.40}); "
            "traces are written by 'stageload meter', MemoryMeter or 'stageload guard'",
        )
    return record


def _add_record(trace: Trace, record: dict[str, Any]) -> None:
    kind = record.get("type")
    t = _number(record.get("t"))
    if t is None or not 0 <= t <= MAX_T:
        # A record without a usable time cannot be placed: one at t = -100 would stretch
        # setup over minutes of a 3 s run. Only `start` may lack one.
        trace.bad_times += 1
        return
    t = float(t)
    trace.last_t = max(trace.last_t, t)

    def take(key: str, reader: Any) -> Any:
        value = record.get(key)
        if value is None:  # null: a value the writer could not read, kept as missing
            return None
        read = reader(value)
        if read is None:
            trace.dropped[key] = trace.dropped.get(key, 0) + 1
        return read

    if kind == "sample":
        device = {k: v for k in DEVICE_KEYS if (v := take(k, _int)) is not None}
        trace.samples.append(
            Sample(
                t=t,
                footprint=take("footprint", _int),
                available=take("available", _int),
                available_pct=take("available_pct", _number),
                swap_used=take("swap_used", _int),
                pressure=take("pressure", _number),
                device=device,
            )
        )
    elif kind == "event":
        event_kind = take("kind", _text)
        if event_kind is None:
            return
        values = {name: take(name, read) for name, read in _EVENT_FIELDS}
        values["kind"] = event_kind
        trace.events.append(
            TraceEvent(**values, t=t, time=trace.monotonic0 + t, pid=take("pid", _int))
        )
    elif kind == "mark":
        trace.marks.append(Mark(t=t, label=take("label", _text) or ""))
    elif kind == "error":
        trace.errors.append(dict(record))
    elif kind == "end":
        trace.end = dict(record)
    # Unknown record types are ignored, as the contract asks.
