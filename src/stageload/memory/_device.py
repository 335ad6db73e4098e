"""Accelerator memory held by torch in this process (CUDA, MPS).

This module never imports torch and never initialises a backend: it reads only when the
program has already imported torch, and CUDA only once CUDA is initialised, so a meter in
a CPU-only run (or a separate sampler process) costs nothing and changes nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from ._types import DeviceMemory


def _cuda(torch: Any, values: dict[str, int | None], sources: dict, errors: dict) -> None:
    cuda = getattr(torch, "cuda", None)
    # is_initialized() is False until something touched CUDA; reading before that would
    # initialise it (and create a context) on the program's behalf.
    if cuda is None or not cuda.is_initialized():
        return
    for name, func in (
        ("cuda_allocated", "memory_allocated"),
        ("cuda_reserved", "memory_reserved"),
    ):
        try:
            # Summed over devices: the allocator's per-device counters need no context.
            values[name] = sum(getattr(cuda, func)(i) for i in range(cuda.device_count()))
            sources[name] = f"torch.cuda.{func}() summed over devices"
        except Exception as exc:  # any failure of a foreign backend is a reading error
            errors[name] = f"torch.cuda.{func}() failed: {exc!r}"


def _mps(torch: Any, values: dict[str, int | None], sources: dict, errors: dict) -> None:
    if sys.platform != "darwin":
        return
    mps_backend = getattr(getattr(torch, "backends", None), "mps", None)
    mps = getattr(torch, "mps", None)
    # MPS has no is_initialized(); is_available() already creates the Metal device, so
    # reading the allocator's counters after it adds nothing the program would not do.
    try:
        if mps is None or mps_backend is None or not mps_backend.is_available():
            return
    except Exception:
        return
    for name, func in (
        ("mps_current", "current_allocated_memory"),
        ("mps_driver", "driver_allocated_memory"),
    ):
        try:
            values[name] = int(getattr(mps, func)())
            sources[name] = f"torch.mps.{func}()"
        except Exception as exc:
            errors[name] = f"torch.mps.{func}() failed: {exc!r}"


def read_device() -> DeviceMemory:
    """CUDA and MPS memory of this process; fields of backends not in use stay None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return DeviceMemory()
    values: dict[str, int | None] = {}
    sources: dict[str, str] = {}
    errors: dict[str, str] = {}
    _cuda(torch, values, sources, errors)
    _mps(torch, values, sources, errors)
    return DeviceMemory(**values, sources=sources, errors=errors)
