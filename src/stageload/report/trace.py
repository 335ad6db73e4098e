"""Split a memory trace into stage windows and summarise it per stage.

Reading the file into a ``Trace`` lives in ``records``; its names are re-exported here, so
``stageload.report.trace`` stays the one module to import for reading and summarising.
``scan_trace`` reads a trace in bounded memory: its samples' figures are kept running per
window (``report.samples``), not the samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.events import (
    BLOCK,
    NOTE,
    REASON_BUDGET,
    REASON_CLOSE,
    REASON_EVICT,
    REASON_NOT_IN_PLAN,
    RELEASE,
    SETUP,
)
from .records import Mark, Trace, TraceEvent, TraceFile, _exit_code, _size, _text
from .records import Sample as Sample  # re-exported: one module to import for reading
from .records import read_trace as read_trace
from .samples import SampleStats

#: The order the report lists release reasons in: the ones the core writes.
RELEASE_REASONS = (REASON_BUDGET, REASON_NOT_IN_PLAN, REASON_EVICT, REASON_CLOSE)
#: The key of releases without a ``reason`` (traces written before events carried one).
NO_REASON = "no reason"


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
    starts: list[tuple[str, float, float]] = [(SETUP, trace.first_t, trace.first_t)]
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
    """Count, bytes and seconds of one kind of event (loads, reloads, prefetches, releases)."""

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
class Blocks:
    """The ``block`` events of one streamed model: blocks read, bytes, seconds reading
    (overlapped with compute where prefetched) and seconds computing with them."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    compute: float = 0.0

    def add(self, event: TraceEvent) -> None:
        self.count += 1
        self.bytes += event.bytes or 0
        self.seconds += event.seconds or 0.0
        self.compute += event.compute or 0.0

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
    #: The process whose events the stages come from, when the trace had several.
    pid: int | None = None
    #: Background loads (``StagedModels(prefetch=...)``); their seconds overlapped compute.
    prefetches: Activity = field(default_factory=Activity)
    #: The releases split by their ``reason`` (``REASON_*`` of ``stageload.events``), in
    #: ``RELEASE_REASONS`` order, then any other reason; ``NO_REASON`` for those without one.
    releases_by_reason: dict[str, Activity] = field(default_factory=dict)
    #: What the reader skipped (``Trace.bad_lines``, ``bad_times``, ``dropped``).
    bad_lines: list[int] = field(default_factory=list)
    bad_times: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    #: Streamed models (``stageload.streamed``): their ``block`` events per model name.
    blocks: dict[str, Blocks] = field(default_factory=dict)
    #: What the run said about its models (``note`` events: what ``stageload.auto`` could
    #: not stage and why, a component that reloads through ``from_pretrained``), in order.
    notes: list[str] = field(default_factory=list)

    def stage(self, name: str) -> StageSummary | None:
        """The summary of stage ``name``, or ``None`` if the run never reached it."""
        return next((s for s in self.stages if s.stage == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-ready data."""
        return {
            "path": self.path,
            "label": self.label,
            "pid": self.pid,
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
            "prefetches": self.prefetches.to_dict(),
            "releases": self.releases.to_dict(),
            "releases_by_reason": {k: v.to_dict() for k, v in self.releases_by_reason.items()},
            "blocks": {k: v.to_dict() for k, v in self.blocks.items()},
            "marks": [asdict(m) for m in self.marks],
            "notes": self.notes,
            "read_errors": self.read_errors,
            "skipped": {
                "lines": self.bad_lines,
                "bad_t": self.bad_times,
                "dropped_values": self.dropped,
            },
        }


def sample_bounds(trace: Trace) -> list[float]:
    """Where the figures of ``trace``'s samples must be cut to summarise it: where its
    windows begin, and its span (``SampleStats``)."""
    return [trace.first_t, trace.last_t, *(w.start for w in stage_windows(trace))]


def sample_stats(trace: Trace, *, series: bool = False) -> SampleStats:
    """The running figures of ``trace``'s samples: those kept while it was read
    (``scan_trace``), or else counted from ``trace.samples`` now."""
    if trace.sampled is not None:
        return trace.sampled
    stats = SampleStats(sample_bounds(trace), series=series)
    for s in trace.samples:
        stats.add(s.t, s.footprint, s.available, s.available_pct, s.swap_used, s.device)
    return stats


def scan_trace(
    path: str | Path,
    *,
    views: Callable[[Trace], list[Trace]] = lambda trace: [trace],
    series: bool = False,
) -> Trace:
    """Read the trace at ``path`` as ``read_trace`` does, but in bounded memory: its
    samples are counted into ``Trace.sampled`` (per window of each of ``views(trace)``,
    which ``summarize`` of those views then reads) and not kept; ``series`` keeps the
    decimated lines a plot draws. Raises ``TraceError`` as ``read_trace`` does."""
    with TraceFile(path) as file:
        trace = file.trace
        stats = SampleStats(
            [b for view in views(trace) for b in sample_bounds(view)], series=series
        )
        add = stats.add
        for t, footprint, available, pct, swap, _pressure, device in file.samples():
            add(t, footprint, available, pct, swap, device)
    trace.sampled = stats
    return trace


def summarize(trace: Trace) -> Summary:
    """Summarise ``trace``: per-stage peaks and durations, swap, available memory, events."""
    stats = sample_stats(trace)
    windows = stage_windows(trace)
    stages: dict[str, StageSummary] = {}
    for k, window in enumerate(windows):
        inside = stats.span(window.start, window.end, closed=k == len(windows) - 1)
        summary = stages.get(window.stage)
        if summary is None:
            stages[window.stage] = StageSummary(
                stage=window.stage,
                peak_footprint=inside.peak_footprint,
                duration=window.duration,
                samples=inside.samples,
                windows=1,
                device_peak=dict(inside.device_peak),
            )
            continue
        if inside.peak_footprint is not None and (
            summary.peak_footprint is None or inside.peak_footprint > summary.peak_footprint
        ):
            summary.peak_footprint = inside.peak_footprint
        summary.duration += window.duration
        summary.samples += inside.samples
        summary.windows += 1
        for key, value in inside.device_peak.items():
            summary.device_peak[key] = max(summary.device_peak.get(key, value), value)
    whole = stats.span(trace.first_t, trace.last_t, closed=True)

    activity = {
        "load": Activity(),
        "reload": Activity(),
        "prefetch": Activity(),
        "release": Activity(),
    }
    by_reason: dict[str, Activity] = {}
    blocks: dict[str, Blocks] = {}
    notes: list[str] = []
    for event in trace.events:
        if event.kind == NOTE and event.note and event.note not in notes:
            notes.append(event.note)
        if event.kind == BLOCK:
            blocks.setdefault(event.model or "?", Blocks()).add(event)
        if event.kind in activity:
            activity[event.kind].add(event)
        if event.kind == RELEASE:
            by_reason.setdefault(event.reason or NO_REASON, Activity()).add(event)
    order = [*RELEASE_REASONS, *sorted(set(by_reason) - set(RELEASE_REASONS) - {NO_REASON})]
    by_reason = {r: by_reason[r] for r in [*order, NO_REASON] if r in by_reason}

    read_errors: dict[str, str] = {}
    for error in trace.errors:
        name = _text(error.get("field")) or "?"
        if not error.get("recovered"):
            read_errors.setdefault(name, _text(error.get("message")) or "")

    end = trace.end or {}
    return Summary(
        path=str(trace.path),
        label=trace.label,
        stages=list(stages.values()),
        windows=windows,
        duration=trace.last_t - trace.first_t,
        samples=whole.samples,
        complete=trace.complete,
        exit_code=_exit_code(end.get("exit_code")),
        peak_footprint=whole.peak_footprint,
        swap_start=whole.swap_start,
        swap_peak=whole.swap_peak,
        swap_end=whole.swap_end,
        swap_growth=None if whole.swap_start is None else whole.swap_peak - whole.swap_start,  # type: ignore[operator]
        lowest_available=whole.lowest_available,
        lowest_available_pct=whole.lowest_available_pct,
        total=_size(trace.start.get("total")),
        loads=activity["load"],
        reloads=activity["reload"],
        prefetches=activity["prefetch"],
        releases=activity["release"],
        releases_by_reason=by_reason,
        bad_lines=list(trace.bad_lines),
        bad_times=trace.bad_times,
        dropped=dict(trace.dropped),
        marks=list(trace.marks),
        read_errors=read_errors,
        meta=trace.meta,
        pid=trace.pid,
        blocks=blocks,
        notes=notes,
    )


def load_summary(path: str | Path) -> Summary:
    """Read the trace at ``path`` and summarise it, in bounded memory (``scan_trace``)."""
    return summarize(scan_trace(path))
