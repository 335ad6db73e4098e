"""Positioned reads into tensor memory, and the threads that run them.

Nothing here knows about modules: ``weights`` plans a load and hands the chunks here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..hooks.release import return_memory_to_os
from .checkpoint import CheckpointError

if TYPE_CHECKING:
    import torch

# Cold reads: three ways to help the disk were measured against the reader as it was (cold,
# each beside a raw read, medians of 7 pairs, bench/results/load/cold-*.md); none beat it
# on this VM, so the defaults keep it, and the knobs stay for a machine where they might.
#: How the chunks are shared among the threads. ``"interleaved"`` (kept): threads take the
#: next 16 MiB chunk in file order from one queue and one descriptor, so the disk sees a few
#: large requests in order. ``"ranges"``: each thread reads its own contiguous range through
#: its own descriptor (readahead state is per open file): 0.17-0.36x raw here against
#: 0.56-0.69x, several streams at once are slower on this virtual disk.
LAYOUT = "interleaved"
#: ``posix_fadvise(POSIX_FADV_SEQUENTIAL)`` on every descriptor read (a larger readahead
#: window). Off: with interleaved chunks it cut cold loads to 0.16x raw here.
SEQUENTIAL = False
#: Before reading a chunk at ``offset``, ``posix_fadvise(WILLNEED)`` the chunk ``AHEAD``
#: bytes further on (0: off), so the disk has the next reads queued while the threads
#: fault and copy. Off: 64 and 128 MiB ahead read at 0.50 and 0.45 GB/s against 0.50.
AHEAD = 0


#: How much nicer than the computing threads a background load's threads run (Linux).
#: ``bench/residency.py contention`` (a cold 128 MiB load with 4 readers beside 0.3 s of
#: compute on one torch thread, 2 cores, medians of 7 pairs): at nice 0 it took 0.028-0.046 s
#: from the compute, at +10 0.007-0.025 s (two runs each; a first run, 0.077 and 0.081 s;
#: a later one, variants interleaved, 0.010 and 0.015 s: not resolved there).
#: Fewer readers took less still, but one read at a third of the speed when nothing computed
#: beside it, and in the cost bench's stages prefetches with 1 or 2 readers took 0.35-0.99 s
#: against 0.11-0.12 s with 4: the readers stay as many as on demand.
BACKGROUND_NICE = 10

_thread = threading.local()  # .background: set by background_thread()


def background_thread() -> None:
    """Make this thread one that only loads ahead: lower its CPU priority by
    :data:`BACKGROUND_NICE` (Linux; elsewhere unchanged), so a load beside a computing stage
    leaves it the cores, and mark it (:func:`in_background`): its loads fill plain pages,
    not huge ones, whose faults may stop to compact memory (see ``weights._destination``).

    The initializer of the prefetch and stream threads. The readers it starts inherit the
    priority (Linux threads take their creator's nice value). An unprivileged thread
    cannot raise its priority back, so only threads that do nothing else call this. macOS
    threads keep their priority: thread QoS is not reachable from Python's ``os``.
    """
    _thread.background = True
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # a seccomp profile may forbid it: load at par
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + BACKGROUND_NICE))


def in_background() -> bool:
    """Whether this thread only loads ahead (:func:`background_thread` ran on it)."""
    return getattr(_thread, "background", False)


def memory(t: torch.Tensor, at: int, n: int) -> memoryview:
    """A writable view of ``n`` bytes of ``t``'s CPU memory from byte ``at``."""
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr() + at)).cast("B")


def pread_into(fd: int, path: Path, offset: int, buf: memoryview) -> None:
    done, n = 0, len(buf)
    while done < n:
        got = _preadv(fd, buf[done:], offset + done)
        if got == 0:
            raise CheckpointError(
                path, f"truncated: the file ended at byte {offset + done}, {n - done} bytes short"
            )
        done += got


def _preadv(fd: int, buf: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buf], offset)  # releases the GIL
    data = os.pread(fd, len(buf), offset)  # Windows: one copy more, still positioned
    buf[: len(data)] = data
    return len(data)


def run_chunks(
    jobs: list[Any],
    device: torch.device,
    threads: int,
    bounce_bytes: int,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Run every chunk job; stop early on the first error and raise it (with the others).

    ``on_bytes(n)`` is called after each chunk of ``n`` bytes is in place, from the
    thread that read it (a progress bar).
    """

    local = threading.local()
    stop = threading.Event()
    pin = device.type in ("cuda", "mps")

    def bounce() -> torch.Tensor:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = _bounce_buffer(pin, bounce_bytes)
            local.buf = buf
        return buf

    def job(fd: int, path: Path, offset: int, n: int, dst: torch.Tensor, at: int, src: Any) -> None:
        if stop.is_set():
            return
        if AHEAD and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # advice only
                os.posix_fadvise(fd, offset + AHEAD, n, os.POSIX_FADV_WILLNEED)
        try:
            if src is None:  # same dtype, on the CPU: straight into the destination
                pread_into(fd, path, offset, memory(dst, at, n))
            else:
                buf = bounce()
                pread_into(fd, path, offset, memory(buf, 0, n))
                size = src.itemsize
                first = at // size
                dst.view(-1)[first : first + n // size].copy_(buf[:n].view(src))
            if on_bytes is not None:
                on_bytes(n)
        except BaseException:
            stop.set()
            raise

    def run_range(part: list[Any]) -> None:
        # An own descriptor per thread and file: readahead state lives in the open file.
        fds: dict[Path, int] = {}
        try:
            for _, path, *rest in part:
                if path not in fds:
                    fds[path] = _open_sequential(path)
                job(fds[path], path, *rest)
        finally:
            for fd in fds.values():
                os.close(fd)

    if SEQUENTIAL and LAYOUT != "ranges" and hasattr(os, "posix_fadvise"):
        for fd in {j[0] for j in jobs}:
            with contextlib.suppress(OSError):  # advice only
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    if threads == 1:
        if LAYOUT == "ranges":
            run_range(jobs)
        else:
            for j in jobs:
                job(*j)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="stageload-load") as pool:
        if LAYOUT == "ranges":
            futures = [pool.submit(run_range, part) for part in split_ranges(jobs, threads)]
        else:
            futures = [pool.submit(job, *j) for j in jobs]
        errors = [f.exception() for f in futures]
    if any(j[6] is not None for j in jobs):
        # The threads' bounce buffers sit in glibc's per-thread arenas: give them back now.
        return_memory_to_os(collect=False)
    raised = [e for e in errors if e is not None]
    if raised:
        raise raised[0]


def split_ranges(jobs: list[Any], parts: int) -> list[list[Any]]:
    """``jobs`` (in file order) cut into at most ``parts`` contiguous runs of about equal
    bytes (a job's byte count is its fourth field)."""
    total = sum(j[3] for j in jobs)
    out: list[list[Any]] = [[] for _ in range(parts)]
    done = 0
    for j in jobs:
        # The part this job's first byte falls in: the runs stay contiguous and balanced.
        out[min(parts - 1, done * parts // max(1, total))].append(j)
        done += j[3]
    return [p for p in out if p]


def _open_sequential(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    if SEQUENTIAL and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):  # advice only
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd


def _bounce_buffer(pin: bool, nbytes: int) -> torch.Tensor:
    import torch

    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinning on this backend: pageable memory still works
            pass
    return torch.empty(nbytes, dtype=torch.uint8)
