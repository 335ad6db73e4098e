"""What a loader declares about itself, by an attribute on it.

A loader that draws no random numbers (:func:`rng_free`) may be prefetched on a background
thread, where ``preserved_rng()`` cannot help; one with ``background_ready()`` says when a
load on another thread is safe. Loaders are made here (``load/weights``) and in the
adapters, and the residency policy reads what they declare (``core/policy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute :func:`rng_free` sets on a loader. ``loader.draws_random = False`` is the
#: whole contract: anyone may set it without importing stageload.
RNG_FREE_ATTR = "draws_random"


def rng_free(loader: F) -> F:
    """Declare that ``loader`` draws no random numbers, so it may be prefetched.

    Sets ``loader.draws_random = False`` and returns the loader (usable as a decorator).
    A loader qualifies when it builds its model without running random initialisers (on
    ``meta``, or with ``init=False``-style constructors) and only copies weights in, and
    when every model it asks the registry for qualifies too. Objects that take no
    attributes (bound methods) are wrapped in a function that does.
    """
    try:
        setattr(loader, RNG_FREE_ATTR, False)
        return loader
    except (AttributeError, TypeError):
        pass

    def load() -> Any:
        return loader()

    load.__qualname__ = getattr(loader, "__qualname__", "load")
    setattr(load, RNG_FREE_ATTR, False)
    return load  # type: ignore[return-value]


#: A loader may carry ``background_ready()``: False while a load now would not be safe on
#: another thread (the diffusers adapter's first load goes through ``from_pretrained``,
#: whose meta-device set-up patches torch for every thread).
BACKGROUND_READY_ATTR = "background_ready"


def ready_for_background(loader: object) -> bool:
    """Whether a prefetch may run ``loader`` on a background thread now."""
    check = getattr(loader, BACKGROUND_READY_ATTR, None)
    return True if check is None else bool(check())


def is_rng_free(loader: object) -> bool:
    """True when ``loader`` is marked as drawing no random numbers (see :func:`rng_free`)."""
    return getattr(loader, RNG_FREE_ATTR, True) is False
