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

    if threads == 1:
        for j in jobs:
            job(*j)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="stageload-load") as pool:
        futures = [pool.submit(job, *j) for j in jobs]
        errors = [f.exception() for f in futures]
    if any(j[6] is not None for j in jobs):
        # The threads' bounce buffers sit in glibc's per-thread arenas: give them back now.
        return_memory_to_os(collect=False)
    raised = [e for e in errors if e is not None]
    if raised:
        raise raised[0]


def _bounce_buffer(pin: bool, nbytes: int) -> torch.Tensor:
    import torch

    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinning on this backend: pageable memory still works
            pass
    return torch.empty(nbytes, dtype=torch.uint8)
