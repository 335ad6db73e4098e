"""The base of every stageload exception: it carries data and survives pickling.

Python pickles an exception as ``cls(*self.args)``. Ours take their fields in ``__init__``
and pass only the message on, so that call would fail on unpickling (``TypeError``) or fill
the fields with the message. :class:`StageloadError` pickles the message and the fields as
they are instead, so errors cross process boundaries (the queue, Ray) intact; psutil's
``Error`` defines ``__reduce__`` for the same reason (``psutil/_common.py``).
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls, *args)  # sets .args; __init__ is not run again
    exc.args = args
    exc.__dict__.update(state)
    return exc


class StageloadError(Exception):
    """An error raised by stageload. Subclasses add a builtin category (``ValueError``,
    ``RuntimeError``) as a second base, so ``except ValueError`` still catches them."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(vars(self))))


class CheckpointError(StageloadError, ValueError):
    """A checkpoint file that cannot be read as safetensors: truncated, corrupt, missing, or
    with a header that safetensors itself rejects; or changed since a model was read from
    it, so a reload would give other weights. ``path`` names the file and ``tensor``
    the tensor the problem is with (None when it is the file's: its length, its header)."""

    def __init__(
        self, path: object, problem: str, tensor: str | None = None, fix: str | None = None
    ) -> None:
        self.path = str(path)
        self.problem = problem
        self.tensor = tensor
        fix = fix or "the file is damaged or incomplete, download or save it again"
        super().__init__(f"{self.path}: {problem}; {fix}")


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the first frame outside stageload and the libraries it works
    under (torch, diffusers, transformers, accelerate, peft): the script's line that led to
    it (``models.enter("decode")``, ``pipe(...)``), not a line of ours or a pipeline's. The
    warnings filter then shows it once per such line, where the script can change it."""
    import os
    import sys
    import warnings

    skipped = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    for name in _LIBRARIES:
        library = sys.modules.get(name)
        where = getattr(library, "__file__", None)
        if where:
            skipped.append(os.path.dirname(os.path.abspath(where)) + os.sep)
    frame, level = sys._getframe(1), 2  # level 2: warn_caller's caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(tuple(skipped)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


#: The packages whose frames :func:`warn_caller` looks past (those imported).
_LIBRARIES = ("torch", "diffusers", "transformers", "accelerate", "peft")
