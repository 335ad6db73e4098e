"""Flag types and checks that several commands share, so a bad value reads the same everywhere.

Each type wraps a ``stageload.units`` parser (the library and the flags accept the same
text) and turns its ``ValueError`` into ``argparse.ArgumentTypeError``, whose message
argparse prints as is; a plain ``ValueError`` would print only "invalid <type> value".
Light to import, like every command module.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from ..units import parse_duration, parse_percent_or_size, parse_size

# What a bare number and a unit mean, in the help of every flag of each kind: `--wait-free 50`
# is 50 % while `--swap-budget 50` is 50 bytes, and `2GB` is GiB, not 10**9 bytes. Escaped
# for argparse, which %-formats help text.
SIZE_HELP = "a bare number is bytes (50 is 50 B) and units are binary (8G, 8GB, 8GiB: 8 GiB)"
AMOUNT_HELP = (
    "a percentage of memory, where a bare number is one (40 is 40%%), or a size with a "
    "unit, binary (12G, 12GB, 12GiB: 12 GiB)"
)


def size(text: str) -> int:
    """A size such as ``8G`` or ``512M``, in bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration(text: str) -> float:
    """A duration such as ``30s``, ``1m`` or ``2.5``, in seconds (0 allowed)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def interval(text: str) -> float:
    """A MemoryMeter's sampling interval: a duration within ``stageload.meter``'s
    ``sampler.MIN_INTERVAL`` to ``MAX_INTERVAL`` (10 ms to 1 hour)."""
    try:
        seconds = duration(text)
    except argparse.ArgumentTypeError as exc:
        try:  # a huge or infinite number: the interval's own range says what is wrong
            seconds = float(text)
        except ValueError:
            raise exc from None
        if not (seconds > 0 or seconds != seconds):
            raise exc from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(
            f"interval must be more than 0 seconds, got {text!r}; e.g. '0.5' or '100ms'"
        )
    from ..meter import check_interval  # at parse time only: importing args stays light

    try:
        return check_interval(seconds)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def amount(text: str) -> str:
    """A percentage (``40%``) or a size (``12G``); checked here, kept as text for the library."""
    try:
        parse_percent_or_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def command_after_dashes(words: Sequence[str], prog: str, example: str) -> list[str] | None:
    """The command given after ``--``; None, with the error printed, when there is none."""
    command = list(words)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print(
            f"{prog}: error: no command given; put it after '--', e.g. {example}",
            file=sys.stderr,
        )
        return None
    return command


def unwritable_file(path: str | os.PathLike[str]) -> str | None:
    """Why a file cannot be written at ``path`` (None when it can), found out before a long
    run rather than after it, without waiting on anything and without leaving a file
    behind that was not there before (through a symbolic link: at its target).

    A named pipe (FIFO) or a socket is refused: a trace is opened by each process of the
    run and read back at its end, and ``plot``'s PNG and PDF writers seek. The check never
    opens one: opening a pipe with no reader waits for ever (``meter -o FIFO`` hung here),
    and closing one with a reader would end the reader's input before the real write."""
    if not os.fspath(path):  # Path("") is ".": the error would name a folder
        return "the file name is empty; give the path of a file"
    try:
        return _unwritable_file(Path(path))
    except OSError as exc:  # even asking fails, e.g. a name too long for the file system
        if exc.errno == errno.ENAMETOOLONG:
            return (
                f"the file name is too long for this file system ({len(str(path))} "
                "characters in all); give a shorter one"
            )
        return f"cannot use {str(path)!r}: {exc.strerror or exc}"


def _unwritable_file(path: Path) -> str | None:
    # Imported here: the meter package costs 0.1 s, which a command's --help need not pay.
    from ..meter.tracefile import NONBLOCK, kind_of_pipe

    # Through a symbolic link, the file is its target: that is what gets written (and a
    # link to a file not yet made must not be replaced by the probe's clean-up).
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode: int | None = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        return f"{str(path)!r} is a folder; give the path of a file"
    if not target.parent.is_dir():
        return (
            f"folder {str(target.parent)!r} does not exist; create it, or give a path in a "
            "folder that exists"
        )
    what = kind_of_pipe(mode) if mode is not None else None
    if what is not None:
        return (
            f"{str(path)!r} is {what}, not a regular file, and this output must be one; "
            "give the path of a regular file"
        )
    if mode is not None and not stat.S_ISREG(mode):
        # A device (/dev/null): opening one may wait (a serial line, a tape), so only
        # the permission is asked.
        if not os.access(target, os.W_OK):
            return f"cannot write {str(path)!r}: {os.strerror(errno.EACCES)}"
        return None
    # A regular file, or none yet: opened as the writer opens it, O_NONBLOCK in case a
    # pipe took its place since the stat (ENXIO then, not a wait).
    flags = os.O_WRONLY | os.O_APPEND | NONBLOCK
    try:
        if mode is None:
            fd = os.open(target, flags | os.O_CREAT | os.O_EXCL, 0o644)
        else:
            fd = os.open(target, flags)
    except OSError as exc:
        return f"cannot write {str(path)!r}: {exc.strerror or exc}"
    os.close(fd)
    if mode is None:
        target.unlink(missing_ok=True)
    return None


def unusable_folder(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be used as an output folder (None when it can); creates it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{str(path)!r} is a file, not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create folder {str(path)!r}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK):
        return f"folder {str(path)!r} is not writable"
    return None
