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
``forward`` on modules, and the patched attribute itself (``tests/test_foreign.py``).

Threads: hooks are added and removed by the thread that owns the module's staging (the one
that enters stages and releases); a running call sees either the old list or the new one.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

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


class HookRegistry:
    """The named hooks of one module, in the order they were added."""

    def __init__(self, module: nn.Module) -> None:
        self._hooks: dict[str, ModuleHook] = {}
        self._own_forward = module.__dict__.get("forward", _MISSING)
        self._forward: _HookedForward | None = None

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
            registry = HookRegistry(module)
            registry._forward = _HookedForward(module, registry)
            # Instance attributes, past nn.Module.__setattr__ (neither is a Module, tensor
            # or parameter, so it would store them the same way).
            module.__dict__[HOOKS_ATTR] = registry
            module.__dict__["forward"] = registry._forward
        return registry

    # -- the hooks ----------------------------------------------------------------------------
    def add(self, name: str, hook: ModuleHook) -> ModuleHook:
        """Add ``hook`` under ``name``, replacing (in place) one of that name."""
        if not isinstance(hook, ModuleHook):
            raise TypeError(f"hook {name!r} must be a ModuleHook, got {type(hook).__name__}")
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
            d = module.__dict__
            del d[HOOKS_ATTR]
            if d.get("forward") is registry._forward:
                if registry._own_forward is _MISSING:
                    del d["forward"]
                else:
                    d["forward"] = registry._own_forward
        return hook

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, registry = self.module, self.registry
        # A hook may take itself or others off while running (a revived placeholder loses
        # its release hooks): each step asks the registry as it is now.
        for hook in registry.hooks():
            if hook in registry._hooks.values():
                changed = hook.pre_call(module, args, kwargs)
                if changed is not None:
                    args, kwargs = changed
        output = registry.original_forward(module)(*args, **kwargs)
        for hook in reversed(registry.hooks()):
            output = hook.post_call(module, output)
        return output


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

        @functools.wraps(self.base)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return self.current(*args, **kwargs)

        # On a class, a plain function would bind to instances; staticmethod keeps the
        # already-bound original (a classmethod) callable both ways.
        self.installed: Any = staticmethod(dispatch) if isinstance(owner, type) else dispatch
        if isinstance(prop, property) and prop.fget is not None:
            self.installed = property(dispatch, prop.fset, prop.fdel, prop.__doc__)
        elif isinstance(prop, types.FunctionType):  # an instance method: it must bind
            self.installed = dispatch

    def recompose(self) -> None:
        fn = self.base
        for _, wrap in self.wraps:
            fn = wrap(fn)
        self.current = fn


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
