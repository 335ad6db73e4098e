"""Ray Data's side: a callable class for ``Dataset.map_batches``, and the measured peak
for its ``memory=`` request."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._worker import StagedRunner, call_kwargs, output_value, probe, rows_to_calls

# What a Ray Data actor has imported before it builds the pipeline: the probe imports them
# too, so its peak covers them (Ray Data's own check measured ~50 MiB more without).
DATA_MODULES = ("ray.data", "pyarrow", "pandas")
#: The column StagedPredictor adds: each call's ``.images`` (or its whole output).
IMAGES = "images"


class StagedPredictor(StagedRunner):
    """A callable class for ``Dataset.map_batches``: a staged pipeline per actor, each batch
    run stage-major (each model loads once per batch).

    ``make_pipeline`` (given as ``fn_constructor_args=(make_pipeline,)``) runs once per
    actor. Each batch's rows become calls: columns are keyword arguments, an integer
    ``seed`` becomes the call's ``generator``. The batch comes back with an ``images``
    column: each call's ``.images`` as a numpy array, or its output as is when it has no
    ``.images``. ``trace_dir`` (``fn_constructor_kwargs``): a folder, visible to the actor,
    where it writes its trace (``actor-NODE-PID.jsonl``); ``stageload.ray.report`` merges
    them. ``threads``: torch's thread count (default: Ray's, one per CPU asked).

    Example::

        ds = ray.data.read_json("prompts.jsonl")
        ds = ds.map_batches(StagedPredictor, fn_constructor_args=(make_pipeline,),
                            batch_size=8, concurrency=2, num_cpus=1,
                            memory=peak_memory(make_pipeline, ds.take(1)[0]))
        ds.write_parquet("out/")
    """

    def __init__(
        self,
        make_pipeline: Callable[[], Any],
        *,
        trace_dir: str | os.PathLike[str] | None = None,
        threads: int | None = None,
    ) -> None:
        super().__init__(make_pipeline, trace_dir=trace_dir, threads=threads)

    def __call__(self, batch: Any) -> dict[str, Any]:
        """Run the batch's rows stage-major; the batch with an ``images`` column added."""
        calls = rows_to_calls(batch)
        _, _, results = self.run(self.batches, calls)
        if hasattr(batch, "columns"):  # pandas: hand back the same kind of batch
            out = batch.copy()
            out[IMAGES] = [output_value(r) for r in results]
            return out
        return {**batch, IMAGES: [output_value(r) for r in results]}


def peak_memory(
    make_pipeline: Callable[[], Any],
    row: Mapping[str, Any],
    *,
    num_cpus: float = 1,
    trace_dir: str | os.PathLike[str] | None = None,
) -> int:
    """The peak footprint, in bytes, of one call in a fresh Ray worker: for ``memory=``.

    Runs ``make_pipeline()`` and the call ``row`` (a dict of keyword arguments, or a row
    of the Dataset) twice, so that the second run reloads the models the first released
    (as an actor's later batches do), in a Ray task of ``num_cpus`` CPUs in a new process,
    under ``MemoryMeter``: the interpreter, torch, Ray's worker with ``ray.data``, pyarrow and
    pandas imported (as a ``map_batches`` actor has them), and the pipeline's largest stage.
    ``trace_dir`` keeps that run's trace as ``probe.jsonl``. Connects to Ray as
    :func:`stageload.ray.connect` does (a local Ray it starts stays up for the
    ``map_batches`` that follows).
    """
    peak, _, _ = probe_remote(
        make_pipeline, row, num_cpus=num_cpus, trace_dir=trace_dir, preload=DATA_MODULES
    )
    return peak


def probe_remote(
    make_pipeline: Callable[[], Any],
    row: Mapping[str, Any],
    *,
    num_cpus: float,
    trace_dir: str | os.PathLike[str] | None,
    preload: tuple[str, ...] = (),
) -> tuple[int, Any, str]:
    """:func:`peak_memory`, also giving the call's result and the trace's text."""
    import ray

    from ._cluster import connect

    if not callable(make_pipeline):
        raise TypeError(
            f"make_pipeline must be a zero-argument function that returns the pipeline "
            f"(e.g. functools.partial(load, path)), got {make_pipeline!r}"
        )
    if not isinstance(row, Mapping):
        raise TypeError(
            f"row must be one call as a dict of keyword arguments (or a row of the Dataset, "
            f"e.g. ds.take(1)[0]), got {row!r}"
        )
    (call,) = rows_to_calls({k: [v] for k, v in row.items()})
    call_kwargs(call)  # a bad seed fails here, not in the remote task
    connect()
    # max_calls=1: a fresh process for the probe, gone after it (its peak is its own).
    task = ray.remote(num_cpus=num_cpus, max_calls=1)(probe)
    peak, result, text = ray.get(task.remote(make_pipeline, call, preload))
    if trace_dir is not None:
        folder = Path(trace_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "probe.jsonl").write_text(text, encoding="utf-8")
    return int(peak), result, text
