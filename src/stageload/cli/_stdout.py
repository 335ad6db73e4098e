"""The stdout of a command whose output is the point (``report``, ``queue``).

``stageload report t.jsonl > /dev/full``: a write that fails raises ``OSError`` from deep
inside a ``print`` (or at the interpreter's last flush, after ``main`` returned), and
Python prints a traceback. ``CheckedStream`` turns any such failure except a closed pipe
(``BrokenPipeError``: the reader took what it wanted) into ``OutputError``, which ``main``
reports in one line, as it does every other error.
"""

from __future__ import annotations

from typing import Any, TextIO


class OutputError(Exception):
    """Writing the command's output failed (a full disk, an I/O error); ``error`` says why."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class CheckedStream:
    """A text stream whose failed writes and flushes raise ``OutputError``."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc) from exc

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, ... of the real stream
        return getattr(self._stream, name)
