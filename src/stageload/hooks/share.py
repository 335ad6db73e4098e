"""Share identical loads: one instance for every identical call of a factory."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from pathlib import PurePath
from typing import Any

from .registry import patch
from .release import is_released

_MISSING = object()


class _ById:
    """Key part for an unhashable value whose repr is abbreviated: equal only to itself.
    Holding the value keeps its id from being reused while the cache lives."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ById) and other.value is self.value


#: Values compared by value and type (``1``, ``1.0`` and ``True`` are three calls).
_PLAIN = (str, bytes, int, float, bool, type(None), PurePath)


def call_key(args: tuple[Any, ...], kwargs: dict[str, Any], *, plain_only: bool = False) -> Any:
    """What makes two calls identical: the one definition, for ``share()`` and for auto's
    factory calls. Plain values (strings, numbers, paths, dtypes, devices, and lists,
    tuples, dicts and sets of them) compare by value and type. Anything else, with
    ``plain_only``, makes the call one that is never identical to another (None); without
    it, a small array compares by value, a hashable object by itself, and another by its
    repr (or by identity when the repr is abbreviated)."""

    def freeze(value: Any) -> Hashable:
        kind = type(value)
        if isinstance(value, _PLAIN):
            return (kind, value)
        if isinstance(value, (list, tuple)):
            return (kind, tuple(freeze(v) for v in value))
        if isinstance(value, dict):
            # Sorted by the keys' repr: keys of mixed types (1 and "x") do not compare.
            items = ((freeze(k), freeze(v)) for k, v in value.items())
            return (dict, tuple(sorted(items, key=repr)))
        if isinstance(value, (set, frozenset)):
            return (kind, frozenset(freeze(v) for v in value))
        if kind.__module__ == "torch" and kind.__name__ in ("dtype", "device"):
            return (kind, str(value))
        if plain_only:
            raise _NotPlain
        if _is_array(value) and value.size <= _WHOLE:
            # By value: a repr rounds (numpy prints 8 digits: [1.0] and [1.0 + 1e-12] alike).
            return ("array", str(value.dtype), tuple(value.shape), value.tobytes())
        try:
            hash(value)
        except TypeError:
            text = repr(value)
            # numpy and torch abbreviate large arrays with "...": two different arrays can
            # print the same, so such values only match themselves.
            return ("repr", kind.__qualname__, _ById(value) if "..." in text else text)
        return value

    try:
        return (freeze(args), freeze(kwargs))
    except _NotPlain:
        return None


class _NotPlain(Exception):
    """An argument that is not a plain value (:func:`call_key` with ``plain_only``)."""


#: Arrays of at most this many elements compare by value (numpy prints them whole); larger
#: ones by identity (reading all their bytes at each call would cost as much as the call).
_WHOLE = 1000


def _is_array(value: Any) -> bool:
    """A numpy-like array: with ``tobytes``, ``dtype``, ``shape`` and ``size``."""
    return all(hasattr(value, a) for a in ("tobytes", "dtype", "shape", "size"))


def _unpatched(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("share(): the slot was used before its patch was installed")


class _Slot:
    """Every active ``share()`` of one ``owner.attr``: one patch of the owner, one cache per
    block, innermost last. Blocks may exit in any order; the patch goes with the last one,
    so no stale wrapper is left behind."""

    def __init__(self, owner: Any, attr: str) -> None:
        self.owner = owner
        self.attr = attr
        self.original: Callable[..., Any] = _unpatched  # what a build calls (set by patch)
        self.remove: Callable[[], None] = lambda: None
        self.caches: list[dict[Hashable, Any]] = []
        self.lock = threading.Lock()  # guards caches and building, never held while building
        # key -> (thread id, done): one build per key at a time, so a prefetch thread and
        # the caller never build the same instance twice.
        self.building: dict[Hashable, tuple[int, threading.Event]] = {}

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = call_key(args, kwargs)
        me = threading.get_ident()
        while True:
            with self.lock:
                if not self.caches:  # every block exited but another wrapper calls ours
                    return_plain = True
                    break
                return_plain = False
                value = self._cached(key)
                if value is not _MISSING:
                    return value
                builder = self.building.get(key)
                if builder is None or builder[0] == me:
                    # Nobody builds it, or this thread does and the factory calls itself
                    # with the same arguments: build here (waiting would deadlock).
                    done = threading.Event()
                    self.building.setdefault(key, (me, done))
                    break
            # Another thread is building it (a prefetch): wait, then take what it built.
            builder[1].wait()
        if return_plain:
            return self._build(args, kwargs)
        try:
            value = self._build(args, kwargs)
            with self.lock:
                for cache in self.caches:
                    cache[key] = value
        finally:
            with self.lock:
                if self.building.get(key, (me, None))[1] is done:
                    del self.building[key]
            done.set()
        return value

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.original(*args, **kwargs)

    def _cached(self, key: Hashable) -> Any:
        """The live shared value for ``key`` or ``_MISSING``; forgets a released one."""
        for cache in reversed(self.caches):
            value = cache.get(key, _MISSING)
            if value is _MISSING:
                continue
            if is_released(value):
                # Released with the model that held it: its weights are on meta. Never hand
                # it out again; the next identical call builds a fresh one to share.
                for other in self.caches:
                    if other.get(key, _MISSING) is value:
                        del other[key]
                return _MISSING
            for other in self.caches:  # an inner block also sees what an outer one shared
                other.setdefault(key, value)
            return value
        return _MISSING


_slots: dict[tuple[int, str], _Slot] = {}
_slots_lock = threading.Lock()


@contextmanager
def share(owner: Any, attr: str) -> Iterator[dict[Hashable, Any]]:
    """Within the block, identical calls of ``owner.attr(...)`` return one shared instance.

    For example, four feature extractors that each call
    ``Backbone.from_pretrained("dinov3")`` get one backbone instead of four::

        with share(Backbone, "from_pretrained"):
            extractors = [Extractor(key) for key in keys]

    Calls are identical when their arguments are equal (small arrays compare by value,
    large ones by identity; other unhashable values by ``repr``, or by identity where the
    repr is abbreviated).
    A shared instance that was released (:func:`stageload.release`, e.g. with the first
    model that held it) is never handed out again: the next identical call builds a fresh
    one, which later identical calls share. Blocks on the same ``owner.attr`` may nest and
    exit in any order. Yields the cache, so callers can see what was shared.
    """
    cache: dict[Hashable, Any] = {}
    with _slots_lock:
        slot = _slots.get((id(owner), attr))
        if slot is None:
            slot = _install(owner, attr)
            _slots[(id(owner), attr)] = slot
        with slot.lock:
            slot.caches.append(cache)
    try:
        yield cache
    finally:
        with _slots_lock:
            with slot.lock:
                slot.caches.remove(cache)
            if not slot.caches:
                del _slots[(id(owner), attr)]
                _uninstall(slot)


def _install(owner: Any, attr: str) -> _Slot:
    slot = _Slot(owner, attr)

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        slot.original = inner  # what a build calls: the attribute as it was before us

        @functools.wraps(inner)
        def shared(*args: Any, **kwargs: Any) -> Any:
            return slot.call(args, kwargs)

        return shared

    slot.remove = patch(owner, attr, wrap)
    return slot


def _uninstall(slot: _Slot) -> None:
    slot.remove()
