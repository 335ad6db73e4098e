"""Attach stage boundaries to methods of objects the user does not own."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MISSING = object()


def on_call(
    obj: Any,
    method: str,
    *,
    before: Callable[..., Any] | None = None,
    after: Callable[..., Any] | None = None,
) -> Callable[[], None]:
    """Wrap ``obj.method`` on this one instance; return a function that removes the wrapper.

    ``before(*args, **kwargs)`` runs before each call with the call's arguments;
    ``after(result, *args, **kwargs)`` runs after it. Their return values are ignored.
    The wrapper keeps the method's name, docstring and signature. Example::

        on_call(pipe, "encode_prompt", before=lambda *a, **k: models.enter("encode"))
    """
    if before is None and after is None:
        raise ValueError("on_call() needs before=, after= or both")
    if isinstance(obj, type):
        raise TypeError(
            f"on_call() wraps a method of one instance, got the class {obj.__qualname__}; "
            f"pass an instance: on_call(my_{obj.__name__.lower()}, {method!r}, ...)"
        )
    try:
        original = getattr(obj, method)
    except AttributeError:
        raise AttributeError(
            f"{type(obj).__name__} object has no method {method!r} to wrap"
        ) from None
    if not callable(original):
        raise TypeError(f"{type(obj).__name__}.{method} is not callable: {original!r}")
    own = vars(obj).get(method, _MISSING) if hasattr(obj, "__dict__") else _MISSING
    active = True

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not active:
            return original(*args, **kwargs)
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    try:
        object.__setattr__(obj, method, wrapper)
    except (AttributeError, TypeError) as exc:
        raise TypeError(
            f"cannot wrap {type(obj).__name__}.{method}: the object does not accept new "
            f"attributes ({exc}); wrap a method of an object that has a __dict__"
        ) from None

    def remove() -> None:
        nonlocal active
        active = False
        if vars(obj).get(method) is not wrapper:
            return  # wrapped again on top of us: stay in the chain, as a pass-through
        if own is _MISSING:
            object.__delattr__(obj, method)
        else:
            object.__setattr__(obj, method, own)

    return remove
