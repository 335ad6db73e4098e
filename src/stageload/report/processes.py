"""Keep apart the pipelines of several processes that sent events into one trace.

Under ``stageload meter`` every StagedModels in the command's process tree appends its
events to the trace (``stageload.outer``), each record with its ``pid``. Stage windows
mean something only within one process's events, so a trace whose pipeline events come
from more than one process is read as one view per process: the span from its ``process``
``start`` to its ``exit`` event, the samples of that span (of the whole tree), that
process's events, and the label ``"<label> [pid N]"``. The report shows one column and
the plot one panel per view.
"""

from __future__ import annotations

import dataclasses
import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from ..core.outer import PROCESS
from .records import Trace, TraceEvent
from .trace import scan_trace

#: Event kinds that belong to a pipeline; a process that emitted one of these gets a view.
#: Others (the guard's decisions, notes) go into every view; ``process`` events bound it.
PIPELINE_KINDS = frozenset({"stage", "load", "reload", "release", "prefetch", "block"})

T = TypeVar("T")


def pipeline_pids(trace: Trace) -> list[int | None]:
    """The processes that emitted pipeline events, in the order of their first one.

    ``None`` stands for events without a ``pid`` (traces written before events carried it).
    """
    seen: dict[int | None, None] = {}  # a dict: ordered, and a lookup in constant time
    for event in trace.events:
        if event.kind in PIPELINE_KINDS:
            seen.setdefault(event.pid)
    return list(seen)


def by_process(trace: Trace) -> list[Trace]:
    """``[trace]`` when at most one process emitted pipeline events; otherwise one view per
    such process, in the order of their first event.

    A view runs from that process's ``process`` ``start`` event (or the trace's start) to
    its ``exit`` event (or the trace's last record), and holds the samples and marks in
    that span. In time linear in the trace plus the views (a pool of thousands of
    processes): each record list is in time order, so a span is cut out by bisection.
    """
    pids = pipeline_pids(trace)
    if len(pids) <= 1:
        return [trace]
    events = trace.events
    # Indices into events: each process's own, and the others' (in every view).
    own: dict[int | None, list[int]] = {pid: [] for pid in pids}
    shared: list[int] = []
    for i, event in enumerate(events):
        own.get(event.pid, shared).append(i)
    shared_t = [events[i].t for i in shared]
    sample_t = [s.t for s in trace.samples]
    mark_t = [m.t for m in trace.marks]
    views = []
    for pid in pids:
        begin, end = _lifetime(trace, [events[i] for i in own[pid]])
        mine = [i for i in own[pid] if begin <= events[i].t <= end]
        others = _within(shared, shared_t, begin, end)
        views.append(
            dataclasses.replace(
                trace,
                events=[events[i] for i in heapq.merge(mine, others)],
                samples=_within(trace.samples, sample_t, begin, end),
                marks=_within(trace.marks, mark_t, begin, end),
                first_t=begin,
                last_t=end,
                pid=pid,
            )
        )
    return views


def _within(items: list[T], times: list[float], begin: float, end: float) -> list[T]:
    """The ``items`` with ``begin <= t <= end``; ``times`` are their ``t``, in order."""
    return items[bisect_left(times, begin) : bisect_right(times, end)]


def _lifetime(trace: Trace, events: list[TraceEvent]) -> tuple[float, float]:
    """When the process of ``events`` (all of its own) began and ended, as far as its
    ``process`` events say."""
    begin, end = trace.first_t, trace.last_t
    for event in events:
        if event.kind == PROCESS:
            if event.note == "start":
                begin = max(begin, event.t)
            elif event.note == "exit":
                end = min(end, event.t)
    return begin, max(begin, end)


def load_views(paths: Iterable[str | Path], *, series: bool = False) -> list[Trace]:
    """Read each trace and split it by process: what ``stageload report`` and ``plot`` show.

    In bounded memory: the samples are counted per window of every view as they are read
    (``trace.scan_trace``), not kept; ``series`` keeps the decimated lines of a plot.
    """
    return [
        view
        for path in paths
        for view in by_process(scan_trace(path, views=by_process, series=series))
    ]
