"""What the kernel charged to a memory cgroup (v1 or v2), read from its counter files.

Kept apart from ``cgroup`` so that the reading stands on its own; ``stageload.testing.cgroup``
re-exports ``CgroupUsage`` and ``read_usage``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CgroupUsage:
    """What the kernel charged to a cgroup. A counter this kernel lacks is None, never 0."""

    version: str  # "cgroup1" or "cgroup2"
    limit: int
    usage: int | None  # bytes charged now (anonymous memory and page cache)
    peak: int | None  # the most ever charged at once
    failcnt: int | None  # times a charge hit the limit (v2: memory.events "max")
    oom_kills: int | None  # processes the OOM killer killed in this cgroup
    sources: dict[str, str] = field(default_factory=dict)


def _read(path: Path) -> str:
    return path.read_text(encoding="ascii", errors="replace")


def _keyed(text: str) -> dict[str, int]:
    """``name value`` lines (memory.events, memory.oom_control) as a dict."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


def read_usage(path: str | os.PathLike[str], version: str, limit: int) -> CgroupUsage:
    """Counters of the cgroup at ``path``; a file this kernel lacks leaves its value None."""
    path = Path(path)
    values: dict[str, int | None] = {}
    sources: dict[str, str] = {}

    def take(key: str, name: str, pick: str | None = None) -> None:
        try:
            text = _read(path / name)
        except FileNotFoundError:
            values.setdefault(key, None)
            return
        value = _keyed(text).get(pick) if pick else int(text.strip())
        if value is not None:
            values[key] = values.get(key, 0) + value if key == "failcnt" else value
            where = f"{name}:{pick}" if pick else name
            sources[key] = f"{sources[key]}+{where}" if key in sources else where
        else:
            values.setdefault(key, None)

    if version == "cgroup1":
        take("usage", "memory.usage_in_bytes")
        take("peak", "memory.max_usage_in_bytes")
        take("failcnt", "memory.failcnt")
        take("failcnt", "memory.memsw.failcnt")
        take("oom_kills", "memory.oom_control", "oom_kill")  # Linux >= 4.13
    else:
        take("usage", "memory.current")
        take("peak", "memory.peak")  # Linux >= 5.19
        take("failcnt", "memory.events", "max")
        take("oom_kills", "memory.events", "oom_kill")
    return CgroupUsage(version, limit, **values, sources=sources)  # type: ignore[arg-type]
