"""The driver's side of ``run_batch``: stage-major chunks on Ray actors, Ray's fault tolerance.

What Ray lacks is all that is here: the measured ``memory=`` request and chunks of calls
run stage-major. Ray does the rest: it places the actors by their ``memory=`` and CPU
requests, ``ray.util.ActorPool`` hands the next chunk to a free actor, and an actor that
dies is restarted by Ray (``max_restarts``) and its chunk retried on it
(``max_task_retries=-1``). A chunk's results come back in one task return, so none is lost
or delivered twice. Only the thread iterating the stream touches its state.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..units import format_size, parse_size
from ._worker import SEED_KEY, StagedRunner, call_kwargs


def _chunks(n: int, workers: int, batch_size: int | None) -> list[list[int]]:
    size = math.ceil(n / max(1, workers)) if batch_size is None else batch_size
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def fitting_workers(peak: int, num_cpus: float) -> dict[str, int]:
    """Per alive node id: how many workers of ``peak`` bytes and ``num_cpus`` CPUs fit."""
    import ray

    fit: dict[str, int] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        n = int(res.get("memory", 0) // peak)
        if num_cpus > 0:
            n = min(n, int(res.get("CPU", 0) // num_cpus))
        fit[node["NodeID"]] = n
    return fit


def _positive_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class BatchStream:
    """One batch on Ray; iterate it once for ``(index, result)`` pairs as chunks finish."""

    def __init__(
        self,
        make_pipeline: Callable[[], Any],
        calls: Sequence[Mapping[str, Any]],
        *,
        memory: int | str | os.PathLike[str],
        workers: int | None,
        batch_size: int | None,
        num_cpus: float,
        trace_dir: str | os.PathLike[str] | None,
        max_restarts: int,
    ) -> None:
        if not callable(make_pipeline):
            raise TypeError(
                f"make_pipeline must be a zero-argument function that returns the pipeline "
                f"(e.g. functools.partial(load, path)), got {make_pipeline!r}"
            )
        self.calls = list(calls)
        for call in self.calls:
            _check_call(call)
        if workers is not None:
            _positive_int("workers", workers, minimum=1)
        if batch_size is not None:
            _positive_int("batch_size", batch_size, minimum=1)
        if max_restarts != -1:  # Ray's meaning: -1 restarts without end
            _positive_int(
                "max_restarts (Ray's actor option; -1: no limit)", max_restarts, minimum=0
            )
        if isinstance(memory, bool):
            raise TypeError(
                f"memory must be bytes, a size such as '6G', a trace path or 'auto', got {memory!r}"
            )
        auto = isinstance(memory, str) and memory.strip().lower() == "auto"
        if isinstance(memory, str) and not auto and not os.path.isfile(memory):
            parse_size(memory)  # a bad size fails here, before Ray is started
        self.make_pipeline = make_pipeline
        self.memory = memory
        self.requested_workers = workers
        self.batch_size = batch_size
        self.num_cpus = num_cpus
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        self.max_restarts = max_restarts
        #: The memory each worker asked Ray for, in bytes (known once iteration began).
        self.peak: int | None = None
        #: Chunks of call indices; each runs as one ``map`` on one worker.
        self.chunks: list[list[int]] = []
        #: Worker actors (handles), by label.
        self.workers: dict[str, Any] = {}
        #: Where each worker last ran: label -> {"pid", "node_id", "threads"}.
        self.placement: dict[str, dict[str, Any]] = {}
        #: Who ran each finished chunk: chunk -> {"label", "pid", "node_id", "threads"}.
        #: A pid that changes under one label is a worker Ray restarted.
        self.ran: dict[int, dict[str, Any]] = {}
        #: The collected trace files (after the batch ended, with ``trace_dir``).
        self.traces: list[Path] = []
        self._started_ray = False
        self._used = False

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self._used:
            raise RuntimeError("a BatchStream runs once; call stream_batch() again")
        self._used = True
        if not self.calls:
            return
        from ._cluster import connect

        self._started_ray = connect()
        try:
            yield from self._run()
        finally:
            self._stop()

    # -- internals -----------------------------------------------------------------------
    def _resolve_memory(self) -> tuple[int, dict[int, Any]]:
        """The per-worker request in bytes, and the probe's result if it ran one."""
        memory = self.memory  # its form was checked in __init__
        if isinstance(memory, int):
            return memory, {}
        if isinstance(memory, str) and memory.strip().lower() == "auto":
            from ._predictor import probe_remote

            peak, result, _ = probe_remote(
                self.make_pipeline, self.calls[0], num_cpus=self.num_cpus, trace_dir=self.trace_dir
            )
            if self.trace_dir is not None:
                self.traces.append(self.trace_dir / "probe.jsonl")
            return peak, {0: result}
        if isinstance(memory, os.PathLike) or (isinstance(memory, str) and os.path.isfile(memory)):
            from ._cluster import peak_from

            return peak_from(memory), {}
        return parse_size(memory), {}

    def _run(self) -> Iterator[tuple[int, Any]]:
        import ray
        from ray.util import ActorPool

        self.peak, done = self._resolve_memory()
        yield from done.items()
        fit = fitting_workers(self.peak, self.num_cpus)
        room = sum(fit.values())
        if room == 0:
            raise RuntimeError(
                f"no alive Ray node has room for a worker that needs {format_size(self.peak)} "
                f"(memory=) and {self.num_cpus} CPUs; nodes: {_nodes_text()}. Add a node with "
                f"more memory, or give a smaller memory= if the peak was over-measured"
            )
        todo = [i for i in range(len(self.calls)) if i not in done]
        if not todo:
            return
        n = min(self.requested_workers or room, len(todo))
        self.chunks = [[todo[k] for k in chunk] for chunk in _chunks(len(todo), n, self.batch_size)]
        n = min(n, len(self.chunks))
        # Ray's fault tolerance: a dead actor is started again (max_restarts) and the
        # chunks it had are retried on it (max_task_retries=-1: as long as it restarts).
        # An exception raised by the pipeline is not retried: it ends the batch.
        actor_cls = ray.remote(StagedRunner).options(
            memory=self.peak,
            num_cpus=self.num_cpus,
            max_restarts=self.max_restarts,
            max_task_retries=-1,
        )
        for k in range(n):
            self.workers[f"worker-{k}"] = actor_cls.remote(self.make_pipeline, f"worker-{k}")
        pool = ActorPool(list(self.workers.values()))
        for chunk, indices in enumerate(self.chunks):
            calls = [self.calls[i] for i in indices]
            pool.submit(lambda actor, job: actor.run.remote(*job), (chunk, calls))
        lost = _lost_worker_errors()
        while pool.has_next():
            try:
                info, chunk, results = pool.get_next_unordered()
            except lost as exc:
                raise RuntimeError(
                    f"a worker died and Ray did not restart it (max_restarts="
                    f"{self.max_restarts} per worker, Ray's actor option): {exc}. Give a "
                    f"larger max_restarts= (or -1) to keep going"
                ) from exc
            self.ran[chunk] = info
            self.placement[info["label"]] = {k: v for k, v in info.items() if k != "label"}
            yield from zip(self.chunks[chunk], results, strict=True)
        finishing = {label: a.finish.remote() for label, a in self.workers.items()}
        for label, ref in finishing.items():
            # One that died after its last chunk: its results are in, its trace is not.
            with contextlib.suppress(*lost):
                self._save_trace(label, ray.get(ref))

    def _save_trace(self, label: str, text: str) -> None:
        if self.trace_dir is None:
            return
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"{label}.jsonl"
        path.write_text(text, encoding="utf-8")
        self.traces.append(path)

    def _stop(self) -> None:
        import ray

        for actor in self.workers.values():
            ray.kill(actor)
        self.workers = {}
        if self._started_ray:
            ray.shutdown()


def _lost_worker_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    # A dead actor that Ray gave up on (restarts used up, node gone). An exception raised
    # by the pipeline is a RayTaskError and passes through as it is.
    return (
        rex.RayActorError,
        rex.WorkerCrashedError,
        rex.OutOfMemoryError,
        rex.NodeDiedError,
        rex.LocalRayletDiedError,
    )


def _check_call(call: Any) -> None:
    # On the driver, before any worker starts; call_kwargs makes the generator there.
    if not isinstance(call, Mapping):
        call_kwargs(call)  # raises its TypeError
    seed = call.get(SEED_KEY)
    if SEED_KEY in call and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"a call's 'seed' must be an int, got {seed!r}; e.g. 'seed': 0")


def _nodes_text() -> str:
    import ray

    return ", ".join(
        f"{n.get('NodeManagerAddress')}: memory {format_size(int(n['Resources'].get('memory', 0)))}"
        f", CPU {n['Resources'].get('CPU', 0)}"
        for n in ray.nodes()
        if n.get("Alive")
    )
