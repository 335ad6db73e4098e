"""How one load runs: on which thread, under which RNG guard, with one future per model.

Split out of staged.py (``StagedModels`` mixes ``LoadJobs`` in). Every load, on any thread,
registers a :class:`_Job` under the registry's lock, then runs its loader without the lock;
whoever else asks for that model waits on the job's future instead of loading it again.
A job on the prefetch thread runs without ``preserved_rng()`` (it would restore a stale
state over the main thread's draws), which is why only rng-free loaders go there.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext, suppress
from typing import TYPE_CHECKING, Any

from ._errors import PicklableError
from .events import LOAD, NOTE, PREFETCH, RELOAD, Event
from .release import is_released, module_bytes
from .rng import preserved_rng

if TYPE_CHECKING:
    from torch import nn

#: The name of the time before the first stage is entered.
SETUP = "setup"


class ModelLoadError(PicklableError, RuntimeError):
    """A loader raised. The registry is left as it was; the cause is chained."""

    def __init__(self, name: str, stage: str | None, cause: BaseException) -> None:
        self.name = name
        self.stage = stage
        super().__init__(
            f"loading model {name!r} for stage {stage or SETUP!r} failed: "
            f"{type(cause).__name__}: {cause}"
        )


def _check_module(name: str, module: object) -> Exception | None:
    """What is wrong with a loader's result, if anything."""
    from torch import nn

    if not isinstance(module, nn.Module):
        return TypeError(
            f"the loader for {name!r} returned {type(module).__module__}."
            f"{type(module).__qualname__}, not a torch.nn.Module; make it return the "
            f"model itself (e.g. `return MyModel.from_pretrained(path)`)"
        )
    if is_released(module):
        return ValueError(
            f"the loader for {name!r} returned a module that was already released; "
            f"it must build a new module on every call instead of caching one"
        )
    return None


class _Job:
    """One load in progress: the future its waiters share, and the thread running it."""

    def __init__(self, name: str, background: bool, purpose: str | None = None) -> None:
        self.name = name
        self.background = background
        self.purpose = purpose  # the stage a prefetch is for
        self.future: Future[nn.Module] = Future()


class LoadJobs:
    """The loading half of ``StagedModels``: it provides the registry's state (``_lock``,
    ``_local``, ``_jobs``, ``_loaders``, ``_models``, ``_sizes``, ``_ever_loaded``,
    ``_stage``, ``preserve_rng``) and ``_emit`` and ``_check_budget``."""

    _lock: threading.RLock
    _local: threading.local
    _jobs: dict[str, _Job]
    _loaders: dict[str, Any]
    _models: dict[str, Any]
    _sizes: dict[str, int]
    _ever_loaded: set[str]
    _stage: str | None
    preserve_rng: bool

    def _emit(self, event: Event) -> None:
        raise NotImplementedError

    def _check_budget(self, stage: str | None, after: str | None = None) -> None:
        raise NotImplementedError

    def _loading(self) -> list[str]:
        if not hasattr(self._local, "loading"):
            self._local.loading = []
        return self._local.loading

    def _in_background(self) -> bool:
        return getattr(self._local, "background", False)

    def _cycle_error(self, name: str) -> None:
        # A loader may use another model (models["backbone"]), but a cycle would wait on
        # its own future forever.
        loading = self._loading()
        cycle = " -> ".join([*loading[loading.index(name) :], name])
        raise RuntimeError(
            f"the loader for {name!r} needs {name!r} itself ({cycle}); a loader must "
            f"build its model, not ask the registry for it"
        )

    def _start(self, name: str, *, background: bool, purpose: str | None = None) -> _Job:
        """Register a load (lock held): from now on, others asking for ``name`` wait."""
        job = _Job(name, background, purpose)
        self._jobs[name] = job
        return job

    def _run_background(self, job: _Job) -> None:
        self._local.background = True
        with suppress(Exception):  # kept in the job's future; raised at first use
            self._run(job)

    def _wait_background(self) -> None:
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.background]
        for job in jobs:
            job.future.exception()  # waits; a failure is raised at first use, not here

    def _wait(self, job: _Job) -> nn.Module:
        """The job's module; a failed load raises ModelLoadError here (once, for a prefetch)."""
        try:
            return job.future.result()
        except Exception as exc:
            with self._lock:
                if self._jobs.get(job.name) is job:
                    del self._jobs[job.name]  # seen: the next access loads again
            raise ModelLoadError(job.name, self._stage, exc) from exc

    def _run(self, job: _Job) -> None:
        """Run ``job``'s loader on this thread, without the lock, and install its module."""
        name, stage = job.name, self._stage
        # preserved_rng() only works on the thread that draws: in the background it would
        # restore a stale state over the main thread's draws (hence rng_free loaders only).
        guard = preserved_rng() if self.preserve_rng and not job.background else nullcontext()
        loading = self._loading()
        start = time.perf_counter()
        loading.append(name)
        try:
            with guard:
                module = self._loaders[name]()
        except Exception as exc:
            self._failed(job, stage, exc)
            raise ModelLoadError(name, stage, exc) from exc
        finally:
            loading.pop()
        problem = _check_module(name, module)
        if problem is not None:
            self._failed(job, stage, problem)
            raise problem
        seconds = time.perf_counter() - start
        with self._lock:
            # Count only what this load added: a backbone that another loaded model already
            # holds (see share()) is not counted twice.
            nbytes = module_bytes(module, exclude=self._models.values())
            kind = PREFETCH if job.background else RELOAD if name in self._ever_loaded else LOAD
            self._models[name] = module
            self._sizes[name] = nbytes
            self._ever_loaded.add(name)
            del self._jobs[name]
            note = f"for stage {job.purpose!r}" if job.purpose else None
            self._emit(
                Event(kind, model=name, stage=stage, bytes=nbytes, seconds=seconds, note=note)
            )
            if not job.background:
                self._check_budget(stage, after=name)
        job.future.set_result(module)

    def _failed(self, job: _Job, stage: str | None, exc: Exception) -> None:
        with self._lock:
            if not job.background:
                del self._jobs[job.name]  # the registry is left as it was
            else:  # kept until first use, which raises it
                self._emit(
                    Event(
                        NOTE,
                        model=job.name,
                        stage=stage,
                        note=f"prefetch of {job.name!r} failed ({type(exc).__name__}: {exc}); "
                        f"its first use raises ModelLoadError",
                    )
                )
        job.future.set_exception(exc)
