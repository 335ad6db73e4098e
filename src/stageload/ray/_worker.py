"""What runs on the Ray side: the staged runner (an actor's body), rows to calls, the probe.

Each runner meters its own process with ``MemoryMeter`` and points ``STAGELOAD_TRACE`` at
that trace before the pipeline is built, so every ``StagedModels`` the pipeline makes
appends its loads, releases and stages there (the outer-trace contract, ``stageload.core.outer``).
Nothing here imports ray at module level: the driver wraps these with ``ray.remote``, and
Ray Data builds :class:`~stageload.ray.StagedPredictor` itself.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
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


def ray_threads(num_cpus: float = 1) -> int:
    """The torch thread count of a Ray worker with ``num_cpus`` CPUs: Ray sets
    ``OMP_NUM_THREADS`` to ``max(1, floor(num_cpus))`` when it is not set already."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env is not None and env.isdigit() and int(env) > 0:
        return int(env)  # Ray leaves a value it finds alone, and workers inherit it
    return max(1, math.floor(num_cpus))


@contextlib.contextmanager
def worker_threads(num_cpus: float = 1) -> Iterator[int]:
    """Run torch here with the thread count of a Ray worker of ``num_cpus`` CPUs.

    For the local reference run: CPU kernels can round differently with another thread
    count, so a bit-for-bit comparison needs the same count on both sides::

        with worker_threads(1):
            local = [pipe(**call_kwargs(c)) for c in calls]
    """
    import torch

    before = torch.get_num_threads()
    threads = ray_threads(num_cpus)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def rows_to_calls(batch: Any) -> list[dict[str, Any]]:
    """A Ray Data batch (a dict of column arrays, or a pandas DataFrame) as one call per row.

    Columns become keyword arguments, numpy scalars become Python values (so an integer
    ``seed`` stays an ``int``), and a ``None`` (a row without that column) is left out.
    """
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas, without importing it
        batch = {str(c): batch[c].to_numpy() for c in batch.columns}
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"StagedPredictor needs a batch of rows: a dict of columns (batch_format='numpy', "
            f"Ray Data's default) or a pandas DataFrame; got {type(batch).__name__}"
        )
    columns = {k: [_plain(x) for x in v] for k, v in batch.items()}
    sizes = {len(v) for v in columns.values()}
    if len(sizes) > 1:
        raise ValueError(f"the batch's columns differ in length: {sorted(sizes)}")
    n = sizes.pop() if sizes else 0
    return [{k: v[i] for k, v in columns.items() if v[i] is not None} for i in range(n)]


def _plain(value: Any) -> Any:
    # A numpy scalar (np.int64 from an int column, np.str_) as its Python value; arrays
    # (an image column) stay arrays.
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def output_value(result: Any) -> Any:
    """What goes into the ``images`` column for one call: its ``.images`` as a numpy array
    (a diffusers output), or the result as it is."""
    images = getattr(result, "images", None)
    if images is None:
        return result
    import numpy as np

    if isinstance(images, (list, tuple)):  # PIL images (output_type="pil")
        return np.stack([np.asarray(im) for im in images])
    if hasattr(images, "detach"):  # a torch tensor (output_type="pt")
        return images.detach().cpu().numpy()
    return np.asarray(images)


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
    """A MemoryMeter on this process, with the outer trace pointed at it.

    In ``folder`` when given (the trace stays there), else in a temporary folder whose
    text :meth:`finish` returns (for a driver on another machine).
    """

    def __init__(self, label: str, meta: Mapping[str, Any], folder: str | None = None) -> None:
        from ..meter import MemoryMeter

        self.temporary = folder is None
        self.dir = tempfile.mkdtemp(prefix="stageload-ray-") if folder is None else folder
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, f"{label}.jsonl")
        info = {"label": label, "host": socket.gethostname(), "pid": os.getpid(), **meta}
        self.meter = MemoryMeter(self.path, SAMPLE_INTERVAL, meta=info)
        self.meter.start()
        # Read by each StagedModels when it is built: make_pipeline's go to this trace.
        os.environ[TRACE_ENV] = self.path

    def finish(self) -> str:
        """Stop the meter; the trace's text (a temporary folder is removed)."""
        if self.meter.running:
            self.meter.stop()
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read()
        finally:
            if self.temporary:
                shutil.rmtree(self.dir, ignore_errors=True)


def _where() -> dict[str, Any]:
    """This worker's pid, node id and torch threads (node id is None outside Ray)."""
    import torch

    node_id = None
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
    return {"pid": os.getpid(), "node_id": node_id, "threads": torch.get_num_threads()}


class StagedRunner:
    """Builds the pipeline once in this process, under a meter; runs lists of calls on it.

    The body of ``run_batch``'s actors, and the base of ``StagedPredictor``. ``threads``
    sets torch's thread count (default: leave Ray's, ``OMP_NUM_THREADS``).
    """

    def __init__(
        self,
        make_pipeline: Callable[[], Any],
        label: str | None = None,
        *,
        trace_dir: str | os.PathLike[str] | None = None,
        threads: int | None = None,
    ) -> None:
        if not callable(make_pipeline):
            raise TypeError(
                f"make_pipeline must be a zero-argument function that returns the pipeline "
                f"(e.g. functools.partial(load, path)), got {make_pipeline!r}"
            )
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        where = _where()
        if label is None:  # Ray Data names no actor: node and pid make one unique label
            label = f"actor-{(where['node_id'] or 'local')[:8]}-{where['pid']}"
        self.label = label
        folder = None if trace_dir is None else os.fspath(Path(trace_dir).absolute())
        self._metered = _Metered(label, where, folder)
        self.batches = 0
        self.pipe = make_pipeline()

    def info(self) -> dict[str, Any]:
        """Label, pid, node id and torch threads of this worker."""
        return {"label": self.label, **_where()}

    def run(self, chunk: int, calls: Sequence[Mapping[str, Any]]) -> tuple[dict, int, list]:
        """Run ``calls`` stage-major: ``(self.info(), chunk, results)``."""
        self._metered.meter.mark(f"batch {chunk}")
        self.batches += 1
        return self.info(), chunk, run_calls(self.pipe, calls)

    def finish(self) -> str:
        """Stop the meter; the trace's text."""
        return self._metered.finish()


def probe(
    make_pipeline: Callable[[], Any], call: Mapping[str, Any], preload: Sequence[str] = ()
) -> tuple[int, Any, str]:
    """Build the pipeline and run one call twice under a meter (the second run reloads
    what the first released): (peak footprint, the first result, trace).

    ``preload``: modules to import first, those the measured worker will hold too (a Ray
    Data actor holds ``ray.data``, pyarrow and pandas: about 50 MiB).
    """
    import importlib

    from ..report.trace import load_summary

    for name in preload:
        importlib.import_module(name)
    metered = _Metered("probe", _where())
    pipe = make_pipeline()
    result = run_calls(pipe, [call])[0]
    # Again, so the peak covers a reload too: a worker's later batches reload models it
    # released, and a reload can take more memory than the first load (the diffusers
    # adapter's first load maps the file, not counted in the footprint; its reload fills
    # anonymous memory: 578 vs 339 MiB on the 0.25 GB Qwen-Image fixture).
    metered.meter.mark("again")
    run_calls(pipe, [call])
    metered.meter.stop()
    peak = load_summary(metered.path).peak_footprint
    text = metered.finish()
    if not peak:
        raise RuntimeError("the probe run's trace has no footprint sample; give memory= in bytes")
    return peak, result, text
