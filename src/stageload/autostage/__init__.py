"""``stageload.auto()``: staged loading for a script that has no line of stageload in it.

While the block runs, the usual model factories (diffusers' ``ModelMixin.from_pretrained``,
transformers' ``PreTrainedModel.from_pretrained``, and any named with ``factories=``) are
wrapped. Each model they make is the script's own object, of its own class, with one hook:

- a library's ``from_pretrained`` of a local folder of safetensors files returns the model
  built from its config with its weights on ``meta`` (a stand-in: the object the diffusers
  adapter starts each component from, :mod:`stageload.load.skeleton`), released: it is
  read at its first use, by the same call, so each model is read once and one the script
  never calls is never read;
- a call of a released model (or a torch function on one of its tensors) reloads it first:
  the factory again, with the RNG as it was at the first load (a part the checkpoint does
  not cover draws the same values) and the script's RNG untouched, converted to the dtypes
  and devices the script gave it, its tensors moved into the objects the script holds;
- before a load, models are released (to ``meta``: the memory goes back to the OS) until
  the new one fits the budget: the least recently used first, while the script makes its
  first pass; once the sequence of uses repeats, the model whose next use in that
  recorded cycle is furthest away (Belady's rule, as :class:`~stageload.FurthestNextUse`);
- once the order is known, the next stage's models that reload from their files load ahead
  in a background thread, as that policy decides (:meth:`AutoSession._look_ahead`);
- identical factory calls (same factory, same plain arguments) return one object while it
  lives and the script has not changed it. A factory that drew random numbers (a model's
  initialisers, a head its checkpoint lacks) is shared only when called with the global
  RNG as it was at that model's call, and leaves it as that call did; from another state
  it would draw other values, so it makes a new model, as without auto.

What auto cannot stage it says once (``notes``, and a ``note`` event) and keeps loaded: a
model used from two threads at once, one the script changed since its load (weights or
parts), one whose reload gave other weights, one that contains another staged model, one
compiled by ``torch.jit``, one whose weights are in shared memory. A
model in a call, through any of its parts, is never released under it.

Which thread does what: factory calls, loads and releases run on the script's threads,
except loads ahead: one thread at a time (``_ahead``), which only fills models marked
``loading`` for it (its owner :data:`AHEAD` until it takes them) from their files, and
which the next stage change and the end of the block wait for. ``_mutex`` guards the
tables and each model's state, and is never held while a factory runs or a release waits
for calls in flight: a release marks its model ``releasing``, a load marks it
``loading``, and other threads that need that model wait for the state to change. One
model is released at a time, so a thread waits only on a model that is being released
or loaded right now.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.abc
import inspect
import itertools
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from .. import bell, external
from ..core.batch import Batch, current_batch
from ..core.events import (
    LOAD,
    NOTE,
    PREFETCH,
    REASON_CLOSE,
    REASON_NOT_IN_PLAN,
    RELEASE,
    RELOAD,
    STAGE,
    Event,
    EventSink,
    TeeSink,
)
from ..core.outer import outer_trace
from ..core.plan import Plan
from ..core.policy import FurthestNextUse, Timings
from ..core.rng import RngState, capture_rng, preserved_rng, restore_rng, same_rng
from ..errors import StageloadError
from ..external import (
    from_pretrained_dtype,
    library_model,
    own_tensor_tables,
    torch_function_off,
)
from ..hooks.empty import mark_empty, own_attributes, unmark_empty
from ..hooks.registry import Hold, HookRegistry, ModuleHook, end_hold, in_call, patch, try_hold
from ..hooks.release import (
    drop_autocast_casts,
    held_by_autograd,
    held_outside,
    is_released,
    release,
    releasing,
    storage_sizes,
    unmark_released,
)
from ..hooks.share import call_key
from ..load import changes
from ..load.checkpoint import (
    INDEX_SUFFIX,
    changed_file,
    checkpoint_bytes,
    checkpoint_files,
    file_stamps,
    float_itemsize,
    pretrained_checkpoint,
)
from ..load.progress import PREFETCH_THREAD
from ..load.reader import background_thread
from ..load.refill import Recipe, conversion_probes, converted, fresh_memory, learn, reload
from ..load.skeleton import fill_from, stand_in
from ..load.weights import named_tensors
from ..memory.budget import parse_budget

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "AutoError",
    "AutoSession",
    "DEFAULT_FACTORIES",
    "PLAN_SOURCES",
    "PlanSource",
    "StageMajor",
    "auto",
]

#: Builds what a factory's call (its arguments, its keywords) returns, its weights on
#: ``meta``; None where it cannot build it the same.
StandIn = Callable[[tuple, dict], "nn.Module | None"]

#: The factories wrapped unless told otherwise: ``module:Class.method``.
DEFAULT_FACTORIES = (
    "diffusers.models.modeling_utils:ModelMixin.from_pretrained",
    "transformers.modeling_utils:PreTrainedModel.from_pretrained",
)
#: The name of auto's hook in a model's hook registry.
AUTO = "auto"
#: Why auto released a model: the ``reason`` of its ``release`` events.
REASON_AUTO = "auto: budget"
#: The script dropped its last reference to a loaded model: its memory went with it.
REASON_DROPPED = "dropped by the script"
#: A model's states. Only the thread that set ``loading`` or ``releasing`` changes it.
LOADED, LOADING, RELEASING, RELEASED = "loaded", "loading", "releasing", "released"
#: The owner of a model marked ``loading`` for a load ahead whose thread has not taken it.
AHEAD = -1
#: Uses kept in the record: enough to see a cycle of this many stages twice.
USES_KEPT = 512


class AutoError(StageloadError, ValueError):
    """``stageload.auto`` cannot start: a factory that cannot be found or wrapped, or a
    second block while one is on."""


#: Each tensor of a model by name: (the tensor object's id, its version counter, the
#: address of its data).
Seen = dict[str, tuple[int, int | None, int]]
#: Each tensor of a model by name: (the dtypes its values went through since they were
#: read, the last its dtype now: :func:`stageload.load.refill.converted`; its device,
#: requires_grad, its strides when it is in channels_last (None otherwise), its own
#: attributes, whether its data moved since its load: a conversion gave it a new
#: allocation, even one that changed no value) as the script left it.
Layout = dict[str, tuple[tuple[Any, ...], Any, bool, tuple[int, ...] | None, dict[str, Any], bool]]


@dataclass(eq=False)
class _Model:
    """One model a factory made under auto: how to make it again, and its state."""

    name: str
    make: Callable[[], Any]
    module: weakref.ref[nn.Module]
    size: int
    #: The global RNG just before the first load: each reload starts from it.
    rng: RngState
    state: str = LOADED
    #: The thread loading or releasing it now.
    owner: int | None = None
    last_use: int = 0
    #: Called at least once (a use, not only made or loaded).
    called: bool = False
    loads: int = 1
    #: Kept loaded from now on (said once in the notes), for the reason in ``said``.
    pinned: bool = False
    #: Changed by the script (or its factory gave other weights): a new call of its
    #: factory makes a new model. A model pinned for another reason (used from two threads
    #: at once) is still shared.
    changed: bool = False
    said: set[str] = field(default_factory=set)
    #: The tensors as auto last loaded them, and a few of their values: whether the script
    #: changed the model since.
    seen: Seen = field(default_factory=dict)
    #: Each tensor's address as its last load left it (see :data:`Layout`).
    placed: dict[str, int] = field(default_factory=dict)
    samples: dict[str, Any] = field(default_factory=dict)
    #: Dtypes, devices and requires_grad as the script left them at the last release: a
    #: reload gives them back.
    layout: Layout = field(default_factory=dict)
    #: Each tensor's dtypes since it was read, as the last load gave it: a conversion
    #: since extends them (a round trip through bfloat16 keeps its rounding at a reload).
    chains: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: What ``model.device`` answers while it is released (pipelines move inputs to it).
    device: Any = None
    #: How it reloads from its files, in place, when its first load read them unchanged
    #: (:func:`stageload.load.refill.learn`); None: through its factory.
    recipe: Recipe | None = None
    #: Its first load made inference tensors (the factory ran under inference_mode).
    inference: bool = False
    #: What the factory gave (:func:`_as_made`): a later call shares it only as it was.
    made: Any = None
    #: Made as a stand-in (:func:`stageload.load.skeleton.stand_in`), not loaded yet: its
    #: first use runs the factory, with the grad mode it was called in, then learns how it
    #: reloads from its files with this.
    first: Callable[..., Recipe | str | None] | None = None
    grad: bool = True
    #: Conversions the script made (``.to``, ``.half``: the function ``_apply`` was given)
    #: before the first load: replayed on it, in order.
    pending: list[Callable[[Any], Any]] = field(default_factory=list)
    #: How many identical factory calls got it besides the one that made it.
    shared: int = 0
    #: The global RNG before and after the factory call, when it drew: an identical call
    #: shares the model only from the same state (and leaves the RNG as the call would).
    drew: tuple[RngState, RngState] | None = None
    #: Its files as they were at the factory call, before a deferred first load: the
    #: script gets what the call would have read then, or an error, never other weights.
    stamps: dict[Path, Any] = field(default_factory=dict)
    #: Staged with parts the script added (a LoRA's layers, a new head): each tensor its
    #: files hold, by its name now -> its name at the first load (the recipe's). The
    #: others are the script's: a release leaves them in memory. None: every tensor is
    #: its files', under the name it loaded with.
    keys: dict[str, str] | None = None


@dataclass
class _Record:
    """The models in use, one entry per change, and the cycle learned from them: once the
    last lap of uses repeats the one before (a model may appear twice in a lap: img2img's
    vae), it is the plan, one stage per use; a use off the plan forgets it until the
    sequence repeats again. A plan source's plan (:meth:`seed`) may list several models
    per stage (Pixal3D's), and need not list every model."""

    uses: list[str] = field(default_factory=list)
    plan: Plan | None = None
    #: Where in ``plan`` the script is now.
    stage: str | None = None
    #: ``plan`` came from a plan source: a use of a model it does not list keeps it.
    seeded: bool = False

    def seed(self, plan: Plan) -> None:
        """A plan known before the models' first use (a plan source: diffusers' offload
        order, Pixal3D's stages): followed from its first stage. A model it lists for a
        later stage, used early, joins the current stage; a use out of its order otherwise
        forgets it."""
        self.plan, self.stage, self.seeded = plan, plan.order[-1], True

    def add(self, name: str) -> bool:
        """Record a use of ``name``; whether it begins a new span of the plan (another
        stage of it, or a use with no plan)."""
        plan, stage = self.plan, self.stage
        if self.uses and self.uses[-1] == name:
            return plan is None
        self.uses.append(name)
        del self.uses[:-USES_KEPT]
        joined = False
        if self.plan is not None and self.stage is not None:
            after = self.plan.next_stage(self.stage)
            if name in self.plan[after] and name not in self.plan[self.stage]:
                self.stage = after
            elif name not in self.plan[self.stage] and self.seeded and self._later(name):
                # Used before its stage (img2img's vae.encode before the unet): the plan
                # holds, the model with the current stage's, as the diffusers adapter's
                # refine bridges it (dropping the plan left the first two calls to LRU).
                stages = dict(self.plan.items())
                stages[self.stage] = (*stages[self.stage], name)
                self.plan, joined = Plan(stages), True
            elif name not in self.plan[self.stage] and (
                not self.seeded or self.plan.listed(name)  # unlisted: MoGe, before the run
            ):
                self.plan = self.stage = None  # off the cycle: learn it again
                self.seeded = False
        if self.plan is None or self.seeded:
            # Also while a source's plan is followed: a lap learned from the uses has a
            # stage per use, finer than a source's stages, and replaces it.
            self._learn()
        return plan is None or (self.plan is not plan and not joined) or self.stage != stage

    def _later(self, name: str) -> bool:
        """Whether the plan lists ``name`` in a stage after the current one, this lap."""
        assert self.plan is not None and self.stage is not None
        at = self.plan.index(self.stage)
        return any(name in self.plan[s] for s in self.plan.order[at + 1 :])

    def _learn(self) -> None:
        """The shortest lap that ends with the use before this one and starts with the same
        model as this use, and has every model of the lap before it."""
        uses, last = self.uses, self.uses[-1]
        for p in range(2, len(uses)):
            if uses[-1 - p] != last:
                continue
            lap = uses[-1 - p : -1]
            if not set(uses[-1 - 2 * p :]) <= set(lap):
                continue
            stages: dict[str, tuple[str, ...]] = {}
            for name in lap:
                n = sum(1 for s in stages.values() if s == (name,))
                stages[name if n == 0 else f"{name}#{n + 1}"] = (name,)
            self.plan = Plan(stages)
            self.stage = self.plan.order[0]
            self.seeded = False
            return


@dataclass
class _Victim:
    """A model chosen for release, and the hold on its calls (:func:`end_hold` ends it)."""

    model: _Model
    hold: Hold


class _Hook(ModuleHook):
    """On each model and its direct children: a call marks the model used (and reloads it
    when it is released: ``revive``). Holds its session: a model released when the block
    ended still reloads on use. A copy of the model (an EMA copy, ``torch.save(model)``)
    is the script's own: it is not made by a factory, so auto leaves it alone."""

    copied = False

    def __init__(self, session: AutoSession, model: _Model) -> None:
        import torch

        self.session = session
        self.model = model
        # auto's bookkeeping runs eagerly under torch.compile: dynamo breaks the graph at
        # these calls (tracing into a release or a reload failed inside dynamo).
        self.pre_call = torch.compiler.disable(self.pre_call)  # type: ignore[method-assign]
        self.revive = torch.compiler.disable(self.revive)  # type: ignore[method-assign]
        self.fill_on_use = torch.compiler.disable(self.fill_on_use)  # type: ignore[method-assign]
        self.post_call = torch.compiler.disable(self.post_call)  # type: ignore[method-assign]

    def pre_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        session = self.session
        if session.batch is not None:  # first: a map call parks before any lock or load
            session.batch.park_for(self.model.name)
        session.used(self.model)
        if not self.model.pinned and module is self.model.module():
            registry = HookRegistry.of(module)
            if registry is not None and registry.called_elsewhere():
                session.pin(self.model, "used from two threads at once")
        return None

    def post_call(self, module: nn.Module, output: Any) -> Any:
        if module is self.model.module():
            self.session.call_ended(self.model)
        return output

    def revive(self, module: nn.Module) -> bool:
        return self.session.load(self.model)

    def released(self, module: nn.Module) -> None:
        if module is self.model.module():  # the model, not one of its children
            mark_empty(module, self)

    def retain(self, module: nn.Module) -> list[Any]:
        """The parts the script added to the model (:attr:`_Model.keys`): its files cannot
        give them back, so a release leaves them in memory."""
        keys = self.model.keys
        if keys is None or module is not self.model.module():
            return []
        return _scripts_parts(module, keys)

    def fill_on_use(self) -> None:
        """One of the released model's tensors was used (:mod:`stageload.hooks.empty`)."""
        self.session.load(self.model)

    #: Its released tensors answer ``.is_meta`` as ``.device`` does: not meta.
    answers_is_meta = True

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def loaded(self) -> bool:
        """Whether its model is loaded (an empty tensor used then was out of it)."""
        return self.model.state == LOADED

    @property
    def run_device(self) -> Any:
        """What a released model's tensors answer for ``.device``: where it ran."""
        return self.model.device


class AutoSession:
    """The models made under one :func:`auto` block, the budget, and the recorded plan."""

    def __init__(
        self,
        budget: int | str | None = None,
        events: EventSink | None = None,
        *,
        prefetch: bool = True,
        stages: bool = True,
        share: bool = True,
    ) -> None:
        self.budget = parse_budget("auto" if budget is None else budget)
        #: Identical factory calls get one model while it lives (False: each its own, as
        #: without auto, for a script that changes one of two copies after loading both).
        self.share = share
        #: Emit a ``stage`` event at each change of model, named after it; False where
        #: the caller marks stages of its own (an adapter's, a measure's).
        self.stages = stages
        #: Load the next stage's models ahead, in a background thread, once the order is
        #: known: what the adapters' policy says (:class:`~stageload.FurthestNextUse`).
        self.prefetch = prefetch
        self._policy = FurthestNextUse(self.budget, prefetch=True)
        self._timings = Timings()
        self._ahead: threading.Thread | None = None  # the load ahead running now
        self._last_ahead: threading.Thread | None = None  # joined when the block ends
        self._driver: int | None = None  # the thread whose use changed the stage last
        outer = outer_trace()
        sinks = [s for s in (events, outer) if s is not None]
        self._sink: EventSink | None = (
            TeeSink(*sinks) if len(sinks) > 1 else next(iter(sinks), None)
        )
        # The tables and every model's state; never held while a factory runs or a
        # release waits (see the module docstring). Reentrant: a hook inside a section
        # that holds it (an event sink's write) may ask again.
        # Taken as `with self._mutex` (C code) only, and waited on with the bell outside
        # it: a Ctrl-C inside a Condition's own __enter__ (Python code) left it taken, and
        # the next load ahead or call hung on it (see stageload.bell for its wait).
        self._mutex = threading.RLock()
        self._bell = bell.Bell()  # rung whenever a model's state or the thread ahead changes
        self._in_making: dict[Any, threading.Event] = {}  # factory calls running now
        #: Factory calls waiting for the same call, or for its model's load or release, on
        #: another thread.
        self.waiting = 0
        self._models: dict[str, _Model] = {}  # by name
        self._shared: dict[Any, _Model] = {}  # by factory call
        self._dead: list[str] = []  # models the script dropped, pruned under the lock
        self._clock = 0
        self._stage: str | None = None
        self._making = threading.local()
        self._closed = False
        # Whether the last room made left the models over the budget because a model that
        # could go was in a call on another thread: room is made again as each call ends.
        self._over = False
        self.record = _Record()
        self.notes: list[str] = []
        #: Calls of each factory the user named (``factories=``), by its spec.
        self.factory_calls: dict[str, int] = {}
        #: Every factory and plan source wrapped for the session, by its spec.
        self.wrapped: set[str] = set()
        #: The factories blocks named (``factories=``): how many blocks on now name each,
        #: and what unwraps it (changed under ``_ACTIVE_LOCK``; see :func:`_named`).
        self.named: dict[str, list[Any]] = {}
        #: The sinks of the blocks that joined this one (:func:`auto` inside it), each
        #: for its block: replaced whole, never changed in place (read without the lock).
        self._joined: tuple[EventSink, ...] = ()
        self.joined_said = False  # the note that a block asked for other options

    # -- what the script sees ------------------------------------------------------------
    #: The stage-major batch running on the session now (:meth:`map`; one at a time).
    batch: StageMajor | None = None

    def map(
        self, fn: Callable[[Any], Any], items: Iterable[Any], *, return_exceptions: bool = False
    ) -> list[Any]:
        """``fn(item)`` for every item, stage-major: a call about to use a model of another
        stage than the batch's waits, so each model loads once for all the items
        (:class:`StageMajor`). Results in item order; a call that raised: a
        :class:`~stageload.core.batch.BatchError` once all ran, or with
        ``return_exceptions`` its exception in its slot. One batch at a time, inside the
        block: after it nothing is staged, and the batch would only slow the items down."""
        self._check_open("session.map()")

        return StageMajor(self).map(fn, items, return_exceptions=return_exceptions)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise AutoError(
                f"{what} after its stageload.auto() block ended: the models are no longer "
                f"staged. Call it inside the with-block"
            )

    @property
    def models(self) -> dict[str, nn.Module | None]:
        """Each model's name and object (None once the script dropped it)."""
        with self._mutex:
            return {name: m.module() for name, m in self._models.items()}

    def uncalled(self) -> list[str]:
        """The factories the user named that nothing has called through auto yet."""
        return [spec for spec, n in self.factory_calls.items() if n == 0]

    def resident(self) -> list[str]:
        """The models loaded now."""
        with self._mutex:
            return [
                n for n, m in self._models.items() if m.state == LOADED and m.module() is not None
            ]

    def resident_bytes(self) -> int:
        with self._mutex:
            return sum(self._models[n].size for n in self.resident())

    # -- the factories -------------------------------------------------------------------
    def call(
        self,
        factory: Callable[..., Any],
        name: str,
        args: tuple,
        kwargs: dict,
        *,
        trusted: bool = False,
        stand_in: StandIn | None = None,
    ) -> Any:
        """Run one factory call for the script: share, make, hook. ``trusted``: a library's
        ``from_pretrained``, whose weights are the file's unless converted whole, so a
        reload's recipe checks the first 4 KiB of each tensor (as the diffusers adapter
        does); a factory the user names may change a weight anywhere after reading it, so
        every byte is compared. ``stand_in``: builds what the call returns with its weights
        on ``meta`` (:func:`auto`'s ``stand_ins``), read at its first use instead (a library's
        ``from_pretrained`` has its own: :func:`stageload.load.skeleton.stand_in`)."""
        if getattr(self._making, "depth", 0):  # a factory inside a factory, or a reload
            return factory(*args, **kwargs)
        # Relative paths anchored now, for everything that reads them from here on: the
        # first call, its files' stamps and recipe, and each reload (a ``chdir`` since read
        # another folder's file of that name, with the stamps checking the first one).
        args, kwargs = _anchored(args), _anchored_kwargs(kwargs)
        key = _key(factory, args, kwargs) if self.share else None
        waited = False  # for the same call in another thread: its result is this one's
        while True:
            # twin: a model of a factory that drew, to compare the call's result with
            ticket = running = twin = None
            with self._mutex:
                self._prune()
                known = self._shared.get(key) if key is not None else None
                module = known.module() if known is not None else None
                if module is not None and known is not None and not known.changed:
                    if _moving_elsewhere(known):
                        # Another thread is filling or emptying its tensors (a copy in
                        # flight reads as other values): compare them once it is done (it
                        # rings).
                        ticket = self._bell.ticket()
                    else:
                        changed = _changed(known)
                        # (a change it keeps marks it changed: never shared again)
                        if changed is None and not known.changed and _as_made(known) == known.made:
                            if known.drew is None or waited:
                                return self._handed_again(known, module)
                            before, after = known.drew
                            if same_rng(capture_rng(), before):
                                restore_rng(after)  # where the call would have left it
                                return self._handed_again(known, module)
                            # Its factory draws other values from here: it runs, as
                            # without auto (the random stream moves as it would), and
                            # _make shares ``known`` only if it made the same weights
                            # (not another random head).
                            twin = known
                        if changed is not None:  # (an EMA copy, a student): a new one
                            why = f"changed by the script since its load ({changed})"
                            self._pin(known, why, changed=True)
                        # Converted (.half(), requires_grad_(False), .train()): it stays
                        # staged, and the call makes a new one as it does without auto.
                if ticket is None:
                    running = self._in_making.get(key) if key is not None else None
                    if running is None:
                        if key is not None:  # this thread makes it; the same call elsewhere waits
                            self._in_making[key] = threading.Event()
                        break
            try:
                with self._mutex:  # no point a Ctrl-C can land before the increment
                    self.waiting += 1
                if ticket is not None:
                    ticket.acquire(timeout=bell.RECHECK)
                else:  # another thread makes the same model: take its result
                    running.wait()
                    waited = True
            finally:
                with self._mutex:
                    self.waiting -= 1
        try:
            return self._make(factory, name, args, kwargs, key, trusted, twin, stand_in)
        finally:
            if key is not None:
                with self._mutex:
                    self._in_making.pop(key).set()

    def _make(
        self,
        factory: Callable[..., Any],
        name: str,
        args: tuple,
        kwargs: dict,
        key: Any,
        trusted: bool,
        twin: _Model | None = None,
        stand_in: StandIn | None = None,
    ) -> Any:
        """Make the model of one factory call. ``twin``: the model an identical call made
        from another RNG state, returned in place of the new one if that has the same
        weights (its three samples a tensor)."""
        make = self._maker(factory, args, kwargs)
        if stand_in is None and trusted and isinstance(factory, _Bound):
            stand_in = functools.partial(_library_stand_in, factory.cls)
        if stand_in is not None:
            rng = capture_rng()  # before the build: the first load replays the call from it
            early = _stand_in(stand_in, args, kwargs, rng)
            if early is not None:
                # A stand-in's weights are its files': the same as its twin's.
                shared = self._same_as(twin, rng, early, compare=False)
                if shared is not None:
                    return shared
                return self._defer(early, factory, rng, name, args, kwargs, key, trusted)
        # Room before it loads: for its size from its files' headers when its arguments
        # name them (a larger model than any before would otherwise load on top of the
        # others: SD3's transformer after its T5), and for the largest model seen.
        expected = _file_bytes(factory, args, kwargs)
        with self._mutex:
            expected = max([expected, *(m.size for m in self._models.values())])
        self._make_room(expected, name, keep=twin)  # (not the twin: it may be the result)
        rng = capture_rng()
        start = time.perf_counter()
        obj = make()
        after = capture_rng()
        from torch import nn

        if isinstance(obj, nn.Module) and (shared := self._same_as(twin, rng, obj)) is not None:
            return shared

        if not isinstance(obj, nn.Module):
            self._note(
                f"{name}: the factory returned a {type(obj).__name__}, not a module: not staged"
            )
            return obj
        registry = HookRegistry.of(obj)
        if registry is not None and AUTO in registry:
            return obj  # a model auto made already (the factory keeps a cache of its own)
        recipe = _learn(obj, args, kwargs, whole=not trusted)
        with self._mutex:
            model = self._new(obj, name, make, _bytes(obj), rng)
            model.device = next((t.device for _, t in named_tensors(obj)), None)
            model.seen, model.samples = _seen(obj), _samples(obj)
            model.placed = {n: address for n, (_, _, address) in model.seen.items()}
            # Each tensor's dtype as read: a round trip the script makes while it is loaded
            # extends it (converted_loaded), and its reloads round as the script's did.
            model.chains = {n: (t.dtype,) for n, t in named_tensors(obj)}
            model.made = _as_made(model, obj)
            model.inference = any(t.is_inference() for _, t in named_tensors(obj))
            model.drew = None if same_rng(rng, after) else (rng, after)
            if isinstance(recipe, str):
                self._through_factory(model, recipe)
            else:
                model.recipe = recipe
            inner = sorted(
                {
                    hooked.model.name
                    for sub in obj.modules()
                    if sub is not obj
                    and isinstance(hooked := _auto_hook(sub), _Hook)
                    and hooked.model.module() is sub
                }
            )
            self._add(obj, model, key)
            self._emit(
                Event(LOAD, model=model.name, bytes=model.size, seconds=time.perf_counter() - start)
            )
            if inner:
                self._pin(model, "contains the staged model " + ", ".join(inner))
        self._make_room(model.size, model.name, keep=model)  # the others it leaves no room for
        return obj

    def _same_as(
        self, twin: _Model | None, rng: RngState, made: nn.Module, *, compare: bool = True
    ) -> Any:
        """``twin``'s module, if ``made`` (the same factory call's new result, dropped
        then) has its weights (``compare``: else they are the files'); it then shares from
        the RNG state of this call on."""
        shared = twin.module() if twin is not None else None
        if shared is None or twin is None:
            return None
        if compare and (
            _as_made(twin, made) != twin.made or _same(_samples(made), twin.samples) is not None
        ):
            return None  # another random head: a model of its own
        with self._mutex:
            twin.drew = (rng, capture_rng())
            return self._handed_again(twin, shared)

    def _handed_again(self, model: _Model, module: nn.Module) -> nn.Module:
        """``module``, for a factory call identical to the one that made it: counted, so a
        change the script makes to it later says that both names see it (:meth:`_pin`).
        Not said here: a loop that rebuilds its models shares at every lap, harmlessly."""
        model.shared += 1
        return module

    def _new(
        self,
        obj: nn.Module,
        name: str,
        make: Callable[[], Any],
        size: int,
        rng: RngState,
        **fields: Any,
    ) -> _Model:
        """Under the lock: the record of ``obj``, under a name no other model has."""
        unique = _unique(name, self._models)
        ref = weakref.ref(obj, self._on_drop(unique))
        return _Model(unique, make, ref, size, rng, last_use=self._tick(), **fields)

    def _add(self, obj: nn.Module, model: _Model, key: Any) -> None:
        """Under the lock: hook ``obj`` (and its direct children, where no other model of
        this session hooked them), and count it among the session's models."""
        hook = _Hook(self, model)
        for sub in (obj, *obj.children()):
            if _auto_hook(sub) is None:
                HookRegistry.attach(sub).add(AUTO, hook)
        self._models[model.name] = model
        if key is not None:
            self._shared[key] = model

    def _maker(self, factory: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[[], Any]:
        """The factory call, made again at each reload (and, deferred, at the first use) as
        the script made it: with its paths as :meth:`call` anchored them, under torch's
        default dtype then (a diffusers model built after
        ``torch.set_default_dtype(torch.float64)`` came out float64). A factory it calls in
        turn is not staged (``call`` sees this thread's depth)."""
        import torch

        default = torch.get_default_dtype()

        def make() -> Any:
            self._making.depth = getattr(self._making, "depth", 0) + 1
            try:
                with _default_dtype(default):
                    return factory(*args, **kwargs)
            finally:
                self._making.depth -= 1

        return make

    def _defer(
        self,
        obj: nn.Module,
        factory: Callable[..., Any],
        rng: RngState,
        name: str,
        args: tuple,
        kwargs: dict,
        key: Any,
        trusted: bool,
    ) -> nn.Module:
        """Stage ``obj``, a stand-in for what ``factory(*args, **kwargs)`` loads, as
        released: its first use loads it, so it is read once (not here and again at that
        use), and a model the script never calls is never read. The arguments are copied
        as they are now (transformers copies ``config=`` at the call: a change the script
        makes to it afterwards is not the model's)."""
        import torch

        after = capture_rng()  # a diffusers stand-in draws as its from_pretrained does
        kwargs = copy.deepcopy(kwargs)
        make = self._maker(factory, args, kwargs)
        size = _file_bytes(factory, args, kwargs)
        stamps = file_stamps(_checkpoint(args, kwargs), sampled=True)
        with self._mutex:
            model = self._new(
                obj,
                name,
                make,
                size,
                rng,
                state=RELEASED,
                loads=0,
                device=torch.device("cpu"),
                first=lambda module, names=None: _learn(
                    module, args, kwargs, whole=not trusted, names=names
                ),
                inference=torch.is_inference_mode_enabled(),
                grad=torch.is_grad_enabled(),
            )
            model.stamps = stamps
            model.drew = None if same_rng(rng, after) else (rng, after)
            self._add(obj, model, key)
        with releasing(collect=False):  # its computed buffers: the load makes them again
            release(obj, name=model.name, wait=False)  # the hook's released() marks them
        with self._mutex:
            model.seen, model.made = _seen(obj), _as_made(model, obj)
        return obj

    # -- uses, loads and releases ----------------------------------------------------------
    def used(self, model: _Model) -> None:
        with self._mutex:
            if self._closed:
                return
            model.last_use, model.called = self._tick(), True
            if self._stage == model.name:
                return
            record, now = self.record, time.perf_counter()
            plan, stage = record.plan, record.stage
            # The plan's stage, not the model, bounds the spans and the loads ahead: a
            # source's stage may list several models (Pixal3D's).
            span = record.add(model.name)
            # As StagedModels.enter: a load ahead ends before the next stage starts (it is
            # for that stage), so the trace and the cost model's spans see it there.
            me = threading.current_thread()
            ahead_done = lambda: self._ahead is None or self._ahead is me  # noqa: E731
            if span:
                self._timings.stage_ends(stage if plan else None, now)
            loaded = None if span and not ahead_done() else self._begin(model, span)
        if loaded is None:
            self._bell.wait(self._mutex, ahead_done)
            with self._mutex:
                loaded = self._begin(model, span)
        if loaded:  # else once its load is done (load())
            self._look_ahead()

    def _begin(self, model: _Model, span: bool) -> bool:
        """Under the lock: ``model``'s use begins a stage (``span``: a new span of the
        plan); whether the model is loaded."""
        if span:
            self._timings.start = time.perf_counter()
        self._stage, self._driver = model.name, threading.get_ident()
        if self.stages:
            self._emit(Event(STAGE, stage=model.name))
        return model.state == LOADED

    def convert_released(
        self,
        model: _Model,
        module: nn.Module,
        fn: Callable[[Any], Any],
        apply: Callable[..., Any],
    ) -> bool:
        """A conversion (``_apply(fn)``: ``.to``, ``.half``, ``.cuda``) of a released model:
        taken without loading it. Its dtypes change now (on meta), the rest at its next
        load: the layout a reload gives it, or, before the first load, the conversion
        itself, replayed. False while it is loaded, or being loaded or released: the
        caller converts it. ``apply`` is torch's own ``_apply``. (Loaded for it before:
        ``pipe.to(device)`` after ``from_pretrained`` loaded every model at once, and
        accelerate's model offloading reloaded each released one at every call: 15
        reloads for 1 on tiny SD.)"""
        import torch

        with self._mutex:
            if model.state != RELEASED or model.owner is not None or model.module() is not module:
                return False
            device = model.device if model.device is not None else torch.device("cpu")
            with torch_function_off():
                # What fn raises on a probe it raises on the weights (no CUDA, a bad device
                # index): raised now, with nothing loaded for it, as eager raises it.
                probes = conversion_probes(fn, {t.dtype for _, t in named_tensors(module)}, device)
                if probes is None:
                    return False
                dtypes = {d: p.dtype for d, p in probes.items() if p.dtype != d}
                moved = {p.device for p in probes.values()} - {device}
                # kept in dtype and device, yet copied (.to("cpu:0")): fresh memory at the reload
                fresh = fresh_memory(fn, set(probes) - set(dtypes), device) if not moved else set()
                if dtypes:  # on meta only the dtype changes now
                    apply(module, lambda t: t.to(dtypes.get(t.dtype, t.dtype)))
                    mark_empty(module, _auto_hook(module))  # converted buffers are new
            if model.first is not None:
                model.pending.append(fn)
            else:
                model.layout = _converted_layout(
                    model.layout, dtypes, next(iter(moved), None), fresh
                )
                # The values a reload must give, as the conversion left them: a round trip
                # through bfloat16 rounds them (else the reload, rounded too, read as other
                # weights, and the model was kept loaded for good).
                model.samples = {
                    n: v.to(dtypes[v.dtype]) if v.dtype in dtypes else v
                    for n, v in model.samples.items()
                }
            if moved:
                model.device = next(iter(moved))
            return True

    def settled(self, model: _Model) -> None:
        """Wait while another thread loads or releases ``model`` (a load ahead): the script
        converts a model (``.to``) once that is done."""
        self._bell.wait(self._mutex, lambda: not _moving_elsewhere(model))

    def pin(self, model: _Model, why: str) -> None:
        """Keep ``model`` loaded from now on, and say why once."""
        with self._mutex:
            self._pin(model, why)

    def keep_loaded(self, obj: nn.Module, why: str) -> None:
        """Load the staged models in ``obj``, and the one it is a part of, and keep them
        loaded from now on (``why``)."""
        parts = {id(sub) for sub in obj.modules()}
        with self._mutex:
            models = list(self._models.values())
        for model in models:
            module = model.module()
            if module is not None and (
                id(module) in parts or any(sub is obj for sub in module.modules())
            ):
                self.pin(model, why)  # first: no other thread's load releases it once loaded
                self.load(model)

    def seed(self, stages: Iterable[Iterable[Any]], source: str) -> None:
        """The order a plan source gives, before the first use: its stages in order, each
        the models of this session among the objects it lists (a stage left with none
        goes); said once per plan."""
        from torch import nn

        with self._mutex:
            plan_stages: dict[str, tuple[str, ...]] = {}
            for objects in stages:
                names: list[str] = []
                for obj in objects:
                    hook = _auto_hook(obj) if isinstance(obj, nn.Module) else None
                    mine = isinstance(hook, _Hook) and hook.session is self
                    if mine and hook.model.module() is obj and hook.model.name not in names:
                        names.append(hook.model.name)
                if not names:
                    continue
                key, n = "+".join(names), 1
                while key in plan_stages:  # a model used twice a call: a stage each time
                    n += 1
                    key = f"{'+'.join(names)}#{n}"
                plan_stages[key] = tuple(names)
            listed = {name for names in plan_stages.values() for name in names}
            if len(plan_stages) < 2 or len(listed) < 2:
                return
            plan = Plan(plan_stages)
            if self.record.plan is not None and not self.record.seeded:
                return  # learned from the uses: one stage per use, finer than a source's
            if plan != self.record.plan or plan.order != self.record.plan.order:
                self.record.seed(plan)
                self._note(
                    f"the plan before the first use, from {source}: {' -> '.join(plan.order)}"
                )

    def load(self, model: _Model) -> bool:
        """Reload a released model in place (its hook's ``revive``); True once it is back."""
        me = threading.get_ident()
        start = time.perf_counter()
        try:
            done = self._load(model, me)
        finally:
            with self._mutex:
                if me == self._driver:  # not compute: the cost model's inputs
                    self._timings.blocked += time.perf_counter() - start
        if done and model.name == self._stage:  # the model in use now: look ahead from it
            self._look_ahead()
        return done

    def _load(self, model: _Model, me: int) -> bool:
        # The releases that make room give memory back once, before the load, without a
        # garbage collection: it walks the whole heap, and auto's releases free the weights
        # in place (bench/results/auto: the collection was half of a lap).
        victim, marked = None, False  # what this call marked, for a Ctrl-C to undo
        try:
            with releasing(collect=False):
                while True:
                    ticket = victim = None
                    with self._mutex:
                        module = model.module()
                        if module is None:
                            return False
                        if model.state == LOADED:
                            return True
                        if model.state in (LOADING, RELEASING):
                            if model.owner == me:  # used inside its own load or release
                                return False
                            ticket = self._bell.ticket()  # another thread's: wait for its end
                        else:
                            victim = (
                                None
                                if self._closed
                                else self._victim(model.size, model.name, model)
                            )
                            if victim is None:
                                model.state, model.owner = LOADING, me
                                marked, room = True, model.size
                                break
                            victim.model.state, victim.model.owner = RELEASING, me
                    if ticket is not None:
                        ticket.acquire(timeout=bell.RECHECK)
                    else:
                        self._release(victim)
            victim = None
            done = self._fill(model, module)
        except BaseException:  # a Ctrl-C before _release or _fill took over what was marked
            self._unchoose(victim)
            with self._mutex:
                if marked and model.state == LOADING and model.owner == me:
                    model.state, model.owner = RELEASED, None  # its fill never began
                    self._bell.ring()
            raise
        if done and model.size > room:  # larger than its files said (converted after them)
            self._make_room(model.size, model.name, keep=model)
        return done

    def converted_loaded(self, model: _Model) -> None:
        """After the script converted a loaded model (``.to``, ``.half``): each tensor's
        dtypes extended by its new one, and the values its reload must give converted as
        its were (a round trip through bfloat16 rounds them: it read as a change by the
        script, and the model was kept loaded for good); its size now, and room made
        beside it when it grew (``.to(torch.float32)`` of a bfloat16 model doubles it; the
        budget was checked only at loads, and three models stayed loaded over it)."""
        with self._mutex:
            module = model.module()
            if model.state != LOADED or module is None:
                return
            with torch_function_off():
                if any(t.is_shared() for _, t in named_tensors(module)):
                    # A reload would be private memory: the other processes' updates
                    # (Hogwild training) lost, and theirs to the old weights never seen.
                    self._pin(model, "its weights are in shared memory (share_memory())")
                for name, t in named_tensors(module):
                    chain = model.chains.get(name, ())
                    if chain and chain[-1] != t.dtype:
                        model.chains[name] = tuple(converted(chain, t.dtype))
                    sample = model.samples.get(name)
                    if sample is not None and sample.dtype != t.dtype:
                        model.samples[name] = sample.to(t.dtype)
            size = _bytes(module)
            grew, model.size = size > model.size, size
        if grew:
            self._make_room(size, model.name, keep=model)

    def _fill(self, model: _Model, module: nn.Module, ahead: str | None = None) -> bool:
        """Load ``model``, marked ``loading`` by this thread, into ``module``; False when
        ``ahead`` (a load ahead for that stage) finds it cannot reload from its files alone
        (left released: its use loads it)."""
        import torch

        ok = False
        how = "abandoned"
        recipe: Recipe | str | None = None
        replaced: str | None = None
        replayed: dict[str, tuple[Any, ...]] | None = None
        try:  # first: a Ctrl-C at the clock's call is this load's (see _load)
            start = time.perf_counter()
            renames = _renames(module, model)
            keys = _keys(model, renames, module)
            replaced = _replaced(module, model) if renames is None else None
            layout = model.layout if renames is None else _renamed(model.layout, renames)
            layout = _grads_now(module, layout)  # set while it was out: peft's freeze
            if ahead is not None and (
                model.first is not None or renames is not None or replaced is not None
            ):
                return False  # a first load or a change: at its use, on the script's thread
            if model.first is not None:
                layout = _layout(module)  # the script's requires_grad and attributes
                try:
                    _first_load(module, model, renames)
                    # How it reloads: the tensors its files hold, under their names now.
                    recipe = model.first(module, keys)
                    if model.pending:  # the script's conversions while it waited
                        replayed = _replayed(module, model.pending)
                        model.pending = []
                except BaseException:  # Ctrl-C, a factory that failed: empty again, as it was
                    with releasing(collect=False):
                        release(module, name=model.name, wait=False)
                    raise
                how = "first use"
            elif _refill(module, model, layout, keys):
                how = "files"
            elif ahead is not None:  # a factory may draw: never beside the script
                return False
            elif keys is not None:
                moved = _moved(renames, model) if renames is not None else _first_own(keys, module)
                raise StageloadError(
                    f"{model.name} has parts the script added or removed ({moved}), and it "
                    f"reloads through its factory, which makes it as it was; change it while "
                    f"it is loaded (call it once first) and keep its tensors on one device, or "
                    f"give auto a factory that reads safetensors files"
                )
            else:
                with torch.inference_mode(model.inference):  # the first load's mode
                    with external.BUILD_LOCK, preserved_rng():
                        restore_rng(model.rng)  # the first load's draws: the same random parts
                        fresh = model.make()
                    _convert(fresh, model.layout)
                with torch_function_off():  # reading an empty tensor would load it again
                    _swap_in(module, fresh)
                del fresh
                how = "factory"
            _settle(module, layout)
            # What the bookkeeping below needs, read here: a Ctrl-C inside it left a loaded
            # model with the last load's addresses, and later reloads placed its tensors
            # otherwise (outputs off by 3e-7, call after call).
            seen, samples = _seen(module), _samples(module, keys)
            other = (
                how != "first use"
                and renames is None
                and replaced is None
                and _same(samples, _converted(model.samples, module)) is not None
            )
            ok = True
        except BaseException:  # Ctrl-C, a failed read: released whole, as it was before
            if not is_released(module):
                with releasing(collect=False):
                    release(module, name=model.name, wait=False)
            raise
        finally:
            with self._mutex:
                model.state, model.owner = (LOADED if ok else RELEASED), None
                if ok:  # stores first, calls after
                    model.seen, model.samples = seen, samples
                    model.placed = {n: address for n, (_, _, address) in seen.items()}
                    model.loads += 1
                    model.chains = {n: want[0] for n, want in layout.items()}
                    seconds = time.perf_counter() - start
                    if how == "first use":
                        self._first_loaded(module, model, recipe, replayed)
                    else:
                        self._timings.loaded(model.name, seconds, ahead=ahead is not None)
                    kind = LOAD if how == "first use" else RELOAD
                    self._emit(
                        Event(
                            kind if ahead is None else PREFETCH,
                            model=model.name,
                            bytes=model.size - _kept_bytes(module, keys),  # what it read
                            seconds=seconds,
                            note=how if ahead is None else f"{how}, for stage {ahead!r}",
                        )
                    )
                    written = _written(model, model.seen, keys) if ahead is not None else []
                    if renames is not None and model.recipe is not None:
                        model.keys = keys  # staged, the script's parts kept: see _Hook.retain
                    elif renames is not None:  # said as _changed says it, kept loaded
                        moved = _moved(renames, model)
                        self._pin(
                            model,
                            f"changed by the script (parts added or removed: {moved})",
                            changed=True,
                        )
                    elif replaced is not None:  # in memory, not the tensor auto loaded
                        self._pin(
                            model,
                            f"changed by the script while released ({replaced})",
                            changed=True,
                        )
                    elif other and not written:  # a write while it loaded ahead: said below
                        self._pin(model, "its factory gave other weights at reload", changed=True)
                    if written:  # the script's own: kept, as a change made while loaded is
                        self._pin(
                            model,
                            f"changed by the script while it loaded ahead ({written[0]})",
                            changed=True,
                        )
                    if self._closed:
                        _unhook(module)
                self._bell.ring()
        return True

    # -- loads ahead ---------------------------------------------------------------------
    def _look_ahead(self) -> None:
        """On a script's thread, without the lock, once the model it uses now is loaded:
        load the next stage's models in a background thread, as the adapters' policy says
        (:meth:`~stageload.FurthestNextUse.decide_prefetch`, from the recorded plan and the
        times measured so far): what fits beside the models in memory, or what fits once
        models whose next use is further go early, when the times say that pays. Only
        models that reload from their files alone: a factory may draw random numbers,
        which would move the script's stream. One load ahead at a time."""
        if not self.prefetch:
            return
        me, start = threading.get_ident(), time.perf_counter()
        with self._mutex:
            plan, stage = self.record.plan, self.record.stage
            if self._closed or self._ahead is not None or plan is None or stage is None:
                return
            self._prune()
            alive = {n: m for n, m in self._models.items() if m.module() is not None}
            view = self._timings.view(
                plan,
                pinned=frozenset(n for n, m in alive.items() if m.pinned),
                sizes={n: m.size for n, m in alive.items()},
                prefetchable=frozenset(n for n, m in alive.items() if _reloads_alone(m)),
            )
            holding = [n for n, m in alive.items() if m.state != RELEASED]
            decision = self._policy.decide_prefetch(stage, holding, view)
            if not decision.names:
                return
            victims: list[_Victim] = []
            for name in decision.early:  # each held as _victim would, or no load ahead
                victim = self._held_for_release(alive[name], say=False)
                if victim is None:
                    for v in victims:
                        end_hold(v.hold)
                    return
                victims.append(victim)
            models = [alive[n] for n in decision.names]
            thread = threading.Thread(
                target=self._run_ahead,
                args=(models, plan.next_stage(stage)),
                name=f"{PREFETCH_THREAD}-auto",
            )
            for v in victims:
                v.model.state, v.model.owner = RELEASING, me
            for m in models:
                m.state, m.owner = LOADING, AHEAD
            self._ahead = self._last_ahead = thread
            self._timings.ahead_in_stage = True
        try:
            with releasing(collect=False):
                for v in victims:
                    self._release(v, note=f"early, to load {', '.join(decision.names)} ahead")
            thread.start()
        finally:
            with self._mutex:
                if thread.ident is None:  # a release failed (Ctrl-C): as before, no load ahead
                    for v in victims:
                        if v.model.state == RELEASING and v.model.owner == me:
                            v.hold.active = False  # not reached, or not finished
                            end_hold(v.hold)
                            module = v.model.module()
                            done = module is not None and is_released(module)
                            v.model.state, v.model.owner = (RELEASED if done else LOADED), None
                    for m in models:
                        if m.owner == AHEAD:
                            m.state, m.owner = RELEASED, None
                    self._ahead = None
                if me == self._driver:
                    self._timings.blocked += time.perf_counter() - start
                self._bell.ring()

    def _held_for_release(self, model: _Model, *, say: bool) -> _Victim | None:
        """Under the lock: ``model``, held for its release, or None when it cannot go now:
        not loaded, kept loaded, in a call, changed by the script, holding gradients (a
        training loop's, accumulated across calls of other models) or held outside the
        model.
        With ``say`` (a use needs room), a change or a holder is said, and a change keeps
        it loaded; ahead of need, the use says it, not a guess ahead."""
        module = model.module()
        if model.state != LOADED or module is None or _busy(model):
            return None
        if model.pinned:
            return None
        changed = _changed(model)
        if changed is not None:
            if say:
                why = f"changed by the script since its load ({changed})"
                self._pin(model, why, changed=True)
            return None
        graded = _with_grad(module, model.keys)
        if graded is not None:  # a release would drop them: an accumulation loses a step
            if say:
                self._say(
                    model,
                    "grad",
                    f"{model.name}: its parameters hold gradients ({graded}.grad): kept "
                    f"loaded until they are cleared (model.zero_grad(), whose set_to_none is "
                    f"the default; a model the script does not train: requires_grad_(False) "
                    f"before the backward)",
                )
            return None
        kept = {id(t) for t in _scripts_parts(module, model.keys)} if model.keys else set()
        held = _held_elsewhere(module, kept)
        if held is not None:  # freeing it would free memory under the holder
            if say:
                self._say(
                    model,
                    "held",
                    f"{model.name}: {held} is held outside the model (a view the script keeps, "
                    f"or an output's autograd graph: run under torch.no_grad()): kept "
                    f"loaded while it is",
                )
            return None
        # Chosen and held in one step: a call that starts now waits for the release (then
        # reloads), instead of being waited for by it.
        hold = try_hold(module.modules())
        if hold is None:
            return None
        try:
            # Inside torch.autocast its cache holds every weight it cast, which counts as
            # autograd's: every model stayed loaded, as 'held by an autograd graph'.
            drop_autocast_casts()
            saved = _saved_for_backward(module, kept)  # in the hold: no call saves more now
        except BaseException:  # a Ctrl-C in the walk: the hold ends with it
            hold.active = False
            end_hold(hold)
            raise
        if saved is not None:
            end_hold(hold)
            if say:
                self._say(
                    model,
                    "saved",
                    f"{model.name}: {saved} is held by an autograd graph whose backward is "
                    f"still to come (saved for it, or to receive its gradient; freed, that "
                    f"backward failed or crashed the interpreter): kept loaded until the "
                    f"graph is gone. Calls that need no gradients: under torch.no_grad()",
                )
            return None
        return _Victim(model, hold)

    def _run_ahead(self, models: list[_Model], purpose: str) -> None:
        """The load-ahead thread: load ``models``, marked ``loading`` for it, in turn."""
        background_thread()
        me = threading.get_ident()
        try:
            for model in models:
                with self._mutex:
                    module = model.module()
                    if self._closed or module is None:
                        continue  # left released by the finally below
                    model.owner = me
                try:
                    self._fill(model, module, ahead=purpose)
                except Exception as exc:  # its use loads it, and says what failed
                    with self._mutex:
                        self._say(
                            model,
                            "ahead",
                            f"{model.name}: a load ahead failed ({type(exc).__name__}: "
                            f"{exc}); it loads at its use",
                        )
        finally:
            with self._mutex:
                for model in models:
                    if model.owner == AHEAD:
                        model.state, model.owner = RELEASED, None
                self._ahead = None
                self._bell.ring()

    def _first_loaded(
        self,
        module: nn.Module,
        model: _Model,
        recipe: Recipe | str | None,
        chains: dict[str, tuple[Any, ...]] | None,
    ) -> None:
        """Under the lock, after a stand-in's first load: how it reloads, its size, and the
        dtypes its tensors went through (``chains``, when conversions were replayed)."""
        model.first = None
        model.size = _bytes(module)
        if isinstance(recipe, str):
            self._through_factory(model, recipe)
        else:
            model.recipe = recipe
        with torch_function_off():
            model.chains = chains or {n: (t.dtype,) for n, t in named_tensors(module)}

    def call_ended(self, model: _Model) -> None:
        """After a call of ``model``, on its thread: when a load went over the budget
        because the models it would have released were in calls on other threads, room
        for ``model`` made now that this call is over (two threads in two models, with room
        for one, left both loaded over the budget until the next load, for good when the
        script loads nothing more). Unlocked, the check costs a call one attribute read."""
        if self._over:
            self._make_room(model.size, model.name, keep=model, say=False)

    def _make_room(
        self, size: int, name: str, keep: _Model | None = None, *, say: bool = True
    ) -> None:
        """Release idle models, one at a time, until ``size`` more bytes fit the budget
        (giving memory back once, after the last: :func:`~stageload.hooks.release.releasing`);
        ``say``: that ``keep`` is loaded over the budget, when it is (once per model)."""
        me = threading.get_ident()
        with releasing(collect=False):
            while True:
                victim = None
                try:
                    with self._mutex:
                        victim = self._victim(size, name, keep, say)
                        if victim is None:
                            return
                        victim.model.state, victim.model.owner = RELEASING, me
                    self._release(victim)
                except BaseException:
                    self._unchoose(victim)
                    raise

    def _unchoose(self, victim: _Victim | None) -> None:
        """After an exception (a Ctrl-C: CPython raises it after the lock's release returns)
        between a release's choice and the start of :meth:`_release`: the model this thread
        marked ``releasing`` is loaded again, and its calls go on (they waited for good)."""
        if victim is None:
            return
        victim.hold.active = False  # one store: its calls go on
        with self._mutex:
            model = victim.model
            if model.state == RELEASING and model.owner == threading.get_ident():
                # _release's finally did not set it: released if its release got that far
                module = model.module()
                done = module is not None and is_released(module)
                model.state, model.owner = (RELEASED if done else LOADED), None
                self._bell.ring()
        end_hold(victim.hold)

    def release_unlisted(
        self, objects: Iterable[Any], reason: str = REASON_NOT_IN_PLAN, later: Iterable[Any] = ()
    ) -> list[str]:
        """A hard stage (an adapter's, with no budget): release every loaded model that is
        not among ``objects`` nor held in one of them (an extractor's backbone, a plain
        object's module), whatever the budget; one that cannot go now (in a call,
        changed, holding gradients, held elsewhere) stays, as under the budget, and so
        does one never called yet that ``later`` (a later stage's objects) lists: made
        loaded before its stage (a factory auto cannot stand in for), it would be read
        again there. Returns the names released; ``reason``: their release events'."""
        listed, waiting = _module_ids(objects), _module_ids(later)
        me, released = threading.get_ident(), []
        with releasing(collect=False):
            while True:
                victim = None
                try:
                    with self._mutex:
                        self._prune()
                        for model in self._models.values():
                            module = model.module()
                            if module is None or _among(module, listed):
                                continue
                            if not model.called and _among(module, waiting):
                                continue
                            victim = self._held_for_release(model, say=True)
                            if victim is not None:
                                break
                        if victim is None or self._closed:
                            if victim is not None:
                                victim.hold.active = False
                                end_hold(victim.hold)
                            return released
                        victim.model.state, victim.model.owner = RELEASING, me
                    self._release(victim, reason=reason)
                except BaseException:
                    self._unchoose(victim)
                    raise
                released.append(victim.model.name)

    def _victim(
        self, size: int, name: str, keep: _Model | None, say: bool = True
    ) -> _Victim | None:
        """Under the lock: the model to release so that ``size`` more bytes fit, or None
        when they fit (or nothing can go: said once, with ``say``)."""
        from ..units import format_apart, format_size

        self._prune()
        if self._closed:
            return None
        others = [  # a model being released still holds its memory
            m
            for m in self._models.values()
            if m is not keep and m.state != RELEASED and m.module() is not None
        ]
        kept = 0  # what released models keep in memory: the script's parts, as they are now
        for m in self._models.values():
            held = m.module() if m is not keep and m.state == RELEASED else None
            if held is not None and m.keys is not None:
                kept += _kept_bytes(held, m.keys)
        if sum(m.size for m in others) + kept + size <= self.budget:
            self._over = False
            return None
        idle = [m for m in others if m.state == LOADED and not m.pinned]
        for m in self._order(idle, others, keep.name if keep is not None else name, size):
            victim = self._held_for_release(m, say=True)
            if victim is not None:
                return victim
        # Room again as each call ends, while a model that could go is in one (not for a
        # pin or a holder, which a call's end does not change: each call would look again).
        self._over = any(_busy(m) for m in idle)
        if keep is not None and say:  # once per model; the room made before a factory says nothing
            n = len(others)
            what = f"beside {n} model{'s' * (n != 1)} in use" if others else "alone"
            if kept:
                what += f" and {format_size(kept)} that released models keep (the script's parts)"
            shown, budget = format_apart(size, self.budget)
            self._say(
                keep,
                "over",
                f"{name}: {shown} {what} is over the budget of {budget}; loaded anyway",
            )
        return None

    def _order(
        self, idle: Sequence[_Model], holding: Sequence[_Model], name: str, size: int
    ) -> list[_Model]:
        """Who goes first, so that ``name`` (``size`` bytes) fits beside ``holding``. Once
        there is a plan, the adapters' rule (:meth:`~stageload.FurthestNextUse.victims`):
        the fewest models whose next uses are furthest, the stage's own models kept; then
        the other idle models, furthest next use first. Before a plan, least recently
        used first."""
        plan, stage = self.record.plan, self.record.stage
        by_use = sorted(idle, key=lambda m: m.last_use)
        if plan is None or stage is None:
            return by_use
        sizes = {m.name: m.size for m in self._models.values() if m.module() is not None}
        sizes[name] = size
        view = self._timings.view(plan, pinned=frozenset(), sizes=sizes, prefetchable=frozenset())
        loaded = [*(m.name for m in holding), name]
        free = {m.name for m in idle}
        names = self._policy.victims(
            stage, loaded, view, protect=frozenset(n for n in loaded if n not in free)
        )
        first = [self._models[n] for n in names if n in free]
        # A model the plan does not list has no next use: inf, it goes first.
        rest = sorted(
            (m for m in by_use if m not in first), key=lambda m: -plan.next_use(m.name, stage)
        )
        return first + rest

    def _release(self, victim: _Victim, note: str | None = None, reason: str = REASON_AUTO) -> None:
        """Release the victim's model, marked ``releasing`` and held by this thread, without
        the lock; ``reason``: the release event's."""
        model, done, module, kept = victim.model, False, None, 0
        try:  # first: a Ctrl-C at the clock's call below is this release's (see _unchoose)
            start = time.perf_counter()
            module = model.module()
            if module is not None:
                model.layout = _layout(module, model.chains, model.placed, model.layout)
                model.size = _bytes(module)
                kept = _kept_bytes(module, model.keys)
                model.device = next(iter(model.layout.values()), (None, model.device))[1]
                # The hook's released() marks its tensors. A Ctrl-C is raised once the
                # release is done (release() finishes first), so the model is released.
                release(module, name=model.name)
            done = True
        except BaseException:  # Ctrl-C, a warning raised: released if the release began
            done = module is not None and is_released(module)
            raise
        finally:
            victim.hold.active = False  # one store: over, whatever interrupts the rest
            with self._mutex:  # the state first: an interrupt below leaves only tidying
                model.state, model.owner = (RELEASED if done else LOADED), None
                if done and model.keys is not None and module is not None:
                    self._say(
                        model,
                        "parts",
                        f"{model.name}: the parts the script added or changed "
                        f"({_first_own(model.keys, module)}) stay in memory while it is "
                        f"released; the rest is staged",
                    )
                if done:
                    self._emit(
                        Event(
                            RELEASE,
                            model=model.name,
                            bytes=model.size - kept,  # what it gave back
                            seconds=time.perf_counter() - start,
                            reason=reason,
                            note=note,
                        )
                    )
                self._bell.ring()
            end_hold(victim.hold)

    def close(self) -> None:
        """The block ended: take auto's hooks off every loaded model; a released one keeps
        its hook and reloads at its next use (then loses it), with no budget."""
        with self._mutex:
            self._closed = True
        # The thread ahead, being started (or given up) on another thread, has an ident.
        self._bell.wait(self._mutex, lambda: self._ahead is None or self._ahead.ident is not None)
        with self._mutex:
            ahead = self._last_ahead
        try:
            if ahead is not None and ahead.ident is not None:  # no thread outlives the block
                ahead.join()
        finally:
            with self._mutex:
                for model in self._models.values():
                    module = model.module()
                    if module is not None and model.state == LOADED:
                        _unhook(module)
                self._prune()  # the records of dropped models (their factory arguments)

    # -- helpers -------------------------------------------------------------------------
    def _on_drop(self, name: str) -> Callable[[Any], None]:
        def dropped(_: Any) -> None:
            self._dead.append(name)  # any thread, inside a collection: no lock here

        return dropped

    def _prune(self) -> None:
        """Under the lock: forget the models the script dropped; one dropped loaded gave
        its memory back, said as a release (``dropped``) so the trace does not show it
        loaded to the end (the Pixal3D port's MoGe, made and dropped per image)."""
        while self._dead:
            model = self._models.get(self._dead.pop())
            if model is not None:
                if model.state == LOADED:
                    self._emit(
                        Event(RELEASE, model=model.name, bytes=model.size, reason=REASON_DROPPED)
                    )
                self._forget(model)

    def _forget(self, model: _Model) -> None:
        """Under the lock: no record of ``model`` from here on, nor of its factory calls."""
        del self._models[model.name]
        for key in [k for k, m in self._shared.items() if m is model]:
            del self._shared[key]

    def give_up(self, model: _Model, module: nn.Module, why: str) -> None:
        """Stop staging ``model``, said once: the script takes it over as it is (its
        released tensors meta tensors whose use loads nothing, as on meta without auto)."""
        while True:
            self.settled(model)
            with self._mutex:
                if _moving_elsewhere(model):  # a load ahead began since: wait for it too
                    continue
                # Each step may be taken again (a Ctrl-C between them, then the script's
                # retry): the hooks go last, so until then a retry comes back here.
                unmark_empty(module)
                for part in module.modules():
                    unmark_released(part)
                _unhook(module)
                if self._models.get(model.name) is model:
                    self._forget(model)
                    self._note(f"{model.name}: {why}: not staged from here on")
                return

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _pin(self, model: _Model, why: str, *, changed: bool = False) -> None:
        """Keep ``model`` loaded from now on, and say why once; ``changed``: it is not as
        its factory makes it (no later factory call shares it)."""
        model.changed = model.changed or changed
        if not model.pinned:
            model.pinned = True
            self._say(model, "pinned", f"{model.name}: {why}: kept loaded, not staged")
        if changed and model.shared:  # a policy and its reference model: one object
            self._say(
                model,
                "shared",
                f"{model.name}: {model.shared + 1} identical factory calls got this one "
                f"model, so each sees the change (auto(share=False) or --no-share makes "
                f"each its own)",
            )

    def _through_factory(self, model: _Model, why: str) -> None:
        """Say once that ``model`` reloads by calling its factory again, and why: its
        files alone do not give its weights. A factory may draw random numbers, so it
        never runs on the load-ahead thread."""
        ahead = "; it loads at its use, never ahead" if self.prefetch else ""
        self._say(model, "factory", f"{model.name}: reloads through its factory: {why}{ahead}")

    def _say(self, model: _Model, kind: str, text: str) -> None:
        if kind not in model.said:
            model.said.add(kind)
            self._note(text)

    def _note(self, text: str) -> None:
        self.notes.append(text)
        self._emit(Event(NOTE, note=text))

    def _emit(self, event: Event) -> None:
        if self._sink is not None:
            self._sink.emit(event)
        for sink in self._joined:
            try:
                sink.emit(event)
            except Exception as exc:  # observation never kills what it observes
                self._joined = tuple(s for s in self._joined if s is not sink)
                self._note(
                    f"a joined block's event sink raised ({type(exc).__name__}: {exc}); "
                    f"it gets no more events"
                )

    def join(self, events: EventSink | None) -> Callable[[], None]:
        """A block that joins this session (:func:`auto` inside one on) gets its events in
        ``events`` too, until the returned function is called."""
        if events is None:
            return lambda: None
        with self._mutex:
            self._joined = (*self._joined, events)

        def leave() -> None:
            with self._mutex:
                joined = list(self._joined)
                joined.remove(events)
                self._joined = tuple(joined)

        return leave


def _written(model: _Model, seen: Seen, keys: dict[str, str] | None) -> list[str]:
    """The tensors written since a reload from the files filled them: it leaves each it
    reads at version 0 (the bytes go in by ``pread``; conversions replace ``.data``, which
    keeps the counter), so a higher one is a write by the script, made while a load ahead
    ran. Tensors the files lack (``position_ids``, computed at the first load and cloned
    back) are not read: their counter may have moved in the reload itself; nor are the
    parts the script added (``keys``: :attr:`_Model.keys`), which stayed in memory."""
    computed = model.recipe.computed if model.recipe is not None else {}
    return [
        n
        for n, (_, version, _) in seen.items()
        if (version or 0) > 0 and n not in computed and (keys is None or n in keys)
    ]


def _reloads_alone(model: _Model) -> bool:
    """Whether ``model`` may load ahead: released, and reloads from its files alone (no
    factory, which may draw random numbers: a background thread would move the script's
    stream), as it was released (one device, not changed, not kept loaded)."""
    devices = {want[1] for want in model.layout.values()}
    return (
        model.state == RELEASED
        and model.first is None
        and model.recipe is not None
        and not model.pinned
        and not model.changed
        and len(devices) == 1
    )


def _moving_elsewhere(model: _Model) -> bool:
    """Another thread is loading or releasing ``model`` (its tensors are being written)."""
    return model.state in (LOADING, RELEASING) and model.owner != threading.get_ident()


def _with_grad(module: nn.Module, keys: dict[str, str] | None) -> str | None:
    """The name of a parameter of ``module`` that holds a gradient and that a release
    takes (every one, or those its files hold: ``keys``, :attr:`_Model.keys`), or None."""
    return next(
        (
            n
            for n, p in module.named_parameters()
            if p.grad is not None and (keys is None or n in keys)
        ),
        None,
    )


def _module_ids(objects: Iterable[Any]) -> set[int]:
    """The ids of every module in ``objects``: modules, and plain objects' modules (a
    background remover's network held as an attribute), with their submodules."""
    from torch import nn

    ids: set[int] = set()
    for obj in objects:
        if isinstance(obj, nn.Module):
            held = [obj]
        else:
            held = [v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, nn.Module)]
        ids.update(id(sub) for module in held for sub in module.modules())
    return ids


def _among(module: nn.Module, ids: set[int]) -> bool:
    """Whether ``module`` or one of its parts is among ``ids`` (:func:`_module_ids`)."""
    return any(id(sub) in ids for sub in module.modules())


def _busy(model: _Model) -> bool:
    """Whether any thread, this one included, is inside a method of the model or of one of
    its parts: a call (``vae.decoder`` inside ``vae.decode()``, which no hook on the model
    sees) or any other method (``vae.decode`` itself, ``generate``), which may hold a view
    of a weight: a frame whose ``self`` is one of its modules is on a stack. Read when a
    victim is chosen, and at each call's end while a load is over the budget (``call_ended``).

    The stacks' ``self`` objects are gathered first (microseconds a frame), then looked
    for among the model's modules: the model itself first, as a call through it puts it
    on the stack; listing its modules costs about 1 µs each (0.5 ms for 529), paid only
    when it is not there (bench/auto_overlap.py)."""
    module = model.module()
    if module is None:
        return False
    selves = set()
    for frame in sys._current_frames().values():
        while frame is not None:
            if "self" in frame.f_code.co_varnames:
                selves.add(id(frame.f_locals.get("self")))
            frame = frame.f_back
    return id(module) in selves or any(id(m) in selves for m in module.modules())


def _seen(module: nn.Module) -> Seen:
    """Each tensor's id, version counter (:func:`stageload.load.changes.version`: None for
    a tensor made in ``inference_mode``, whose change shows only in its values) and
    address."""
    with torch_function_off():
        return {
            name: (id(t), changes.version(t), t.data_ptr()) for name, t in named_tensors(module)
        }


def _samples(module: nn.Module, keys: dict[str, str] | None = None) -> dict[str, Any]:
    """A sample of each tensor's values (:func:`stageload.load.changes.sample`): it tells a
    change made through ``.data``, which no version counter sees, or a reload that made
    other weights. ``keys``: only the tensors its files hold (:attr:`_Model.keys`); the
    script's own parts may change as it likes (a LoRA it trains)."""
    out: dict[str, Any] = {}
    with torch_function_off():
        for name, t in named_tensors(module):
            if keys is not None and name not in keys:
                continue
            values = changes.sample(t)
            if values is not None:
                out[name] = values
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first name whose samples differ (a NaN equal to a NaN), or None."""
    differs = _differing(a, b)
    return differs[0] if differs else None


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The names whose samples differ (:func:`stageload.load.changes.same`), in order."""
    return [n for n in sorted(a.keys() | b.keys()) if not changes.same(a.get(n), b.get(n))]


def _changed(model: _Model) -> str | None:
    """What the script changed in ``model`` since auto loaded it that a release would lose,
    or None. A loaded model that reloads from its files loses nothing: parts added or
    removed (a LoRA), tensors changed in place (their version counters) and tensors whose
    values differ from the loaded ones (changed through ``.data``, or replaced) become the
    script's own (:attr:`_Model.keys`), which its releases leave in memory. For any other
    model, the first of these is said. A tensor replaced by its own values converted
    (``.to``, ``.half``: buffers get new objects) is no change: a reload converts the same
    way. A released model's empty tensors are no change either. None also records a loaded
    model's tensors as they are now, for the next check."""
    module = model.module()
    if module is None:
        return None
    now = _seen(module)
    from_files = model.first is None and model.recipe is not None
    staged = from_files and model.state == LOADED  # what it changed is kept, not said
    keys, renames = model.keys, None
    if now.keys() != model.seen.keys():
        if from_files and model.state != LOADED:
            return None  # its reload takes the new names (_fill)
        if not staged:
            extra = sorted(now.keys() ^ model.seen.keys())
            return f"parts added or removed: {extra[0]}"
        renames = _renames(module, model)
        keys = _keys(model, renames, module)
    back = renames if renames is not None else {n: n for n in now}  # name now -> at load
    changed: set[str] = set()
    for name, (ident, version, address) in now.items():
        then = model.seen.get(back.get(name, ""))
        if then is None or keys is not None and name not in keys:
            continue  # the script's own part
        # The same object and data, a later version: changed in place. New data under the
        # same object is a conversion that swapped it in (torch's
        # swap_module_params_on_conversion) or a new ``.data``: the values decide below.
        # Later, not just another: a conversion's new buffer can take the id and the
        # address of the one it replaced, with a fresh counter below its version (1 run in
        # 20 of a bfloat16 round trip said "scale" changed).
        if then[0] == ident and _later(then[1], version) and then[2] == address:
            if not staged:
                return f"{name} changed in place"
            changed.add(name)
    loaded = {n: model.samples[b] for n, b in back.items() if b in model.samples}
    samples, then_samples = _samples(module, keys), _converted(loaded, module)
    if model.state != LOADED:
        # Released by auto (or on its way in or out): its empty tensors have nothing to
        # compare; the ones in memory still must equal their load's.
        then_samples = {n: s for n, s in then_samples.items() if n in samples}
    differs = _differing(samples, then_samples)
    if differs and not staged:
        return f"{differs[0]} changed"
    if model.state == LOADED:  # a released model's empty tensors are not what to compare to
        changed.update(differs)
        if changed:  # the script's from now on; a factory call makes a new model
            keys = {n: k for n, k in (keys or {n: n for n in now}).items() if n not in changed}
            if not keys:  # nothing left to release: kept loaded, as said
                return f"{sorted(changed)[0]} changed"
        if renames is not None or changed:  # what auto keeps by name follows the tensors
            samples = {n: v for n, v in loaded.items() if keys is None or n in keys}
            placed = {n: model.placed[b] for n, b in back.items() if b in model.placed}
            chains = {n: model.chains[b] for n, b in back.items() if b in model.chains}
            layout = _renamed(model.layout, renames) if renames is not None else model.layout
            # Stored together, with no call between: a Ctrl-C lands before or after.
            model.samples, model.keys, model.placed, model.chains, model.layout = (
                samples,
                keys,
                placed,
                chains,
                layout,
            )
            model.changed = model.changed or bool(changed)
        model.seen = now
    return None


def _later(then: int | None, now: int | None) -> bool:
    """Whether version counter ``now`` moved on from ``then``: a tensor's counter only
    grows. None (an inference tensor, no counter) against a number: another tensor."""
    if then is None or now is None:
        return then != now
    return now > then


def _keys(
    model: _Model, renames: dict[str, str] | None, module: nn.Module
) -> dict[str, str] | None:
    """:attr:`_Model.keys` of ``module`` once the script's renames since the last load
    (``renames``: :func:`_renames`) are taken: None when every tensor is the files',
    under the name it loaded with."""
    if renames is None:
        return model.keys
    base = model.keys if model.keys is not None else {n: n for n in model.seen}
    keys = {now: base[then] for now, then in renames.items() if then in base}
    with torch_function_off():
        names = [n for n, _ in named_tensors(module)]
    if len(keys) == len(names) and all(keys.get(n) == n for n in names):
        return None
    return keys


def _scripts_parts(module: nn.Module, keys: dict[str, str]) -> list[Any]:
    """The tensors of ``module`` in memory that its files do not hold (``keys``:
    :attr:`_Model.keys`), each once."""
    with torch_function_off():
        tensors = [(n, t, t.is_meta) for n, t in named_tensors(module)]
    files = {id(t) for n, t, _ in tensors if n in keys}
    own = {id(t): t for _, t, meta in tensors if id(t) not in files and not meta}
    return list(own.values())


def _kept_bytes(module: nn.Module, keys: dict[str, str] | None) -> int:
    """The bytes a release of ``module`` leaves in memory: the script's parts (``keys``)."""
    return sum(t.nbytes for t in _scripts_parts(module, keys)) if keys is not None else 0


def _first_own(keys: dict[str, str], module: nn.Module) -> str:
    """The first name of ``module`` that its files do not hold (``keys``)."""
    with torch_function_off():
        return next((n for n, _ in named_tensors(module) if n not in keys), "none")


def _as_made(model: _Model, module: nn.Module | None = None) -> Any:
    """What a factory call that shares ``model`` would get, in what the script may change
    without changing a value: its mode (``train()``), each tensor's dtype and
    ``requires_grad``, and its device."""
    module = module if module is not None else model.module()
    if module is None:
        return None
    with torch_function_off():
        tensors = tuple((n, t.dtype, t.requires_grad) for n, t in named_tensors(module))
        devices = {t.device for _, t in named_tensors(module) if not t.is_meta}
    return module.training, tensors, devices or {model.device}


def _held_elsewhere(module: nn.Module, kept: Collection[int] = ()) -> str | None:
    """The first tensor of ``module`` whose memory something outside the model still
    holds (:func:`~stageload.hooks.release.held_outside`), or None: a release would free
    memory under the holder. ``kept``: the ids of tensors a release leaves in memory
    (:meth:`_Hook.retain`)."""
    with torch_function_off():
        held = held_outside(named_tensors(module), kept)
    return held[0][0] if held else None


def _saved_for_backward(module: nn.Module, kept: Collection[int] = ()) -> str | None:
    """The first tensor of ``module`` that autograd holds as it is (:func:`held_by_autograd`:
    a graph saved it for a backward still to come, or will accumulate a gradient into it),
    or None. A release would cut that backward off, and a reload would hold it twice. A
    view it saved counts in the storage too (:func:`_held_elsewhere`). ``kept``: as
    there, tensors a release leaves alone."""
    import torch

    with torch_function_off():
        for prefix, sub in module.named_modules(remove_duplicate=False):
            # A TorchScript module's C++ object holds its tensors too (not a graph).
            slots = int(isinstance(sub, torch.jit.ScriptModule))
            for key, t in itertools.chain(*(table.items() for table in own_tensor_tables(sub))):
                if t is not None and id(t) not in kept and held_by_autograd(t, slots=slots):
                    return f"{prefix}.{key}" if prefix else key
    return None


def _converted(samples: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """``samples`` in the dtypes the module's tensors have now (a conversion is no change)."""
    with torch_function_off():
        dtypes = {name: t.dtype for name, t in named_tensors(module)}
    return {n: changes.converted(v, dtypes[n]) if n in dtypes else v for n, v in samples.items()}


def _layout(
    module: nn.Module,
    chains: dict[str, tuple[Any, ...]] | None = None,
    placed: dict[str, int] | None = None,
    before: Layout | None = None,
) -> Layout:
    """Each tensor as the script left it (:data:`Layout`); ``chains``: the dtypes each went
    through up to its last load; ``placed``: where that load left each; ``before``: the
    layout at the release before (a tensor once moved stays so: the reload that gave it
    fresh memory left it where the next load will look)."""
    import torch

    chains, placed, before = chains or {}, placed or {}, before or {}
    with torch_function_off():
        return {
            n: (
                tuple(converted(chains.get(n, ()), t.dtype)),
                t.device,
                t.requires_grad,
                # channels_last as the script left it: a 1x1 kernel is contiguous in both
                # formats, and its strides (C, 1, C, C) are what a conversion gives it
                t.stride()
                if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                else None,
                own_attributes(t),
                placed.get(n, t.data_ptr()) != t.data_ptr() or before.get(n, _UNMOVED)[5],
            )
            for n, t in named_tensors(module)
        }


#: A layout entry of a tensor never released: only its ``moved``, False, is read.
_UNMOVED = ((), None, False, None, {}, False)


def _converted_layout(
    layout: Layout, dtypes: dict[Any, Any], device: Any, fresh: Collection[Any] = ()
) -> Layout:
    """``layout`` after a conversion of the released model: ``dtypes`` maps each dtype that
    changes to its new one, ``device`` is where every tensor goes (None: each stays),
    ``fresh`` the dtypes it copies while keeping them and the device (``.to("cpu:0")``:
    :func:`~stageload.load.refill.fresh_memory`). A tensor converted gets fresh memory at
    its reload, as the script's conversion gave it (a round trip that ends where it began
    included)."""
    out: Layout = {}
    for name, (chain, was, grad, strides, attrs, moved) in layout.items():
        dtype = dtypes.get(chain[-1]) if chain else None
        new = tuple(converted(chain, dtype)) if dtype is not None else chain
        to = device if device is not None else was
        moved = moved or dtype is not None or to != was or bool(chain) and chain[-1] in fresh
        out[name] = (new, to, grad, strides, attrs, moved)
    return out


def _replayed(module: nn.Module, pending: list[Callable[[Any], Any]]) -> dict[str, tuple[Any, ...]]:
    """Run the conversions the script made before the first load on it, in order; returns
    each tensor's dtypes through them (a round trip keeps its rounding at a reload, as it
    does in the script's weights)."""
    with torch_function_off():
        chains = {n: (t.dtype,) for n, t in named_tensors(module)}
    for fn in pending:
        module._apply(fn)  # loading, by this thread: torch's own conversion
        with torch_function_off():
            chains = {
                n: tuple(converted(chains.get(n, ()), t.dtype)) for n, t in named_tensors(module)
            }
    return chains


def _convert(fresh: nn.Module, layout: Layout) -> None:
    """Give ``fresh`` (a reload) the dtypes and devices the script left: each tensor
    converted through the dtypes its values went through (tied ones stay tied: ``.data``
    keeps the object). One the script's conversions moved gets an allocation of its own
    even where they changed no value (float32 -> float64 -> float32): left where the load
    put it (a checkpoint's offset, 56 bytes past a 64-byte line), a kernel could take
    another path than on the script's fresh, aligned copy, and a linear layer gave other
    last bits (a new-user helper's finding, 3e-7 on Stable Diffusion's time embedding)."""
    import torch

    done: set[int] = set()
    with torch.no_grad():
        for name, t in named_tensors(fresh):
            want = layout.get(name)
            if want is None or id(t) in done:
                continue
            done.add(id(t))
            dtypes, device, _, strides, _, moved = want
            before = t.data_ptr()
            for dtype in dtypes:  # each in turn: a round trip keeps its rounding
                if t.dtype != dtype or t.device != device:
                    t.data = t.data.to(device=device, dtype=dtype)
            if moved and t.data_ptr() == before:
                t.data = t.data.clone()
            if strides is not None and t.stride() != strides:  # .to(memory_format=...)
                placed = torch.empty_strided(t.size(), strides, dtype=t.dtype, device=t.device)
                placed.copy_(t.data)
                t.data = placed


def _auto_hook(module: nn.Module) -> ModuleHook | None:
    registry = HookRegistry.of(module)
    return registry.get(AUTO) if registry is not None else None


def _unhook(module: nn.Module) -> None:
    for sub in (module, *module.children()):
        registry = HookRegistry.of(sub)
        hook = registry.get(AUTO) if registry is not None else None
        if isinstance(hook, _Hook) and hook.model.module() is module:
            HookRegistry.remove(sub, AUTO)


def _settled_first(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module._apply`` (``.to``, ``.half``, ``.cuda``...) while auto is on: a model
    that another thread is loading (ahead) or releasing is converted once that is done.
    Converted midway, the load's own conversion to the layout it started with undid the
    script's: mixed dtypes, or a dtype mismatch at the next call."""

    @functools.wraps(inner)
    def _apply(module: Any, *args: Any, **kwargs: Any) -> Any:
        hook = _auto_hook(module)
        if isinstance(hook, _Hook):
            session, model = hook.session, hook.model
            whole = len(args) == 1 and not kwargs  # _apply(fn, recurse=False): a part only
            # to_empty passes recurse=True by name
            entire = len(args) == 1 and kwargs in ({}, {"recurse": True})
            if entire and model.module() is module and _to_meta(args[0]):
                session.give_up(model, module, "moved to meta by the script")
                return inner(module, *args, **kwargs)
            if whole and session.convert_released(model, module, args[0], inner):
                return module
            session.settled(model)  # then released, maybe: taken as such
            if whole and session.convert_released(model, module, args[0], inner):
                return module
            out = inner(module, *args, **kwargs)
            if whole and model.module() is module:
                session.converted_loaded(model)
            return out
        return inner(module, *args, **kwargs)

    return _apply


def _kept_for_torchscript(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.jit.trace`` and ``torch.jit.script`` while auto is on: the staged models in
    what they compile load first (a first load inside the tracer was traced too, and
    failed: "We don't have an op for aten::view") and stay (the TorchScript module holds
    their tensors: a release emptied them under it, and its next call failed)."""

    @functools.wraps(inner)
    def compile_kept(obj: Any, *args: Any, **kwargs: Any) -> Any:
        from torch import nn

        if isinstance(obj, nn.Module) and _ACTIVE:
            _ACTIVE[0].keep_loaded(obj, f"compiled by torch.jit.{inner.__name__}")
        return inner(obj, *args, **kwargs)

    return compile_kept


def _to_meta(fn: Callable[[Any], Any]) -> bool:
    """Whether the conversion ``fn`` (``_apply``'s) moves tensors to ``meta``
    (``model.to("meta")``: the script drops the weights)."""
    import torch

    try:
        with torch_function_off():
            return fn(torch.zeros(1, device="cpu")).is_meta  # not the default device
    except Exception:  # what it raises on the weights it raises there, as eager does
        return False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``waiting[name](module)`` once the module ``name`` is imported (a library the
    script imports after auto began), so auto itself imports none of them."""

    def __init__(self, waiting: dict[str, Callable[[Any], None]]) -> None:
        self.waiting = waiting

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        then = self.waiting.get(name)
        if then is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        del self.waiting[name]
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            then(module)

        loader.exec_module = exec_module  # this spec's loader only
        return spec


def _bytes(module: nn.Module) -> int:
    return sum(storage_sizes(module).values())


def _learn(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    whole: bool,
    names: dict[str, str] | None = None,
) -> Recipe | str | None:
    """How ``module``, just made by a factory called with ``args`` and ``kwargs``, reloads
    from the safetensors files those name (a file, an index, a ``from_pretrained`` folder
    with its ``subfolder`` and ``variant``), or why it cannot (with ``whole``, every byte
    of each tensor is compared with the files: a factory that changed a weight after
    reading it reloads through itself), or None when they name no file. ``names``: the
    tensors its files hold, by name now -> name as made (:attr:`_Model.keys`)."""
    files = _checkpoint(args, kwargs)
    if not files:
        return None
    try:
        with torch_function_off():
            # made_new: transformers maps a base model's names into one with a head, and
            # makes the head new (a classifier on BERT's checkpoint: the fine-tuning load).
            return learn(module, files, names=names, whole=whole, made_new=True)
    except Exception as exc:  # a damaged or unreadable file: the factory still works
        return f"its files cannot be checked ({type(exc).__name__}: {exc})"


def _file_bytes(factory: Any, args: tuple, kwargs: dict) -> int:
    """What the model a factory call makes will take, from the headers of the files its
    arguments name, at the dtype its ``from_pretrained`` gives the weights
    (:func:`stageload.external.from_pretrained_dtype`); 0 when they name none or cannot be
    read."""
    files = _checkpoint(args, kwargs)
    if not files:
        return 0
    dtype = kwargs.get("torch_dtype", kwargs.get("dtype"))
    if isinstance(factory, _Bound):
        dtype = from_pretrained_dtype(factory.cls, dtype)
    if dtype is not None and not _floating(dtype):  # a dict per module, an integer dtype
        dtype = None  # counted as stored
    try:
        return checkpoint_bytes(files, dtype)
    except Exception:  # a damaged header: the load itself will say so
        return 0


def _floating(dtype: Any) -> bool:
    try:
        float_itemsize(dtype)
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` for the block, if it is not: a factory call
    made again as the script made it. The setting is the process's: a load ahead (on its
    own thread, beside the script's) fails instead, and the use loads the model."""
    import torch

    now = torch.get_default_dtype()
    if now == dtype:
        yield
        return
    if threading.current_thread().name.startswith(PREFETCH_THREAD):
        raise AutoError(f"torch's default dtype is {now} now, {dtype} at the factory call")
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(now)


def _anchored(values: tuple) -> tuple:
    """``values`` with each relative path to a file or folder that exists now, or to a
    checkpoint named without its suffix (:func:`_suffixed`), made absolute, of the same
    type (str or Path)."""

    def anchored(value: Any) -> Any:
        if not isinstance(value, (str, PurePath)) or not str(value):
            return value
        path = Path(value)
        try:
            if path.is_absolute() or not (path.exists() or _suffixed(value)):
                return value
        except (OSError, ValueError):  # a name too long for a path: a hub id, say
            return value
        return type(value)(path.absolute()) if isinstance(value, PurePath) else str(path.absolute())

    return tuple(anchored(v) for v in values)


#: Keywords of ``from_pretrained`` whose values are names, not paths: a ``subfolder="unet"``
#: anchored beside a ``unet`` folder in the working directory named another folder.
_NOT_PATHS = frozenset({"subfolder", "variant", "revision", "device_map", "token"})


def _anchored_kwargs(kwargs: dict) -> dict:
    """:func:`_anchored` for keyword arguments, leaving the ones that name no path."""
    keys = [k for k in kwargs if k not in _NOT_PATHS]
    anchored = _anchored(tuple(kwargs[k] for k in keys))
    return {**kwargs, **dict(zip(keys, anchored, strict=True))}


def _suffixed(value: str | PurePath) -> Path | None:
    """The checkpoint a path names without its suffix, if there is one: the Pixal3D port's
    and TRELLIS' ``from_pretrained("ckpts/ss_flow")`` read ``ckpts/ss_flow.safetensors``.
    Only a path with a folder in it: a bare word (``revision="main"``) is not a path,
    whatever files the current folder holds."""
    text = str(value)
    if "/" not in text and os.sep not in text:
        return None
    file = Path(f"{text}.safetensors")
    return file if file.is_file() else None


def _checkpoint(args: tuple, kwargs: dict) -> list[Path]:
    """The safetensors files a factory's arguments name: each path to a ``.safetensors``
    file or a sharded index, each folder where ``from_pretrained`` finds one, and each
    path that is one without its suffix. A file the model does not match is not used: its
    first load compares them (:func:`_learn`), and a mismatch reloads through the factory."""
    found: list[Path] = []
    skip = ("subfolder", "variant")
    for value in (*args, *(v for k, v in kwargs.items() if k not in skip)):
        if not isinstance(value, (str, PurePath)):
            continue
        path = Path(value)
        try:
            if path.is_dir():
                sub = kwargs.get("subfolder")
                files = pretrained_checkpoint(path / sub if sub else path, kwargs)
                if isinstance(files, str):
                    continue
            elif path.name.endswith((".safetensors", INDEX_SUFFIX)) and path.is_file():
                files = checkpoint_files(path)
            elif (suffixed := _suffixed(value)) is not None:
                files = [suffixed]
            else:
                continue
        except (OSError, ValueError):  # a name too long for a path, a damaged index
            continue
        found.extend(files)
    return list(dict.fromkeys(found))


def _refill(module: nn.Module, model: _Model, layout: Layout, keys: dict[str, str] | None) -> bool:
    """Reload ``module`` in place from its files, as its first load read them (its
    recipe), then convert it to ``layout``, the one the script left; False when it has no
    recipe or its tensors sat on more than one device (the factory reloads it then).
    ``keys``: the tensors its files hold, by name now (:attr:`_Model.keys`)."""
    import torch

    devices = {want[1] for want in layout.values()}
    if model.recipe is None or len(devices) != 1:
        return False
    # The mode of the first load, not the caller's: a reload inside the script's
    # inference_mode must not make a converted weight an inference tensor.
    with torch.inference_mode(model.inference), torch_function_off():
        reload(
            module,
            model.recipe,
            devices.pop(),
            names=keys,
            convert=lambda fresh: _convert(fresh, layout),  # the script's parts as they are
            progress=False,
        )
    return True


def _stand_in(build: StandIn, args: tuple, kwargs: dict, rng: RngState) -> nn.Module | None:
    """``build(args, kwargs)``: a model with its weights on ``meta`` in place of what the
    factory's call loads, or None to load it now (an argument it does not know, a head
    the checkpoint lacks, a config it cannot build: the factory itself will say why). The
    global RNG moves as the build left it when it gave a model (a diffusers model draws
    as diffusers builds it), else as it was (``rng``: its state before)."""
    import torch

    try:
        built = build(args, kwargs)
    except Exception:  # a config it cannot read: the factory itself will say why
        built = None
    keep = isinstance(built, torch.nn.Module)
    if not keep and not torch.equal(torch.get_rng_state(), rng.cpu):
        restore_rng(rng)
    return built if keep else None


def _library_stand_in(cls: type, args: tuple, kwargs: dict) -> nn.Module | None:
    """What ``cls.from_pretrained(*args, **kwargs)`` loads, on ``meta``
    (:func:`stageload.load.skeleton.stand_in`), the global RNG moved as that call moves it:
    a diffusers model's constructor draws, a transformers model is built under ``meta``
    and draws nothing (a build that drew gives it back)."""
    import torch

    rng = capture_rng()
    built = stand_in(cls, args, kwargs)
    if not isinstance(built, torch.nn.Module):
        return None
    if library_model(cls) != "diffusers" and not torch.equal(torch.get_rng_state(), rng.cpu):
        restore_rng(rng)
    return built


def _first_load(module: nn.Module, model: _Model, renames: dict[str, str] | None) -> None:
    """A stand-in's first load: its factory, as the script called it (the global RNG as it
    was then, restored for the script after; the same grad and inference modes), its
    tensors moved into the stand-in's objects by name, tied ones as the factory tied them."""
    import torch

    changed = changed_file(model.stamps)
    if changed is not None:  # read now, it would be other weights than the call's
        path, how = changed
        raise AutoError(
            f"{model.name}: {path} was {how} after the factory call that made the model "
            f"and before its first use. auto reads a model at its first use, so it would "
            f"get what is there now, not what the call would have read. Use the model "
            f"once before changing its files, or keep them (a TemporaryDirectory: keep it "
            f"open while the model is in use), or run the script without auto"
        )
    with external.BUILD_LOCK, preserved_rng(), torch.set_grad_enabled(model.grad):
        restore_rng(model.rng)
        with torch.inference_mode(model.inference):
            fresh = model.make()
    model.made = _as_made(model, fresh)  # what the factory gives (the stand-in's buffers
    # may have had another dtype than the load gives them)

    def missing(name: str) -> StageloadError:
        return StageloadError(
            f"{model.name}: its factory made a {type(fresh).__name__} without {name!r}, which "
            f"the model built from its config has: load it without auto, or name a factory "
            f"that builds it the same"
        )

    with torch_function_off():
        fill_from(
            module,
            fresh,
            missing=missing,
            names=renames,
            skip=functools.partial(_scripts_own, model),
            loaded_too=True,  # a buffer the constructor computed takes the load's
        )
    for key, value in vars(fresh).items():  # what from_pretrained set and a build does not
        module.__dict__.setdefault(key, value)  # (transformers' _weight_conversions)


def _scripts_own(model: _Model, name: str, t: Any) -> bool:
    """Whether ``t``, at ``name`` of the stand-in, is one the script put there since it
    was made (a new head, a LoRA's): in memory, and not the object auto made."""
    return not t.is_meta and model.seen.get(name, (None,))[0] != id(t)


def _renames(module: nn.Module, model: _Model) -> dict[str, str] | None:
    """For a model whose parts the script moved while it was released (peft's
    ``get_peft_model`` wraps each target layer: ``c_attn.weight`` becomes
    ``c_attn.base_layer.weight``), each tensor's name now and at its load, told by the
    tensor object itself; None when its names are as they were. Tensors added since (the
    LoRA's) are left out: they are the script's, in memory."""
    with torch_function_off():
        now = {name: id(t) for name, t in named_tensors(module)}
    if now.keys() == model.seen.keys():
        return None
    then: dict[int, str] = {}
    for name, (ident, _, _) in model.seen.items():
        then.setdefault(ident, name)  # a tied tensor: its first name
    return {
        name: name if model.seen.get(name, (None,))[0] == ident else then[ident]
        for name, ident in now.items()
        if ident in then
    }


def _replaced(module: nn.Module, model: _Model) -> str | None:
    """The first tensor of the released ``module`` that the script replaced with one in
    memory (``layer.weight = nn.Parameter(...)``), said as ``"NAME replaced"``, or None."""
    with torch_function_off():
        for name, t in named_tensors(module):
            if name in model.seen and _scripts_own(model, name, t):
                return f"{name} replaced"
    return None


def _grads_now(module: nn.Module, layout: Layout) -> Layout:
    """``layout`` with each tensor's ``requires_grad`` as it is now: the script may set it
    on a released model's empty tensors (``get_peft_model`` freezes the base, a script
    calls ``requires_grad_(False)``), and the reload gives that, not the release's."""
    with torch_function_off():
        now = {n: t.requires_grad for n, t in named_tensors(module)}
    return {n: (w[0], w[1], now.get(n, w[2]), w[3], w[4], w[5]) for n, w in layout.items()}


def _renamed(layout: Layout, renames: dict[str, str]) -> Layout:
    return {new: layout[old] for new, old in renames.items() if old in layout}


def _moved(renames: dict[str, str], model: _Model) -> str:
    """The first name that is not as it was at the load."""
    changed = sorted(
        {*renames.keys() ^ model.seen.keys(), *(n for n, o in renames.items() if n != o)}
    )
    return changed[0] if changed else "none"


def _settle(module: nn.Module, layout: Layout) -> None:
    """After a reload filled ``module``'s tensor objects: check none is left empty, give
    back the ``requires_grad`` and attributes the script set, and take release's hooks
    off."""
    with torch_function_off():  # reading an empty tensor (.is_meta) would load it again
        for name, t in named_tensors(module):
            if t.is_meta:
                raise StageloadError(
                    f"the reload of {type(module).__name__} left {name!r} empty: its "
                    f"factory made a model without that tensor"
                )
            want = layout.get(name)
            if want is None:
                continue
            if t.requires_grad != want[2] and t.is_leaf:
                t.requires_grad_(want[2])
            t.__dict__.update(want[4])  # the attributes the script set on it
    for part in module.modules():
        unmark_released(part)


def _swap_in(module: nn.Module, fresh: nn.Module) -> None:
    """Move ``fresh``'s tensors (a reload by the factory: same class, same structure) into
    the released ``module``, in place (:func:`stageload.load.skeleton.fill_from`). A tensor
    never released (kept by a hook) stays the script's."""
    extra = sorted({n for n, _ in named_tensors(fresh)} - {n for n, _ in named_tensors(module)})
    if extra:
        raise StageloadError(
            f"the reload of {type(module).__name__} has a tensor {extra[0]!r} the first load "
            f"had not: its factory made a different model"
        )

    def missing(name: str) -> StageloadError:
        return StageloadError(
            f"the reload of {type(module).__name__} left {name!r} empty: its factory made a "
            f"model without that tensor"
        )

    fill_from(module, fresh, missing=missing)


#: Argument types whose equal values make equal factory calls (a path, a dtype, a flag).
def _key(factory: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """What makes two factory calls identical (:func:`stageload.hooks.share.call_key`: plain
    values only), or None when an argument is not a plain value (then the call is never
    shared: a tensor, a module, a state dict or an object)."""
    key = call_key(args, kwargs, plain_only=True)
    return None if key is None else (factory, key)


def _unique(name: str, taken: Iterable[str]) -> str:
    taken = set(taken)
    if name not in taken:
        return name
    i = 2
    while f"{name}#{i}" in taken:
        i += 1
    return f"{name}#{i}"


def _model_name(owner: Any, args: tuple, kwargs: dict) -> str:
    """A model's name: its subfolder or its folder's name, else its class or factory
    (a device given first, ``load_upsampler("cpu")``, names no model)."""
    sub = kwargs.get("subfolder")
    if sub:
        return str(sub)
    if args and isinstance(args[0], (str, PurePath)):
        first = args[0]
        if isinstance(first, PurePath) or os.path.exists(first) or not _is_device(first):
            return PurePath(str(first)).name or str(first)
    return str(getattr(owner, "__name__", "")).lstrip("_") or "model"


def _is_device(text: str) -> bool:
    """Whether ``text`` names a torch device (``"cpu"``, ``"cuda:0"``)."""
    import torch

    with warnings.catch_warnings():  # "mkldnn" warns
        warnings.simplefilter("ignore")
        try:
            torch.device(text)
        except (RuntimeError, ValueError):
            return False
    return True


def _resolve(spec: str) -> tuple[Any, str]:
    """``module:Class.method`` (or ``module:function``) -> (owner, attribute)."""
    module_name, _, path = spec.partition(":")
    if not module_name or not path:
        raise AutoError(f"factory {spec!r}: write it as module:Class.method or module:function")
    if module_name == "__main__":
        raise AutoError(
            f"factory {spec!r}: a function of the script itself is defined only as it runs; "
            f"move it to a module the script imports, and name that module"
        )
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise AutoError(f"factory {spec!r}: cannot import {module_name!r} ({exc})") from None
    *parents, attr = path.split(".")
    for part in parents:
        try:
            owner = getattr(owner, part)
        except AttributeError:
            raise AutoError(f"factory {spec!r}: {module_name} has no {part!r}") from None
    target = getattr(owner, attr, None)
    if not callable(target):
        raise AutoError(f"factory {spec!r}: {attr!r} is not a callable of {owner!r}")
    if isinstance(target, type):  # wrapped, the name would be a function: isinstance breaks
        raise AutoError(
            f"factory {spec!r}: {attr} is a class; name a function or a classmethod that "
            f"returns the model ({module_name}:{path}.from_pretrained, or a function of "
            f"yours that builds it and loads its weights)"
        )
    return owner, attr


#: What a wrapped callable calls instead: ``around(call, who, args, kwargs)``, ``call``
#: the original bound to the class it was called on, ``who`` that class (or the function).
Around = Callable[[Callable[..., Any], Any, tuple, dict], Any]


def _wrap(owner: Any, attr: str, around: Around) -> Callable[[], None]:
    """Route each call of ``owner.attr`` through ``around``; return what undoes it. A
    classmethod (its own or inherited) stays a classmethod, so a subclass's call makes the
    subclass."""
    own = isinstance(owner, type) and attr in owner.__dict__
    raw = inspect.getattr_static(owner, attr)
    if isinstance(owner, type):

        def undo() -> None:
            if own:
                setattr(owner, attr, raw)
            else:  # it was inherited: the parent's serves again
                delattr(owner, attr)

    else:
        original = getattr(owner, attr)

        def undo() -> None:
            setattr(owner, attr, original)

    if isinstance(raw, classmethod):
        func = raw.__func__

        def through(cls: type, *args: Any, **kwargs: Any) -> Any:
            return around(_Bound(func, cls), cls, args, kwargs)

        setattr(owner, attr, classmethod(through))
        return undo
    original_call = getattr(owner, attr)

    def plain(*args: Any, **kwargs: Any) -> Any:
        return around(original_call, original_call, args, kwargs)

    setattr(owner, attr, staticmethod(plain) if isinstance(raw, staticmethod) else plain)
    return undo


def _as_factory(
    session: AutoSession, *, trusted: bool = False, stand_in: StandIn | None = None
) -> Around:
    """A factory's calls: each model it makes is staged by ``session`` (``trusted``,
    ``stand_in``: see :meth:`AutoSession.call`)."""

    def around(call: Callable[..., Any], who: Any, args: tuple, kwargs: dict) -> Any:
        name = _model_name(who, args, kwargs)
        return session.call(call, name, args, kwargs, trusted=trusted, stand_in=stand_in)

    return around


def _counted(session: AutoSession, spec: str, around: Around) -> Around:
    """``around``, counting the calls of the factory ``spec`` names in ``session``."""
    session.factory_calls.setdefault(spec, 0)  # a block that joins later keeps the count

    def counting(call: Callable[..., Any], who: Any, args: tuple, kwargs: dict) -> Any:
        session.factory_calls[spec] += 1
        return around(call, who, args, kwargs)

    return counting


def uncalled_note(spec: str) -> str:
    """What to say of a factory the user named that nothing called through auto."""
    module, _, attr = spec.partition(":")
    return (
        f"{spec} was never called through auto: nothing it made was staged. A script that "
        f"imports it before auto wraps it (from {module} import {attr.split('.')[0]}, "
        f"before the block) keeps the unwrapped function, and so does one that imports it "
        f"from a package that re-exports it: name the module the script imports it from"
    )


# Checks and sets a session's running batch in one step.
_BATCH_LOCK = threading.Lock()


class StageMajor:
    """The stages of an auto session as a stage-major batch needs them (a
    :class:`~stageload.core.batch.BatchHost`), and :meth:`map`, which runs one.

    ``stages``: the caller's own stages (name -> what each uses), in order, marked by
    :meth:`mark`; None: stages by model, entered where a model is about to be called.
    ``emit``: where a marked stage's ``stage`` event goes (auto emits its own otherwise);
    ``listening``: whether that emit reaches a sink now (default: assumed it does), so a
    batch with nothing to read its notes skips what they cost.
    ``listed``: hard stages, the objects each stage uses now (see :meth:`enter`).

    A call parks at the top of a model's call hook, before :meth:`AutoSession.used`: before
    the session's lock, the load and the room it makes. A call nested in another model's
    call never parks: the outer model would stay in a call, unreleasable, while the others
    run. Threads: :meth:`map` runs on its caller's thread, the batch's scheduler, which
    alone enters stages; each item runs on a thread of its own, one at a time, and parks in
    :meth:`park_for` or :meth:`mark`; loads and releases run on the item's thread.
    """

    def __init__(
        self,
        session: AutoSession,
        stages: Mapping[str, Iterable[str]] | None = None,
        *,
        emit: Callable[[Event], None] | None = None,
        listening: Callable[[], bool] | None = None,
        listed: Callable[[], Mapping[str, Sequence[Any]]] | None = None,
    ) -> None:
        for option, value in (("emit", emit), ("listening", listening), ("listed", listed)):
            if value is not None and not callable(value):
                raise TypeError(
                    f"StageMajor's {option}= takes a function or None, got {value!r} "
                    f"({type(value).__name__})"
                )
        self.session = session
        self.marked = stages is not None
        self._stages: dict[str, tuple[str, ...]] = {
            name: tuple(uses) for name, uses in (stages or {}).items()
        }
        self.stage: str | None = None
        self._emit = emit if emit is not None else session._emit
        # Whether a caller's own emit reaches a sink: assumed, unless it says.
        self._heard = listening if listening is not None else (lambda: emit is not None)
        self._listed = listed
        self._batch: Batch | None = None

    # -- BatchHost -----------------------------------------------------------------------
    @property
    def stages(self) -> Mapping[str, tuple[str, ...]]:
        """The stages in order; by model, it grows as the batch meets new models."""
        return self._stages

    def emit(self, event: Event) -> None:
        self._emit(event)

    def listening(self) -> bool:
        """Whether :meth:`emit` reaches any sink."""
        return self._heard() or self.session._sink is not None or bool(self.session._joined)

    def resident(self) -> dict[str, nn.Module]:
        """The models auto has loaded now (the batch's note counts what else is held)."""
        models = self.session.models
        return {n: m for n in self.session.resident() if (m := models.get(n)) is not None}

    def enter(self, stage: str) -> None:
        """Mark ``stage`` begun (by the batch's scheduler, or :meth:`mark`); again: nothing.
        Marked stages emit a ``stage`` event; hard ones release every model the stage does
        not use, but for one that a later stage lists and nothing has called yet (made
        loaded before its stage, it would be read again there)."""
        if stage == self.stage:
            return
        self.stage = stage
        if self.marked:
            self._emit(Event(STAGE, stage=stage))
        if self._listed is not None:
            by_stage = list(self._listed().items())
            at = next((i for i, (name, _) in enumerate(by_stage) if name == stage), None)
            later = [] if at is None else by_stage[at + 1 :]
            self.session.release_unlisted(
                dict(by_stage).get(stage, []), later=[o for _, objs in later for o in objs]
            )

    # -- the calls' side -----------------------------------------------------------------
    def mark(self, stage: str) -> None:
        """A caller's stage boundary: in a batch, wait until the batch is in ``stage``."""
        batch = self._batch
        if batch is not None:
            batch.park(stage)
        self.enter(stage)

    def park_for(self, name: str) -> None:
        """The model ``name`` is about to be called (its hook, before any lock): a call of
        the batch parks until the batch is in that model's stage. Stages by model only."""
        batch = self._batch
        if batch is None or current_batch() is not batch:
            return
        # Before the returns below: the call with the turn when Ctrl-C came parks only at
        # a model of another stage, so a stage's repeated calls (50 denoising steps) ran
        # to their end before the KeyboardInterrupt was raised; a child's call unwinds it.
        batch.check()
        if self.marked or in_call():
            return
        if bell.owned(self.session._mutex):  # parked under it, all would hang
            return
        if name in self._stages.get(self.stage or "", ()):
            return
        batch.park(self._stage_of(name))

    def _stage_of(self, name: str) -> str:
        """The stage of model ``name``: its first at or after the current one, else its
        first; a model no stage lists gets its own, last (run by one call at a time)."""
        order = list(self._stages)
        at = order.index(self.stage) if self.stage in self._stages else 0
        found = [s for s in order if name in self._stages[s]]
        if not found:
            self._stages[name] = (name,)
            return name
        return next((s for s in found if order.index(s) >= at), found[0])

    # -- running a batch -----------------------------------------------------------------
    def map(
        self, fn: Callable[[Any], Any], items: Iterable[Any], *, return_exceptions: bool = False
    ) -> list[Any]:
        """``fn(item)`` for every item, stage-major; results in item order. A call that
        raised: :class:`~stageload.core.batch.BatchError` once all are done, or, with
        ``return_exceptions``, its exception in its slot. One batch at a time per session."""
        if not self.marked:
            self._stages = self._planned()
            self.stage = None  # the first use of each call parks: every item starts together
        batch = Batch(self, fn, items)
        session = self.session
        try:  # set inside: a Ctrl-C just after it left the session counting a batch for good
            with _BATCH_LOCK:  # checked and set in one step: two threads' batches never both run
                running = session.batch
                if running is not None and current_batch() is running._batch is not None:
                    # fn of the running batch: said to be "another thread" before, which
                    # it is (each item has one), but the cure differs: no wait helps.
                    raise RuntimeError(
                        "session.map() inside fn of a running session.map() on the same "
                        "session: one batch at a time, and this one cannot wait for the "
                        "outer one, which waits for it. Loop over the inner items in fn, "
                        "or map once over every (outer, inner) pair"
                    )
                if running is not None:
                    raise RuntimeError(
                        "one batch at a time on an auto session: map() is running on another "
                        "thread; call it again once that one returns"
                    )
                session.batch, self._batch = self, batch
            return batch.run(return_exceptions=return_exceptions)
        finally:
            if self._batch is batch:
                session.batch, self._batch = None, None

    def _planned(self) -> dict[str, tuple[str, ...]]:
        """Stages by model, before the batch: the seeded plan's, or one per model in the
        recorded plan's order, then the session's other models as they were made."""
        session = self.session
        with session._mutex:
            plan, seeded = session.record.plan, session.record.seeded
            stages = dict(plan.items()) if plan is not None and seeded else {}
            names = [n for s in plan.values() for n in s] if plan is not None else []
            names += list(session._models)
        listed = {n for uses in stages.values() for n in uses}
        for name in names:
            if name not in listed:
                listed.add(name)
                stages[name] = (name,)
        return stages

    def close(self) -> None:
        """Release every model the session holds (reason ``close``): a run's end, as the
        staged build's close; the block's end alone leaves them loaded."""
        self.session.release_unlisted((), reason=REASON_CLOSE)


@dataclass(frozen=True)
class PlanSource:
    """Where a library knows the order of its models before their first use: a call whose
    result (or, with ``before``, whose arguments: a dict by their names in the call's
    signature, ``self`` first) ``stages`` turns into the objects it will use, stage by
    stage, and what the note calls it."""

    stages: Callable[..., list[list[Any]]]
    name: str
    before: bool = False


def _as_plan_source(session: AutoSession, source: PlanSource) -> Around:
    """A plan source's calls: the stages it gives are the plan until a use shows otherwise."""

    def around(call: Callable[..., Any], who: Any, args: tuple, kwargs: dict) -> Any:
        if source.before:
            _seed_from(session, source, lambda: _arguments(call, args, kwargs))
            return call(*args, **kwargs)
        result = call(*args, **kwargs)
        _seed_from(session, source, lambda: result)
        return result

    return around


def _arguments(call: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name, however the script passed them (``pipeline_type``
    positionally); with a signature that does not take them (the call raises its own error
    then), or none to read, the first positional one as ``self`` and the keywords."""
    try:
        signature = inspect.signature(call)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    first = next(iter(signature.parameters.values()), None) if bound is not None else None
    if first is None or first.kind in (first.VAR_POSITIONAL, first.VAR_KEYWORD):
        return {"self": args[0] if args else None, **kwargs}  # (*args, **kwargs): a wrapper
    return dict(bound.arguments)


def _seed_from(session: AutoSession, source: PlanSource, given: Callable[[], Any]) -> None:
    """Seed ``session`` with ``source``'s stages for ``given()``; a source that fails says
    so in a note and seeds nothing: the plan is a hint, never a reason for the call to fail."""
    try:
        stages = source.stages(given())
    except Exception as exc:
        session._note(f"{source.name} gave no plan ({type(exc).__name__}: {exc})")
        return
    session.seed(stages, source.name)


def _diffusers_stages(pipe: Any) -> list[list[Any]]:
    """A diffusers pipeline's components by stage, as the diffusers adapter plans them
    (:func:`stageload.diffusers.default_plan`): ``model_cpu_offload_seq``'s order
    (``"text_encoder->unet->vae"``, which diffusers' model offloading follows), with the
    components it leaves out placed by their role: a ControlNet beside its UNet, Kandinsky's
    ``prior_prior``, AudioLDM2's (it has no order)."""
    from torch import nn

    from ..diffusers import default_plan

    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        return []
    models = {n: type(c) for n, c in components.items() if isinstance(c, nn.Module)}
    seq = getattr(pipe, "model_cpu_offload_seq", None)
    plan = default_plan(seq if isinstance(seq, str) else None, models)
    return [[components[name] for name in names] for names in plan.values()]


def _pixal3d_stages(arguments: dict[str, Any]) -> list[list[Any]]:
    """The Pixal3D port's ``run(self, ..., pipeline_type=None, ...)``, its arguments by
    name: its stage plan (:mod:`stageload.pixal3d.plan`)."""
    from ..pixal3d.plan import run_stages

    pipeline = next(iter(arguments.values()), None)
    return run_stages(pipeline, arguments.get("pipeline_type"))


_DIFFUSERS_PLAN = "the diffusers adapter's plan (model_cpu_offload_seq, and roles)"

#: Plan sources wrapped with the default factories, by ``module:Class.method``.
PLAN_SOURCES: dict[str, PlanSource] = {
    "diffusers.pipelines.pipeline_utils:DiffusionPipeline.from_pretrained": PlanSource(
        _diffusers_stages, _DIFFUSERS_PLAN
    ),
    "diffusers.pipelines.pipeline_utils:DiffusionPipeline.from_pipe": PlanSource(
        _diffusers_stages, _DIFFUSERS_PLAN
    ),
    "pixal3d.pipelines.pixal3d_image_to_3d:Pixal3DImageTo3DPipeline.run": PlanSource(
        _pixal3d_stages, "the Pixal3D stage plan", before=True
    ),
}


@dataclass(frozen=True)
class _Bound:
    """A classmethod's function bound to the class it was called on: equal for equal
    (function, class), so identical calls share."""

    func: Callable[..., Any]
    cls: type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(self.cls, *args, **kwargs)


@contextlib.contextmanager
def auto(
    *,
    budget: int | str | None = None,
    factories: Iterable[str] = (),
    defaults: bool = True,
    events: EventSink | None = None,
    prefetch: bool = True,
    stages: bool = True,
    stand_ins: Mapping[str, StandIn] | None = None,
    share: bool = True,
) -> Iterator[AutoSession]:
    """Stage the models the block makes through its factories (see the module docstring).

    ``budget``: bytes, ``"12G"``, ``"80%"`` or ``"auto"`` (the default: the memory
    available now, less a reserve for working memory). ``factories``: more factories,
    ``"module:Class.method"``; ``defaults=False`` wraps only those. ``prefetch=False``:
    no loads ahead, every reload at its use. ``stages=False``: no ``stage`` events (each
    names the model whose use began it), for a caller that marks its own stages.
    ``share=False``: identical factory calls each make a model of their own, as without
    auto (by default they get one model while it lives; a change to it that auto finds
    is said to reach every name).
    ``stand_ins``: for factories of ``factories``, by spec, what builds the model a call
    returns with its weights on ``meta``, to read it at its first use instead (an
    adapter's, which knows that the script reseeds before it draws: a stand-in draws
    none of the numbers the factory's build would). After the block, a model it released
    loads again at its next use and stays. A block inside one already on joins it
    (:func:`_joining`), and ends before it."""
    if isinstance(factories, str):
        raise TypeError(
            f"factories must list 'module:function' or 'module:Class.method' names, e.g. "
            f"factories=[{factories!r}]; got the string {factories!r}"
        )
    if events is not None and not callable(getattr(events, "emit", None)):
        raise TypeError(
            f"events must be an event sink, an object with an emit(event) method (such as "
            f"stageload.ListSink() or a MemoryMeter); got {events!r}"
        )
    factories = tuple(factories)  # checked, then wrapped: a generator is read once
    _check_options(
        factories, stand_ins, defaults=defaults, prefetch=prefetch, stages=stages, share=share
    )
    own = sorted((stand_ins or {}).keys() & {*DEFAULT_FACTORIES, *PLAN_SOURCES})
    if defaults and own:
        raise TypeError(
            f"stand_ins names {own[0]!r}, one of auto's own factories, which already reads "
            f"its models at their first use; pass defaults=False to wrap it with this "
            f"stand-in instead"
        )
    with _ACTIVE_LOCK:
        outer = _ACTIVE[0] if _ACTIVE else None
        if outer is None:
            session = AutoSession(budget, events, prefetch=prefetch, stages=stages, share=share)
            _ACTIVE.append(session)
    if outer is not None:
        asked = {
            "budget": budget,
            "defaults": defaults,
            "prefetch": prefetch,
            "stages": stages,
            "share": share,
        }
        with _joining(outer, factories, events, asked, stand_ins or {}):
            yield outer
        return
    from torch import nn

    undo: list[Callable[[], None]] = []

    def factory(spec: str) -> Callable[[Any], None]:
        def wrap(module: Any) -> None:
            undo.append(_wrap(*_resolve(spec), _as_factory(session, trusted=True)))

        return wrap

    def plan_source(spec: str) -> Callable[[Any], None]:
        def wrap(module: Any) -> None:
            undo.append(_wrap(*_resolve(spec), _as_plan_source(session, PLAN_SOURCES[spec])))

        return wrap

    if defaults:
        session.wrapped.update(DEFAULT_FACTORIES, PLAN_SOURCES)

    steps: dict[str, list[Callable[[Any], None]]] = {}  # by module: once it is imported
    for spec in DEFAULT_FACTORIES if defaults else ():
        steps.setdefault(spec.partition(":")[0], []).append(factory(spec))
    for spec in PLAN_SOURCES if defaults else ():
        steps.setdefault(spec.partition(":")[0], []).append(plan_source(spec))
    waiting: dict[str, Callable[[Any], None]] = {}
    finder = _AfterImport(waiting)
    # The finder goes in first: a user's factory module that imports transformers or
    # diffusers as it is resolved below gets the defaults wrapped too.
    sys.meta_path.insert(0, finder)
    try:
        undo.append(patch(nn.Module, "_apply", _settled_first))
        import torch.jit

        for attr in ("trace", "script"):
            undo.append(patch(torch.jit, attr, _kept_for_torchscript))
        for module_name, todo in steps.items():

            def run(module: Any, todo: list[Callable[[Any], None]] = todo) -> None:
                for step in todo:
                    step(module)

            if module_name in sys.modules:
                run(sys.modules[module_name])
            else:  # wrapped when the script imports it
                waiting[module_name] = run
        undo.append(_named(session, factories, stand_ins or {}))
        yield session
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for spec in session.uncalled():
            session._note(uncalled_note(spec))
        try:
            for step in reversed(undo):
                step()
            session.close()
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE.remove(session)


def _check_options(
    factories: Iterable[str], stand_ins: Mapping[str, StandIn] | None, **switches: Any
) -> None:
    """Raise a TypeError naming the value and the fix for :func:`auto`'s options that are
    not what it takes (an option taken as true or ignored would stage otherwise than asked)."""
    for option, value in switches.items():
        if type(value).__name__ not in ("bool", "bool_"):  # numpy's too
            raise TypeError(f"{option} must be True or False; got {value!r}")
    if stand_ins is None:
        return
    if not isinstance(stand_ins, Mapping):
        raise TypeError(
            f"stand_ins must map a factory's 'module:function' name to a function "
            f"(args, kwargs) -> module on meta, e.g. stand_ins={{'pkg.models:load': build}}; "
            f"got {stand_ins!r}"
        )
    listed = set(factories)
    for spec, build in stand_ins.items():
        if spec not in listed:
            raise TypeError(
                f"stand_ins names {spec!r}, which factories does not list: a stand-in "
                f"stands for one of the factories the block wraps; add it to factories"
            )
        if not callable(build):
            raise TypeError(
                f"stand_ins[{spec!r}] must be a function (args, kwargs) -> module on "
                f"meta; got {build!r}"
            )


def _named(
    session: AutoSession, factories: Iterable[str], stand_ins: Mapping[str, StandIn]
) -> Callable[[], None]:
    """Wrap the factories the user names for ``session`` (``stand_ins``: see
    :func:`auto`), each once however many blocks name it (joined blocks on several
    threads): counted under ``_ACTIVE_LOCK``, unwrapped when the last block that named it
    ends. Returns what ends this block's part."""
    taken: list[str] = []

    def unwrap() -> None:
        with _ACTIVE_LOCK:
            while taken:
                spec = taken.pop()
                entry = session.named[spec]
                entry[0] -= 1
                if entry[0] == 0:
                    del session.named[spec]
                    session.wrapped.discard(spec)
                    entry[1]()

    try:
        with _ACTIVE_LOCK:
            for spec in factories:
                entry = session.named.get(spec)
                if entry is None:
                    if spec in session.wrapped:  # a default factory: wrapped for the session
                        continue
                    around = _as_factory(session, stand_in=stand_ins.get(spec))
                    undo = _wrap(*_resolve(spec), _counted(session, spec, around))
                    entry = session.named[spec] = [0, undo]
                    session.wrapped.add(spec)
                entry[0] += 1
                taken.append(spec)
    except BaseException:
        unwrap()
        raise
    return unwrap


@contextlib.contextmanager
def _joining(
    session: AutoSession,
    factories: Iterable[str],
    events: EventSink | None,
    asked: dict,
    stand_ins: Mapping[str, StandIn],
) -> Iterator[None]:
    """A block of :func:`auto` inside one already on (a script that calls
    ``stageload.auto()`` run under the ``stageload auto`` command, a library's block inside
    the script's) joins it: the factories it names that the session does not wrap are
    wrapped for the block, and its ``events`` get the session's events for the block.
    The session's budget and options hold; a block that asks for others is told once, in
    a note. (Refusing it broke every script that opens a block, run under the command.)"""
    defaults = set(DEFAULT_FACTORIES) <= session.wrapped
    differ = [
        what
        for what, asks in (
            (
                "budget",
                asked["budget"] is not None and parse_budget(asked["budget"]) != session.budget,
            ),
            ("default factories", asked["defaults"] != defaults),
            ("loads ahead", asked["prefetch"] != session.prefetch),
            ("stage events", asked["stages"] != session.stages),
            ("shared loads", asked["share"] != session.share),
        )
        if asks
    ]
    if differ and not session.joined_said:
        session.joined_said = True
        session._note(
            f"a stageload.auto() block inside the one on (the stageload auto command's, or "
            f"an outer block) joins it: the outer one's {' and '.join(differ)} "
            f"{'hold' if len(differ) > 1 else 'holds'}"
        )
    leave = session.join(events)
    try:
        unwrap = _named(session, factories, stand_ins)
        try:
            yield
        finally:
            unwrap()
    finally:
        leave()


#: The session on now (one at a time), and its lock.
_ACTIVE: list[AutoSession] = []
_ACTIVE_LOCK = threading.Lock()
