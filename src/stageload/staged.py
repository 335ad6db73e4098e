"""StagedModels: load a model when a stage first asks for it, release it when no longer planned."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .events import LOAD, NOTE, RELEASE, RELOAD, STAGE, Event, EventSink
from .outer import outer_trace
from .release import is_released, module_bytes, release
from .rng import preserved_rng

if TYPE_CHECKING:
    from torch import nn

    from .batch import Batch

#: The name of the time before the first stage is entered.
SETUP = "setup"

Loader = Callable[[], "nn.Module"]


class ModelLoadError(RuntimeError):
    """A loader raised. The registry is left as it was; the cause is chained."""

    def __init__(self, name: str, stage: str | None, cause: BaseException) -> None:
        self.name = name
        self.stage = stage
        super().__init__(
            f"loading model {name!r} for stage {stage or SETUP!r} failed: "
            f"{type(cause).__name__}: {cause}"
        )


@dataclass(frozen=True)
class Plan:
    """What a residency policy may look at: the stage plan and what is known of the models."""

    stages: Mapping[str, tuple[str, ...]]
    pinned: frozenset[str]
    sizes: Mapping[str, int] = field(default_factory=dict)  # bytes at the last load


class ResidencyPolicy(Protocol):
    """Decides what stays in memory. StagedModels asks it on every ``enter``.

    The default releases what the entered stage does not list. A memory-budget policy
    (keep while it fits, evict the model whose next use is furthest away) plugs in here.
    """

    def to_release(self, stage: str, loaded: Sequence[str], plan: Plan) -> list[str]:
        """Names of loaded models to release on entering ``stage``."""
        ...

    def to_prefetch(self, stage: str, loaded: Sequence[str], plan: Plan) -> list[str]:
        """Names to load right after entering ``stage``, before anyone asks."""
        ...


class ReleaseUnlisted:
    """Release every loaded model that the entered stage does not list (pinned ones stay)."""

    def to_release(self, stage: str, loaded: Sequence[str], plan: Plan) -> list[str]:
        wanted = set(plan.stages[stage]) | plan.pinned
        return [name for name in loaded if name not in wanted]

    def to_prefetch(self, stage: str, loaded: Sequence[str], plan: Plan) -> list[str]:
        return []


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
    ) -> None:
        self._loaders = dict(loaders)
        for name, loader in self._loaders.items():
            if not callable(loader):
                raise TypeError(
                    f"loader for {name!r} must be a zero-argument callable that returns an "
                    f"nn.Module, got {loader!r}"
                )
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Mapping):
            raise TypeError(
                f"stages must map each stage name to the models it uses, e.g. "
                f"{{'encode': ['text_encoder']}}; got {stages!r}"
            )
        plan: dict[str, tuple[str, ...]] = {}
        for stage, names in stages.items():
            if isinstance(names, str):
                raise TypeError(
                    f"stage {stage!r} lists {names!r} as a string; use a list: [{names!r}]"
                )
            plan[stage] = tuple(names)
        self._pinned = frozenset(pinned)
        known = ", ".join(sorted(self._loaders)) or "(none)"
        for stage, names in plan.items():
            for name in names:
                if name not in self._loaders:
                    raise ValueError(
                        f"stage {stage!r} lists model {name!r}, which has no loader; "
                        f"models with loaders: {known}"
                    )
        for name in self._pinned:
            if name not in self._loaders:
                raise ValueError(
                    f"pinned model {name!r} has no loader; models with loaders: {known}"
                )
        self._plan = plan
        self._sink = events
        # Under `stageload meter` or `guard --trace`, events also go to that tool's trace
        # (STAGELOAD_TRACE; see stageload.outer), alongside the sink given here.
        self._outer = outer_trace()
        self.preserve_rng = preserve_rng
        self.policy: ResidencyPolicy = policy if policy is not None else ReleaseUnlisted()
        self._models: dict[str, nn.Module] = {}
        self._sizes: dict[str, int] = {}
        self._ever_loaded: set[str] = set()
        self._stage: str | None = None
        self._noted: set[str] = set()
        self._loading: list[str] = []  # loads in progress in the lock's thread, outermost first
        self._lock = threading.RLock()
        self._batch: Batch | None = None  # set by map() while its calls run

    # -- mapping -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> nn.Module:
        with self._lock:
            if name not in self._loaders:
                raise KeyError(f"no model named {name!r}; known models: {', '.join(self._loaders)}")
            module = self._models.get(name)
            if module is None:
                module = self._load(name)
            self._note_unplanned(name)
            return module

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
    def pinned(self) -> frozenset[str]:
        return self._pinned

    def loaded(self) -> list[str]:
        """Names of the models in memory now, in load order."""
        with self._lock:
            return list(self._models)

    def is_loaded(self, name: str) -> bool:
        return name in self._models

    # -- stage changes -------------------------------------------------------------------
    def enter(self, stage: str) -> None:
        """Enter ``stage``: release what the residency policy says (by default, every
        loaded model the stage does not list, except pinned ones). Re-entering the
        current stage does nothing."""
        if stage not in self._plan:
            raise KeyError(f"unknown stage {stage!r}; known stages: {', '.join(self._plan)}")
        batch = self._batch
        if batch is not None:
            # A call of map() waits here, outside the lock, until the batch is in ``stage``.
            batch.park(stage)
        with self._lock:
            if stage == self._stage:
                return
            self._stage = stage
            self._noted.clear()
            self._emit(Event(STAGE, stage=stage))
            plan = self._plan_view()
            loaded = list(self._models)
            for name in self.policy.to_release(stage, loaded, plan):
                self._release(name, stage)
            for name in self.policy.to_prefetch(stage, list(self._models), plan):
                if name not in self._models:
                    self._load(name)

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
        from .batch import run_batch

        return run_batch(self, fn, items, return_exceptions=return_exceptions)

    def evict(self, name: str) -> int:
        """Release one model now; returns the bytes freed (0 if it was not loaded)."""
        if name not in self._loaders:
            raise KeyError(f"no model named {name!r}; known models: {', '.join(self._loaders)}")
        with self._lock:
            if name not in self._models:
                return 0
            return self._release(name, self._stage)

    def close(self) -> None:
        """Release every loaded model, most recently loaded first."""
        with self._lock:
            for name in reversed(list(self._models)):
                self._release(name, self._stage)

    def __enter__(self) -> StagedModels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _plan_view(self) -> Plan:
        return Plan(stages=self._plan, pinned=self._pinned, sizes=dict(self._sizes))

    def _emit(self, event: Event) -> None:
        if self._sink is not None:
            self._sink.emit(event)
        if self._outer is not None:
            self._outer.emit(event)

    def _load(self, name: str) -> nn.Module:
        from torch import nn

        stage = self._stage
        if name in self._loading:
            # A loader may use another model (models["backbone"]), but a cycle would recurse
            # until RecursionError, wrapped in one ModelLoadError per level.
            cycle = " -> ".join([*self._loading[self._loading.index(name) :], name])
            raise RuntimeError(
                f"the loader for {name!r} needs {name!r} itself ({cycle}); a loader must "
                f"build its model, not ask the registry for it"
            )
        guard = preserved_rng() if self.preserve_rng else nullcontext()
        start = time.perf_counter()
        self._loading.append(name)
        try:
            with guard:
                module = self._loaders[name]()
        except Exception as exc:
            raise ModelLoadError(name, stage, exc) from exc
        finally:
            self._loading.pop()
        seconds = time.perf_counter() - start
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"the loader for {name!r} returned {type(module).__module__}."
                f"{type(module).__qualname__}, not a torch.nn.Module; make it return the "
                f"model itself (e.g. `return MyModel.from_pretrained(path)`)"
            )
        if is_released(module):
            raise ValueError(
                f"the loader for {name!r} returned a module that was already released; "
                f"it must build a new module on every call instead of caching one"
            )
        # Count only what this load added: a backbone that another loaded model already
        # holds (see share()) is not counted twice.
        nbytes = module_bytes(module, exclude=self._models.values())
        kind = RELOAD if name in self._ever_loaded else LOAD
        self._models[name] = module
        self._sizes[name] = nbytes
        self._ever_loaded.add(name)
        self._emit(Event(kind, model=name, stage=stage, bytes=nbytes, seconds=seconds))
        return module

    def _release(self, name: str, stage: str | None) -> int:
        module = self._models.pop(name)
        keep: list[Any] = list(self._models.values())  # storage they share must survive
        start = time.perf_counter()
        nbytes = release(module, name=name, stage=stage, keep=keep)
        seconds = time.perf_counter() - start
        self._emit(Event(RELEASE, model=name, stage=stage, bytes=nbytes, seconds=seconds))
        return nbytes

    def _note_unplanned(self, name: str) -> None:
        if name in self._pinned or name in self._noted:
            return
        stage = self._stage
        if stage is not None and name in self._plan[stage]:
            return
        self._noted.add(name)
        where = f"stage {stage!r}" if stage is not None else "setup, before any stage"
        self._emit(
            Event(
                NOTE,
                model=name,
                stage=stage,
                note=f"{name!r} used in {where}, which does not list it in the plan",
            )
        )
