"""A stderr that nobody reading it cannot turn into a wrong exit code.

``stageload guard -- CMD 2>&1 | true``: the reader is gone before the guard's summary line,
so writing it raises ``BrokenPipeError`` (or ``OSError`` for ``2>/dev/full``), and a
command that runs a command must still exit with that command's code. ``QuietStream``
wraps the stream for those commands: the first failed write points the file descriptor
at ``/dev/null`` (so the interpreter's final flush, and any later write, succeed) and
every later line is dropped.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, TextIO


class QuietStream:
    """A text stream that swallows write errors, after pointing its descriptor at devnull."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        #: Why writing stopped (the first error), or None while it works.
        self.failed: OSError | None = None

    def _fail(self, exc: OSError) -> None:
        if self.failed is None:
            self.failed = exc
            # Later writes (ours, the interpreter's flush at exit) go nowhere, not to an
            # error: the bytes still buffered in the stream are written to devnull.
            with contextlib.suppress(OSError, ValueError, AttributeError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._stream.fileno())
                os.close(devnull)

    def write(self, text: str) -> int:
        if self.failed is not None:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._fail(exc)
            return len(text)

    def flush(self) -> None:
        if self.failed is not None:
            with contextlib.suppress(OSError, ValueError):
                self._stream.flush()  # empties the buffer into devnull
            return
        try:
            self._stream.flush()
        except OSError as exc:
            self._fail(exc)
            with contextlib.suppress(OSError, ValueError):
                self._stream.flush()

    def isatty(self) -> bool:
        try:
            return self._stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, ... of the real stream
        return getattr(self._stream, name)
