"""Share identical loads: one instance for every identical call of a factory."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

_MISSING = object()


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    def freeze(value: Any) -> Hashable:
        if isinstance(value, dict):
            return ("dict", tuple(sorted((k, freeze(v)) for k, v in value.items())))
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(freeze(v) for v in value))
        try:
            hash(value)
        except TypeError:
            return ("repr", type(value).__qualname__, repr(value))
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
    ``repr``). Yields the cache, so callers can see what was shared.
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
