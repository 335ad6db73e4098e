"""The driver's side of a batch: start workers, hand out chunks, survive dead workers.

No scheduler of our own beyond handing the next chunk to whichever worker is free: Ray
places the actors (by their ``memory=`` and CPU requests), and ``ray.wait`` says which
worker finished or died. Only the thread iterating the stream touches its state.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..units import format_size, parse_size
from ._worker import SEED_KEY, Worker, call_kwargs, probe


@dataclass(frozen=True)
class Fault:
    """A chunk whose worker died before returning it; the chunk was run again."""

    chunk: int
    worker: str
    error: str


def _lost_worker_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    # A dead actor (ray.kill, a crash, the OOM killer, its node gone): the chunk is
    # run again elsewhere. An exception raised by the pipeline itself is a RayTaskError
    # and ends the batch instead.
    return (
        rex.RayActorError,
        rex.WorkerCrashedError,
        rex.OutOfMemoryError,
        rex.NodeDiedError,
        rex.LocalRayletDiedError,
    )


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
        max_restarts: int | None,
    ) -> None:
        if not callable(make_pipeline):
            raise TypeError(
                f"make_pipeline must be a zero-argument function that returns the pipeline "
                f"(e.g. functools.partial(load, path)), got {make_pipeline!r}"
            )
        self.calls = list(calls)
        for call in self.calls:
            _check_call(call)
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
        ):
            raise ValueError(f"workers must be a positive int or None, got {workers!r}")
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
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
        #: Live worker actors (handles), by label.
        self.workers: dict[str, Any] = {}
        #: Where each worker ran: label -> {"pid", "node_id"}.
        self.placement: dict[str, dict[str, Any]] = {}
        #: Which worker ran each finished chunk: chunk -> label.
        self.ran: dict[int, str] = {}
        self.faults: list[Fault] = []
        #: The chunk each worker is running now: label -> chunk.
        self.busy: dict[str, int] = {}
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
        from . import connect

        self._started_ray = connect()
        try:
            yield from self._run()
        finally:
            self._stop()

    # -- internals -----------------------------------------------------------------------
    def _resolve_memory(self) -> tuple[int, dict[int, Any]]:
        """The per-worker request in bytes, and the probe's result if it ran one."""
        import ray

        memory = self.memory  # its form was checked in __init__
        if isinstance(memory, int):
            return memory, {}
        if isinstance(memory, str) and memory.strip().lower() == "auto":
            task = ray.remote(num_cpus=self.num_cpus, max_calls=1)(probe)
            peak, result, text = ray.get(task.remote(self.make_pipeline, self.calls[0]))
            self._save_trace("probe", text)
            return int(peak), {0: result}
        if isinstance(memory, os.PathLike) or (isinstance(memory, str) and os.path.isfile(memory)):
            from . import peak_from

            return peak_from(memory), {}
        return parse_size(memory), {}

    def _run(self) -> Iterator[tuple[int, Any]]:
        import ray

        lost = _lost_worker_errors()
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
        n = self.requested_workers or room
        self.chunks = _chunks(len(todo), min(n, len(todo)), self.batch_size)
        self.chunks = [[todo[k] for k in chunk] for chunk in self.chunks]
        n = min(n, len(self.chunks))
        restarts = n if self.max_restarts is None else self.max_restarts
        actor_cls = ray.remote(Worker)
        pending = deque(range(len(self.chunks)))
        refs: dict[Any, tuple[str, str, int | None]] = {}  # ref -> (kind, label, chunk)
        idle: list[str] = []
        started = 0

        def start_worker() -> None:
            nonlocal started
            label = f"worker-{started}"
            started += 1
            actor = actor_cls.options(memory=self.peak, num_cpus=self.num_cpus).remote(
                self.make_pipeline, label
            )
            self.workers[label] = actor
            refs[actor.ready.remote()] = ("ready", label, None)

        def give(label: str) -> None:
            if pending:
                chunk = pending.popleft()
                calls = [self.calls[i] for i in self.chunks[chunk]]
                refs[self.workers[label].run.remote(chunk, calls)] = ("run", label, chunk)
                self.busy[label] = chunk
            else:
                idle.append(label)

        for _ in range(n):
            start_worker()
        while pending or any(kind == "run" for kind, _, _ in refs.values()):
            if not refs:
                raise RuntimeError(
                    f"every worker died and no restarts are left ({len(self.faults)} faults: "
                    f"{self.faults!r}); raise max_restarts= to keep trying"
                )
            (ref,), _ = ray.wait(list(refs), num_returns=1)
            kind, label, chunk = refs.pop(ref)
            if chunk is not None:
                self.busy.pop(label, None)
            try:
                value = ray.get(ref)
            except lost as exc:
                if getattr(exc, "actor_init_failed", False):
                    raise  # make_pipeline itself failed: a restart would fail the same way
                self.workers.pop(label, None)
                if chunk is not None:
                    pending.appendleft(chunk)
                    self.faults.append(Fault(chunk, label, type(exc).__name__))
                if idle and pending:
                    give(idle.pop(0))
                elif restarts > 0 and pending:
                    restarts -= 1
                    start_worker()
                continue
            # The worker gets its next chunk before the results go out, so it computes
            # while the caller handles them.
            give(label)
            if kind == "ready":
                self.placement[label] = value
            else:
                assert chunk is not None
                self.ran[chunk] = label
                yield from zip(self.chunks[chunk], value, strict=True)
        for label in list(self.workers):
            if label not in self.placement:  # never started (no room yet): not needed
                ray.kill(self.workers.pop(label))
        finishing = {label: a.finish.remote() for label, a in self.workers.items()}
        for label, ref in finishing.items():
            try:
                self._save_trace(label, ray.get(ref))
            except lost:  # died after its last chunk: its results are in, its trace is not
                self.workers.pop(label, None)

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
