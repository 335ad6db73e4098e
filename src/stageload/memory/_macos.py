"""macOS memory readers: phys_footprint and kern.memorystatus_level, which psutil lacks.

Footprint is ``phys_footprint`` from ``proc_pid_rusage``, the Memory column of Activity
Monitor: it counts compressed and swapped-out pages and leaves out clean file pages.
Available memory is ``kern.memorystatus_level``, the percentage of memory the kernel's
memorystatus considers free. Total and swap come from psutil (hw.memsize, vm.swapusage).
ctypes libraries load on first use, so importing this module is safe on any OS; the byte
parsers are pure functions, tested everywhere on fixed inputs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from typing import Any

import psutil

from ._types import ProcessMemory, SystemMemory

# <sys/resource.h>: RUSAGE_INFO_V2 = 2. struct rusage_info_v2 is a 16-byte uuid followed by
# 18 uint64 fields; phys_footprint is the 8th of them.
RUSAGE_INFO_V2 = 2
RUSAGE_INFO_V2_SIZE = 16 + 18 * 8
_PHYS_FOOTPRINT_OFFSET = 16 + 7 * 8


def parse_rusage_v2(buf: bytes) -> int:
    """``phys_footprint`` from the bytes of a ``struct rusage_info_v2`` (little-endian)."""
    if len(buf) < RUSAGE_INFO_V2_SIZE:
        raise ValueError(f"rusage_info_v2 needs {RUSAGE_INFO_V2_SIZE} bytes, got {len(buf)}")
    return struct.unpack_from("<Q", buf, _PHYS_FOOTPRINT_OFFSET)[0]


def parse_memorystatus_level(buf: bytes) -> int:
    """The percentage in ``kern.memorystatus_level`` (a C int, 0-100)."""
    if len(buf) != 4:
        raise ValueError(f"kern.memorystatus_level should be a 4-byte int, got {len(buf)} bytes")
    level = struct.unpack("<i", buf)[0]
    if not 0 <= level <= 100:
        raise ValueError(f"kern.memorystatus_level {level!r} is not a percentage")
    return level


@functools.cache
def _libc() -> Any:
    lib = ctypes.CDLL("/usr/lib/libSystem.B.dylib", use_errno=True)
    lib.sysctlbyname.argtypes = [
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_void_p,
        ctypes.c_size_t,
    ]
    lib.proc_pid_rusage.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return lib


def sysctl_bytes(name: str, size: int) -> bytes:
    """The raw value of sysctl ``name`` (at most ``size`` bytes)."""
    buf = ctypes.create_string_buffer(size)
    length = ctypes.c_size_t(size)
    if _libc().sysctlbyname(name.encode(), buf, ctypes.byref(length), None, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sysctlbyname({name!r}): {os.strerror(err)}")
    return buf.raw[: length.value]


def phys_footprint(pid: int) -> int:
    """``phys_footprint`` of one process via ``proc_pid_rusage``."""
    buf = ctypes.create_string_buffer(RUSAGE_INFO_V2_SIZE)
    if _libc().proc_pid_rusage(pid, RUSAGE_INFO_V2, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"proc_pid_rusage({pid}): {os.strerror(err)}")
    return parse_rusage_v2(buf.raw)


def read_process(pid: int | None = None, *, tree: bool = False) -> ProcessMemory:
    """phys_footprint of ``pid`` (default: this process), summed over descendants if ``tree``."""
    pid = os.getpid() if pid is None else pid
    source = "proc_pid_rusage:phys_footprint"
    sources = {"footprint": source + (" summed over the process tree" if tree else "")}
    try:
        total = phys_footprint(pid)
    except OSError as exc:
        return ProcessMemory(None, 0, sources, {"footprint": str(exc)})
    count = 1
    if tree:
        try:
            children = [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            children = []
        for child in children:
            try:
                total += phys_footprint(child)
            except ProcessLookupError:
                continue  # exited since it was listed
            except OSError as exc:  # EPERM: another user's process
                return ProcessMemory(None, count, sources, {"footprint": str(exc)})
            count += 1
    return ProcessMemory(total, count, sources, {})


def read_system(pid: int | None = None) -> SystemMemory:
    """Total (hw.memsize), available (kern.memorystatus_level) and swap (vm.swapusage)."""
    sources: dict[str, str] = {}
    errors: dict[str, str] = {}
    total = available = swap_used = swap_total = None
    available_percent: float | None = None
    try:
        total = psutil.virtual_memory().total
        sources["total"] = "psutil.virtual_memory().total (sysctl hw.memsize)"
    except Exception as exc:
        errors["total"] = f"psutil.virtual_memory() failed: {exc!r}"
    try:
        available_percent = float(
            parse_memorystatus_level(sysctl_bytes("kern.memorystatus_level", 4))
        )
        sources["available_percent"] = "sysctl kern.memorystatus_level"
    except (OSError, ValueError) as exc:
        errors["available_percent"] = str(exc)
    if total is not None and available_percent is not None:
        available = int(total * available_percent / 100)
        sources["available"] = "hw.memsize*kern.memorystatus_level/100"
    else:
        errors["available"] = "needs hw.memsize and kern.memorystatus_level"
    try:
        swap = psutil.swap_memory()
        swap_used, swap_total = swap.used, swap.total
        sources["swap_used"] = "psutil.swap_memory().used (sysctl vm.swapusage)"
        sources["swap_total"] = "psutil.swap_memory().total (sysctl vm.swapusage)"
    except Exception as exc:
        errors["swap_used"] = errors["swap_total"] = f"psutil.swap_memory() failed: {exc!r}"
    # macOS has no PSI; pressure stays None and is in neither sources nor errors.
    return SystemMemory(
        total, available, available_percent, swap_used, swap_total, None, sources, errors
    )
