"""The result types every memory backend returns, one per kind of reading."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class ProcessMemory:
    """The memory a process (or its tree) really holds.

    ``footprint`` is bytes, or None when it could not be read (reason in ``errors``).
    ``pids`` is how many processes were summed (0 when the process was gone).
    """

    footprint: int | None
    pids: int
    sources: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SystemMemory:
    """What the machine (or this process's memory cgroup) still has room for.

    Sizes are bytes, ``available_percent`` is 0-100 of ``total``, ``pressure`` is Linux PSI
    ``some avg10`` in percent. A value that could not be read is None with a reason in
    ``errors``; one this platform does not have (pressure on macOS) is None and in neither
    ``sources`` nor ``errors``.
    """

    total: int | None
    available: int | None
    available_percent: float | None
    swap_used: int | None
    swap_total: int | None
    pressure: float | None
    sources: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceMemory:
    """Accelerator memory held by torch in this process, in bytes.

    A backend that is not in use leaves its fields None and out of ``sources`` and
    ``errors``; one in use but unreadable is None with a reason in ``errors``.
    """

    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    mps_current: int | None = None
    mps_driver: int | None = None
    sources: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


#: The device memory keys of a trace sample: DeviceMemory's fields, named the same.
DEVICE_KEYS: tuple[str, ...] = tuple(
    f.name for f in fields(DeviceMemory) if f.name not in ("sources", "errors")
)
