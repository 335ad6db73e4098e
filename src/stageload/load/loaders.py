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


def check_build(build: object, call: str) -> None:
    """Raise a TypeError unless ``build`` is a function that makes a model, as ``call``
    (``"from_safetensors"``) takes it: a model instance is callable (its forward), so
    passed instead it failed later with "forward() missing 1 required positional argument"."""
    if not callable(build):
        raise TypeError(f"build must be a callable that returns an nn.Module, got {build!r}")
    if is_model(build):
        cls = type(build).__name__
        raise TypeError(
            f"{call}() takes a function that builds the model, not a model ({cls}): the "
            f"weights go into a fresh one built on meta. Pass the class or a function: "
            f"{call}({cls}, ...) or {call}(lambda: {cls}(config), ...)"
        )


def is_model(obj: object) -> bool:
    """Whether ``obj`` is a model instance (a module), not a class or function making one."""
    return hasattr(obj, "forward") and hasattr(obj, "parameters") and not isinstance(obj, type)
