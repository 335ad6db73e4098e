"""Keep apart the pipelines of several processes that sent events into one trace.

Under ``stageload meter`` every StagedModels in the command's process tree appends its
events to the trace (``stageload.outer``), each record with its ``pid``. Stage windows
mean something only within one process's events, so a trace whose pipeline events come
from more than one process is read as one view per process: the same samples (of the
whole tree), that process's events, and the label ``"<label> [pid N]"``. The report shows
one column and the plot one panel per view.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from .records import Trace, read_trace

#: Event kinds that belong to a pipeline; a process that emitted one of these gets a view.
#: Others (the guard's decisions, notes) go into every view.
PIPELINE_KINDS = frozenset({"stage", "load", "reload", "release", "prefetch"})


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
    such process, in the order of their first event."""
    pids = pipeline_pids(trace)
    if len(pids) <= 1:
        return [trace]
    return [
        dataclasses.replace(
            trace,
            events=[e for e in trace.events if e.pid == pid or e.pid not in pids],
            pid=pid,
        )
        for pid in pids
    ]


def load_views(paths: Iterable[str | Path]) -> list[Trace]:
    """Read each trace and split it by process: what ``stageload report`` and ``plot`` show."""
    return [view for path in paths for view in by_process(read_trace(path))]
