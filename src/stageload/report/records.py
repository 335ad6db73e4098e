"""Read a JSONL memory trace into a ``Trace``: its samples, events and stage marks.

The format is the contract in ``docs/trace-format.md``. Reading is forgiving where the
contract says so (a half-written last line, unknown keys and record types) and strict
elsewhere, so that a file that is not a trace fails with a clear message.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .._errors import PicklableError
from ..events import Event
from ..memory import DEVICE_KEYS as DEVICE_KEYS  # sample keys of device memory, report order

#: The stage name of the time before the first ``stage`` event.
SETUP = "setup"


class TraceError(PicklableError, ValueError):
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
    #: Half-written last lines that were skipped (0 or 1).
    skipped_lines: int = 0
    #: The largest ``t`` of any record: where the last window ends.
    last_t: float = 0.0
    #: Where the first window (``setup``) begins: 0, or in a view of one process of
    #: several, when that process began (``report.processes``).
    first_t: float = 0.0
    #: Set on a view that holds the events of one process of several (``report.processes``).
    pid: int | None = None

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

    Skips a half-written last line and ignores unknown keys and record types. Raises
    ``TraceError`` for a missing, empty or unreadable file, or one that does not start
    with a ``start`` record.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(
            path,
            "no such file; give the path of a trace written by "
            "'stageload meter -o FILE' or MemoryMeter(FILE)",
        ) from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise TraceError(path, "is not a text file, so not a JSONL trace") from None
    except OSError as exc:
        raise TraceError(path, f"cannot be read: {exc.strerror or exc}") from None

    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise TraceError(path, "is empty; the run may not have started its meter yet")

    records: list[dict[str, Any]] = []
    skipped = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                # A killed writer can leave its last line cut short: the contract says skip it.
                skipped += 1
                continue
            raise TraceError(
                path, f"line {number} is not JSON ({line[:40]!r}); is this a stageload trace?"
            ) from None
        if not isinstance(record, dict):
            raise TraceError(path, f"line {number} is {record!r}, not a JSON object")
        records.append(record)

    if not records or records[0].get("type") != "start":
        first = records[0].get("type") if records else None
        raise TraceError(
            path,
            f"does not begin with a 'start' record (first record type: {first!r}); "
            "traces are written by 'stageload meter', MemoryMeter or 'stageload guard'",
        )

    trace = Trace(path=path, start=records[0], skipped_lines=skipped)
    for record in records[1:]:
        _add_record(trace, record)
    # Samples come from a sampler process and events from the pipeline, so file order can
    # interleave slightly; sort by time (stable, so events at one t keep their order).
    trace.samples.sort(key=lambda s: s.t)
    trace.events.sort(key=lambda e: e.t)
    trace.marks.sort(key=lambda m: m.t)
    return trace


def _add_record(trace: Trace, record: dict[str, Any]) -> None:
    kind = record.get("type")
    t = _number(record.get("t"))
    if t is None:
        # A record without a time cannot be placed; only `start` may lack one.
        return
    trace.last_t = max(trace.last_t, float(t))
    if kind == "sample":
        device = {k: v for k in DEVICE_KEYS if (v := _int(record.get(k))) is not None}
        trace.samples.append(
            Sample(
                t=float(t),
                footprint=_int(record.get("footprint")),
                available=_int(record.get("available")),
                available_pct=_number(record.get("available_pct")),
                swap_used=_int(record.get("swap_used")),
                pressure=_number(record.get("pressure")),
                device=device,
            )
        )
    elif kind == "event":
        event_kind = _text(record.get("kind"))
        if event_kind is None:
            return
        values = {name: convert(record.get(name)) for name, convert in _EVENT_FIELDS}
        values["kind"] = event_kind
        trace.events.append(
            TraceEvent(**values, t=float(t), time=trace.monotonic0 + t, pid=_int(record.get("pid")))
        )
    elif kind == "mark":
        trace.marks.append(Mark(t=float(t), label=str(record.get("label", ""))))
    elif kind == "error":
        trace.errors.append(dict(record))
    elif kind == "end":
        trace.end = dict(record)
    # Unknown record types are ignored, as the contract asks.
