"""``stageload meter``: run a command and record its process tree's memory in a trace."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.outer import command_env
from ..guard.process import EXIT_CANNOT_START
from ..units import format_duration, format_size
from .args import command_after_dashes, interval, unwritable_file

if TYPE_CHECKING:
    from ..report.trace import Summary

HELP = "run a command and record its memory (footprint, swap, available) in a trace"

DESCRIPTION = """\
Run CMD and record the memory of its whole process tree in a JSONL trace, like
'mprof run': every --interval seconds the footprint of CMD and all its children
(Linux: RssAnon+RssShmem+VmSwap, macOS: phys_footprint), memory available, swap used
and memory pressure. 'stageload report' and 'stageload plot' read the trace; its
format is in docs/trace-format.md.

Every StagedModels in CMD's process tree (staged_pipeline, the adapters) sends its
events into the trace too, so 'stageload report' shows the peak per stage with no
change to CMD: the trace's path is in STAGELOAD_TRACE for CMD, and each event record
names its pid. --no-events (or STAGELOAD_EVENTS=0) keeps them out.

Samples come from a separate sampler process by default, so they keep coming while
CMD is busy; --sampler thread samples from a thread in this process instead. CMD runs
in the foreground as usual; SIGINT and SIGTERM sent to stageload are passed on to it.
At the end a one-line summary goes to stderr.

A file already at the -o path is replaced only once CMD has started (a CMD that
cannot start leaves it as it was), and one trace file takes one run at a time: a
second 'stageload meter' or 'guard --trace' on it is refused (exit 2).

Exit codes:
  CMD's own       (128+N if CMD died from signal N)
  127             CMD could not be started
  2               bad command line

Examples:
  stageload meter -o eager.jsonl --label eager -- python run.py --eager
  stageload meter -o staged.jsonl --label staged -- python run.py
  stageload report eager.jsonl staged.jsonl
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        metavar="TRACE",
        default=None,
        help="trace file to write (default: meter-YYYYmmdd-HHMMSS.jsonl here, with -2, -3, "
        "... added when that name is taken: never an existing file)",
    )
    parser.add_argument(
        "--interval",
        type=interval,
        default=0.5,
        metavar="S",
        help="time between samples: seconds or e.g. '100ms', from 10ms to 1 hour (default: 0.5)",
    )
    parser.add_argument(
        "--sampler",
        choices=("process", "thread"),
        default="process",
        help="sample from a separate process (default) or a thread of this one",
    )
    parser.add_argument(
        "--label",
        default=None,
        help="name of this run in the trace, shown by 'stageload report' (e.g. 'staged')",
    )
    parser.add_argument(
        "--no-events",
        dest="events",
        action="store_false",
        help="keep the command's own stageload events (stages, loads, releases) out of "
        "the trace; the same as STAGELOAD_EVENTS=0",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the command to run, after '--'",
    )


def _in_terminal_foreground() -> bool:
    # Ctrl-C in a terminal signals the whole foreground process group, the command too.
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


class _Forwarder:
    """Passes SIGINT and SIGTERM on to the command while it runs; restores handlers after.

    Installed before the command starts (``proc`` is set once it has): a signal that comes
    as the command starts is held and passed on then, never taken for one to this process
    (a KeyboardInterrupt, or death by SIGTERM) while the command runs on."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._held: list[int] = []
        self.previous: dict[int, Any] = {}

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    @proc.setter
    def proc(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        held, self._held = self._held, []
        for signum in held:
            self._pass(signum)

    def _handle(self, signum: int, frame: object) -> None:
        # A terminal's Ctrl-C already reached the command (same process group); sending it
        # again could interrupt the command's own clean-up. Anything else is passed on.
        if signum == signal.SIGINT and _in_terminal_foreground():
            return
        if self._proc is None:
            self._held.append(signum)
            return
        self._pass(signum)

    def _pass(self, signum: int) -> None:
        assert self._proc is not None
        with contextlib.suppress(OSError):
            self._proc.send_signal(signum)

    def __enter__(self) -> _Forwarder:
        for sig in self.SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def new_default_trace() -> Path:
    """Create, empty, the trace of a run given no ``-o``: ``meter-YYYYmmdd-HHMMSS.jsonl``
    here, or ``...-2.jsonl``, ``-3`` ... when that name is taken (runs started within one
    second). Made with ``O_EXCL``, so two runs never get one name and no file is replaced.
    Raises ``OSError`` when the folder cannot take a file."""
    stem = time.strftime("meter-%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        path = Path(f"{stem}.jsonl" if n == 1 else f"{stem}-{n}.jsonl")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


def summary_line(summary: Summary) -> str:
    """Peak footprint, swap growth and lowest available memory of a trace's summary."""
    parts = [f"peak footprint {format_size(summary.peak_footprint)}"]
    growth = summary.swap_growth
    parts.append(f"swap {'-' if growth is None else '+' + format_size(growth)}")
    lowest = f"lowest available {format_size(summary.lowest_available)}"
    if summary.lowest_available_pct is not None:
        lowest += f" ({summary.lowest_available_pct:.0f}%)"
    return ", ".join(parts + [lowest])


def run(args: argparse.Namespace) -> int:
    from ..guard.process import end_fields, exit_status
    from ..meter import MemoryMeter
    from ..meter.tracefile import NotAFileError, NotATraceError, TraceBusyError
    from ..report.trace import load_summary
    from . import EXIT_USAGE

    command = command_after_dashes(
        args.command, "stageload meter", "stageload meter -o run.jsonl -- python run.py"
    )
    if command is None:
        return EXIT_USAGE
    made = args.output is None  # a name of our own, created here: removed if CMD can't start
    if made:
        try:
            output = new_default_trace()
        except OSError as exc:
            print(
                f"stageload meter: error: cannot create a trace file in {os.getcwd()!r}: "
                f"{exc.strerror or exc}; give -o TRACE in a writable folder",
                file=sys.stderr,
            )
            return EXIT_USAGE
    else:
        problem = unwritable_file(args.output)  # find out now, not after the command has run
        if problem is not None:
            print(f"stageload meter: error: -o {args.output!r}: {problem}", file=sys.stderr)
            return EXIT_USAGE
        output = Path(args.output)

    meta = {} if args.label is None else {"label": args.label}
    meter = MemoryMeter(output, args.interval, sampler=args.sampler, meta=meta)
    # Open the trace (taking its lock: one run per file) and start the sampler process
    # first: it takes ~0.1 s, and a short command could be over before its first sample.
    # The command's StagedModels append their events to the trace (stageload.outer), so the
    # file exists before the command starts; an older trace there is emptied only once
    # the command has started (meter.start), and kept whole if it cannot start.
    try:
        meter.prepare()
    # Not for a name of ours: O_EXCL made it.
    except (TraceBusyError, NotATraceError, NotAFileError) as exc:
        print(f"stageload meter: error: -o {str(output)!r}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    started = time.monotonic()
    forwarder = _Forwarder()
    with forwarder:
        try:
            proc = subprocess.Popen(command, env=command_env(output, events=args.events))
        except OSError as exc:
            meter.cancel()  # nothing ran: no trace, and an older one at the path stays whole
            if made:
                output.unlink(missing_ok=True)
            print(f"stageload meter: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
            return EXIT_CANNOT_START
        forwarder.proc = proc
        meter.pid = proc.pid
        try:
            meter.start(command=command)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        try:
            code = exit_status(proc.wait())
        finally:
            if proc.returncode is None:  # interrupted in here: don't leave it behind
                proc.kill()
                proc.wait()
            meter.stop(**end_fields(proc.returncode))
    elapsed = time.monotonic() - started
    if meter.failure is not None:  # said on stderr when it happened
        figures = f"trace incomplete ({meter.failure})"
    else:
        try:
            figures = summary_line(load_summary(output))
        except (OSError, ValueError) as exc:  # removed or damaged meanwhile: CMD's code stands
            figures = f"trace unreadable ({getattr(exc, 'strerror', None) or exc})"
    print(
        f"stageload meter: exit {code} after {format_duration(elapsed)}; "
        f"{figures}; {meter.samples} samples in {str(output)}",
        file=sys.stderr,
    )
    return code
