"""What runs on the Ray side: the worker actor's body and the probe that measures a peak.

Both meter their own process with ``MemoryMeter`` and point ``STAGELOAD_TRACE`` at that
trace before the pipeline is built, so every ``StagedModels`` the pipeline makes appends
its loads, releases and stages there (the outer-trace contract, ``stageload.outer``).
Nothing here imports ray: the classes are wrapped with ``ray.remote`` by the driver.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core.outer import TRACE_ENV

#: The key of a call that becomes its ``generator=`` on the worker.
SEED_KEY = "seed"
# A worker's samples: often enough to catch a stage's peak on small test pipelines.
SAMPLE_INTERVAL = 0.05


def call_kwargs(call: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments for one call: an integer ``seed`` becomes
    ``generator=torch.Generator().manual_seed(seed)`` (generators do not cross processes)."""
    if not isinstance(call, Mapping):
        raise TypeError(
            f"each call must be a dict of keyword arguments for the pipeline, e.g. "
            f"{{'prompt': 'a cat', 'seed': 0}}, got {call!r}"
        )
    kwargs = dict(call)
    if SEED_KEY in kwargs:
        seed = kwargs.pop(SEED_KEY)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"a call's 'seed' must be an int, got {seed!r}; e.g. 'seed': 0")
        if "generator" in kwargs:
            raise ValueError(
                f"a call gives both 'seed' ({seed!r}) and 'generator'; give one of them"
            )
        import torch

        kwargs["generator"] = torch.Generator().manual_seed(seed)
    return kwargs


def run_calls(pipe: Any, calls: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Run ``calls`` on ``pipe`` stage-major, through ``pipe.stageload.map``."""
    state = getattr(pipe, "stageload", None)
    if not callable(getattr(state, "map", None)):
        raise TypeError(
            f"make_pipeline must return a staged pipeline (stageload.diffusers."
            f"staged_pipeline) or an object whose .stageload.map(calls) runs a batch; "
            f"got {type(pipe).__name__}, which has no .stageload.map"
        )
    return list(state.map([call_kwargs(c) for c in calls]))


class _Metered:
    """A MemoryMeter on this process, with the outer trace pointed at it."""

    def __init__(self, label: str, meta: Mapping[str, Any]) -> None:
        from ..meter import MemoryMeter

        self.dir = tempfile.mkdtemp(prefix="stageload-ray-")
        self.path = os.path.join(self.dir, f"{label}.jsonl")
        info = {"label": label, "host": socket.gethostname(), "pid": os.getpid(), **meta}
        self.meter = MemoryMeter(self.path, SAMPLE_INTERVAL, meta=info)
        self.meter.start()
        # Read by each StagedModels when it is built: make_pipeline's go to this trace.
        os.environ[TRACE_ENV] = self.path

    def finish(self) -> str:
        """Stop the meter; the trace's text (the folder is removed)."""
        if self.meter.running:
            self.meter.stop()
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class Worker:
    """A Ray actor's body: builds the pipeline once, runs chunks of calls stage-major."""

    def __init__(self, make_pipeline: Callable[[], Any], label: str) -> None:
        import ray

        self.label = label
        self._metered = _Metered(label, {"node": ray.util.get_node_ip_address()})
        self.pipe = make_pipeline()

    def ready(self) -> dict[str, Any]:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return {"label": self.label, "pid": os.getpid(), "node_id": node_id}

    def run(self, chunk: int, calls: Sequence[Mapping[str, Any]]) -> list[Any]:
        self._metered.meter.mark(f"chunk {chunk}")
        return run_calls(self.pipe, calls)

    def finish(self) -> str:
        return self._metered.finish()


def probe(make_pipeline: Callable[[], Any], call: Mapping[str, Any]) -> tuple[int, Any, str]:
    """Build the pipeline and run one call under a meter: (peak footprint, result, trace)."""
    from ..report.trace import load_summary

    metered = _Metered("probe", {})
    result = run_calls(make_pipeline(), [call])[0]
    metered.meter.stop()
    peak = load_summary(metered.path).peak_footprint
    text = metered.finish()
    if not peak:
        raise RuntimeError("the probe run's trace has no footprint sample; give memory= in bytes")
    return peak, result, text
