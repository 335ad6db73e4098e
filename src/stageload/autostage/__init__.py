"""``stageload.auto()``: staged loading for a script that has no line of stageload in it.

While the block runs, the usual model factories (diffusers' ``ModelMixin.from_pretrained``,
transformers' ``PreTrainedModel.from_pretrained``, and any named with ``factories=``) are
wrapped. Each model they make is the script's own object, of its own class, with one hook:

- a call of a released model reloads it first (the factory again, with the RNG preserved,
  and its tensors moved into the object the script holds), so seeded scripts give eager's
  results bit for bit;
- before a load, models are released (to ``meta``: the memory goes back to the OS) until
  the new one fits the budget: the least recently used first, while the script makes its
  first pass; once the sequence of uses has repeated, the model whose next use in that
  recorded cycle is furthest away (Belady's rule, as :class:`~stageload.FurthestNextUse`);
- identical factory calls (same factory, same arguments) return one object while it lives.

A model in a call is never released under it. Events (loads, releases, and one stage per
model in use, named after it) go to ``events`` and, under ``stageload meter``, the trace.

Which thread does what: factory calls and loads run on the script's threads, one load at a
time (a lock); a release waits for the model's calls in flight (``stageload.release``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.events import LOAD, NOTE, RELEASE, RELOAD, STAGE, Event, EventSink, TeeSink
from ..core.outer import outer_trace
from ..core.plan import Plan
from ..core.rng import preserved_rng
from ..errors import StageloadError
from ..external import CONVERT_METHOD, module_call_code, torch_function_off
from ..hooks.empty import mark_empty
from ..hooks.registry import HookRegistry, ModuleHook, patch
from ..hooks.release import is_released, release, storage_sizes, unmark_released
from ..memory.budget import parse_budget

if TYPE_CHECKING:
    from torch import nn

__all__ = ["AutoError", "AutoSession", "auto", "DEFAULT_FACTORIES"]

#: The factories wrapped unless told otherwise: ``module:Class.method``.
DEFAULT_FACTORIES = (
    "diffusers.models.modeling_utils:ModelMixin.from_pretrained",
    "transformers.modeling_utils:PreTrainedModel.from_pretrained",
)
#: The name of auto's hook in a model's hook registry.
AUTO = "auto"
#: Why auto released a model: the ``reason`` of its ``release`` events.
REASON_AUTO = "auto: budget"


class AutoError(StageloadError, ValueError):
    """A factory named for ``stageload.auto`` cannot be found or wrapped."""


@dataclass(eq=False)
class _Model:
    """One model a factory made under auto: how to make it again, and its state."""

    name: str
    make: Callable[[], Any]
    module: weakref.ref[nn.Module]
    size: int
    loaded: bool = True
    last_use: int = 0
    loads: int = 1
    #: Used from two threads at once: kept loaded from then on (a release would wait for
    #: the other thread's call, and a reload would race with it).
    pinned: bool = False
    #: Conversions applied to it (``to``, ``half``: each ``nn.Module._apply`` function), in
    #: order: a reload applies them again, so the script's model stays as it made it.
    conversions: list[Callable[[Any], Any]] = field(default_factory=list)
    #: Where its tensors were at the first load: what ``model.device`` answers while it is
    #: released (pipelines move their inputs to it).
    device: Any = None


@dataclass
class _Record:
    """The sequence of models in use, one entry per change: the plan once it repeats."""

    uses: list[str] = field(default_factory=list)
    plan: Plan | None = None

    def add(self, name: str) -> None:
        if self.uses and self.uses[-1] == name:
            return
        self.uses.append(name)
        if self.plan is None and len(self.uses) > 1 and name == self.uses[0]:
            lap = self.uses[:-1]
            if len(set(lap)) == len(lap):  # a clean first lap: each model once
                self.plan = Plan({n: (n,) for n in lap})


class _Hook(ModuleHook):
    """On each model and its direct children: a call marks the model used (and reloads it
    when it is released: ``revive``)."""

    def __init__(self, session: AutoSession, model: _Model) -> None:
        self._session = weakref.ref(session)
        self.model = model

    def pre_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        session = self._session()
        if session is not None:
            session.used(self.model)
            if not self.model.pinned and module is self.model.module():
                registry = HookRegistry.of(module)
                if registry is not None and registry.called_elsewhere():
                    session.pin(self.model, "used from two threads at once")
        return None

    def revive(self, module: nn.Module) -> bool:
        session = self._session()
        return session is not None and session.load(self.model)

    def released(self, module: nn.Module) -> None:
        if module is self.model.module():  # the model, not one of its children
            mark_empty(module, self)

    def fill_on_use(self) -> None:
        """One of the released model's tensors was used (:mod:`stageload.hooks.empty`)."""
        self.revive(None)  # type: ignore[arg-type]


class AutoSession:
    """The models made under one :func:`auto` block, the budget, and the recorded plan."""

    def __init__(self, budget: int | str | None = None, events: EventSink | None = None) -> None:
        if budget is None:
            from ..memory import read_system

            available = read_system().available
            if available is None:
                raise AutoError("auto() needs a budget here: the available memory is unknown")
            budget = available
        self.budget = parse_budget(budget)
        outer = outer_trace()
        sinks = [s for s in (events, outer) if s is not None]
        self._sink: EventSink | None = (
            TeeSink(*sinks) if len(sinks) > 1 else next(iter(sinks), None)
        )
        # Which thread holds what: ``_lock`` for loads, releases and the tables (a release
        # under it waits for the model's calls in flight); ``_uses`` for the use record
        # only, taken by the hooks inside those calls, and never held while waiting.
        self._lock = threading.RLock()
        self._uses = threading.Lock()
        self._in_making: dict[Any, threading.Event] = {}  # factory calls running now
        #: Factory calls waiting for the same call running on another thread.
        self.waiting = 0
        self._models: dict[str, _Model] = {}  # by name
        self._shared: dict[Any, _Model] = {}  # by factory call
        self._clock = 0
        self._stage: str | None = None
        self._making = threading.local()
        self.record = _Record()
        self.notes: list[str] = []
        self._undo: list[Callable[[], None]] = []  # patches on the models, undone at close

    # -- what the script sees ------------------------------------------------------------
    @property
    def models(self) -> dict[str, nn.Module | None]:
        """Each model's name and object (None once the script dropped it)."""
        return {name: m.module() for name, m in self._models.items()}

    def resident(self) -> list[str]:
        """The models loaded now."""
        return [n for n, m in self._models.items() if m.loaded and m.module() is not None]

    def resident_bytes(self) -> int:
        return sum(self._models[n].size for n in self.resident())

    # -- the factories -------------------------------------------------------------------
    def call(self, factory: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> Any:
        """Run one factory call for the script: share, make, hook."""
        if getattr(self._making, "depth", 0):  # a factory inside a factory, or a reload
            return factory(*args, **kwargs)
        key = _key(factory, args, kwargs)
        while True:
            with self._lock:
                known = self._shared.get(key) if key is not None else None
                module = known.module() if known is not None else None
                if module is not None:
                    return module
                running = self._in_making.get(key) if key is not None else None
                if running is None:
                    if key is not None:  # this thread makes it; the same call elsewhere waits
                        self._in_making[key] = threading.Event()
                    break
            with self._lock:
                self.waiting += 1
            running.wait()  # another thread makes the same model: take its result
            with self._lock:
                self.waiting -= 1
        try:
            return self._make(factory, name, args, kwargs, key)
        finally:
            if key is not None:
                with self._lock:
                    self._in_making.pop(key).set()

    def _make(
        self, factory: Callable[..., Any], name: str, args: tuple, kwargs: dict, key: Any
    ) -> Any:

        def make() -> Any:
            self._making.depth = getattr(self._making, "depth", 0) + 1
            try:
                return factory(*args, **kwargs)
            finally:
                self._making.depth -= 1

        with self._lock:  # room for a model the size of the largest seen, before it loads
            expected = max((m.size for m in self._models.values()), default=0)
            self._make_room(expected, name)
        start = time.perf_counter()
        obj = make()
        from torch import nn

        if not isinstance(obj, nn.Module):
            self._note(
                f"{name}: the factory returned a {type(obj).__name__}, not a module: not staged"
            )
            return obj
        with self._lock:
            model = _Model(
                _unique(name, self._models),
                make,
                weakref.ref(obj),
                _bytes(obj),
                last_use=self._tick(),
            )
            model.device = next((t.device for t in _tensors(obj)), None)
            self._models[model.name] = model
            if key is not None:
                self._shared[key] = model
            self._emit(
                Event(LOAD, model=model.name, bytes=model.size, seconds=time.perf_counter() - start)
            )
            hook = _Hook(self, model)
            for sub in (obj, *obj.children()):
                HookRegistry.attach(sub).add(AUTO, hook)
            self._undo.append(patch(obj, CONVERT_METHOD, _recording(model)))
            self._fit(model)  # the others it does not leave room for go now
        return obj

    # -- uses, loads and releases ----------------------------------------------------------
    def used(self, model: _Model) -> None:
        with self._uses:
            model.last_use = self._tick()
            if self._stage != model.name:
                self._stage = model.name
                self.record.add(model.name)
                self._emit(Event(STAGE, stage=model.name))

    def pin(self, model: _Model, why: str) -> None:
        """Keep ``model`` loaded from now on, and say why once."""
        with self._uses:
            if not model.pinned:
                model.pinned = True
                self._note(f"{model.name}: {why}: kept loaded, not staged")

    def load(self, model: _Model) -> bool:
        """Reload a released model in place (its hook's ``revive``); True once it is back."""
        with self._lock:
            module = model.module()
            if module is None:
                return False
            if model.loaded and not is_released(module):
                return True
            self._fit(model)
            start = time.perf_counter()
            with preserved_rng():
                fresh = model.make()
                for fn in model.conversions:  # as the script converted it since
                    getattr(fresh, CONVERT_METHOD)(fn)
            _adopt(module, fresh)
            del fresh
            model.loaded, model.loads = True, model.loads + 1
            self._emit(
                Event(
                    RELOAD, model=model.name, bytes=model.size, seconds=time.perf_counter() - start
                )
            )
            return True

    def _fit(self, incoming: _Model) -> None:
        """Release models until ``incoming`` fits the budget beside the rest."""
        self._make_room(incoming.size, incoming.name, keep=incoming)

    def _make_room(self, size: int, name: str, keep: _Model | None = None) -> None:
        """Release idle models until ``size`` more bytes fit the budget."""
        from ..units import format_size

        while True:
            others = [self._models[n] for n in self.resident() if self._models[n] is not keep]
            if sum(m.size for m in others) + size <= self.budget:
                return
            idle = [m for m in others if not m.pinned and not _busy(m)]
            if not idle:
                what = f"beside {len(others)} models in calls" if others else "alone"
                self._note(
                    f"{name}: {format_size(size)} {what} is over the budget of "
                    f"{format_size(self.budget)}; loaded anyway"
                )
                return
            self._release(self._victim(idle, name))

    def _victim(self, idle: Sequence[_Model], incoming: str) -> _Model:
        plan = self.record.plan
        if plan is not None and incoming in plan and all(m.name in plan for m in idle):
            return max(idle, key=lambda m: (plan.next_use(m.name, incoming), -m.last_use))
        return min(idle, key=lambda m: m.last_use)  # first pass: least recently used

    def _release(self, model: _Model) -> None:
        module = model.module()
        model.loaded = False
        if module is None:
            return
        start = time.perf_counter()
        release(module, name=model.name)  # the hook's released() marks its tensors empty
        self._emit(
            Event(
                RELEASE,
                model=model.name,
                bytes=model.size,
                seconds=time.perf_counter() - start,
                reason=REASON_AUTO,
            )
        )

    def close(self) -> None:
        """Take auto's hooks off every model still alive; released ones stay released."""
        with self._lock:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            for model in self._models.values():
                module = model.module()
                if module is None:
                    continue
                for sub in (module, *module.children()):
                    HookRegistry.remove(sub, AUTO)

    # -- helpers -------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _note(self, text: str) -> None:
        self.notes.append(text)
        self._emit(Event(NOTE, note=text))

    def _emit(self, event: Event) -> None:
        if self._sink is not None:
            self._sink.emit(event)


def _recording(model: _Model) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A patch of a model's ``_apply`` that records each conversion once it is done (on a
    released model the conversion's first tensor loads it, then it converts)."""

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)
        def _apply(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            out = inner(fn, *args, **kwargs)
            model.conversions.append(fn)
            module = model.module()
            if module is not None:  # a dtype change changes its size
                model.size = _bytes(module)
            return out

        return _apply

    return wrap


def _busy(model: _Model) -> bool:
    """Whether any thread, this one included, is inside a call of the model or of one of
    its parts (``vae.decode()`` runs in ``vae.decoder``, which no hook on the model sees):
    an ``nn.Module._call_impl`` frame of one of its modules is on a stack. Read when a
    victim is chosen, which is rare; a stack walk costs microseconds per frame."""
    module = model.module()
    if module is None:
        return False
    ids = {id(m) for m in module.modules()}
    code = module_call_code()
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code is code and id(frame.f_locals.get("self")) in ids:
                return True
            frame = frame.f_back
    return False


def _tensors(module: nn.Module) -> Iterator[Any]:
    yield from module.parameters()
    yield from module.buffers()


def released_device(module: Any, found: Any) -> Any:
    """What ``model.device`` answers: ``found``, except for a model auto released, which
    answers where it ran (diffusers' pipelines do ``inputs.to(self.text_encoder.device)``)."""
    if getattr(found, "type", None) == "meta":
        registry = HookRegistry.of(module)
        hook = registry.get(AUTO) if registry is not None else None
        if isinstance(hook, _Hook) and hook.model.device is not None:
            return hook.model.device
    return found


def _device_wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(inner)
    def device(module: Any) -> Any:
        return released_device(module, inner(module))

    return device


def _diffusers_devices(modeling_utils: Any) -> Callable[[], None]:
    """diffusers' ``ModelMixin.device`` asks ``get_parameter_device``: route it."""
    return patch(modeling_utils, "get_parameter_device", _device_wrap)


def _transformers_devices(modeling_utils: Any) -> Callable[[], None]:
    """transformers' ``PreTrainedModel.device`` is a property of a mixin: route it."""
    model = modeling_utils.PreTrainedModel
    owner = next((c for c in model.__mro__ if "device" in vars(c)), None)
    return patch(owner, "device", _device_wrap) if owner is not None else (lambda: None)


#: For each default factory's module: where ``.device`` is answered, patched with it.
_DEVICE_ANSWERS: dict[str, Callable[[Any], Callable[[], None]]] = {
    "diffusers.models.modeling_utils": _diffusers_devices,
    "transformers.modeling_utils": _transformers_devices,
}


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


def _adopt(module: nn.Module, fresh: nn.Module) -> None:
    """Move ``fresh``'s tensors into ``module`` (same class, same structure), in place: each
    of ``module``'s tensor objects takes the fresh one's data (``swap_tensors``), so what
    the script holds (a buffer read before, tied weights) is live again; then take
    release's hooks off."""
    with torch_function_off():  # reading an empty tensor (.is_meta) would load it again
        _swap_in(module, fresh)
    for part in module.modules():
        unmark_released(part)


def _swap_in(module: nn.Module, fresh: nn.Module) -> None:
    import torch

    mine = dict(module.named_modules(remove_duplicate=False))
    done: set[int] = set()
    for path, part in fresh.named_modules(remove_duplicate=False):
        target = mine.get(path)
        if target is None:
            raise StageloadError(
                f"the reload of {type(module).__name__} has a part {path!r} the first "
                f"load had not: its factory made a different model"
            )
        for table, theirs in (
            (target._parameters, part._parameters),
            (target._buffers, part._buffers),
        ):
            for key, tensor in theirs.items():
                if tensor is None or id(tensor) in done:
                    continue
                done.add(id(tensor))
                old = table.get(key)
                if old is None or not old.is_meta:
                    table[key] = tensor
                    continue
                try:
                    torch.utils.swap_tensors(old, tensor)
                except RuntimeError:  # held elsewhere: the new object takes its place
                    table[key] = tensor


def _key(factory: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """What makes two factory calls identical, or None when the arguments cannot say."""
    try:
        return (factory, repr(args), repr(sorted(kwargs.items())))
    except Exception:  # noqa: BLE001  an argument whose repr fails: never shared
        return None


def _unique(name: str, taken: Iterable[str]) -> str:
    taken = set(taken)
    if name not in taken:
        return name
    i = 2
    while f"{name}#{i}" in taken:
        i += 1
    return f"{name}#{i}"


def _model_name(owner: Any, args: tuple, kwargs: dict) -> str:
    """A model's name: its subfolder or its folder's name, else its class."""
    sub = kwargs.get("subfolder")
    if sub:
        return str(sub)
    if args and isinstance(args[0], (str, Path)):
        return Path(str(args[0])).name or str(args[0])
    return getattr(owner, "__name__", "model")


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
    if not callable(getattr(owner, attr, None)):
        raise AutoError(f"factory {spec!r}: {attr!r} is not a callable of {owner!r}")
    return owner, attr


def _wrap(session: AutoSession, owner: Any, attr: str) -> Callable[[], None]:
    """Wrap ``owner.attr`` for ``session``; return what undoes it."""
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if isinstance(raw, classmethod):
        func = raw.__func__

        def through(cls: type, *args: Any, **kwargs: Any) -> Any:
            name = _model_name(cls, args, kwargs)
            return session.call(_Bound(func, cls), name, args, kwargs)

        setattr(owner, attr, classmethod(through))
        return lambda: setattr(owner, attr, raw)
    original = getattr(owner, attr)

    def plain(*args: Any, **kwargs: Any) -> Any:
        return session.call(original, _model_name(original, args, kwargs), args, kwargs)

    setattr(owner, attr, plain)
    if isinstance(owner, type):
        return lambda: setattr(owner, attr, raw) if raw is not None else delattr(owner, attr)
    return lambda: setattr(owner, attr, original)


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
) -> Iterator[AutoSession]:
    """Stage the models the block makes through its factories (see the module docstring).

    ``budget``: bytes, ``"12G"``, ``"80%"`` or ``"auto"``; default, the memory available
    now. ``factories``: more factories, ``"module:Class.method"``; ``defaults=False`` wraps
    only those. Models made in the block stay staged only while it runs.
    """
    session = AutoSession(budget, events)
    undo: list[Callable[[], None]] = []
    waiting: dict[str, Callable[[Any], None]] = {}
    finder = _AfterImport(waiting)
    try:
        for spec in [*(DEFAULT_FACTORIES if defaults else ()), *factories]:
            module_name = spec.partition(":")[0]
            if spec in DEFAULT_FACTORIES and module_name not in sys.modules:
                # Not imported yet: wrap it when the script imports it.
                def later(module: Any, spec: str = spec) -> None:
                    owner, attr = _resolve(spec)
                    undo.append(_wrap(session, owner, attr))
                    undo.append(_DEVICE_ANSWERS[module.__name__](module))

                waiting[module_name] = later
                continue
            owner, attr = _resolve(spec)
            undo.append(_wrap(session, owner, attr))
            if spec in DEFAULT_FACTORIES:
                undo.append(_DEVICE_ANSWERS[module_name](sys.modules[module_name]))
        if waiting:
            sys.meta_path.insert(0, finder)
        yield session
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for step in reversed(undo):
            step()
        session.close()
