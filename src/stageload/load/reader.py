"""Positioned reads into tensor memory, and the threads that run them.

Nothing here knows about modules: ``weights`` plans a load and hands the chunks here.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..hooks.release import return_memory_to_os
from .checkpoint import CheckpointError

if TYPE_CHECKING:
    import torch

_thread = threading.local()  # .background: set by background_thread()


def background_thread() -> None:
    """Mark this thread as one that only loads ahead (:func:`in_background`): its loads
    fill plain pages, not huge ones, whose faults may stop to compact memory (see
    ``weights._destination``). The initializer of the prefetch and stream threads.

    It no longer lowers the thread's CPU priority: at nice +10 a cold load beside 0.26 s
    of compute took 0.015 s of it against 0.010 s at nice 0 (bench/results/residency/
    contention-1t.md; 0.081 against 0.077 s in contention-first-run.md), no gain, so the
    priority went (issue 37: tuning stays only where a bench shows >= 10 %).
    """
    _thread.background = True


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
                # Through an alias with a version counter of its own: a read leaves each
                # tensor it fills at version 0 (auto tells the script's writes by it).
                alias = unversioned(dst)
                alias.view(-1)[first : first + n // size].copy_(buf[:n].view(src))
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


def unversioned(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory, of its shape, with a version counter of its own: writing
    through it leaves ``t``'s counter as it was (``t.view`` or ``t.detach()`` share it)."""
    import torch

    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _bounce_buffer(pin: bool, nbytes: int) -> torch.Tensor:
    import torch

    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinning on this backend: pageable memory still works
            pass
    return torch.empty(nbytes, dtype=torch.uint8)
