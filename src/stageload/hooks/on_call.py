"""Attach stage boundaries to methods of objects the user does not own (a :func:`patch`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .registry import patch


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
    for key, fn in (("before", before), ("after", after)):
        if fn is not None and not callable(fn):
            raise TypeError(f"on_call() {key}= must be callable, got {fn!r}")
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

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before(*args, **kwargs)
            result = inner(*args, **kwargs)
            if after is not None:
                after(result, *args, **kwargs)
            return result

        return wrapper

    return patch(obj, method, wrap)
