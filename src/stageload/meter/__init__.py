"""MemoryMeter: record a process tree's memory, the pipeline's events and marks in a JSONL trace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.events import Event
from ..memory import (
    read_device,
    read_process,
    sample_errors,
    sample_sources,
    to_sample,
)
from ..traceformat import SAMPLE, line_prefix
from ..units import parse_duration
from .sampler import Channel, Messages, Sampler, check_interval, pid_alive, read_system_for
from .tracefile import TraceWriter

#: The ways to take samples: a separate sampler process (default) or a thread in this one.
SAMPLERS = ("process", "thread")

# A sampler process starts in ~0.1 s; allow for a machine that is swapping hard.
_START_TIMEOUT = 20.0
_STOP_TIMEOUT = 10.0


def _interval(value: float | str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_interval(float(value))  # the interval's own range, before parse limits
    return check_interval(parse_duration(value))


def _package_root() -> str:
    # The folder that holds the stageload package, so the sampler imports this same copy
    # (a source checkout on PYTHONPATH or an installed one alike).
    return str(Path(__file__).resolve().parents[2])


class MemoryMeter:
    """Writes a memory trace (``docs/trace-format.md``) while it runs; also an event sink.

    Samples the footprint of ``pid`` (default: this process), summed over its process tree
    unless ``tree=False``, with available memory, swap and pressure, every ``interval``
    seconds (from ``sampler.MIN_INTERVAL``, 10 ms, to ``sampler.MAX_INTERVAL``, 1 hour).
    ``sampler="process"`` (the default) samples from a separate process, which keeps
    sampling while native code holds the GIL; ``"thread"`` samples from a thread in this
    process. Device memory (CUDA, MPS) can only be read here, so when ``pid`` is this
    process the meter adds it to the samples either way. Pass the meter to
    ``StagedModels(events=...)`` to record loads, releases and stages; ``mark(label)``
    records a point of your own. ``meta`` goes into the start record.

    Example::

        with MemoryMeter("staged.jsonl", meta={"label": "staged"}) as meter:
            models = StagedModels(loaders, stages=plan, events=meter)
            run_pipeline(models)
            meter.mark("done")

    Events emitted before ``start()`` or after ``stop()`` are dropped, so a StagedModels
    may outlive its meter.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        interval: float | str = 0.5,
        *,
        pid: int | None = None,
        tree: bool = True,
        sampler: str = "process",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be 'process' or 'thread', got {sampler!r}")
        if pid is not None and (not isinstance(pid, int) or pid <= 0):
            raise ValueError(f"pid must be a positive process id, got {pid!r}")
        self.path = Path(path)
        self.interval = _interval(interval)
        self.pid = os.getpid() if pid is None else pid
        self.tree = bool(tree)
        self.requested_sampler = sampler
        #: The sampler really used: "thread" when the sampler process could not start.
        self.sampler = sampler
        self.meta = dict(meta or {})
        #: The start and end records as written (None until then).
        self.start_record: dict[str, Any] | None = None
        self.end_record: dict[str, Any] | None = None
        self._writer: TraceWriter | None = None
        self._channel: Channel | None = None
        self._sampler_pid: int | None = None
        self._sampler_created: float | None = None  # its create time, against pid reuse
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._device = False
        self._prepared = False
        self._started = False
        self._why_not: str | None = None
        self._failure: str | None = None

    # -- public ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._started and self._writer is not None and not self._writer.closed

    @property
    def failure(self) -> str | None:
        """Why the trace stopped being written (a full disk...), or None: the run went on,
        the trace has only what was written until then."""
        if self._failure is not None:
            return self._failure
        return None if self._writer is None else self._writer.failure

    @failure.setter
    def failure(self, value: str | None) -> None:
        self._failure = value

    @property
    def samples(self) -> int | None:
        """Samples written, once stopped (None if the sampler process could not tell)."""
        return None if self.end_record is None else self.end_record.get("samples")

    def prepare(self) -> None:
        """Open the trace and start the sampler process now (it takes ~0.1 s), ahead of
        ``start()``.

        ``stageload meter`` calls this before it starts the command, then sets ``pid`` to
        the command's and calls ``start()``, so the first sample follows within
        milliseconds. ``start()`` calls it if needed. Opening takes the trace's lock
        (``TraceBusyError`` when another run writes it) and leaves an existing file as it
        is until ``start()``; ``cancel()`` lets go of both.
        """
        if self._prepared:
            return
        # The trace first: a path another run writes fails before a sampler is spawned.
        self._writer = TraceWriter(self.path)
        self._prepared = True
        if self.sampler == "process":
            self._why_not = self._spawn()
            if self._why_not is not None:
                self.sampler = "thread"

    def cancel(self) -> None:
        """Let go of the trace and the sampler process that ``prepare()`` opened and started,
        when ``start()`` won't come: a file that was at the path stays as it was."""
        if self._started:
            return
        if self._channel is not None:
            self._channel.close()  # end of file on its stdin: the sampler exits
            self._channel = None
        if self._writer is not None:
            self._writer.discard()
            self._writer = None
        self._prepared = False

    def start(self, **extra: Any) -> MemoryMeter:
        """Write the start record and begin sampling; returns the meter.

        ``extra`` adds keys to the start record, e.g. ``command=[...]`` for a metered command.
        """
        if self._started:
            raise RuntimeError(f"{self!r} was already started; use a new MemoryMeter per trace")
        if not pid_alive(self.pid):
            self.cancel()
            raise ValueError(f"no process with pid {self.pid!r} to measure")
        self.prepare()
        writer = self._writer
        if writer is None:  # cannot be: prepare() opened it or raised
            raise RuntimeError(f"{self!r} has no trace open")
        # From here the file is this run's: empty it now (the command's processes read the
        # start record from its first line), and count t from now.
        writer.claim()
        writer.monotonic0 = time.monotonic()
        self._started = True
        why_not = self._why_not
        self._device = self.pid == os.getpid()  # device memory is readable only for ourselves
        readings: list[Any] = [
            read_process(self.pid, tree=self.tree),
            read_system_for(self.pid, os.getpid()),
        ]
        if self._device:
            readings.append(read_device())
        system = readings[1]
        sources = sample_sources(*readings)
        if "total" in system.sources:  # where the start record's total comes from, too
            sources["total"] = system.sources["total"]
        self.start_record = writer.start(
            pid=self.pid,
            interval=self.interval,
            sampler=self.sampler,
            total=system.total,
            sources=sources,
            meta=self.meta,
            tree=self.tree,
            **({"sampler_pid": self._sampler_pid} if self.sampler == "process" else {}),
            **extra,
        )
        if why_not is not None:
            writer.error("sampler", f"sampling from a thread: {why_not}")
            warnings.warn(
                f"MemoryMeter: {why_not}; sampling from a thread, which misses peaks "
                "inside long native calls",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._channel is not None:
            self._relay_device()
            failed = writer.failure is not None
            self._channel.send(Messages.go(writer.monotonic0, self.pid, failed=failed))
            reply = self._channel.receive(_START_TIMEOUT)
            if reply is None or Messages.READY not in reply:
                # Started, then failed before its first sample: measure from here instead.
                self._kill_sampler()
                self.sampler = "thread"
                writer.error("sampler", "the sampler process stopped before its first sample")
        if self.sampler == "thread":
            sampler = Sampler(
                writer, self.pid, tree=self.tree, device=self._device, starter=os.getpid()
            )
            sampler.sample()
            target: Any = self._sample_loop
            args: tuple[Any, ...] = (sampler,)
        else:
            target, args = self._relay_loop, ()
        if self.sampler == "thread" or self._device:
            self._thread = threading.Thread(
                target=target, args=args, name="stageload-meter", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, **end: Any) -> None:
        """Stop sampling and write the end record; ``end`` adds keys to it (``exit_code``).

        Safe to call twice; the second call does nothing.
        """
        if not self._started:
            self.cancel()  # prepared, never started: nothing to end
            return
        writer = self._writer
        if writer is None or writer.closed:
            return
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        samples: int | None
        if self.sampler == "thread":
            Sampler(
                writer, self.pid, tree=self.tree, device=self._device, starter=os.getpid()
            ).sample()
            samples = writer.samples
        else:
            samples = self._stop_sampler()
        self.end_record = writer.end(samples=samples, **end)
        writer.close()

    def emit(self, event: Event) -> None:
        """EventSink: write ``event`` as an ``event`` record at the event's own time."""
        writer = self._writer
        if writer is None or not self._started:
            return
        # ValueError: closed, because the meter stopped while the pipeline went on.
        with contextlib.suppress(ValueError):
            writer.event(event)

    def mark(self, label: str) -> None:
        """Record a point in time of your own, e.g. ``meter.mark("first image")``."""
        if not self.running:
            raise RuntimeError(
                f"{self!r} is not running; call mark() inside 'with MemoryMeter(...)'"
            )
        assert self._writer is not None
        self._writer.mark(label)

    def __enter__(self) -> MemoryMeter:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any):
        extra = {} if exc_type is None else {"exception": f"{exc_type.__name__}: {exc}"}
        self.stop(**extra)

    def __repr__(self) -> str:
        return (
            f"MemoryMeter({str(self.path)!r}, interval={self.interval}, pid={self.pid}, "
            f"sampler={self.sampler!r})"
        )

    # -- the sampler process -----------------------------------------------------------

    def _spawn(self) -> str | None:
        """Start the sampler process; returns why it could not start, or None."""
        # A fresh interpreter via subprocess, not multiprocessing: a spawned multiprocessing
        # child re-imports the user's __main__ module (torch and all).
        cmd = [
            sys.executable,
            "-m",
            "stageload.meter",
            "--path",
            os.path.abspath(self.path),
            "--watch",
            str(os.getpid()),
            "--interval",
            repr(self.interval),
        ]
        if not self.tree:
            cmd.append("--no-tree")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH")]))
        if not sys.executable:
            return "no Python executable to start a sampler process with (sys.executable)"
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        except OSError as exc:
            return f"cannot start a sampler process: {exc}"
        channel = Channel(proc)
        hello = channel.receive(_START_TIMEOUT)
        try:
            # The started process forks the real sampler off and exits (see _detach).
            code = proc.wait(timeout=_START_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        if hello is None or Messages.HELLO not in hello:
            proc.kill()
            proc.wait()
            channel.close()
            return f"the sampler process did not start (exit code {code})"
        self._channel = channel
        self._sampler_pid = int(hello[Messages.HELLO])
        self._sampler_created = _create_time(self._sampler_pid)
        return None

    def _relay_device(self) -> bool:
        """Send this process's device memory to the sampler; False if it is gone."""
        if "torch" not in sys.modules or self._channel is None or self._writer is None:
            return True  # device memory needs torch, and this never imports it
        device = read_device()
        values = to_sample(device)
        self._writer.track_errors(values, sample_errors(device))
        if not values:
            return True
        try:
            self._channel.send(Messages.device(values))
        except OSError as exc:
            self._writer.error("sampler", f"the sampler process is gone: {exc}")
            return False
        return True

    def _relay_loop(self) -> None:
        while not self._stopping.wait(self.interval):
            if not self._relay_device():
                return

    def _stop_sampler(self) -> int | None:
        channel = self._channel
        assert channel is not None and self._writer is not None
        reply = None
        try:
            channel.send(Messages.stop(final=True))  # a closing sample, as the thread takes
            reply = channel.receive(_STOP_TIMEOUT)
        except OSError:
            pass
        channel.close()
        if reply is None or Messages.SAMPLES not in reply:
            self._writer.error("sampler", "the sampler process did not report at stop")
            self._kill_sampler()
            return count_samples(self.path)
        if reply.get("failure") and self._writer.failure is None:
            # The sampler could not write the trace and said so on stderr: one line is
            # enough. The end record is still tried (the disk may have room again).
            self._writer.on_fail = _silent
            self.failure = str(reply["failure"])
        return int(reply[Messages.SAMPLES])

    def _kill_sampler(self) -> None:
        if self._channel is not None:
            self._channel.close()  # end of file on its stdin: a sampler that still reads exits
            self._channel = None
        # The sampler is detached (init reaps it), so once it is gone its pid may be reused:
        # SIGKILL only the process that was born when the sampler was.
        pid, created = self._sampler_pid, self._sampler_created
        if pid is not None and created is not None and _create_time(pid) == created:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    # -- the sampler thread ------------------------------------------------------------

    def _sample_loop(self, sampler: Sampler) -> None:
        next_tick = time.monotonic() + self.interval
        while not self._stopping.wait(max(0.0, next_tick - time.monotonic())):
            sampler.sample()
            next_tick += self.interval
            now = time.monotonic()
            if next_tick <= now:  # fell behind (the GIL was held): skip the missed ticks
                next_tick = now + self.interval


def _silent(message: str) -> None:
    """An ``on_fail`` that says nothing (someone said it already)."""


def _create_time(pid: int) -> float | None:
    """When ``pid`` was started (psutil's create time), or None if it is gone."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def count_samples(path: str | os.PathLike[str]) -> int | None:
    """The sample records in the trace at ``path`` so far (a trace is flushed line by
    line, so a meter's progress can be waited for), or None when it cannot be read."""
    prefix = line_prefix(SAMPLE)
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.startswith(prefix))
    except OSError:
        return None
