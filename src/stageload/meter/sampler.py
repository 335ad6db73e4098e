"""MemoryMeter's sampling loop, and the sampler process that runs it outside the metered program.

A Python thread takes no sample while native code holds the GIL, so a peak that lives only
inside one long C call is invisible to it. The sampler process (``python -m
stageload.meter``) has its own interpreter and samples regardless. It imports only
``stageload.memory`` and ``stageload.meter.tracefile`` (psutil, never torch) and starts in about a
tenth of a second.

The sampler writes its samples straight into the trace file, and the metered process writes
its events into the same file: each writer appends whole lines with one ``O_APPEND`` write
(see ``stageload.meter.tracefile``), so lines never mix. Samples are not sent to the parent
through a pipe for it to write: they would die with it, and the samples just before a
crash (an OOM kill) are the ones that matter most.

Protocol with the parent (``MemoryMeter``), over the sampler's stdin and stdout, one JSON
object per line. Both sides build and read messages only through :class:`Messages` below,
so the two cannot drift apart:

- sampler -> parent ``hello(pid)`` once it is running (detached, see below);
- parent -> sampler ``go(monotonic0, pid)`` once the start record is written: the
  ``time.monotonic()`` that ``t = 0`` stands for and the process to measure (not known at
  spawn time: ``stageload meter`` starts the sampler before the command, so that the first
  sample comes right after the command starts);
- sampler -> parent ``ready()`` after its first sample;
- parent -> sampler ``device(values)``: device memory read in the parent (only the process
  that uses torch can read it); merged into later samples;
- parent -> sampler ``stop(final=True)``: take a closing sample (as the thread sampler
  does), then stop; sampler -> parent ``samples(n)``.

End of file on stdin means the parent is gone: the sampler exits at once, writing nothing
more. It also checks every tick that the parent (``--watch``) is still alive, because a
child the parent forked keeps the pipe open.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..memory import (
    DEVICE_KEYS,
    SystemMemory,
    read_device,
    read_process,
    read_system,
    sample_errors,
    to_sample,
)
from .tracefile import TraceWriter

#: The shortest time between samples: one sample of a process tree takes about a
#: millisecond, and a shorter interval only spends the CPU it is meant to watch.
MIN_INTERVAL = 0.01
#: The longest: an hour (a longer wait could not be told from a hang, and the timers that
#: wait it, ``select`` and ``threading.Event.wait``, overflow on huge values).
MAX_INTERVAL = 3600.0


def check_interval(seconds: float) -> float:
    """``seconds`` if it is a usable sampling interval; ``ValueError`` naming the range if not."""
    if not MIN_INTERVAL <= seconds <= MAX_INTERVAL:  # also refuses nan
        raise ValueError(
            f"interval must be from {MIN_INTERVAL:g} s (10 ms) to {MAX_INTERVAL:g} s (1 hour), "
            f"got {seconds!r}; e.g. 0.5 or '100ms'"
        )
    return seconds


class Messages:
    """The parent-sampler protocol: each message's builder, and the key that names it."""

    HELLO = "hello"
    GO = "go"
    READY = "ready"
    DEVICE = "device"
    STOP = "stop"
    SAMPLES = "samples"

    @staticmethod
    def hello(pid: int) -> dict[str, Any]:
        return {Messages.HELLO: pid}

    @staticmethod
    def go(monotonic0: float, pid: int, *, failed: bool = False) -> dict[str, Any]:
        # failed: the parent could not write the trace (and said so): write nothing more.
        return {Messages.GO: monotonic0, "pid": pid, "failed": failed}

    @staticmethod
    def ready() -> dict[str, Any]:
        return {Messages.READY: True}

    @staticmethod
    def device(values: Mapping[str, Any]) -> dict[str, Any]:
        return {Messages.DEVICE: {k: v for k, v in values.items() if k in DEVICE_KEYS}}

    @staticmethod
    def stop(*, final: bool) -> dict[str, Any]:
        return {Messages.STOP: True, "final": final}

    @staticmethod
    def samples(n: int, failure: str | None = None) -> dict[str, Any]:
        # failure: why the sampler stopped writing (it said so on stderr), or None.
        return {Messages.SAMPLES: n, "failure": failure}


# The fields of a SystemMemory that depend on the memory cgroup of the process asked about.
_CGROUP_FIELDS = ("total", "available", "available_percent")


def read_system_for(pid: int, starter: int | None) -> SystemMemory:
    """``read_system(pid)``; when that cannot say what ``pid`` may use (on cgroup v1 a process
    that is exiting shows no cgroup, so ``total`` and ``available`` are unknown), the values
    of ``starter``'s cgroup instead: the meter, which started ``pid`` (a metered command
    begins in its cgroup). Their ``sources`` then name ``starter`` and why.

    ``stageload meter -- true`` hit this at every start: the command was already exiting
    when the start record was written, and ``total`` stayed null.
    """
    system = read_system(pid)
    if starter is None or starter == pid or system.total is not None:
        return system
    other = read_system(starter)
    if other.total is None:
        return system
    why = system.errors.get("total", "unreadable")
    sources = dict(other.sources)
    for name in _CGROUP_FIELDS:
        if name in sources:
            sources[name] += f" for the meter's process {starter}, not process {pid} ({why})"
    return dataclasses.replace(other, sources=sources)


class Sampler:
    """Writes one sample of ``pid``'s memory (its tree with ``tree``) to ``writer`` per call.

    ``starter`` is the process that started ``pid`` (the meter): while ``pid`` exits, its
    cgroup's total and available memory stand in (``read_system_for``).
    """

    def __init__(
        self,
        writer: TraceWriter,
        pid: int,
        *,
        tree: bool = True,
        device: bool = False,
        starter: int | None = None,
    ) -> None:
        self.writer = writer
        self.pid = pid
        self.tree = tree
        self.device = device  # read device memory here (only in the process that uses torch)
        self.starter = starter

    def sample(self, extra: Mapping[str, Any] | None = None) -> bool:
        """Take and write one sample; ``extra`` adds keys (device memory read elsewhere).

        Returns False, writing nothing, when the measured process is gone: a command that
        just exited is not a read error. A live process whose footprint cannot be read
        (permissions, an old kernel) gets a sample with ``footprint`` null and an error record.
        """
        t = self.writer.t()
        try:
            process = read_process(self.pid, tree=self.tree)
            if process.pids == 0 and not pid_alive(self.pid):
                return False
            readings: list[Any] = [process, read_system_for(self.pid, self.starter)]
            if self.device:
                readings.append(read_device())
        except Exception as exc:  # a reader bug must not end the metering: record it once
            self.writer.error("sample", f"reading memory failed: {exc!r}", t=t)
            return False
        self.writer.recovered("sample", t=t)
        values = to_sample(*readings)
        if extra:
            values.update(extra)
        self.writer.track_errors(values, sample_errors(*readings), t=t)
        self.writer.sample(values, t=t)
        return True


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts), whoever owns it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class Channel:
    """MemoryMeter's end of the pipes to the sampler process: JSON lines, read with a deadline."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self._in = proc.stdin
        self._out = proc.stdout.fileno()
        self._buffer = b""

    def send(self, message: Mapping[str, Any]) -> None:
        self._in.write((json.dumps(message) + "\n").encode())
        self._in.flush()

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next message, or None on timeout or when the sampler closed its stdout."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                return None
            data = os.read(self._out, 1 << 16)
            if not data:
                return None
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


def _say(message: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class _Control:
    """Reads the parent's JSON lines from stdin without blocking past a deadline."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.eof = False

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Messages that arrive within ``timeout`` seconds (returns early when one does)."""
        readable, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not readable:
            return []
        data = os.read(self.fd, 1 << 16)
        if not data:
            self.eof = True
            return []
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


def _detach() -> None:
    """Leave the metered process's tree and session.

    The parent measures its own process tree, so the sampler must not be in it: fork once
    more and let the intermediate exit (the parent reaps it), which re-parents the sampler
    to init. A new session keeps a terminal's Ctrl-C (sent to the foreground process group)
    from killing the sampler before the parent has written its end record.
    """
    if os.fork() != 0:
        os._exit(0)
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run(args: argparse.Namespace) -> int:
    """The sampler process's main loop; see the module docstring for the protocol."""
    control = _Control(sys.stdin.fileno())
    _say(Messages.hello(os.getpid()))
    # Wait for "go": the parent writes the start record first, so it stays the first line.
    while True:
        messages = control.wait(60.0)
        if control.eof or not messages and not pid_alive(args.watch):
            return 0
        go = [m for m in messages if Messages.GO in m]
        if go:
            break
    writer = TraceWriter(args.path, append=True, monotonic0=float(go[0][Messages.GO]))
    if go[0].get("failed"):  # the trace cannot be written; the parent said so already
        writer.failure = "the meter could not write the trace"
    # The parent (--watch) started the measured process, or is it: its cgroup stands in.
    sampler = Sampler(writer, int(go[0]["pid"]), tree=args.tree, starter=args.watch)
    device: dict[str, Any] = {}
    next_tick = time.monotonic()
    first = True
    while True:
        sampler.sample(device)
        if first:
            _say(Messages.ready())
            first = False
        next_tick += args.interval
        now = time.monotonic()
        if next_tick <= now:  # fell behind (machine busy): skip the missed ticks
            next_tick = now + args.interval
        # Read the parent's messages at least once per tick, even when sampling takes longer
        # than the interval: otherwise a "stop" waits unread until the parent gives up.
        while True:
            for message in control.wait(next_tick - time.monotonic()):
                if Messages.DEVICE in message:
                    device = Messages.device(message[Messages.DEVICE])[Messages.DEVICE]
                if message.get(Messages.STOP):
                    if message.get("final"):
                        sampler.sample(device)
                    writer.close()
                    _say(Messages.samples(writer.samples, writer.failure))
                    return 0
            if control.eof:  # the parent is gone (or closed the pipe): stop writing now
                return 0
            if time.monotonic() >= next_tick:
                break
        if not pid_alive(args.watch):
            return 0


def _interval_flag(text: str) -> float:
    try:
        return check_interval(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stageload.meter",
        description="MemoryMeter's sampler process; started by MemoryMeter, not by hand.",
    )
    parser.add_argument("--path", required=True, help="trace file to append samples to")
    parser.add_argument("--watch", type=int, required=True, help="stop when this pid is gone")
    parser.add_argument(
        "--interval", type=_interval_flag, required=True, help="seconds between samples"
    )
    parser.add_argument(
        "--no-tree", dest="tree", action="store_false", help="measure the process, not its tree"
    )
    parser.add_argument("--no-detach", dest="detach", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.detach:
        _detach()
    try:
        return run(args)
    except BrokenPipeError:  # the parent is gone while we spoke to it
        return 0


if __name__ == "__main__":
    sys.exit(main())
