"""Read a JSONL memory trace, split it into stage windows, and summarise it per stage.

The format is the contract in ``docs/trace-format.md``. Reading is forgiving where the
contract says so (a half-written last line, unknown keys and record types) and strict
elsewhere, so that a file that is not a trace fails with a clear message.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The stage name of the time before the first ``stage`` event.
SETUP = "setup"

#: Sample keys that hold device memory, in the order reports show them.
DEVICE_KEYS = ("cuda_allocated", "cuda_reserved", "mps_current", "mps_driver")


class TraceError(ValueError):
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
class TraceEvent:
    """One ``event`` record: an Event from StagedModels or the guard, at ``t`` seconds."""

    t: float
    kind: str
    model: str | None = None
    stage: str | None = None
    bytes: int | None = None
    seconds: float | None = None
    note: str | None = None


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

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.start.get("meta")
        return meta if isinstance(meta, dict) else {}

    @property
    def label(self) -> str:
        """The trace's ``meta.label``, or the file name without its suffix."""
        label = self.meta.get("label")
        if isinstance(label, str) and label:
            return label
        name = self.path.name
        for suffix in (".jsonl", ".json", ".trace"):
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return self.path.stem

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
        trace.events.append(
            TraceEvent(
                t=float(t),
                kind=event_kind,
                model=_text(record.get("model")),
                stage=_text(record.get("stage")),
                bytes=_int(record.get("bytes")),
                seconds=_number(record.get("seconds")),
                note=_text(record.get("note")),
            )
        )
    elif kind == "mark":
        trace.marks.append(Mark(t=float(t), label=str(record.get("label", ""))))
    elif kind == "error":
        trace.errors.append(dict(record))
    elif kind == "end":
        trace.end = dict(record)
    # Unknown record types are ignored, as the contract asks.


@dataclass(frozen=True)
class Window:
    """A stretch of the run that belongs to one stage: ``start <= t < end``."""

    stage: str
    start: float
    end: float
    #: When the ``stage`` event was written; ``start`` is later when releases followed it.
    entered: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def stage_windows(trace: Trace) -> list[Window]:
    """Split the run into stage windows by the release rule of ``docs/trace-format.md``.

    The time before the first ``stage`` event is ``setup``. A stage's window begins at the
    ``t`` of the last ``release`` in the run of releases directly after its ``stage`` event
    (or at the stage event when none follow), so memory still being freed counts toward the
    stage before. A window ends where the next begins, or at the last record.
    """
    starts: list[tuple[str, float, float]] = [(SETUP, 0.0, 0.0)]
    events = trace.events
    i = 0
    while i < len(events):
        event = events[i]
        i += 1
        if event.kind != "stage" or event.stage is None:
            continue
        begin = event.t
        # "Directly after" counts event records only: samples and marks in between are
        # written by other threads or processes and do not break the run.
        while i < len(events) and events[i].kind == "release":
            begin = max(begin, events[i].t)
            i += 1
        starts.append((event.stage, begin, event.t))

    last = max(trace.last_t, starts[-1][1])
    windows = []
    for k, (stage, begin, entered) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else last
        # Never negative: a release that outlasts the next stage event cannot reorder time.
        windows.append(Window(stage=stage, start=begin, end=max(begin, end), entered=entered))
    return windows


def _samples_in(samples: list[Sample], window: Window, *, last: bool) -> list[Sample]:
    return [
        s
        for s in samples
        if window.start <= s.t and (s.t < window.end or (last and s.t <= window.end))
    ]


def _max(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _min(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    return min(values) if values else None


@dataclass
class StageSummary:
    """One stage's figures; a stage entered more than once adds up its windows."""

    stage: str
    #: Highest footprint sampled in the stage's windows; ``None`` when no sample fell in them.
    peak_footprint: int | None
    #: Seconds spent in the stage's windows, summed.
    duration: float
    samples: int
    windows: int
    #: Highest device memory per key (``cuda_allocated``, ...) where the trace has it.
    device_peak: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Activity:
    """Count, bytes and seconds of one kind of event (loads, reloads or releases)."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, event: TraceEvent) -> None:
        self.count += 1
        self.bytes += event.bytes or 0
        self.seconds += event.seconds or 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Summary:
    """What a trace says about the run, per stage and as a whole."""

    path: str
    label: str
    stages: list[StageSummary]
    windows: list[Window]
    duration: float
    samples: int
    complete: bool
    exit_code: int | None
    peak_footprint: int | None
    #: Swap in use at the first and last sample that read it, and the highest reading.
    swap_start: int | None
    swap_peak: int | None
    swap_end: int | None
    #: How far swap rose above its starting value while the run went on (peak - start).
    swap_growth: int | None
    lowest_available: int | None
    lowest_available_pct: float | None
    total: int | None
    loads: Activity
    reloads: Activity
    releases: Activity
    marks: list[Mark]
    #: Fields that could not be read at some point, with the first message for each.
    read_errors: dict[str, str]
    meta: dict[str, Any]

    def stage(self, name: str) -> StageSummary | None:
        """The summary of stage ``name``, or ``None`` if the run never reached it."""
        return next((s for s in self.stages if s.stage == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-ready data."""
        return {
            "path": self.path,
            "label": self.label,
            "meta": self.meta,
            "complete": self.complete,
            "exit_code": self.exit_code,
            "duration": self.duration,
            "samples": self.samples,
            "stages": [s.to_dict() for s in self.stages],
            "windows": [asdict(w) for w in self.windows],
            "peak_footprint": self.peak_footprint,
            "swap": {
                "start": self.swap_start,
                "peak": self.swap_peak,
                "end": self.swap_end,
                "growth": self.swap_growth,
            },
            "lowest_available": self.lowest_available,
            "lowest_available_pct": self.lowest_available_pct,
            "total": self.total,
            "loads": self.loads.to_dict(),
            "reloads": self.reloads.to_dict(),
            "releases": self.releases.to_dict(),
            "marks": [asdict(m) for m in self.marks],
            "read_errors": self.read_errors,
        }


def summarize(trace: Trace) -> Summary:
    """Summarise ``trace``: per-stage peaks and durations, swap, available memory, events."""
    windows = stage_windows(trace)
    stages: dict[str, StageSummary] = {}
    for k, window in enumerate(windows):
        inside = _samples_in(trace.samples, window, last=k == len(windows) - 1)
        peak = _max([s.footprint for s in inside])
        device: dict[str, int] = {}
        for s in inside:
            for key, value in s.device.items():
                device[key] = max(device.get(key, value), value)
        summary = stages.get(window.stage)
        if summary is None:
            stages[window.stage] = StageSummary(
                stage=window.stage,
                peak_footprint=peak,
                duration=window.duration,
                samples=len(inside),
                windows=1,
                device_peak=device,
            )
            continue
        summary.peak_footprint = _max([summary.peak_footprint, peak])
        summary.duration += window.duration
        summary.samples += len(inside)
        summary.windows += 1
        for key, value in device.items():
            summary.device_peak[key] = max(summary.device_peak.get(key, value), value)

    swaps = [s.swap_used for s in trace.samples if s.swap_used is not None]
    swap_start = swaps[0] if swaps else None
    swap_peak = max(swaps) if swaps else None

    activity = {"load": Activity(), "reload": Activity(), "release": Activity()}
    for event in trace.events:
        if event.kind in activity:
            activity[event.kind].add(event)

    read_errors: dict[str, str] = {}
    for error in trace.errors:
        name = str(error.get("field", "?"))
        if not error.get("recovered"):
            read_errors.setdefault(name, str(error.get("message", "")))

    end = trace.end or {}
    return Summary(
        path=str(trace.path),
        label=trace.label,
        stages=list(stages.values()),
        windows=windows,
        duration=trace.last_t,
        samples=len(trace.samples),
        complete=trace.complete,
        exit_code=_int(end.get("exit_code")),
        peak_footprint=_max([s.footprint for s in trace.samples]),
        swap_start=swap_start,
        swap_peak=swap_peak,
        swap_end=swaps[-1] if swaps else None,
        swap_growth=None if swap_start is None else swap_peak - swap_start,
        lowest_available=_min([s.available for s in trace.samples]),
        lowest_available_pct=_min([s.available_pct for s in trace.samples]),
        total=_int(trace.start.get("total")),
        loads=activity["load"],
        reloads=activity["reload"],
        releases=activity["release"],
        marks=list(trace.marks),
        read_errors=read_errors,
        meta=trace.meta,
    )


def load_summary(path: str | Path) -> Summary:
    """Read the trace at ``path`` and summarise it."""
    return summarize(read_trace(path))
