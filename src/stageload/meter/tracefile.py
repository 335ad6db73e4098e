"""Write a memory trace: the JSONL records of ``docs/trace-format.md``, one line each.

``TraceWriter`` is shared by ``MemoryMeter``, its sampler process and ``stageload guard``::

    with TraceWriter("run.jsonl") as trace:
        trace.start(pid=os.getpid(), interval=0.5, sampler="thread", meta={"label": "x"})
        trace.sample({"footprint": 123, "available": 456})
        trace.event(Event("stage", stage="decode"))
        trace.mark("warm-up done")
        trace.error("swap_used", "cannot read /proc/meminfo")  # once, until...
        trace.recovered("swap_used")                            # ...the read works again
        trace.end(exit_code=0)

Every record is one ``os.write`` of one whole line on a file opened with ``O_APPEND``:
nothing is buffered in this process, so a run killed at any moment leaves every record it
wrote readable (at worst a half last line if the kernel write itself was cut short), and
several writers (threads, or a sampler process with its own ``TraceWriter(append=True)``)
never interleave parts of lines: on Linux and macOS an ``O_APPEND`` write of a regular file
moves to the end and writes under the inode lock. The writer does not ``fsync``: a trace
survives the death of the process, not the loss of the machine's power.

Observation never kills what it observes: a write that fails (a full disk, a mount gone,
a file too large) stops the writer, which writes nothing more and says so once through
``on_fail`` (default: one line on stderr), instead of raising into the run it traces.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .._version import __version__
from ..core.events import Event
from ..core.outer import encode, event_record
from ..traceformat import END, ERROR, EVENT, FORMAT_VERSION, MARK, SAMPLE, START, line_prefix

try:
    import fcntl
except ImportError:  # not Linux or macOS
    fcntl = None  # type: ignore[assignment]


def versions() -> dict[str, str]:
    """stageload, Python and (when already imported, never importing it) torch versions."""
    found = {"stageload": __version__, "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "__version__", None), str):
        found["torch"] = torch.__version__
    return found


class TraceBusyError(OSError):
    """Another writer (a ``stageload meter``, ``guard --trace`` or ``MemoryMeter``) holds the
    trace file's lock: two runs' records would mix in one file."""


class NotATraceError(FileExistsError):
    """The trace path holds a file that is not a stageload trace (a script, say, given to
    ``-o`` by mistake): a trace writer does not empty it."""


class NotAFileError(OSError):
    """An output path (a trace, by default; a plot's image) is a named pipe or a socket.
    A trace is opened by each process of a run (the sampler, the command's
    ``StagedModels``) and read back at its end, and an image is written whole beside its
    path and renamed into place, so each must be a regular file or a device such as
    ``/dev/null``. Opening a pipe with no reader would wait for ever. ``output`` names
    the kind of file in the message, ``why`` says why it must be a regular file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        what: str,
        output: str = "trace file",
        why: str = "a trace is opened by each process of the run and read back at its end",
    ) -> None:
        super().__init__(
            errno.EINVAL,
            f"{output} {str(path)!r} is {what}, not a regular file: {why}; give the path "
            "of a regular file",
        )
        self.path, self.what, self.output, self.why = str(path), what, output, why

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.what, self.output, self.why))


#: Added to the open of a trace (and of the CLI's check of an output path) so that a named
#: pipe with no reader fails it (ENXIO) rather than block; 0 where the platform has none.
NONBLOCK: int = getattr(os, "O_NONBLOCK", 0)


def kind_of_pipe(mode: int) -> str | None:
    """What a file of ``st_mode`` is when it is a pipe or a socket ("a named pipe (FIFO)",
    "a socket"), which no output of stageload can be (a trace, a plot); None for any other
    file."""
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def _pipe_or_socket(path: Path) -> str | None:
    try:
        return kind_of_pipe(os.stat(path).st_mode)
    except OSError:
        return None


#: The record types a writer puts on a trace's first line (``start``, or any record of a
#: writer used without one); a file whose first line is none of them is not a trace.
_RECORD_TYPES = (START, SAMPLE, EVENT, MARK, ERROR, END)
#: How much of the first line is read to tell: a start record with a long command is under
#: 1 MiB (``core.outer``), and a record's type is in its first bytes.
_FIRST_LINE_MAX = 1 << 20


def _is_trace(path: Path) -> bool:
    """Whether the first line of the file at ``path`` is a stageload trace record, or the
    start of one cut short (a run killed while writing its first line)."""
    with open(path, "rb") as f:
        first = f.readline(_FIRST_LINE_MAX)
    if not first.endswith(b"\n"):
        return any(first.startswith(line_prefix(kind)) for kind in _RECORD_TYPES)
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("type") in _RECORD_TYPES


class TraceWriter:
    """Writes trace records to ``path``, one flushed JSON line each; safe to share between threads.

    ``append=False`` (the default) starts a trace: it holds an exclusive lock on the file
    (``flock``) until closed, so a second such writer of the same file raises
    ``TraceBusyError``, and it empties an existing file only at its first record (or
    ``claim()``): a run that never writes leaves a file that was there as it was (see
    ``discard()``); an existing non-empty file that is not a trace raises
    ``NotATraceError`` and is left alone. ``append=True`` adds to a trace another writer
    started (the sampler process does that; so do the command's processes through
    ``stageload.outer``) and takes no lock. ``monotonic0`` is the ``time.monotonic()``
    that ``t = 0`` stands for; it defaults to now, and a second writer of the same trace
    must pass the first one's so both write comparable ``t``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        append: bool = False,
        monotonic0: float | None = None,
        on_fail: Callable[[str], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.monotonic0 = time.monotonic() if monotonic0 is None else float(monotonic0)
        self.samples = 0  # sample records written by this writer
        self.records = 0  # records of any type written by this writer
        #: Why writing stopped (``"No space left on device"``), or None while it works.
        self.failure: str | None = None
        #: Told once, with a one-line message, when a write fails and the writer stops.
        self.on_fail: Callable[[str], None] = say_on_stderr if on_fail is None else on_fail
        self._failing: set[str] = set()  # fields with an error record and no recovery yet
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._created = False  # this writer made the file (so discard() removes it)
        self._unclaimed = not append  # what the file holds is an older run's, kept until used
        # O_NONBLOCK: a named pipe with no reader fails the open (ENXIO) instead of
        # waiting for one for ever; it is cleared again once the file is known to be none.
        flags = os.O_WRONLY | os.O_APPEND | NONBLOCK
        # Through a symbolic link, the file is its target: O_EXCL refuses any link, even
        # one to a file not made yet, and discard() must remove a file it made, not the link.
        self._file = Path(os.path.realpath(self.path)) if self.path.is_symlink() else self.path
        try:
            if append:
                self._fd = os.open(self._file, flags | os.O_CREAT, 0o644)
            else:
                try:
                    self._fd = os.open(self._file, flags | os.O_CREAT | os.O_EXCL, 0o644)
                    self._created = True
                except FileExistsError:
                    # No O_TRUNC: an existing trace is emptied only once this run writes.
                    self._fd = os.open(self._file, flags)
        except OSError as exc:
            what = _pipe_or_socket(self._file) if exc.errno == errno.ENXIO else None
            if what is not None:  # a pipe with no reader, or a socket: no file to write
                raise NotAFileError(self.path, what) from None
            raise OSError(
                exc.errno,
                f"cannot open trace file {str(self.path)!r} for writing: {exc.strerror}; "
                "check that its folder exists and is writable",
            ) from exc
        what = kind_of_pipe(os.fstat(self._fd).st_mode)
        if what is not None:  # a pipe with a reader: still not a trace (NotAFileError)
            os.close(self._fd)
            self._fd = None
            raise NotAFileError(self.path, what)
        if NONBLOCK and fcntl is not None:  # a device (/dev/full) is written as before
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~NONBLOCK)
        if not append:
            self._take_lock(self._fd)
            if not self._created:
                self._refuse_other_files()

    def _refuse_other_files(self) -> None:
        """Raise ``NotATraceError`` (closing the file) when the existing file is not empty
        and not a trace: a user's script mixed up with ``-o`` would be lost at the first
        record. Devices (``/dev/null``) and empty files are written as before."""
        assert self._fd is not None
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            return
        try:
            is_trace = _is_trace(self.path)
        except OSError as exc:
            is_trace, why = False, f"it cannot be read to check ({exc.strerror or exc})"
        else:
            why = "its first line is not a trace record"
        if is_trace:
            return
        os.close(self._fd)
        self._fd = None
        raise NotATraceError(
            errno.EEXIST,
            f"{str(self.path)!r} exists and is not a stageload trace ({why}), so it is not "
            "overwritten; give another file name, or delete the file if it is not needed",
        )

    def _take_lock(self, fd: int) -> None:
        """Hold the file's exclusive lock, or raise ``TraceBusyError`` (closing the file)."""
        if fcntl is None:  # no flock on this platform: nothing to guard with
            return
        try:
            # Non-blocking: a second run should fail now, not wait for the first to end.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            self._fd = None
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise TraceBusyError(
                exc.errno,
                f"trace file {str(self.path)!r} is being written by another run (a stageload "
                "meter, guard --trace or MemoryMeter holds its lock); give another path, or "
                "wait for that run to end",
            ) from None

    # -- low level ---------------------------------------------------------------------

    def t(self, monotonic: float | None = None) -> float:
        """Seconds since the start for ``monotonic`` (default: now), rounded to microseconds."""
        now = time.monotonic() if monotonic is None else monotonic
        return round(now - self.monotonic0, 6)

    def claim(self) -> None:
        """Empty the file of an older run's records now, ahead of the first record (which
        does it otherwise). Does nothing after the first time, and for ``append=True``."""
        with self._lock:
            if self.failure is not None:
                return
            try:
                self._claim()
            except OSError as exc:
                message = self._failed(exc)
            else:
                return
        self._tell(message)

    def _failed(self, exc: OSError) -> str:
        """Stop writing for good (under the lock); the one-line message that says why."""
        self.failure = exc.strerror or str(exc)
        return (
            f"trace {str(self.path)!r} is not written any more: {self.failure} "
            f"(after {self.records} records); the run goes on without it"
        )

    def _tell(self, message: str) -> None:
        with contextlib.suppress(Exception):  # a failing reporter must not fail the run
            self.on_fail(message)

    def _claim(self) -> None:
        if self._fd is None:
            raise ValueError(f"trace file {str(self.path)!r} is closed")
        if self._unclaimed:
            # A regular file only: a device (-o /dev/null, /dev/full) has nothing to empty,
            # and ftruncate on it fails with EINVAL before the write says what is wrong.
            if stat.S_ISREG(os.fstat(self._fd).st_mode):
                os.ftruncate(self._fd, 0)
            self._unclaimed = False

    def write(self, record: Mapping[str, Any]) -> bool:
        """Write one record as one line; False when it was not written because writing has
        failed (``failure``). Keys that are ``None`` are kept (as ``null``)."""
        data = encode(record)
        with self._lock:
            if self.failure is not None:
                return False
            try:
                self._claim()
                # One write call per line: with O_APPEND the kernel places it whole at the
                # end. The loop only matters for a short write (disk full, huge line).
                view = memoryview(data)
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
            except OSError as exc:
                message = self._failed(exc)
            else:
                self.records += 1
                return True
        self._tell(message)
        return False

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Close the file; writing afterwards raises ``ValueError``. Safe to call twice."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def discard(self) -> None:
        """Close, leaving the path as it was before this writer when it wrote nothing: an
        older trace there stays whole, and a file this writer created is removed. A run
        that cannot start calls this, so no user's trace is lost to it."""
        with self._lock:
            if self._fd is None:
                return
            if self._unclaimed and self._created:
                # Unlinked while still locked, so no second writer can take the lock on it.
                with contextlib.suppress(OSError):
                    self._file.unlink()
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.samples} samples"
        return f"TraceWriter({str(self.path)!r}, {state})"

    # -- records -----------------------------------------------------------------------

    def start(
        self,
        *,
        pid: int,
        interval: float | None = None,
        sampler: str | None = None,
        total: int | None = None,
        sources: Mapping[str, str] | None = None,
        meta: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Write the start record (the first line) and return it.

        ``pid`` is the process whose tree is measured, ``total`` the memory it may use,
        ``sources`` where each sampled value comes from, ``meta`` user metadata. ``extra``
        keys are added as given (e.g. ``sampler_pid``, ``command``).
        """
        record: dict[str, Any] = {
            "type": START,
            "version": FORMAT_VERSION,
            "wall_time": round(time.time() - (time.monotonic() - self.monotonic0), 6),
            "monotonic": self.monotonic0,
            "platform": sys.platform,
            "machine": platform.machine(),
            "pid": pid,
            "total": total,
            "interval": interval,
            "sampler": sampler,
            "versions": versions(),
            "sources": dict(sources or {}),
            "meta": dict(meta or {}),
            **extra,
        }
        self.write(record)
        return record

    def sample(self, values: Mapping[str, Any], *, t: float | None = None) -> None:
        """Write a sample; ``values`` maps sample keys (``footprint``, ...) to numbers."""
        if self.write({"type": SAMPLE, "t": self.t() if t is None else t, **values}):
            self.samples += 1

    def event(self, event: Event | Mapping[str, Any]) -> None:
        """Write an ``Event`` (or its dict); ``t`` comes from the event's own monotonic
        ``time``, and ``pid`` says which process emitted it (this one, unless given)."""
        self.write(event_record(event, self.monotonic0))

    def mark(self, label: str, *, t: float | None = None) -> None:
        """Write a user mark, e.g. ``"warm-up done"``."""
        self.write({"type": MARK, "t": self.t() if t is None else t, "label": str(label)})

    def error(self, field: str, message: str, *, t: float | None = None) -> bool:
        """Record that ``field`` could not be read; written only the first time it fails.

        Returns True when a record was written. Further failures of the same field are
        silent until ``recovered(field)``.
        """
        with self._lock:
            if field in self._failing:
                return False
            self._failing.add(field)
        when = self.t() if t is None else t
        self.write({"type": ERROR, "t": when, "field": field, "message": str(message)})
        return True

    def recovered(self, field: str, *, t: float | None = None) -> bool:
        """Record that ``field`` can be read again, if it was failing; returns True if written."""
        with self._lock:
            if field not in self._failing:
                return False
            self._failing.discard(field)
        when = self.t() if t is None else t
        self.write({"type": ERROR, "t": when, "field": field, "recovered": True})
        return True

    def track_errors(
        self, fields: Iterable[str], errors: Mapping[str, str], *, t: float | None = None
    ) -> None:
        """Update error state after a reading of ``fields``: new failures from ``errors``
        (field -> message) get an error record, fields that read again get a recovery."""
        for field in fields:
            if field in errors:
                self.error(field, errors[field], t=t)
            else:
                self.recovered(field, t=t)

    def failing(self) -> frozenset[str]:
        """Fields with an error record and no recovery yet."""
        with self._lock:
            return frozenset(self._failing)

    def end(
        self, *, samples: int | None = None, exit_code: int | None = None, **extra: Any
    ) -> dict[str, Any]:
        """Write the end record (the last line) and return it. ``samples`` defaults to this
        writer's count; ``exit_code`` is written only when given (a command was run)."""
        record: dict[str, Any] = {
            "type": END,
            "t": self.t(),
            "samples": self.samples if samples is None else samples,
        }
        if exit_code is not None:
            record["exit_code"] = exit_code
        record.update(extra)
        self.write(record)
        return record


def say_on_stderr(message: str) -> None:
    """``TraceWriter``'s default ``on_fail``: one warning line on stderr, never an error."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"stageload: warning: {message}\n")
        sys.stderr.flush()


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a trace's records, skipping a half-written last line (a run killed mid-write).

    A line that does not parse anywhere else is corruption and raises ``ValueError``.
    The ``stageload.report.trace`` module has the full reader and summary; this one is for tests
    and tools that only need the raw records.
    """
    text = Path(path).read_text()
    lines = text.split("\n")
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:  # no newline after it: cut short by a kill
                break
            raise ValueError(f"{str(path)!r} line {i + 1} is not JSON: {exc}") from None
    return records
