"""Memory readers: process footprint, system availability and device memory, per platform.

One private backend per OS (``_linux``, ``_macos``), chosen once below, as psutil does; all
return the dataclasses in ``_types``. A value that cannot be read is None with the reason in
``errors[field]``, never 0, and every value names its source in ``sources[field]``.

The sample helpers turn readings into the keys of a trace ``sample`` record
(docs/trace-format.md)::

    system, process, device = read_system(), read_process(tree=True), read_device()
    sample = to_sample(system, process, device)     # {"footprint": ..., "available": ...}
    start["sources"] = sample_sources(system, process, device)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from ._device import read_device
from ._types import DEVICE_KEYS, DeviceMemory, ProcessMemory, SystemMemory

if sys.platform.startswith("linux"):
    from . import _linux as _backend
elif sys.platform == "darwin":
    from . import _macos as _backend
else:
    from . import _unsupported as _backend

__all__ = [
    "DEVICE_KEYS",
    "SAMPLE_KEYS",
    "DeviceMemory",
    "ProcessMemory",
    "SystemMemory",
    "memory_cgroups",
    "read_device",
    "read_process",
    "read_system",
    "sample_errors",
    "sample_sources",
    "to_sample",
]

Reading = ProcessMemory | SystemMemory | DeviceMemory

# Trace sample key -> dataclass field. Only these fields are sampled; total and swap_total go
# in the start record, as they do not change during a run.
SAMPLE_KEYS: dict[str, str] = {
    "footprint": "footprint",
    "available": "available",
    "available_pct": "available_percent",
    "swap_used": "swap_used",
    "pressure": "pressure",
    **{key: key for key in DEVICE_KEYS},
}


def memory_cgroups(
    pid: int | None = None, cgroupfs: str = "/sys/fs/cgroup"
) -> tuple[str, list[str]]:
    """The memory cgroup version ("cgroup1" or "cgroup2") of ``pid`` (default: this process)
    and its folders under ``cgroupfs``, leaf first; ``("", [])`` where there are none (not
    Linux, or no memory hierarchy). Raises OSError when ``/proc`` cannot be read."""
    if not sys.platform.startswith("linux"):
        return "", []
    return _backend.cgroup_levels(pid, "/proc", cgroupfs)


def read_process(pid: int | None = None, *, tree: bool = False) -> ProcessMemory:
    """Footprint of ``pid`` (default: this process); with ``tree``, summed over descendants.

    Linux: RssAnon + RssShmem + VmSwap from /proc/PID/status. macOS: phys_footprint.
    """
    return _backend.read_process(pid, tree=tree)


def read_system(pid: int | None = None) -> SystemMemory:
    """Total, available and swap memory; on Linux capped by the memory cgroup of ``pid``."""
    return _backend.read_system(pid)


def _pairs(readings: tuple[Reading, ...]) -> Iterator[tuple[str, str, Reading]]:
    """(sample key, field, reading) for each field a reading provides or failed to read."""
    for reading in readings:
        for key, name in SAMPLE_KEYS.items():
            if hasattr(reading, name) and (name in reading.sources or name in reading.errors):
                yield key, name, reading


def to_sample(*readings: Reading) -> dict[str, int | float | None]:
    """The trace ``sample`` keys of ``readings``: every value this platform provides, None if
    unreadable. Values a platform or an unused backend does not have are left out."""
    return {key: getattr(reading, name) for key, name, reading in _pairs(readings)}


def sample_sources(*readings: Reading) -> dict[str, str]:
    """Where each sampled value comes from, by sample key, for the trace's ``start`` record."""
    return {
        key: reading.sources[name]
        for key, name, reading in _pairs(readings)
        if name in reading.sources
    }


def sample_errors(*readings: Reading) -> dict[str, str]:
    """Why each unreadable sampled value is missing, by sample key (for ``error`` records)."""
    return {
        key: reading.errors[name]
        for key, name, reading in _pairs(readings)
        if name in reading.errors
    }
