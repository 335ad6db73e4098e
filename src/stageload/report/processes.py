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
from collections.abc import Iterable
from pathlib import Path

from ..core.outer import PROCESS
from .records import Trace
from .trace import scan_trace

#: Event kinds that belong to a pipeline; a process that emitted one of these gets a view.
#: Others (the guard's decisions, notes) go into every view; ``process`` events bound it.
PIPELINE_KINDS = frozenset({"stage", "load", "reload", "release", "prefetch", "block"})


def pipeline_pids(trace: Trace) -> list[int | None]:
    """The processes that emitted pipeline events, in the order of their first one.

    ``None`` stands for events without a ``pid`` (traces written before events carried it).
    """
    pids: list[int | None] = []
    for event in trace.events:
        if event.kind in PIPELINE_KINDS and event.pid not in pids:
            pids.append(event.pid)
    return pids


def by_process(trace: Trace) -> list[Trace]:
    """``[trace]`` when at most one process emitted pipeline events; otherwise one view per
    such process, in the order of their first event.

    A view runs from that process's ``process`` ``start`` event (or the trace's start) to
    its ``exit`` event (or the trace's last record), and holds the samples and marks in
    that span.
    """
    pids = pipeline_pids(trace)
    if len(pids) <= 1:
        return [trace]
    views = []
    for pid in pids:
        begin, end = _lifetime(trace, pid)
        views.append(
            dataclasses.replace(
                trace,
                events=[
                    e
                    for e in trace.events
                    if (e.pid == pid or e.pid not in pids) and begin <= e.t <= end
                ],
                samples=[s for s in trace.samples if begin <= s.t <= end],
                marks=[m for m in trace.marks if begin <= m.t <= end],
                first_t=begin,
                last_t=end,
                pid=pid,
            )
        )
    return views


def _lifetime(trace: Trace, pid: int | None) -> tuple[float, float]:
    """When ``pid`` began and ended, as far as its ``process`` events say."""
    begin, end = trace.first_t, trace.last_t
    for event in trace.events:
        if event.pid == pid and event.kind == PROCESS:
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
