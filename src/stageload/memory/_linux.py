"""Linux memory readers: /proc/PID/status, /proc/meminfo, the memory cgroup and PSI.

Every reader takes the roots it reads (``procfs``, ``cgroupfs``) as parameters, so tests
can point it at a folder of recorded files, as psutil does with its configurable procfs.
meminfo is parsed here rather than through ``psutil.virtual_memory()`` because psutil reads
through a process-wide root and fills in 0 or an estimate for missing fields, where we want
None and a reason. psutil does give us the process tree.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import psutil

from ._types import ProcessMemory, SystemMemory

# Footprint = memory the process really holds: anonymous + shared-memory resident pages, plus
# what it has in swap. RssFile is left out: file pages (mmapped safetensors) are reclaimable.
# Fields documented in Documentation/filesystems/proc.rst; RssAnon/RssShmem need Linux >= 4.5.
FOOTPRINT_FIELDS = ("RssAnon", "RssShmem", "VmSwap")

# cgroup v1 spells "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB
# pages); anything this large is no limit.
_V1_UNLIMITED = 2**62


class CgroupLimit(NamedTuple):
    """The tightest memory cgroup limit on a process, over its cgroup and all ancestors."""

    limit: int  # bytes the cgroup may hold
    headroom: int  # bytes it may still take: limit - (usage - reclaimable file cache)
    limit_source: str
    headroom_source: str


def parse_kib_fields(text: str) -> dict[str, int]:
    """Parse ``Name:   123 kB`` lines (``/proc/meminfo``, ``/proc/PID/status``) into bytes."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out


def parse_psi_some_avg10(text: str) -> float:
    """The ``some avg10`` percentage from a PSI file such as ``/proc/pressure/memory``."""
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "some":
            for item in rest.split():
                key, _, value = item.partition("=")
                if key == "avg10":
                    return float(value)
    raise ValueError(f"no 'some avg10=' in PSI text {text[:80]!r}")


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def _status_footprint(pid: int, procfs: str) -> int:
    """Footprint of one process; raises FileNotFoundError/ProcessLookupError if it is gone."""
    path = f"{procfs}/{pid}/status"
    text = _read(path)
    fields = parse_kib_fields(text)
    missing = [name for name in FOOTPRINT_FIELDS if name not in fields]
    if missing:
        # The kernel omits the Vm*/Rss* lines once a process has let go of its memory: a
        # zombie (Z), and before that an exiting one (exit_mm drops the mm, then frees its
        # pages; Linux 6.18 showed "State: R" with PF_EXITING for the ~0.1 s that freeing
        # 1 GiB took), or one gone by the time its stat is read. None of it is counted.
        if re.search(r"^State:\s+[ZX]", text, re.MULTILINE) or _exiting(pid, procfs):
            return 0
        raise ValueError(f"{path} has no {'/'.join(missing)} (needs Linux >= 4.5)")
    return sum(fields[name] for name in FOOTPRINT_FIELDS)


def _descendants(pid: int, procfs: str) -> list[int]:
    """PIDs of every descendant of ``pid``; psutil for the live /proc, a scan for others."""
    if os.path.realpath(procfs) == os.path.realpath(psutil.PROCFS_PATH):
        try:
            return [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
    # A recorded procfs folder: build the parent map from each PID's stat line.
    children: dict[int, list[int]] = {}
    for name in os.listdir(procfs):
        if not name.isdigit():
            continue
        try:
            stat = _read(f"{procfs}/{name}/stat")
        except OSError:
            continue
        # The command name (field 2) may hold spaces and ')', so split after the last ')'.
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def read_process(
    pid: int | None = None, *, tree: bool = False, procfs: str = "/proc"
) -> ProcessMemory:
    """Footprint of ``pid`` (default: this process), summed over its descendants if ``tree``."""
    pid = os.getpid() if pid is None else pid
    source = f"{procfs}/PID/status:" + "+".join(FOOTPRINT_FIELDS)
    if tree:
        source += " summed over the process tree"
    sources = {"footprint": source}
    try:
        total = _status_footprint(pid, procfs)
    except (FileNotFoundError, ProcessLookupError):
        return ProcessMemory(None, 0, sources, {"footprint": f"no process {pid} in {procfs}"})
    except (OSError, ValueError) as exc:
        return ProcessMemory(None, 0, sources, {"footprint": f"{exc}"})
    count = 1
    if tree:
        for child in _descendants(pid, procfs):
            try:
                total += _status_footprint(child, procfs)
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited since it was listed; its memory is gone with it
            except (OSError, ValueError) as exc:
                return ProcessMemory(None, count, sources, {"footprint": f"{exc}"})
            count += 1
    return ProcessMemory(total, count, sources, {})


def cgroup_levels(pid: int | None, procfs: str, cgroupfs: str) -> tuple[str, list[str]]:
    """The memory cgroup version ("cgroup1"/"cgroup2") and its folders, leaf first, up to root.

    Returns ("", []) when the process is in no memory cgroup hierarchy we can see.
    """
    try:
        text = _read(f"{procfs}/{'self' if pid is None else pid}/cgroup")
    except FileNotFoundError:
        if pid is not None and not os.path.isdir(f"{procfs}/{pid}"):
            raise ProcessLookupError(f"no process {pid} in {procfs}") from None
        return "", []  # a kernel without cgroups
    v1_path = v2_path = None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    if v1_path == "/" and pid is not None and _exiting(pid, procfs):
        # cgroup v1 shows "/" for a task that is exiting, whatever its cgroup was
        # (proc_cgroup_show in kernel/cgroup/cgroup.c), e.g. an OOM-killed process while it
        # frees its memory: its limit is unknown, not the root's.
        raise ProcessLookupError(f"process {pid} is exiting; cgroup v1 no longer shows its cgroup")
    # On a hybrid system the memory controller sits on v1 and the v2 tree has none.
    if v1_path is not None:
        version, base, path = "cgroup1", os.path.join(cgroupfs, "memory"), v1_path
    elif v2_path is not None:
        version, path = "cgroup2", v2_path
        unified = os.path.join(cgroupfs, "unified")
        has_root = os.path.exists(os.path.join(cgroupfs, "cgroup.controllers"))
        base = cgroupfs if has_root or not os.path.isdir(unified) else unified
    else:
        return "", []
    leaf = os.path.normpath(os.path.join(base, path.lstrip("/")))
    if not os.path.isdir(leaf):
        # Without a private cgroup namespace /proc/PID/cgroup shows the host's path while the
        # container mounts its own cgroup as the root: the root folder is the process's cgroup.
        leaf = base
    levels = [leaf]
    while levels[-1] != os.path.normpath(base):
        levels.append(os.path.dirname(levels[-1]))
    return version, levels


def _exiting(pid: int, procfs: str) -> bool:
    """Whether ``pid`` is exiting or a zombie: PF_EXITING (0x4) in the flags of its stat."""
    try:
        stat = _read(f"{procfs}/{pid}/stat")
    except FileNotFoundError:
        return True  # gone since its cgroup file was read
    # Field 9 (flags); the command name (field 2) may hold spaces and ')'.
    return bool(int(stat.rpartition(")")[2].split()[6]) & 0x4)


def _int_file(path: str) -> int | None:
    """An integer cgroup file; None when missing or 'max' (no limit)."""
    try:
        text = _read(path).strip()
    except FileNotFoundError:
        return None
    return None if text == "max" else int(text)


def _stat_value(path: str, key: str) -> int:
    try:
        text = _read(path)
    except FileNotFoundError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def read_cgroup_limit(
    pid: int | None = None, *, procfs: str = "/proc", cgroupfs: str = "/sys/fs/cgroup"
) -> CgroupLimit | None:
    """The tightest memory limit over the process's cgroup and its ancestors, or None.

    Headroom adds back the cgroup's inactive file cache: the kernel reclaims it before it
    hits the limit, just as MemAvailable counts reclaimable cache as available (this is also
    how ``docker stats`` and the kubelet compute working-set memory).
    """
    version, levels = cgroup_levels(pid, procfs, cgroupfs)
    if version == "cgroup2":
        limit_file, usage_file, cache_key = "memory.max", "memory.current", "inactive_file"
    else:
        limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        cache_key = "total_inactive_file"  # v1 "total_*" counts include descendants
    limit_best: tuple[int, str] | None = None
    headroom_best: tuple[int, str] = (0, "")
    for level in levels:
        limit = _int_file(os.path.join(level, limit_file))
        if limit is None or limit >= _V1_UNLIMITED:
            continue
        usage = _int_file(os.path.join(level, usage_file)) or 0
        cache = _stat_value(os.path.join(level, "memory.stat"), cache_key)
        headroom = max(0, limit - max(0, usage - cache))
        where = f"{version}:{level}/"
        if limit_best is None or headroom < headroom_best[0]:
            headroom_best = (headroom, f"{where}{limit_file}-({usage_file}-{cache_key})")
        if limit_best is None or limit < limit_best[0]:
            limit_best = (limit, f"{where}{limit_file}")
    if limit_best is None:
        return None
    return CgroupLimit(limit_best[0], headroom_best[0], limit_best[1], headroom_best[1])


def read_system(
    pid: int | None = None, *, procfs: str = "/proc", cgroupfs: str = "/sys/fs/cgroup"
) -> SystemMemory:
    """Total, available and swap memory, capped by the memory cgroup of ``pid`` (default self)."""
    sources: dict[str, str] = {}
    errors: dict[str, str] = {}
    meminfo_path = f"{procfs}/meminfo"
    try:
        info = parse_kib_fields(_read(meminfo_path))
    except OSError as exc:
        info = {}
        for name in ("total", "available", "available_percent", "swap_used", "swap_total"):
            errors[name] = f"cannot read {meminfo_path}: {exc}"

    def field(name: str, key: str) -> int | None:
        if key in info:
            sources[name] = f"{meminfo_path}:{key}"
        elif name not in errors:
            errors[name] = f"{meminfo_path} has no {key}"
        return info.get(key)

    total = field("total", "MemTotal")
    available = field("available", "MemAvailable")  # Linux >= 3.14
    swap_total = field("swap_total", "SwapTotal")
    swap_free = info.get("SwapFree")
    swap_used = None
    if swap_total is not None and swap_free is not None:
        swap_used = swap_total - swap_free
        sources["swap_used"] = f"{meminfo_path}:SwapTotal-SwapFree"
    elif "swap_used" not in errors:
        errors["swap_used"] = f"{meminfo_path} has no SwapTotal/SwapFree"

    # Inside a container /proc/meminfo describes the host; the cgroup says what we may take.
    try:
        cap = read_cgroup_limit(pid, procfs=procfs, cgroupfs=cgroupfs)
    except ProcessLookupError as exc:
        # Gone or exiting: its cgroup, so what it may take, is unknown; the host's MemAvailable
        # in its place would jump up at the moment an OOM kill ends a trace.
        cap = None
        for name in ("total", "available", "available_percent"):
            errors[name] = f"no memory cgroup for process {pid}: {exc}"
            sources.pop(name, None)
        total = available = None
    except (OSError, ValueError) as exc:
        cap = None
        if "available" in sources:
            sources["available"] += f" (cgroup limit unreadable: {exc})"
    if cap is not None:
        if total is not None and cap.limit < total:
            total = cap.limit
            sources["total"] = f"min({sources['total']}, {cap.limit_source})"
        if available is not None:
            available = min(available, cap.headroom)
            sources["available"] = f"min({sources['available']}, {cap.headroom_source})"

    available_percent = None
    if total and available is not None:
        available_percent = 100.0 * available / total
        sources["available_percent"] = "100*available/total"
    elif "available_percent" not in errors:
        errors["available_percent"] = "needs total and available"

    pressure = None
    psi_path = f"{procfs}/pressure/memory"
    try:
        pressure = parse_psi_some_avg10(_read(psi_path))
        sources["pressure"] = f"{psi_path}:some avg10"
    except FileNotFoundError:
        errors["pressure"] = f"{psi_path} missing: kernel without PSI (CONFIG_PSI)"
    except (OSError, ValueError) as exc:  # EOPNOTSUPP when booted with psi=0
        errors["pressure"] = f"cannot read {psi_path}: {exc}"

    return SystemMemory(
        total, available, available_percent, swap_used, swap_total, pressure, sources, errors
    )
