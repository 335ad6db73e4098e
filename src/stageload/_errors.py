"""Exceptions that survive pickling, so they cross process boundaries (queues, Ray).

Python pickles an exception as ``cls(*self.args)``. Ours take their fields in
``__init__`` and pass only the message on, so that call fails (``TypeError`` on
unpickling) or fills the fields with the message. psutil's ``Error`` defines
``__reduce__`` for the same reason (``psutil/_common.py``).
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls, *args)  # sets .args; __init__ is not run again
    exc.args = args
    exc.__dict__.update(state)
    return exc


class PicklableError:
    """Mixin for an exception with its own ``__init__``: pickles the message and fields
    as they are instead of calling ``__init__`` again. Put it first in the bases."""

    def __reduce__(self) -> tuple[Any, ...]:
        exc: BaseException = self  # type: ignore[assignment]
        return (_rebuild, (type(self), exc.args, dict(vars(self))))
