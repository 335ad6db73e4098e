"""StagedModels: load a model when a stage first asks for it, release it when no longer planned.

Threads: one thread drives the stages (``enter``, ``evict``, ``close``) and is the only one
that releases. Other threads may call ``models[name]`` and the models it returns. Each
model handed out counts its calls in flight (a hook of the one protocol, ``COUNTED``), and
a release waits for them on another thread's behalf, without the registry's lock held (a
call may itself ask ``models[...]``): a model is never released under a running call.
``models[name]`` hands out only a model still resident as it returns; one released after
(the driving thread entered a stage without it) raises ``ReleasedModuleError`` when
called, never computes on freed memory. Prefetch loads run on one background thread and
never release. Every load, on any thread, goes through one future per model name, so a
model is never loaded twice at once, and the registry's lock is never held while a loader
runs. A load interrupted (``KeyboardInterrupt``, ``SystemExit``, any ``BaseException``)
leaves the registry as it was: the next access loads again.

Under a budget, a load that reveals a size (the first load of a model without ``sizes=``)
releases at once, on the driving thread, what the budget no longer holds (the policy's
``after_load``), before the stage's code gets the model. The entered stage's models, pinned
ones, and every model handed out in this stage stay. A load on the prefetch thread, or on
a thread other than the driving one, only marks that check as due; the driving thread
runs it at its next ``enter`` or ``models[...]``.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from contextlib import nullcontext, suppress
from typing import TYPE_CHECKING, Any

from ..errors import StageloadError
from ..hooks.registry import HookRegistry, ModuleHook
from ..hooks.release import (
    held_elsewhere,
    is_released,
    module_bytes,
    release,
    releasing,
    to_the_end,
    warn_cut,
)
from ..load.loaders import ready_for_background
from ..load.progress import PREFETCH_THREAD
from ..load.reader import background_thread
from ..memory.budget import parse_budget
from .batch import Batch, current_batch
from .events import (
    LOAD,
    NOTE,
    PREFETCH,
    REASON_BUDGET,
    REASON_CLOSE,
    REASON_EVICT,
    RELEASE,
    RELOAD,
    SETUP,
    STAGE,
    Event,
    EventSink,
)
from .outer import outer_trace
from .plan import Plan, check_plan
from .policy import (
    PolicySteps,
    PolicyView,
    ResidencyPolicy,
    Timings,
    check_sizes,
    choose_policy,
    over_budget,
    prefetchable,
    unprefetchable,
)
from .rng import preserved_rng

if TYPE_CHECKING:
    from torch import nn

Loader = Callable[[], "nn.Module"]


#: The hook every model handed out by a ``StagedModels`` carries: it changes nothing; a
#: hooked module counts its calls in flight, which a release waits for (hooks/registry).
COUNTED = "counted"


class ModelLoadError(StageloadError, RuntimeError):
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


def _fingerprint(module: nn.Module) -> dict[str, Any]:
    """What a release drops unsaid: each parameter's and stored buffer's name, dtype and
    shape. Not computed buffers (a rotary cache grown with the sequence: the loader's model
    grows it again), nor values or in-place changes (a streamed model's blocks are written
    in place by every load)."""
    from ..load.weights import targets

    return {
        name: (target.tensor.dtype, tuple(target.tensor.shape))
        for target in targets(module)
        if target.persistent
        for name in target.names
    }


def _changed(then: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How ``now`` differs from ``then`` (both :func:`_fingerprint`), or None."""
    if then.keys() != now.keys():
        extra = sorted(then.keys() ^ now.keys())
        return f"parts added or removed: {extra[0]}" + (", ..." if len(extra) > 1 else "")
    for name, (dtype, shape) in now.items():
        was_dtype, was_shape = then[name]
        if (dtype, shape) != (was_dtype, was_shape):
            return f"{name} changed from {was_dtype} {list(was_shape)} to {dtype} {list(shape)}"
    return None


def _graded(module: nn.Module) -> str | None:
    """The first parameter of ``module`` holding a gradient (``.grad``), said as a change a
    release drops: the reload is the loader's model, without it (a gradient accumulated
    before the optimizer's step is lost)."""
    name = next((n for n, p in module.named_parameters() if p.grad is not None), None)
    return None if name is None else f"gradients accumulated in {name}.grad"


class _Doomed:
    """A model taken out of the registry (no longer handed out), to be released by the
    thread that took it out, once no lock is held."""

    def __init__(self, name: str, module: nn.Module, stage: str | None, reason: str | None):
        self.name = name
        self.module = module
        self.stage = stage
        self.reason = reason
        self.thread = threading.get_ident()


class _Job:
    """One load in progress: the future its waiters share, and the thread running it."""

    def __init__(self, name: str, background: bool, purpose: str | None = None) -> None:
        self.name = name
        self.background = background
        self.purpose = purpose  # the stage a prefetch is for
        self.future: Future[nn.Module] = Future()
        # Another load ran at the same time (a load on demand beside a prefetch): both
        # shared the disk and cores, so this one's time says little of either alone.
        self.overlapped = False


class StagedModels(Mapping[str, "nn.Module"]):
    """A mapping from model name to ``nn.Module`` that loads and releases by stage.

    Example::

        models = StagedModels(
            {"encoder": load_encoder, "decoder": load_decoder},
            stages={"encode": ["encoder"], "decode": ["decoder"]},
        )
        models.enter("encode")
        h = models["encoder"](x)     # loaded now
        models.enter("decode")       # encoder released here
        y = models["decoder"](h)

    ``budget`` (bytes, ``"12G"``, ``"80%"`` or ``"auto"``) keeps models across stages while
    they fit and evicts by furthest next use (:class:`~stageload.FurthestNextUse`);
    ``sizes`` gives each model's bytes before its first load (else learned then).
    ``prefetch=True`` loads the next stage's models in a background thread, for loaders
    marked :func:`~stageload.rng_free`; ``prefetch=["name", ...]`` opts named models
    in instead (their loaders must draw no random numbers: see docs/residency.md).

    ``in``, ``len()`` and iterating names never load; ``models.values()`` and
    ``dict(models)`` do, as for any mapping.
    """

    def __init__(
        self,
        loaders: Mapping[str, Loader],
        *,
        stages: Mapping[str, Iterable[str]],
        pinned: Iterable[str] = (),
        events: EventSink | None = None,
        preserve_rng: bool = True,
        policy: ResidencyPolicy | None = None,
        budget: int | str | None = None,
        prefetch: bool | Iterable[str] = False,
        sizes: Mapping[str, int | str] | None = None,
    ) -> None:
        self._loaders = dict(loaders)
        self._plan = check_plan(self._loaders, stages, pinned)
        self._pinned = frozenset(pinned)
        if events is not None and not callable(getattr(events, "emit", None)):
            raise TypeError(
                f"events must be an EventSink (an object with emit(event)), such as "
                f"ListSink() or JsonlSink('trace.jsonl'); got {events!r}"
            )
        self._sink = events
        # Under `stageload meter` or `guard --trace`, events also go to that tool's trace
        # (STAGELOAD_TRACE; see stageload.outer), alongside the sink given here.
        self._outer = outer_trace()
        self.preserve_rng = preserve_rng
        self._given_sizes = check_sizes(sizes, self._loaders)
        self._prefetchable = prefetchable(prefetch, self._loaders)
        self.prefetch = bool(self._prefetchable) or prefetch is True
        self.budget: int | None = None if budget is None else parse_budget(budget)
        self.policy: ResidencyPolicy = choose_policy(policy, self.budget, self.prefetch)
        self._steps = PolicySteps.of(self.policy)
        self._models: dict[str, nn.Module] = {}
        self._sizes: dict[str, int] = {}
        self._ever_loaded: set[str] = set()
        self._stage: str | None = None
        self._noted: set[str] = set()
        self._over_noted = False  # the over-budget note was given in this stage
        self._jobs: dict[str, _Job] = {}  # loads in flight (or failed prefetches not yet seen)
        self._doomed: list[_Doomed] = []  # taken out, to be released outside the lock
        self._driver: int | None = None  # the thread that entered the current stage
        self._local = threading.local()  # .loading: this thread's nested loads, outermost first
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()
        self._batch: Batch | None = None  # set by map() while its calls run
        self._used: set[str] = set()  # handed out in this stage: never released by a trim
        self._trim_due = False  # a background load revealed a size: trim on the driving thread
        self._timings = Timings()  # what the cost model of prefetch weighs
        # Each loaded model (weakly) and its _fingerprint as loaded.
        self._as_loaded: dict[str, tuple[Callable[[], nn.Module | None], dict[str, Any]]] = {}
        # Released models changed since their load: the model (weakly), and what changed.
        self._dropped: dict[str, tuple[Callable[[], nn.Module | None], str]] = {}
        self._warned: set[str] = set()  # models whose dropped change a warning told of
        if self.prefetch:
            note = unprefetchable(self._plan, self._prefetchable)
            if note is not None:
                self.emit(Event(NOTE, note=note))

    # -- mapping -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> nn.Module:
        if name not in self._loaders:
            raise KeyError(f"no model named {name!r}; known models: {', '.join(self._loaders)}")
        background = self._in_background()
        outermost = not self._loading()
        try:
            while True:
                with self._lock:
                    self._used.add(name)
                    if self._trim_due and self._drives():
                        self._trim(self._stage)
                    module = self._models.get(name)
                    job = None if module is not None else self._jobs.get(name)
                    run = False
                    if module is None and job is None:
                        job, run = self._start(name, background=background), True
                    elif job is not None and name in self._loading():
                        self._cycle_error(name)
                if job is not None:
                    start = time.perf_counter()
                    if run:
                        self._run(job)
                    module = self._wait(job)
                    if outermost and not background:  # not compute: the cost model's inputs
                        self._timings.blocked += time.perf_counter() - start
                with self._lock:
                    # Still resident: a load waited for may have been released since, by a
                    # stage change on the driving thread; then it is loaded again.
                    if self._models.get(name) is module:
                        self._note_unplanned(name)
                        return module
        finally:
            self._drain()  # what a trim took out above, now that no lock is held

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def __repr__(self) -> str:
        return (
            f"StagedModels(stage={self.stage!r}, loaded={self.loaded()!r}, "
            f"models={list(self._loaders)!r})"
        )

    # -- state ---------------------------------------------------------------------------
    @property
    def stage(self) -> str | None:
        """The current stage, or ``None`` before the first :meth:`enter` (the setup)."""
        return self._stage

    @property
    def stages(self) -> dict[str, tuple[str, ...]]:
        """The stage plan: stage name -> model names, in pipeline order."""
        return dict(self._plan)

    @property
    def plan(self) -> Plan:
        """The stage plan as a :class:`~stageload.core.plan.Plan`: ask it for the order,
        the next stage (calls cycle) and a model's next use."""
        return self._plan

    def replan(self, stages: Mapping[str, Iterable[str]]) -> None:
        """Replace the stage plan (an adapter that learns where models are used refines it
        as it goes). Nothing is loaded or released now; the current stage must remain."""
        plan = check_plan(self._loaders, stages, self._pinned)
        with self._lock:
            if self._stage is not None and self._stage not in plan:
                raise ValueError(f"the new plan drops the current stage {self._stage!r}")
            self._plan = plan

    @property
    def pinned(self) -> frozenset[str]:
        return self._pinned

    @property
    def sizes(self) -> dict[str, int]:
        """Bytes per model: measured at its last load, else as given in ``sizes=``."""
        with self._lock:
            return {**self._given_sizes, **self._sizes}

    def loaded(self) -> list[str]:
        """Names of the models in memory now, in load order."""
        with self._lock:
            return list(self._models)

    def is_loaded(self, name: str) -> bool:
        return name in self._models

    def resident(self) -> dict[str, nn.Module]:
        """The loaded models by name, in load order; unlike ``models[name]``, this loads
        nothing and notes nothing."""
        with self._lock:
            return dict(self._models)

    @property
    def batch_running(self) -> bool:
        """Whether a :meth:`map` batch runs now (its calls park at stage changes)."""
        return self._batch is not None

    # -- stage changes -------------------------------------------------------------------
    def enter(self, stage: str) -> None:
        """Enter ``stage``: release what the residency policy says (by default, every
        loaded model the stage does not list, except pinned ones), then start what it
        says to load ahead. Background loads still running are waited for first, so
        releases never race them. Re-entering the current stage does nothing."""
        if stage not in self._plan:
            raise KeyError(f"unknown stage {stage!r}; known stages: {', '.join(self._plan)}")
        batch = self._batch
        if batch is not None:
            # A call of map() waits here, outside the lock, until the batch is in ``stage``.
            batch.park(stage)
        if stage == self._stage:
            return
        try:
            self._change(stage)
        except BaseException:  # Ctrl-C, a failed release: entering again makes the change
            with self._lock:
                self._stage = None
                # Taken out but not released (interrupted before its release began): listed
                # again, else a use would load a second copy beside it.
                for doomed in self._taken_out():
                    if not is_released(doomed.module):
                        self._models.setdefault(doomed.name, doomed.module)
                    self._doomed.remove(doomed)
            raise

    def _change(self, stage: str) -> None:
        """:meth:`enter`'s work: undone (the stage forgotten) if it does not end."""
        self._timings.stage_ends(self._stage, time.perf_counter())
        self._wait_background()
        with self._lock:
            self._driver = threading.get_ident()
            self._stage = stage
            self._timings.start, self._timings.blocked = time.perf_counter(), 0.0
            self._noted.clear()
            self._used.clear()
            self._trim_due = False  # the releases below see every size measured so far
            self._over_noted = False
            self.emit(Event(STAGE, stage=stage))
            plan = self._plan_view()
            steps = self._steps
            note = steps.prefetch_note(stage, list(self._models), plan) if self.prefetch else None
            if note is not None:
                self.emit(Event(NOTE, stage=stage, note=note))
            for name in steps.to_release(stage, list(self._models), plan):
                self._release(name, stage, steps.why(name, stage, plan))
        # Released without the lock: a release waits for the model's calls in flight, and
        # a call may ask the registry for a model.
        self._drain()
        with self._lock:
            # The stage's span starts here: its releases (and their one collection) are
            # not its compute, which the prefetch cost model weighs.
            self._timings.start = time.perf_counter()
            self._check_budget(stage)
            ahead = [
                n
                for n in steps.to_prefetch(stage, list(self._models), self._plan_view())
                if n not in self._models and n not in self._jobs
            ]
            jobs = []
            if self.prefetch:
                purpose = self._plan.next_stage(stage)
                for name in ahead:
                    if name in self._prefetchable:
                        jobs.append(self._start(name, background=True, purpose=purpose))
                self._timings.ahead_in_stage = bool(jobs)
                if jobs and self._executor is None:
                    self._executor = ThreadPoolExecutor(
                        1,
                        thread_name_prefix=PREFETCH_THREAD,
                        initializer=background_thread,
                    )
                for job in jobs:
                    self._executor.submit(self._run_background, job)  # type: ignore[union-attr]
        # A custom policy's loads ahead that may not run in the background (all of them
        # without prefetch): on this thread, now, as the policy asked. (Dropped before when
        # prefetch was on: Pixal3D's shared backbone was built inside each extractor.)
        for name in ahead:
            if not (self.prefetch and name in self._prefetchable):
                self[name]

    def map(
        self, fn: Callable[[Any], Any], items: Iterable[Any], *, return_exceptions: bool = False
    ) -> list[Any]:
        """Run ``fn(item)`` for every item stage-major; return the results in item order.

        The calls take turns, one running at a time. A call that enters a stage other than
        the current one waits there; once all have arrived (or finished), the stage is
        entered once and they continue in item order. So each model loads once per batch,
        not once per call. A call needing an earlier stage again (a negative-prompt pass)
        waits for it like the others; the earliest stage anyone waits for comes first.

        Every call starts from the global RNG state at ``map()``'s entry, saved and
        restored at each switch: a call that seeds itself (``torch.manual_seed`` or its own
        ``torch.Generator``) returns exactly what ``fn(item)`` returns run alone. Afterwards
        the RNG is where the last call left it.

        A call that raises does not stop the others. Once all have ended, ``BatchError``
        is raised (``.results`` has every slot, ``.errors`` the failures), or with
        ``return_exceptions=True`` each exception is returned in its item's slot.
        """
        batch = Batch(self, fn, items)
        try:  # set inside: a Ctrl-C just after left the models counting a batch for good
            with self._lock:  # checked and set in one step: two threads' maps never both run
                if self._batch is not None:
                    where = (
                        "a call of a batch cannot start another one on the same StagedModels"
                        if current_batch() is self._batch
                        else "one batch at a time: call map() again once it returns (the "
                        "diffusers adapter's pipe.stageload.map waits its turn)"
                    )
                    raise RuntimeError(f"map() is already running a batch on these models; {where}")
                self._batch = batch  # enter() parks the batch's calls from now on
            return batch.run(return_exceptions=return_exceptions)
        finally:
            if self._batch is batch:
                self._batch = None

    def evict(self, name: str) -> int:
        """Release one model now; returns the bytes freed (0 if it was not loaded)."""
        if name not in self._loaders:
            raise KeyError(f"no model named {name!r}; known models: {', '.join(self._loaders)}")
        self._wait_background()
        with self._lock:
            if name not in self._models:
                return 0
            self._release(name, self._stage, REASON_EVICT)
        return self._drain()

    def close(self) -> None:
        """Release every loaded model, most recently loaded first."""
        self._wait_background()
        with self._lock:
            self._jobs = {n: j for n, j in self._jobs.items() if not j.future.done()}
            for name in reversed(list(self._models)):
                self._release(name, self._stage, REASON_CLOSE)
            executor, self._executor = self._executor, None
        self._drain()
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> StagedModels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _plan_view(self) -> PolicyView:
        return self._timings.view(
            self._plan,
            pinned=self._pinned,
            sizes={**self._given_sizes, **self._sizes},
            # A loader may be fit for a background thread only at times (see
            # policy.ready_for_background): ask it at every decision, not once.
            prefetchable=frozenset(
                n for n in self._prefetchable if ready_for_background(self._loaders[n])
            ),
        )

    def _trim(self, stage: str | None) -> None:
        """Release what the budget no longer holds now that a load measured a size (lock
        held, driving thread only). The stage's models, pinned ones and every model handed
        out in this stage stay: the stage's code may hold them."""
        self._trim_due = False
        if stage is None:
            return
        protect = frozenset(self._used)
        for name in self._steps.after_load(stage, list(self._models), self._plan_view(), protect):
            self._release(name, stage, REASON_BUDGET)

    def emit(self, event: Event) -> None:
        """Send ``event`` where this registry's own events go: its sink and, under
        ``stageload meter`` or ``guard --trace``, the outer trace. Adapters use it for
        their notes."""
        if self._sink is not None:
            self._sink.emit(event)
        if self._outer is not None:
            self._outer.emit(event)

    def listening(self) -> bool:
        """Whether :meth:`emit` reaches any sink."""
        return self._sink is not None or self._outer is not None

    def _release(self, name: str, stage: str | None, reason: str | None = None) -> None:
        """Take ``name`` out (lock held): it is handed out no more. This thread releases it
        at its next :meth:`_drain`, once it holds no lock."""
        doomed = _Doomed(name, self._models[name], stage, reason)
        self._doomed.append(doomed)
        del self._models[name]  # after: a Ctrl-C between the two leaves it listed, not lost

    def _drain(self) -> int:
        """Release what this thread took out, in order (no lock held); returns the bytes
        freed. Each release waits for the model's calls in flight on other threads; the
        garbage is collected once for all of them (``releasing``). A Ctrl-C is raised once
        every release decided is done."""
        total = 0
        taken: list[_Doomed] = []  # out of _doomed, its release not over yet

        def rest() -> None:
            nonlocal total
            # An earlier pass was interrupted before this one's release was done (while it
            # waited for calls in flight, or before it began): it stays loaded and listed.
            for doomed in taken:
                if not is_released(doomed.module):
                    with self._lock:
                        self._models.setdefault(doomed.name, doomed.module)
            taken.clear()
            while True:
                with self._lock:
                    taken_out = self._taken_out()
                    if not taken_out:
                        return
                    mine = taken_out[0]
                    # Storage the loaded models and those still to be released share must
                    # survive this release (a shared backbone goes with the last holder).
                    others = {d.name: d.module for d in taken_out[1:]}
                    others.update(self._models)
                    keep: list[Any] = list(others.values())
                    heard = self._sink is not None or self._outer is not None
                    note = held_elsewhere(mine.module, others) if heard else None
                    batch = self._batch is not None
                    taken.append(mine)
                    self._doomed.remove(mine)
                total += self._release_now(mine, keep, note, wait=not batch)
                taken.clear()

        with releasing():
            interrupt = to_the_end(rest)
        if interrupt is not None:
            raise interrupt
        return total

    def _taken_out(self) -> list[_Doomed]:
        """The models this thread took out, to release, in order (lock held)."""
        me = threading.get_ident()
        return [d for d in self._doomed if d.thread == me]

    def _release_now(self, doomed: _Doomed, keep: list[Any], note: str | None, wait: bool) -> int:
        name, module, stage = doomed.name, doomed.module, doomed.stage
        with self._lock:
            loaded = self._as_loaded.get(name)
        changed = None
        if loaded is not None and loaded[0]() is module:  # not a later load's
            changed = _changed(loaded[1], _fingerprint(module)) or _graded(module)
        with self._lock:  # said at the reload, unless the loader fills this object again
            if changed is not None:
                self._dropped[name] = (weakref.ref(module), changed)
            else:  # one left by a release that did not happen (interrupted) is over too
                self._dropped.pop(name, None)

        def waiting(calls: int) -> None:
            self.emit(
                Event(
                    NOTE,
                    model=name,
                    stage=stage,
                    note=f"releasing {name!r} waits for {calls} call(s) of it in flight",
                )
            )

        def said(nbytes: int | None, *why: str | None) -> None:
            self.emit(
                Event(
                    RELEASE,
                    model=name,
                    stage=stage,
                    bytes=nbytes,
                    seconds=time.perf_counter() - start,
                    reason=doomed.reason,
                    note="; ".join(filter(None, why)) or None,
                )
            )

        start = time.perf_counter()
        cut: list[int] = []  # warned of after the event: -W error raises the warning
        try:
            # A batch's other calls are parked, not computing: waiting for them would wait
            # for the scheduler, which waits for this release.
            nbytes = release(
                module,
                name=name,
                stage=stage,
                keep=keep,
                wait=wait,
                on_wait=waiting,
                on_cut=cut.append,
            )
        except Exception:
            raise
        except BaseException:  # Ctrl-C; if not released, _drain lists the model again
            if is_released(module):  # release() finishes what it begins, then raises
                said(None, note, "interrupted (Ctrl-C), released whole")
            raise
        said(nbytes, note)
        if cut:
            warn_cut(name, cut[0])
        return nbytes

    def _say_dropped(self, name: str, stage: str | None, changed: str) -> str | None:
        """Under the lock: a reload made a new model where the released one had been
        changed since its load (a LoRA injected, ``.half()``): the change is gone. The note
        goes out now; returns the warning to give (once a model) after the lock."""
        note = (
            f"model {name!r} was changed after its load ({changed}); its release dropped "
            f"that, and this load ran its loader again: the calls now use the loader's "
            f"model. Make the change in the loader, or pin the model"
        )
        self.emit(Event(NOTE, model=name, stage=stage, note=note))
        if name in self._warned:  # the note each time, the warning once
            return None
        self._warned.add(name)
        return note

    def _check_budget(self, stage: str | None, after: str | None = None) -> None:
        """A ``note`` when what must stay exceeds the budget: the stage runs anyway."""
        if self.budget is None or stage is None or self._over_noted:
            return
        resident = set(self._models) | (set() if after else set(self._plan[stage]))
        over = over_budget(stage, resident, self._plan_view().sizes, self.budget, after)
        if over is not None:
            self._over_noted = True
            self.emit(Event(NOTE, stage=stage, bytes=over[0], note=over[1]))

    def _note_unplanned(self, name: str) -> None:
        if name in self._pinned or name in self._noted:
            return
        stage = self._stage
        if stage is not None and name in self._plan[stage]:
            return
        self._noted.add(name)
        where = f"stage {stage!r}" if stage is not None else "setup, before any stage"
        self.emit(
            Event(
                NOTE,
                model=name,
                stage=stage,
                note=f"{name!r} used in {where}, which does not list it in the plan",
            )
        )

    # -- loading: one job per model name, run without the lock ----------------------------
    def _loading(self) -> list[str]:
        if not hasattr(self._local, "loading"):
            self._local.loading = []
        return self._local.loading

    def _in_background(self) -> bool:
        return getattr(self._local, "background", False)

    def _drives(self) -> bool:
        """Whether this thread may release: the one that entered the current stage, or a
        call of its batch (any but the prefetch thread before the first stage)."""
        if self._in_background():
            return False
        if self._batch is not None and current_batch() is self._batch:
            return True  # a batch's call, holding the turn: the driving thread's stand-in
        return self._driver is None or self._driver == threading.get_ident()

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
        with suppress(BaseException):  # kept in the job's future; raised at first use
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
        except BaseException as exc:  # the loader's failure or interruption, on its thread
            with self._lock:
                if self._jobs.get(job.name) is job:
                    del self._jobs[job.name]  # seen: the next access loads again
            raise ModelLoadError(job.name, self._stage, exc) from exc

    def _run(self, job: _Job) -> None:
        """Run ``job``'s loader on this thread, without the lock, and install its module.
        However it ends, the job's future is settled: a load interrupted anywhere
        (Ctrl-C in the loader, ``SystemExit``) leaves no job for the next access to wait
        on forever."""
        try:
            self._load(job)
        except BaseException as exc:
            if not job.future.done():
                self._interrupted(job, exc)
            raise

    def _interrupted(self, job: _Job, exc: BaseException) -> None:
        """A load ended by a BaseException: forget the job (the next access loads again)
        and tell those waiting on it, with the interruption as the cause."""
        with self._lock:
            if self._jobs.get(job.name) is job:
                del self._jobs[job.name]
        with suppress(InvalidStateError):  # settled by another thread meanwhile
            job.future.set_exception(exc)

    def _load(self, job: _Job) -> None:
        name, stage = job.name, self._stage
        # preserved_rng() only works on the thread that draws: in the background it would
        # restore a stale state over the main thread's draws (hence rng_free loaders only).
        guard = preserved_rng() if self.preserve_rng and not job.background else nullcontext()
        loading = self._loading()
        with self._lock:
            others = [j for j in self._jobs.values() if j is not job and not j.future.done()]
            for other in others:
                other.overlapped = True
            job.overlapped = job.overlapped or bool(others)
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
        # Its calls count themselves in flight from now on: a release waits for them.
        # (A module loaded again, as an adapter's skeleton refilled, keeps the one it has.)
        registry = HookRegistry.attach(module)
        if COUNTED not in registry:
            registry.add(COUNTED, ModuleHook())
        seconds = time.perf_counter() - start
        loaded = _fingerprint(module)
        warning = None
        with self._lock:
            self._as_loaded[name] = (weakref.ref(module), loaded)
            dropped = self._dropped.pop(name, None)
            if dropped is not None and dropped[0]() is not module:
                warning = self._say_dropped(name, stage, dropped[1])
            # Count only what this load added: a backbone that another loaded model already
            # holds (see share()) is not counted twice.
            nbytes = module_bytes(module, exclude=self._models.values())
            kind = PREFETCH if job.background else RELOAD if name in self._ever_loaded else LOAD
            self._models[name] = module
            self._sizes[name] = nbytes
            self._timings.loaded(name, seconds, ahead=job.background, overlapped=job.overlapped)
            self._ever_loaded.add(name)
            del self._jobs[name]
            note = f"for stage {job.purpose!r}" if job.purpose else None
            self.emit(
                Event(kind, model=name, stage=stage, bytes=nbytes, seconds=seconds, note=note)
            )
            if not job.background:
                self._used.add(name)  # handed to its caller next: it stays
            if self._drives():
                self._trim(stage)
                self._check_budget(stage, after=name)
            else:
                self._trim_due = True  # releasing is the driving thread's (see the top)
        job.future.set_result(module)
        if warning is not None:  # registered first: under -W error it raises, the model stays
            warnings.warn(warning, stacklevel=4)  # the caller of models[name], mostly

    def _failed(self, job: _Job, stage: str | None, exc: Exception) -> None:
        with self._lock:
            if not job.background:
                del self._jobs[job.name]  # the registry is left as it was
            else:  # kept until first use, which raises it
                self.emit(
                    Event(
                        NOTE,
                        model=job.name,
                        stage=stage,
                        note=f"prefetch of {job.name!r} failed ({type(exc).__name__}: {exc}); "
                        f"its first use raises ModelLoadError",
                    )
                )
        job.future.set_exception(exc)
