"""Readers for platforms stageload has no backend for: every value missing, with the reason."""

from __future__ import annotations

import sys

from ._types import ProcessMemory, SystemMemory

_REASON = f"no stageload memory reader for platform {sys.platform!r} (Linux and macOS only)"
_SYSTEM_FIELDS = ("total", "available", "available_percent", "swap_used", "swap_total")


def read_process(pid: int | None = None, *, tree: bool = False) -> ProcessMemory:
    """Always unreadable here."""
    return ProcessMemory(None, 0, {}, {"footprint": _REASON})


def read_system(pid: int | None = None) -> SystemMemory:
    """Always unreadable here."""
    return SystemMemory(
        None, None, None, None, None, None, {}, dict.fromkeys(_SYSTEM_FIELDS, _REASON)
    )
