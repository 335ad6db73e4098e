"""Share identical loads: one instance for every identical call of a factory."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

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


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    def freeze(value: Any) -> Hashable:
        if isinstance(value, dict):
            # Sorted by the keys' repr: keys of mixed types (1 and "x") do not compare.
            items = sorted(((k, freeze(v)) for k, v in value.items()), key=lambda kv: repr(kv[0]))
            return ("dict", tuple(items))
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(freeze(v) for v in value))
        if isinstance(value, set):
            return ("set", frozenset(freeze(v) for v in value))
        try:
            hash(value)
        except TypeError:
            text = repr(value)
            # numpy and torch abbreviate large arrays with "...": two different arrays can
            # print the same, so such values only match themselves.
            return ("repr", type(value).__qualname__, _ById(value) if "..." in text else text)
        return value

    return (freeze(args), freeze(kwargs))


@contextmanager
def share(owner: Any, attr: str) -> Iterator[dict[Hashable, Any]]:
    """Within the block, identical calls of ``owner.attr(...)`` return one shared instance.

    For example, four feature extractors that each call
    ``Backbone.from_pretrained("dinov3")`` get one backbone instead of four::

        with share(Backbone, "from_pretrained"):
            extractors = [Extractor(key) for key in keys]

    Calls are identical when their arguments are equal (unhashable ones compare by
    ``repr``, or by identity where the repr is abbreviated, as for large arrays).
    Yields the cache, so callers can see what was shared.
    """
    try:
        original = getattr(owner, attr)
    except AttributeError:
        raise AttributeError(f"{owner!r} has no attribute {attr!r} to share") from None
    if not callable(original):
        raise TypeError(f"{owner!r}.{attr} is not callable: {original!r}")
    own = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    cache: dict[Hashable, Any] = {}

    @functools.wraps(original)
    def shared(*args: Any, **kwargs: Any) -> Any:
        key = _key(args, kwargs)
        if key not in cache:
            cache[key] = original(*args, **kwargs)
        return cache[key]

    # On a class, a plain function would bind to instances; staticmethod keeps the
    # already-bound original (e.g. a classmethod) callable both ways.
    setattr(owner, attr, staticmethod(shared) if isinstance(owner, type) else shared)
    try:
        yield cache
    finally:
        if own is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)
