"""Staged pipelines on Ray: Ray Data's ``map_batches``, or a list of calls on Ray actors.

``StagedPredictor`` is a callable class for ``Dataset.map_batches``: each actor builds the
pipeline once and runs each batch of rows stage-major with ``pipe.stageload.map`` (each
model loads once per batch); ``peak_memory(make_pipeline, row)`` measures the ``memory=``
request, one call under ``MemoryMeter`` in a fresh worker. ``run_batch(make_pipeline,
calls)`` does the same for a list of calls, on actors that Ray restarts when they die
(``max_restarts``, Ray's own option) with their chunk retried, so no result is lost or
duplicated. Each worker meters itself; ``report`` merges their traces.

An optional extra (``pip install "stageload[ray]"``); ``import stageload`` never imports it.
See docs/ray.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._cluster import connect, peak_from
from ._predictor import StagedPredictor, peak_memory
from ._stream import BatchStream
from ._worker import SEED_KEY, call_kwargs, ray_threads, rows_to_calls, worker_threads

__all__ = [
    "BatchStream",
    "SEED_KEY",
    "StagedPredictor",
    "call_kwargs",
    "connect",
    "peak_from",
    "peak_memory",
    "ray_threads",
    "report",
    "rows_to_calls",
    "run_batch",
    "stream_batch",
    "worker_threads",
]


def stream_batch(
    make_pipeline: Callable[[], Any],
    calls: Sequence[Mapping[str, Any]],
    *,
    memory: int | str | os.PathLike[str] = "auto",
    workers: int | None = None,
    batch_size: int | None = None,
    num_cpus: float = 1,
    trace_dir: str | os.PathLike[str] | None = None,
    max_restarts: int = 3,
) -> BatchStream:
    """Like :func:`run_batch`, but yields ``(index, result)`` as each chunk finishes.

    The returned :class:`BatchStream` is iterable once; ``.workers`` are the actors,
    ``.ran`` who ran each chunk (a pid that changes under one label: Ray restarted that
    worker), ``.traces`` the collected trace paths (after the end).
    """
    return BatchStream(
        make_pipeline,
        calls,
        memory=memory,
        workers=workers,
        batch_size=batch_size,
        num_cpus=num_cpus,
        trace_dir=trace_dir,
        max_restarts=max_restarts,
    )


def run_batch(
    make_pipeline: Callable[[], Any],
    calls: Sequence[Mapping[str, Any]],
    *,
    memory: int | str | os.PathLike[str] = "auto",
    workers: int | None = None,
    batch_size: int | None = None,
    num_cpus: float = 1,
    trace_dir: str | os.PathLike[str] | None = None,
    max_restarts: int = 3,
) -> list[Any]:
    """Run ``calls`` of a staged pipeline on Ray actors; the results in call order.

    Args:
        make_pipeline: a zero-argument function (picklable: a module-level function or a
            ``functools.partial``) that returns a staged diffusers pipeline, or any object
            whose ``.stageload.map(calls)`` runs a batch. Each worker calls it once.
        calls: keyword-argument dicts for the pipeline; an integer ``seed`` becomes that
            call's ``generator=torch.Generator().manual_seed(seed)``.
        memory: what each worker asks Ray for (``memory=``): bytes, a size (``"6G"``), a
            trace or report file to read the peak from, or ``"auto"``: run the first call
            in a probe task under ``MemoryMeter`` and take its peak footprint (its result
            is kept).
        workers: how many actors; ``None``: as many as fit, per alive node
            ``min(memory // peak, CPU // num_cpus)``, at most one per chunk.
        batch_size: calls per chunk (one ``map`` on a worker); ``None``: the calls split
            evenly, one chunk per worker.
        num_cpus: CPUs each worker asks for.
        trace_dir: a folder for each worker's trace (``worker-K.jsonl``, and
            ``probe.jsonl``); :func:`report` merges them.
        max_restarts: Ray's actor option: how many times Ray restarts each worker that
            dies (-1: without limit). The chunks it had are retried on the restarted
            worker (Ray's ``max_task_retries=-1``); an exception raised by the pipeline is
            not retried.

    Example::

        from functools import partial
        images = run_batch(partial(load_pipeline, "/models/qwen"),
                           [{"prompt": p, "seed": i} for i, p in enumerate(prompts)])
    """
    stream = stream_batch(
        make_pipeline,
        calls,
        memory=memory,
        workers=workers,
        batch_size=batch_size,
        num_cpus=num_cpus,
        trace_dir=trace_dir,
        max_restarts=max_restarts,
    )
    results: dict[int, Any] = {}
    for index, result in stream:
        results[index] = result
    return [results[i] for i in range(len(calls))]


def report(traces: Sequence[str | os.PathLike[str]] | str | os.PathLike[str]) -> str:
    """One ``stageload report`` table over the workers' traces (a list, or their folder)."""
    from ..report.processes import load_views
    from ..report.tables import format_report
    from ..report.trace import summarize

    if isinstance(traces, (str, os.PathLike)):
        paths: list[Any] = sorted(Path(traces).glob("*.jsonl"))
        if not paths:
            raise ValueError(f"no *.jsonl traces in {os.fspath(traces)!r}")
    else:
        paths = list(traces)
    return format_report([summarize(view) for view in load_views(paths)])
