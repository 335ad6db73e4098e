"""The one hook protocol: how stageload intercepts a call of code it does not own.

Two mechanisms, and only two:

- **Module hooks.** A :class:`HookRegistry` per ``nn.Module``, at one attribute
  (``HOOKS_ATTR``), holds named :class:`ModuleHook` objects. While it holds any, the
  module's ``forward`` is an instance attribute that runs each hook's ``pre_call``, the
  real forward, then each hook's ``post_call`` (accelerate's ``add_hook_to_module``,
  diffusers' ``HookRegistry``). :func:`stageload.release` adds a hook to every module it
  empties; a call of a released module asks the hooks of the module it was released with
  whether one can bring it back (:meth:`ModuleHook.revive`), and raises otherwise. When
  the last hook goes, the module gets its own ``forward`` back.
- **Attribute patches.** :func:`patch` replaces ``owner.attr`` (a method of an instance, a
  classmethod of a class, a module-level function) by a wrapper of it. Patches on one
  attribute chain; each can be removed in any order, and the owner gets its own attribute
  back when the last one goes. :func:`stageload.on_call` and :func:`stageload.share` are
  built on it.

So the only attributes stageload sets on objects it does not own are ``HOOKS_ATTR`` and
``forward`` on modules, and the patched attribute itself (``tests/hooks/test_foreign.py``).

Calls in flight: every call of a hooked module counts itself in around the module's own
forward (after the ``pre_call`` hooks, before the ``post_call`` ones), per thread.
:func:`hold_calls` waits until no other thread has a call of given modules in flight and
holds new ones back until :func:`end_hold`; :func:`stageload.release` empties a module
inside such a hold, so weights are never freed under a running call (freeing them under one
crashed the interpreter). A call held back, or one whose ``pre_call`` hooks ran while the
module was released, asks its hooks again: it is revived or raises
:class:`~stageload.ReleasedModuleError`, never computes on freed memory.

Threads: hooks are added and removed by the thread that owns the module's staging (the one
that enters stages and releases); a running call sees either the old list or the new one.
"""

from __future__ import annotations

import copyreg
import functools
import gc
import inspect
import operator
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .. import bell
from ..external import module_call_code

if TYPE_CHECKING:
    import torch
    from torch import nn

#: The one attribute the protocol sets on a module (besides ``forward``, while hooked).
HOOKS_ATTR = "_stageload_hooks"


class _Missing:
    """ "No attribute of its own". Copies are itself: ``copy.deepcopy`` of a hooked module
    copies its registry, whose check ``is _MISSING`` must still hold in the copy."""

    def __copy__(self) -> _Missing:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Missing:
        return self

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()


class ModuleHook:
    """One hook around a module's calls. Override the steps you need; the defaults pass
    everything through unchanged.

    ``pre_call`` runs before the module's forward and may return new ``(args, kwargs)``;
    ``post_call`` runs after it and returns the output (possibly replaced). ``revive`` is
    asked when a module released by :func:`stageload.release` is called: return True once
    its weights are back (a staged placeholder loads its component), False to let the call
    raise :class:`~stageload.ReleasedModuleError`. ``retain`` is asked when the module is
    released as a whole: the tensors to leave in memory (a user's changes to a staged
    component, which its checkpoint cannot give back); ``released`` once it was.
    """

    #: Whether a copy of the module (``copy.deepcopy``, ``torch.save``) keeps this hook.
    #: A hook that manages the module for an owner the copy does not belong to says no.
    #: A copy that keeps none is the module as it is without stageload.
    copied = True

    def pre_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return None

    def post_call(self, module: nn.Module, output: Any) -> Any:
        return output

    def revive(self, module: nn.Module) -> bool:
        return False

    def retain(self, module: nn.Module) -> Iterable[torch.Tensor]:
        return ()

    def released(self, module: nn.Module) -> None:
        """Called by :func:`stageload.release` once ``module``'s tensors are on ``meta``."""

    def before_copy(self) -> None:
        """The module is about to be copied (``copy.deepcopy``, pickling): a hook that
        brings released weights back on use (``fill_on_use``: :mod:`stageload.hooks.empty`)
        brings them back now, so the copy holds them."""
        fill = getattr(self, "fill_on_use", None)
        if fill is not None:
            fill()


# One lock for the calls of every hooked module: a call counts itself in and out under it,
# and a hold waits for them (see stageload.bell). Uncontended, it costs two lock round trips per
# call. Taken as `with _calls_lock` (C code): a Ctrl-C inside a Condition's own __enter__
# (Python code) left the lock taken, and every later call hung.
_calls_lock = threading.Lock()  # never taken twice by one thread


_changed = bell.Bell()  # rung whenever a call ends or a hold ends
# This thread's calls in flight, of all hooked modules, one token each (see in_call()).
_depth = threading.local()
# Threads whose call waits for a hold to end: they compute nothing until it does. A dict,
# so a clean-up is `del` (no call: no point where Ctrl-C can land, see _HookedForward).
_held_back: dict[int, bool] = {}


def _holder(registry: HookRegistry) -> int | None:
    """The thread holding the module's calls now, or None."""
    hold = registry._held_by
    return hold.thread if hold is not None and hold.active else None


class HookRegistry:
    """The named hooks of one module, in the order they were added, and its calls in flight."""

    def __init__(self, module: nn.Module) -> None:
        self._hooks: dict[str, ModuleHook] = {}
        self._own_forward = module.__dict__.get("forward", _MISSING)
        self._forward: _HookedForward | None = None
        self._reset_calls()

    def _reset_calls(self) -> None:
        # One token per call of the module in flight -> its thread. A call removes its own
        # token, whatever a Ctrl-C interrupted: a count could be left one too high (a call
        # in flight forever, which a release on another thread then waited for).
        self._running: dict[object, int] = {}
        self._held_by: Hold | None = None  # the hold of hold_calls() or try_hold(), if any
        # Bumped as a hold starts and ends: a call whose hooks ran across either asks again.
        self._epoch = 0

    def _copied_hooks(self) -> dict[str, ModuleHook]:
        """The hooks a copy of the module keeps, once each hook prepared for the copy."""
        for hook in list(self._hooks.values()):
            hook.before_copy()  # may take hooks off (a load ends a release's): read after
        return {k: h for k, h in self._hooks.items() if h.copied}

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A copy (copy.deepcopy, pickling) starts with no calls in flight, and without the
        # hooks that stay with the original. With none left it is the module as it is
        # without stageload: None here (HookRegistry.of reads no registry) and its own
        # forward (_HookedForward), so a file torch.save wrote loads where stageload is
        # not installed.
        hooks = self._copied_hooks()
        if not hooks:
            return type(None), ()
        state = dict(self.__dict__)
        state.update(_running={}, _held_by=None, _epoch=0, _hooks=hooks)
        return copyreg.__newobj__, (type(self),), state

    def called_elsewhere(self) -> bool:
        """Whether a thread other than this one has a call of the module running now."""
        me = threading.get_ident()
        with _calls_lock:
            return any(thread != me for thread in self._running.values())

    def wait_for_turn(self) -> None:
        """Wait until this thread's call of the module is the earliest of its calls in
        flight, for a module whose calls must run one at a time (a streamed model: its
        calls share each block's memory). Called inside the call (by a hook of a part of
        the module); each call waits for those that began before it, whichever way they
        end: their tokens go in ``_HookedForward``'s ``finally``."""
        me = threading.get_ident()
        _changed.wait(_calls_lock, lambda: next(iter(self._running.values()), me) == me)

    def calls_in_flight(self) -> int:
        """How many calls of the module are running now, on every thread."""
        with _calls_lock:
            return len(self._running)

    # -- finding ----------------------------------------------------------------------------
    @staticmethod
    def of(module: nn.Module) -> HookRegistry | None:
        """The module's registry, or None when it has no hooks."""
        registry = getattr(module, "__dict__", {}).get(HOOKS_ATTR)
        return registry if isinstance(registry, HookRegistry) else None

    @staticmethod
    def attach(module: nn.Module) -> HookRegistry:
        """The module's registry, made (and its forward wrapped) if it has none."""
        registry = HookRegistry.of(module)
        if registry is None:
            _keep_out_of_compiled_graphs()
            registry = HookRegistry(module)
            registry._forward = _HookedForward(module, registry)
            # Instance attributes, past nn.Module.__setattr__ (neither is a Module, tensor
            # or parameter, so it would store them the same way).
            module.__dict__[HOOKS_ATTR] = registry
            module.__dict__["forward"] = registry._forward
        return registry

    # -- the hooks ----------------------------------------------------------------------------
    def add(self, name: str, hook: ModuleHook, *, replace: bool = False) -> ModuleHook:
        """Add ``hook`` under ``name``. A name already taken raises ValueError (two features
        must not silently overwrite each other's hook); with ``replace``, the new hook takes
        the old one's place in the order."""
        if not isinstance(hook, ModuleHook):
            raise TypeError(f"hook {name!r} must be a ModuleHook, got {type(hook).__name__}")
        if not replace and name in self._hooks:
            raise ValueError(
                f"this module already has a hook named {name!r} "
                f"({self._hooks[name]!r}); remove it first, or pass replace=True"
            )
        self._hooks[name] = hook
        return hook

    def get(self, name: str) -> ModuleHook | None:
        return self._hooks.get(name)

    def hooks(self) -> list[ModuleHook]:
        return list(self._hooks.values())

    def __contains__(self, name: object) -> bool:
        return name in self._hooks

    def __repr__(self) -> str:
        return f"HookRegistry({list(self._hooks)!r})"

    @staticmethod
    def remove(module: nn.Module, name: str) -> ModuleHook | None:
        """Take ``name`` off ``module``; with its last hook, the module gets its own
        ``forward`` back and loses the registry. Returns the hook, or None."""
        registry = HookRegistry.of(module)
        if registry is None:
            return None
        hook = registry._hooks.pop(name, None)
        if not registry._hooks:
            HookRegistry._detach(module, registry)
        return hook

    @staticmethod
    def _detach(module: nn.Module, registry: HookRegistry) -> None:
        """Take an empty registry off: the module gets its own ``forward`` back."""
        d = module.__dict__
        del d[HOOKS_ATTR]
        if d.get("forward") is registry._forward:
            if registry._own_forward is _MISSING:
                del d["forward"]
            else:
                d["forward"] = registry._own_forward

    def original_forward(self, module: nn.Module) -> Callable[..., Any]:
        """The forward the hooks wrap: the module's own instance forward, else its class's."""
        if self._own_forward is not _MISSING:
            return self._own_forward  # type: ignore[return-value]
        return type(module).forward.__get__(module)


class _HookedForward:
    """A hooked module's ``forward``: hooks, then the original. A class, not a closure, so
    that ``copy.deepcopy`` of the module binds the copy's own forward to the copy."""

    def __init__(self, module: nn.Module, registry: HookRegistry) -> None:
        self.module = module
        self.registry = registry
        original = registry.original_forward(module)
        functools.update_wrapper(self, original)  # name, docstring, signature (__wrapped__)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Copied with a module whose registry keeps no hook (HookRegistry.__reduce_ex__):
        # the module's own forward, as _Dispatch gives a patched attribute.
        registry = self.registry
        if not registry._copied_hooks():
            return _as_it_was(self.module, "forward", registry._own_forward)
        # The original, a method bound to the module, pickles by its name on the module:
        # ``_forward_unimplemented`` for a ModuleList, which it cannot be found by. As the
        # function and the module it binds, it pickles and copies (to the copy).
        state = dict(self.__dict__)
        wrapped = state.get("__wrapped__")
        if isinstance(wrapped, types.MethodType) and wrapped.__self__ is self.module:
            state["__wrapped__"] = functools.partial(wrapped.__func__, self.module)
        return copyreg.__newobj__, (type(self),), state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, registry = self.module, self.registry
        me, token = threading.get_ident(), object()
        mine = _tokens()
        # CPython raises a Ctrl-C's KeyboardInterrupt at a function's start, after a call
        # returns and at a loop's jump back: the counting in and out below makes no call
        # between its steps, and each step is undone only if done.
        try:
            while True:
                epoch = registry._epoch
                call_args, call_kwargs, forward = _before(module, registry, args, kwargs)
                while True:
                    with _calls_lock:
                        if _holder(registry) in (None, me) or _begun_before(registry._held_by):
                            if me in _held_back:
                                del _held_back[me]
                            if registry._epoch == epoch:
                                registry._running[token] = me
                                mine[token] = True
                            break
                        _held_back[me] = True
                        ticket = _changed.ticket()
                    ticket.acquire(timeout=bell.RECHECK)  # a release empties the module: its end
                if token in mine:
                    break
                # Released (or held) while the hooks ran: ask them again (revive or raise).
            # The one step a compiled module compiles: dynamo skips this frame and traces
            # the forward's own (see _keep_out_of_compiled_graphs).
            output = forward(*call_args, **call_kwargs)
        finally:  # each step undoes only what was done: safe wherever a Ctrl-C landed
            with _calls_lock:
                if token in registry._running:
                    del registry._running[token]
                if token in mine:
                    del mine[token]
                if me in _held_back:
                    del _held_back[me]
                _changed.ring()
        return _after(module, registry, output)


def _before(
    module: nn.Module, registry: HookRegistry, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], Callable[..., Any]]:
    """A call's ``pre_call`` hooks: its arguments as they leave them, and the forward to run.
    A hook may take itself or others off while running (a revived placeholder loses its
    release hooks): each step asks the registry as it is now."""
    for hook in registry.hooks():
        if hook in registry._hooks.values():
            changed = hook.pre_call(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
    return args, kwargs, registry.original_forward(module)


def _after(module: nn.Module, registry: HookRegistry, output: Any) -> Any:
    """A call's ``post_call`` hooks, last added first."""
    for hook in reversed(registry.hooks()):
        output = hook.post_call(module, output)
    return output


_OUTSIDE_GRAPHS = (
    "stageload loads, counts and releases this module around its forward, outside compiled "
    "graphs, so a graph that calls it breaks there. Compile the staged module itself "
    "(torch.compile(module) or module.compile(), fullgraph=True included): its forward is "
    "compiled whole and the staging runs around it. Under stageload auto a model's direct "
    "children are hooked too: compile it without fullgraph=True"
)
_marks_lock = threading.Lock()
_marked = False


def _keep_out_of_compiled_graphs() -> None:
    """Tell dynamo (torch.compile) to run the hooks and the counting as Python and to
    compile only the module's own forward; once, at a module hooked once dynamo is
    imported. Without it dynamo traced into them and broke the graph at
    ``threading.get_ident``: with fullgraph=True it raised.

    The code of ``_HookedForward.__call__`` is one dynamo skips as a frame while it still
    compiles the frames it calls: the forward (dynamo's ``skip``; torch's public
    ``disable(recursive=False)`` puts a wrapper in place that raises under
    ``torch.export``, and whose code, shared by all such wrappers, ``_uncounted`` would take
    for a counted call). The hooks run in frames dynamo skips with all they call (a load, a
    release); each costs about 0.4 µs when nothing is compiled. Not before dynamo is
    imported (diffusers and transformers import it; ``torch.compile`` does): importing it
    here took 1.5 s and 69 MiB, which a script that compiles nothing would pay at its first
    release. A torch without these leaves the hooks to dynamo, as before: graph breaks."""
    global _before, _after, _marked
    if _marked or "torch._dynamo" not in sys.modules:
        return
    with _marks_lock:
        if _marked:
            return
        _marked = True  # first: a torch this fails on is not asked again at every hook
        try:
            import torch
            from torch._dynamo import decorators

            skip = decorators.skip
            takes_reason = "reason" in inspect.signature(torch.compiler.disable).parameters
            reason = {"reason": _OUTSIDE_GRAPHS} if takes_reason else {}
            before = torch.compiler.disable(_before, **reason)
            after = torch.compiler.disable(_after, **reason)
        except Exception:  # noqa: BLE001 - an older or newer torch: graph breaks, as before
            return
        skip(_HookedForward.__call__)
        _before, _after = before, after


def in_call() -> bool:
    """Whether this thread is inside a call of a hooked module (a hook's own work, such as
    a streamed block released after its forward, runs inside the model's call)."""
    return bool(_tokens())


def _tokens() -> dict[object, bool]:
    """This thread's calls in flight, of every hooked module."""
    tokens = getattr(_depth, "tokens", None)
    if tokens is None:
        tokens = _depth.tokens = {}
    return tokens


def _others(registries: list[HookRegistry], me: int) -> int:
    return sum(t != me for r in registries for t in r._running.values())


class Hold:
    """One thread's hold of some modules' calls (:func:`hold_calls`, :func:`try_hold`).
    Over once ``active`` is False: one store, which no Ctrl-C can split, so an interrupted
    clean-up never leaves a module held. It lists what it holds, for :func:`end_hold`."""

    __slots__ = ("active", "made", "registries", "thread")

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.active = True
        self.registries: list[HookRegistry] = []
        # Modules given a registry for the hold only (unhooked ones): taken off after.
        self.made: list[tuple[nn.Module, HookRegistry]] = []


def new_hold() -> Hold:
    """A hold for this thread, holding nothing yet. Made in the caller's frame before its
    ``try`` (a Ctrl-C then finds it there to end), filled by :func:`hold_calls`::

        hold = new_hold()
        try:
            hold_calls(hold, modules)
            ...
        finally:
            hold.active = False  # one store: over, whatever interrupts the rest
            end_hold(hold)
    """
    return Hold(threading.get_ident())


def hold_calls(
    hold: Hold,
    modules: Iterable[nn.Module],
    *,
    on_wait: Callable[[int], None] | None = None,
    unhooked: bool = False,
) -> None:
    """Wait until no other thread has a call of any hooked module in ``modules`` in flight,
    then hold new calls of them back (on other threads) until :func:`end_hold`.

    ``on_wait(n)`` is called once, before waiting, when ``n`` calls are in flight.
    This thread's own calls are not waited for (it would wait for itself): a hook that
    releases its own module while it runs keeps today's meaning. All modules are held at
    once, so a call nested in two of them never waits for a release waiting for it.

    ``unhooked=True`` covers the modules without hooks too (``release`` of a plain
    module): each gets a registry for the hold (so new calls are held), and calls that
    began before, which nothing counted, are waited for by looking at the other threads'
    stacks (``nn.Module._call_impl`` frames of these modules), polled every few ms.
    """
    me = hold.thread
    modules = list(modules)
    registries = [r for m in modules if (r := HookRegistry.of(m)) is not None]
    with _calls_lock:
        busy = _others(registries, me)
    if busy and on_wait is not None:
        on_wait(busy)
    while True:
        with _calls_lock:
            if not _others(registries, me) and all(_holder(r) in (None, me) for r in registries):
                for r in registries:
                    if _holder(r) is None:
                        r._held_by = hold
                        r._epoch += 1
                        hold.registries.append(r)
                if unhooked:
                    for m in modules:
                        if HookRegistry.of(m) is None:
                            made = HookRegistry.attach(m)
                            made._held_by = hold
                            hold.made.append((m, made))
                break
            ticket = _changed.ticket()
        ticket.acquire(timeout=bell.RECHECK)
    if hold.made:
        ids = {id(m) for m, _ in hold.made}
        uncounted = _uncounted(ids, me)
        if uncounted and not busy and on_wait is not None:
            on_wait(uncounted)
        if uncounted:
            _wait_uncounted(ids, me)


def end_hold(hold: Hold) -> None:
    """End ``hold`` (already over once ``hold.active`` is False; this tidies up): its
    modules' calls go on, and registries given for the hold only are taken off."""
    hold.active = False
    with _calls_lock:
        for r in hold.registries + [r for _, r in hold.made]:
            if r._held_by is hold:
                r._held_by = None
                r._epoch += 1  # hooks run during the hold saw the module half released
        for m, r in hold.made:  # given for the hold only, and still without hooks
            if not r._hooks and HookRegistry.of(m) is r:
                HookRegistry._detach(m, r)
        _changed.ring()


def try_hold(modules: Iterable[nn.Module]) -> Hold | None:
    """Hold new calls of the hooked modules among ``modules`` back now, if no other thread
    has a call of one in flight; return the hold (for :func:`end_hold`), or None.

    Unlike :func:`hold_calls` it never waits, so a caller may choose a module and hold it
    in one step under a lock of its own: a call that starts afterwards waits for the hold
    to end instead of being waited for. A release by this thread inside the hold proceeds
    at once."""
    me = threading.get_ident()
    registries = [r for m in modules if (r := HookRegistry.of(m)) is not None]
    hold = Hold(me)
    try:
        with _calls_lock:
            if _others(registries, me) or any(_holder(r) not in (None, me) for r in registries):
                return None
            for r in registries:
                if _holder(r) is None:
                    r._held_by = hold
                    r._epoch += 1
                    hold.registries.append(r)
    except BaseException:  # Ctrl-C: nothing stays held
        hold.active = False
        raise
    return hold


@functools.lru_cache(maxsize=1)
def _call_code() -> Any:
    return module_call_code()


def _begun_before(hold: Hold | None) -> bool:
    """Whether this thread is inside a call that ``hold`` waits for: a call of one of the
    plain modules it covers (``nn.Module._call_impl`` frame whose callee is not our hooked
    forward) began before the hold, since any later call of one is held at its start. Its
    calls of held submodules go on: held, they would wait for the release that waits for
    the call around them, and it went on without them, so the call in flight raised
    ``ReleasedModuleError`` at its next submodule. Called under ``_calls_lock``."""
    if hold is None or not hold.active or not hold.made:
        return False
    ids = {id(m) for m, _ in hold.made}
    call, hooked = _call_code(), _HookedForward.__call__.__code__
    inner = None
    f = sys._getframe(1)
    try:
        while f is not None:
            if (
                f.f_code is call
                and (inner is None or inner.f_code is not hooked)
                and id(f.f_locals.get("self")) in ids
            ):
                return True
            inner, f = f, f.f_back
        return False
    finally:
        f = inner = None  # no frame kept alive by a cycle through this one


def _uncounted(ids: set[int], me: int) -> int:
    """Calls of the modules ``ids`` running on other threads outside the protocol: an
    ``nn.Module._call_impl`` frame of one whose callee is not our hooked forward. A thread
    held back by a hold (a call of a submodule, nested in one of these) computes nothing
    until the hold ends: it is not waited for, or the two would wait for each other."""
    call, hooked = _call_code(), _HookedForward.__call__.__code__
    n = 0
    with _calls_lock:
        waiting = set(_held_back)
    frames: dict[int, Any] = {}
    frame = f = inner = None
    # Collections off while the stacks are read: sys._current_frames() deadlocked with one
    # while a thread started (CPython 3.11, releases in a releasing() block: a new-user
    # helper). Inline, not a context manager: a Ctrl-C anywhere here still runs the finally.
    with _reading:  # one read at a time: each puts back what it found
        collecting = gc.isenabled()
        try:
            gc.disable()
            frames = sys._current_frames()
            for thread, frame in frames.items():
                if thread == me or thread in waiting:
                    continue
                inner = None
                f = frame
                while f is not None:
                    running = f.f_code is call and (inner is None or inner.f_code is not hooked)
                    if running and id(f.f_locals.get("self")) in ids:
                        n += 1
                        break
                    inner, f = f, f.f_back
        finally:
            # No frame of another thread outlives the read, even in a traceback: kept by a
            # cycle through this frame, a later collection cleared frames still running (a
            # segfault, or other objects in place of frames: a streamed model's own reader
            # threads were enough).
            frames = frame = f = inner = None  # noqa: F841
            if collecting:
                gc.enable()
    return n


_reading = threading.Lock()


def _wait_uncounted(ids: set[int], me: int) -> None:
    delay = 0.0005
    while _uncounted(ids, me):
        time.sleep(delay)  # nothing to be told by: the call's frame going is the state
        delay = min(delay * 2, 0.01)


# -- attribute patches ------------------------------------------------------------------------
class _Chain:
    """Every active patch of one ``owner.attr``, innermost first."""

    def __init__(self, owner: Any, attr: str) -> None:
        try:
            self.base = getattr(owner, attr)
        except AttributeError:
            raise AttributeError(f"{_describe(owner)} has no attribute {attr!r} to patch") from None
        # A property of a class is patched through its getter: wrap(fget) -> new fget.
        prop = inspect.getattr_static(owner, attr) if isinstance(owner, type) else None
        if isinstance(prop, property) and prop.fget is not None:
            self.base = prop.fget
        if not callable(self.base):
            raise TypeError(f"{_describe(owner)}.{attr} is not callable: {self.base!r}")
        # Weakly: the patch lives on the owner (its attribute holds the chain), so
        # dropping the owner frees the chain and everything its wraps hold.
        try:
            self.owner_ref: Callable[[], Any] = weakref.ref(owner)
        except TypeError:  # not weakly referenceable: held as long as the patch is
            self.owner_ref = lambda: owner
        self.attr = attr
        self.own = _own(owner, attr)
        self.wraps: list[tuple[object, Callable[..., Any]]] = []
        self.current: Callable[..., Any] = self.base

        if not isinstance(owner, type):  # see _Dispatch
            self.installed: Any = _Dispatch(self)
            return

        @functools.wraps(self.base)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return self.current(*args, **kwargs)

        # On a class, a plain function would bind to instances; staticmethod keeps the
        # already-bound original (a classmethod) callable both ways.
        self.installed = staticmethod(dispatch)
        if isinstance(prop, property) and prop.fget is not None:
            self.installed = property(dispatch, prop.fset, prop.fdel, prop.__doc__)
        elif isinstance(prop, types.FunctionType):  # an instance method: it must bind
            self.installed = dispatch

    def recompose(self) -> None:
        fn = self.base
        for _, wrap in self.wraps:
            fn = wrap(fn)
        self.current = fn


class _Dispatch:
    """An object's patched attribute: calls the chain's current callable. A class, not a
    closure, so that a copy of the object (``copy.deepcopy``, pickling) gets the attribute
    as it was before the patch, bound to the copy: the patches act on the original (a
    staged placeholder's conversions record a move for its stager)."""

    def __init__(self, chain: _Chain) -> None:
        self.chain = chain
        functools.update_wrapper(self, chain.base)  # name, docstring, signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.chain.current(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # Copied or unpickled with its owner: the attribute as the owner had it before the
        # patch. Its own one (a partial, an instance forward) is copied with it; else the
        # class's, looked up on the new owner, whose state is being set (this attribute
        # is not in it yet), so it binds to the copy.
        return _as_it_was(self.chain.owner_ref(), self.chain.attr, self.chain.own)


def _as_it_was(owner: Any, attr: str, own: Any) -> tuple[Any, ...]:
    """How a copy gets ``owner.attr`` as it was before stageload replaced it: its own
    value, else the class's looked up on the copy, whose state is being set (this
    attribute is not in it yet), so it binds to the copy. Only standard-library callables:
    a pickle of it loads where stageload is not installed. The copy holds it as an
    attribute of its own (a later patch of the class's does not reach it)."""
    if own is not _MISSING:
        return operator.itemgetter(0), ((own,),)
    function = inspect.getattr_static(type(owner), attr, None)
    if isinstance(function, types.FunctionType) and function.__name__ != attr:
        # A method bound to the copy pickles by its function's name, which a ModuleList's
        # forward (``_forward_unimplemented``) cannot be found by: the copy could not be
        # pickled again. The function and the copy it binds can.
        return functools.partial, (function, owner)
    return getattr, (owner, attr)


# Keyed by id(owner) with weak values: the chain lives in the owner's patched attribute,
# and an entry whose owner is gone (its id since reused) reads as no chain.
_chains: weakref.WeakValueDictionary[tuple[int, str], _Chain] = weakref.WeakValueDictionary()
_chains_lock = threading.Lock()


def _chain_of(owner: Any, key: tuple[int, str]) -> _Chain | None:
    chain = _chains.get(key)
    return chain if chain is not None and chain.owner_ref() is owner else None


Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def patch(owner: Any, attr: str, wrap: Wrap) -> Callable[[], None]:
    """Replace ``owner.attr`` by ``wrap(previous)``; return a function that undoes it.

    ``wrap`` gets the callable as it is under this patch (the original, or the patches
    added before) and returns its replacement. Patches of one attribute chain in the order
    they were added, and can be removed in any order: the chain is rebuilt without the
    removed one, and the owner gets its own attribute back when the last goes. If someone
    else replaced the attribute since, theirs stays, and ours calls straight through.
    """
    if not callable(wrap):
        raise TypeError(f"patch() needs a wrap function, got {wrap!r}")
    token = object()
    with _chains_lock:
        key = (id(owner), attr)
        chain = _chain_of(owner, key)
        if chain is None:
            chain = _Chain(owner, attr)
            try:
                setattr(owner, attr, chain.installed)
            except (AttributeError, TypeError) as exc:
                raise TypeError(
                    f"cannot patch {_describe(owner)}.{attr}: the object does not accept new "
                    f"attributes ({exc}); patch an object that has a __dict__"
                ) from None
            _chains[key] = chain
        chain.wraps.append((token, wrap))
        chain.recompose()

    del owner  # the remover holds it weakly too, through the chain

    def remove() -> None:
        with _chains_lock:
            if not any(t is token for t, _ in chain.wraps):
                return  # removed already
            chain.wraps = [(t, w) for t, w in chain.wraps if t is not token]
            chain.recompose()
            if chain.wraps:
                return
            owner = chain.owner_ref()
            if _chains.get(key) is chain:
                del _chains[key]
            if owner is None or _own(owner, attr) is not chain.installed:
                return  # replaced on top of ours since: leave theirs, ours calls through
            if chain.own is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, chain.own)

    return remove


def _own(owner: Any, attr: str) -> Any:
    """``owner``'s own attribute (not its class's), or _MISSING."""
    d = getattr(owner, "__dict__", None)
    if d is None:
        return _MISSING
    return d.get(attr, _MISSING)


def _describe(owner: Any) -> str:
    return owner.__qualname__ if isinstance(owner, type) else f"{type(owner).__name__} object"
