"""Read a JSONL memory trace into a ``Trace``: its samples, events and stage marks.

The format is the contract in ``docs/trace-format.md``. Reading is forgiving within a trace
(a half-written last line, a garbled line, a record at an impossible time and a value of the
wrong type or out of range are skipped and counted; unknown keys and record types are
ignored) and strict about its first line, so that a file that is not a trace fails with a
clear message.

A trace is read in two passes over the file (``TraceFile``): the first parses every record
but the samples, the second only the samples. So the events, and with them the stage
windows, are known before the first sample is counted, and a summary can keep running
figures per window instead of every sample (``report.samples``); each line is still parsed
once.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO

from ..core.events import Event
from ..errors import StageloadError
from ..memory import DEVICE_KEYS, SAMPLE_KEYS  # DEVICE_KEYS: in report order
from ..traceformat import END, ERROR, EVENT, MARK, MAX_LINE, MAX_SIZE, MAX_T, SAMPLE, START
from ..traceformat import TYPE_KEY as TYPE

if TYPE_CHECKING:
    from .samples import SampleStats

#: The largest integer read as a number where no range applies (2**63).
MAX_INT = 1 << 63
#: How a sample line written by ``TraceWriter`` (or ``json.dumps``) begins: the first pass
#: skips these without parsing them, the second parses only them (and lines that name
#: ``"sample"`` elsewhere, to find a sample record whose keys come in another order).
_SAMPLE_PREFIXES = (f'{{"{TYPE}":"{SAMPLE}",'.encode(), f'{{"{TYPE}": "{SAMPLE}", '.encode())
_SAMPLE_NAME = f'"{SAMPLE}"'.encode()


class TraceError(StageloadError, ValueError):
    """A file could not be read as a trace; the message says which file and why."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True, slots=True)
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
    #: The samples' running figures, when they were kept as they were read instead of as
    #: ``samples`` (``report.processes.load_views``); ``samples`` is empty then.
    sampled: SampleStats | None = None

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
        return None  # NaN and Infinity: json.loads reads those tokens
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
        return None  # 10**400 bytes is no reading, and would overflow a float
    return value


def _size(value: Any) -> int | None:
    """A size in bytes: a whole number from 0 to below ``MAX_SIZE``."""
    if type(value) is int:  # the writer's type, checked first (and never a bool)
        return value if 0 <= value < MAX_SIZE else None
    if type(value) is float and value.is_integer() and 0 <= value < MAX_SIZE:
        return int(value)  # 1e9 from another writer; NaN and Infinity are not integers
    return None


def _seconds(value: Any) -> float | None:
    """A duration or a ``t``: finite, from 0 to ``MAX_T``."""
    # By exact type, for speed (a million samples); NaN fails both comparisons, and an
    # int of any size compares with a float exactly. bool is not int here.
    if type(value) is float or type(value) is int:
        return value if 0 <= value <= MAX_T else None
    return None


def _percent(value: Any) -> float | None:
    """A percentage (``available_pct``, PSI ``pressure``): from 0 to 100."""
    if type(value) is float or type(value) is int:
        return value if 0 <= value <= 100 else None
    return None


def _pid(value: Any) -> int | None:
    """A process id: a whole number from 0 to below 2**31."""
    return value if type(value) is int and 0 <= value < 1 << 31 else None


def _exit_code(value: Any) -> int | None:
    """An exit code: an ``int`` (negative for a signal, as ``subprocess`` has it)."""
    return value if type(value) is int and -(1 << 31) <= value < 1 << 32 else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# How each ``Event`` field is read back: numbers by what they measure (so a load of -100
# bytes in -3 s is dropped, not added up), text by its type.
_NUMBER_READERS = {"bytes": _size, "seconds": _seconds, "compute": _seconds}
_TEXT_TYPES = {"str", "str | None"}


def _event_fields() -> list[tuple[str, Any]]:
    """(name, reader) for each field of ``Event`` that an event record carries."""
    found = []
    for f in fields(Event):
        if f.name == "time":  # written as ``t``, relative to the start record
            continue
        reader = _NUMBER_READERS.get(f.name) or (_text if str(f.type) in _TEXT_TYPES else None)
        if reader is None:  # a new Event field: say in _NUMBER_READERS what range it has
            raise TypeError(f"Event.{f.name} has type {f.type!r}, which the trace reader lacks")
        found.append((f.name, reader))
    return found


#: The fields of an event record, from ``Event`` itself, so writer and reader cannot drift.
_EVENT_FIELDS = _event_fields()
_DEVICE_KEYS = frozenset(DEVICE_KEYS)


def _sample_readers(keys: Iterable[str]) -> dict[str, Any]:
    """How each of the sample ``keys`` the meter writes is read (``TraceFile.samples``
    checks the writer's types inline first, for speed, and falls back to these); a key
    this reader does not know is a ``TypeError`` at import, not a value silently unread."""
    readers = {
        "footprint": _size,
        "available": _size,
        "available_pct": _percent,
        "swap_used": _size,
        "pressure": _percent,
        **dict.fromkeys(DEVICE_KEYS, _size),
    }
    if set(readers) != set(keys):
        raise TypeError(
            f"the trace reader reads sample keys {sorted(readers)}, the meter writes "
            f"{sorted(keys)}: teach records._sample_readers the new one"
        )
    return readers


_SAMPLE_READERS = _sample_readers(SAMPLE_KEYS)


def _checked(dropped: dict[str, int], key: str, value: Any, reader: Any) -> Any:
    """``reader(value)``, counted in ``dropped`` when it is out of range or of a wrong type."""
    read = reader(value)
    if read is None:
        dropped[key] = dropped.get(key, 0) + 1
    return read


def read_trace(path: str | Path) -> Trace:
    """Read the trace at ``path``, every sample kept in ``Trace.samples``.

    Skips lines that are not a JSON object (a half-written last line from a killed run, a
    line cut or garbled in the middle), records whose ``t`` is missing or out of range and
    values of the wrong type or out of range, counting each in the ``Trace``; ignores
    unknown keys and record types. Raises ``TraceError`` for a missing, empty or unreadable
    file, or one that does not start with a ``start`` record.
    """
    with TraceFile(path) as file:
        trace = file.trace
        trace.samples = [
            Sample(t, fp, avail, pct, swap, pressure, device)
            for t, fp, avail, pct, swap, pressure, device in file.samples()
        ]
    # Samples come from a sampler process and events from the pipeline, so file order can
    # interleave slightly; sort by time (stable, so samples at one t keep their order).
    trace.samples.sort(key=lambda s: s.t)
    return trace


#: One sample's values as ``TraceFile.samples`` yields them, in ``Sample``'s field order.
SampleValues = tuple[
    float, int | None, int | None, float | None, int | None, float | None, dict[str, int]
]


class TraceFile:
    """An open trace: opening reads every record but the samples into ``trace`` (the
    first pass); ``samples()`` then reads the samples (the second), once.

    Raises ``TraceError`` as ``read_trace`` does. The second pass reads the file only as
    far as the first did, so a trace still being written reads as one moment of it. A
    file that cannot be read twice (a pipe) is copied to a temporary file as the first
    pass reads it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: BinaryIO | None = None
        self._copy: IO[bytes] | None = None
        self._bad: list[int] = []  # line numbers of lines that are not a JSON object
        self._odd: set[int] = set()  # sample records the second pass would not look at
        self._first = 0  # line number of the start record
        self._size = 0  # bytes the first pass read
        self._read = 0  # bytes the pass under way has read
        self._second = False  # whether samples() ran
        try:
            # Held open over both passes, closed by close() (``with TraceFile(...)``).
            self._file = open(self.path, "rb")  # noqa: SIM115
            if not self._file.seekable():
                self._copy = tempfile.TemporaryFile()  # noqa: SIM115
            self.trace = self._first_pass()
        except FileNotFoundError:
            self.close()
            raise TraceError(
                self.path,
                "no such file; give the path of a trace written by "
                "'stageload meter -o FILE' or MemoryMeter(FILE)",
            ) from None
        except IsADirectoryError:
            self.close()
            raise TraceError(self.path, "is a directory, not a trace file") from None
        except OSError as exc:
            self.close()
            raise TraceError(self.path, f"cannot be read: {exc.strerror or exc}") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for f in (self._file, self._copy):
            if f is not None:
                f.close()
        self._file = self._copy = None

    def __enter__(self) -> TraceFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lines(self, f: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
        """(number, line) for each line, with ``None`` for a line longer than ``MAX_LINE``
        (the rest of it is read and dropped in bounded pieces, so memory stays bounded);
        copied to the temporary file of a pipe as it is read."""
        number = 0
        self._read = 0
        copy = self._copy

        def read(size: int) -> bytes:
            chunk = f.readline(size)
            self._read += len(chunk)
            if copy is not None:
                copy.write(chunk)
            return chunk

        while line := read(MAX_LINE + 1):
            number += 1
            if len(line) <= MAX_LINE:
                yield number, line
                continue
            if number == 1:  # no record is this long, least of all the start: not a trace
                raise TraceError(
                    self.path,
                    f"line 1 is longer than {MAX_LINE >> 20} MiB, so it is not a trace's "
                    "start record; is this a stageload trace?",
                )
            while not line.endswith(b"\n") and (line := read(1 << 20)):
                pass
            yield number, None

    def _first_pass(self) -> Trace:
        assert self._file is not None
        trace: Trace | None = None
        for number, line in self._lines(self._file):
            if line is None:
                self._bad.append(number)
                continue
            if not line.strip():
                continue
            if trace is None:
                self._first = number
                record = _parse_first(line)
                trace = Trace(path=self.path, start=_start(self.path, number, line, record))
                _check_start(trace)
                continue
            if line.startswith(_SAMPLE_PREFIXES):
                continue  # the second pass's
            record = _parse(line)
            if record is None:
                self._bad.append(number)
            elif record.get(TYPE) == SAMPLE:
                if _SAMPLE_NAME not in line:  # spelt with escapes: tell the second pass
                    self._odd.add(number)
            else:
                _add_record(trace, record)
        if trace is None:
            raise TraceError(self.path, "is empty; the run may not have started its meter yet")
        self._size = self._read
        trace.events.sort(key=lambda e: e.t)  # stable: events at one t keep file order
        trace.marks.sort(key=lambda m: m.t)
        trace.bad_lines = sorted(self._bad)
        return trace

    def samples(self) -> Iterator[SampleValues]:
        """The samples of the trace in file order, their values range-checked (what is
        skipped is counted in ``trace`` as the first pass counts: ``bad_lines``,
        ``bad_times``, ``dropped``; ``last_t`` takes in the samples' ``t``)."""
        f = self._copy if self._copy is not None else self._file
        if f is None:
            raise ValueError(f"{self.path}: the trace file is closed")
        if self._second:  # a second reading would count every skipped value twice
            raise ValueError(f"{self.path}: the samples were read already; open it again")
        self._second = True
        try:
            yield from self._second_pass(f)
        except OSError as exc:
            raise TraceError(self.path, f"cannot be read: {exc.strerror or exc}") from None

    def _second_pass(self, f: BinaryIO | IO[bytes]) -> Iterator[SampleValues]:
        f.seek(0)
        trace = self.trace
        dropped = trace.dropped
        first, odd, bad = self._first, self._odd, self._bad
        readline, size, number = f.readline, self._size, 0
        self._read = 0
        # The loop runs once per line of a trace of millions, so it reads lines itself and
        # checks the writer's types inline; anything else goes through the readers.
        while self._read < size:
            line = readline(min(MAX_LINE + 1, size - self._read))
            if not line:
                break
            self._read += len(line)
            number += 1
            if len(line) > MAX_LINE:  # the first pass counted it; drop the rest unread
                while not line.endswith(b"\n") and (
                    line := readline(min(1 << 20, size - self._read))
                ):
                    self._read += len(line)
                continue
            if number <= first:
                continue
            prefixed = line.startswith(_SAMPLE_PREFIXES)
            if not (prefixed or _SAMPLE_NAME in line or number in odd):
                continue
            record = _parse(line)
            if record is None or record.get(TYPE) != SAMPLE:
                if prefixed:  # e.g. {"type":"sample",...,"type":"event"}: neither pass's
                    bad.append(number)
                continue
            get = record.get
            t = get("t")
            if not ((type(t) is float or type(t) is int) and 0 <= t <= MAX_T):
                trace.bad_times += 1
                continue
            t = float(t)
            if t > trace.last_t:
                trace.last_t = t
            footprint, available, swap = get("footprint"), get("available"), get("swap_used")
            pct, pressure = get("available_pct"), get("pressure")
            if footprint is not None and not (type(footprint) is int and 0 <= footprint < MAX_SIZE):
                footprint = _checked(dropped, "footprint", footprint, _size)
            if available is not None and not (type(available) is int and 0 <= available < MAX_SIZE):
                available = _checked(dropped, "available", available, _size)
            if swap is not None and not (type(swap) is int and 0 <= swap < MAX_SIZE):
                swap = _checked(dropped, "swap_used", swap, _size)
            if pct is not None and not (type(pct) is float and 0 <= pct <= 100):
                pct = _checked(dropped, "available_pct", pct, _percent)
            if pressure is not None and not (type(pressure) is float and 0 <= pressure <= 100):
                pressure = _checked(dropped, "pressure", pressure, _percent)
            device = {}
            if not _DEVICE_KEYS.isdisjoint(record):
                for key in DEVICE_KEYS:
                    value = get(key)
                    if value is not None:
                        value = _checked(dropped, key, value, _SAMPLE_READERS[key])
                        if value is not None:
                            device[key] = value
            yield t, footprint, available, pct, swap, pressure, device
        if self._read < self._size:
            raise TraceError(
                self.path,
                f"was cut to {self._read} bytes while being read (it had {self._size}); "
                "was a new run started at this path? Read it again",
            )
        trace.bad_lines = sorted(bad)


#: The C scanner under ``json.loads``, called on text directly: half the time of
#: ``json.loads(bytes)`` (which first guesses the encoding of every line).
_scan = json.JSONDecoder().scan_once
_JSON_SPACE = " \t\n\r"


def _parse(line: bytes) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None when it is not one (cut, garbled, too deep):
    what ``json.loads`` would return, but for the UTF-16/32 it would also guess."""
    try:
        text = line.decode().lstrip(_JSON_SPACE)
        record, end = _scan(text, 0)
    # ValueError: not JSON or not UTF-8, or an integer of over 4,300 digits;
    # StopIteration: no JSON value at all; RecursionError: nested too deep to read.
    except (ValueError, StopIteration, RecursionError):
        return None
    if end < len(text) and text[end:].strip(_JSON_SPACE):
        return None  # more after the object: two records run together
    return record if isinstance(record, dict) else None


def _parse_first(line: bytes) -> dict[str, Any] | None:
    """``_parse`` through ``json.loads``, which also takes a UTF-8 byte order mark."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


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
    if not isinstance(record, dict) or record.get(TYPE) != START:
        first = record.get(TYPE) if isinstance(record, dict) else None
        raise TraceError(
            path,
            f"does not begin with a 'start' record (first record type: {first!r:.40}); "
            "traces are written by 'stageload meter', MemoryMeter or 'stageload guard'",
        )
    return record


def _drop(trace: Trace, key: str) -> None:
    trace.dropped[key] = trace.dropped.get(key, 0) + 1


def _check_start(trace: Trace) -> None:
    """Count the start record's values that are out of range; the summary reads them with
    the same readers, so what is counted here is what it leaves out."""
    start = trace.start
    for key, reader in (("total", _size), ("monotonic", _number)):
        if start.get(key) is not None and reader(start[key]) is None:
            _drop(trace, key)


def _add_record(trace: Trace, record: dict[str, Any]) -> None:
    """Add a record other than a sample (the second pass reads those)."""
    kind = record.get(TYPE)
    t = _seconds(record.get("t"))
    if t is None:
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
            _drop(trace, key)
        return read

    if kind == EVENT:
        event_kind = take("kind", _text)
        if event_kind is None:
            return
        values = {name: take(name, read) for name, read in _EVENT_FIELDS}
        values["kind"] = event_kind
        trace.events.append(
            TraceEvent(**values, t=t, time=trace.monotonic0 + t, pid=take("pid", _pid))
        )
    elif kind == MARK:
        trace.marks.append(Mark(t=t, label=take("label", _text) or ""))
    elif kind == ERROR:
        # Only what the report reads, as text: a nested value is no field name.
        error: dict[str, Any] = {TYPE: ERROR, "t": t, "field": take("field", _text) or "?"}
        if (message := take("message", _text)) is not None:
            error["message"] = message
        if record.get("recovered") is True:
            error["recovered"] = True
        trace.errors.append(error)
    elif kind == END:
        end = dict(record)
        end["t"] = t
        if "exit_code" in end:
            end["exit_code"] = take("exit_code", _exit_code)
        trace.end = end
    # Unknown record types are ignored, as the contract asks.
