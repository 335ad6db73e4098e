"""A cgroup v2 that holds the guarded command and every process it ever forks.

However a descendant forks (``setsid``, a double fork, a process that forks itself anew
every 20 ms and lets the old one exit), it stays in the cgroup its parent was in: only a
write to a ``cgroup.procs`` moves it, and the command cannot write where the guard made
the cgroup unless it runs as root and means to. ``cgroup.kill`` (Linux >= 5.14) SIGKILLs
all of it at once, with no window between listing and signalling; on an older kernel the
cgroup is frozen (``cgroup.freeze``, Linux >= 5.2) so nothing forks while each pid gets its
SIGKILL. ``cgroup.events`` says when nothing is left (``populated 0``; zombies do not count).

No controller is enabled: the cgroup only groups, it limits nothing, so the kernel's rule
against processes in inner cgroups with controllers does not apply, and the command's
memory stays charged where it was. Where no cgroup v2 can be made (no cgroup2 mount, not
permitted, ``STAGELOAD_GUARD_CGROUP=0``) ``CommandCgroup.create`` returns None and the guard
falls back to its subreaper sweep (``process``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import time
from pathlib import Path

#: Set to 0 to keep the guard from making a cgroup (it then sweeps as a subreaper).
CGROUP_ENV = "STAGELOAD_GUARD_CGROUP"
#: Folder names: prefix, the guard's pid, a counter.
PREFIX = "stageload-guard-"

_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-\d+")
_counter = itertools.count()
_POLL = 0.01

#: Why the last ``create()`` made no cgroup (for the docs' "where it may"), or None.
why_not: str | None = None


def _cgroup2_home() -> tuple[Path, str] | None:
    """This process's cgroup v2 folder (under the cgroup2 mount) and its name in the
    hierarchy (as /proc/PID/cgroup shows it), or None."""
    mount = None
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1] == "cgroup2":
                mount = (fields[3], fields[4])  # root inside the hierarchy, mount point
                break
    if mount is None:
        return None
    own = None
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            if line.startswith("0::"):
                own = line[3:].strip()
    if own is None:
        return None
    root, point = mount
    if root != "/" and not (own == root or own.startswith(root.rstrip("/") + "/")):
        return None  # our cgroup is outside what this mount shows
    relative = own[len(root) :] if root != "/" else own
    return Path(point) / relative.lstrip("/"), own


class CommandCgroup:
    """One guarded command's cgroup; ``create()`` makes it, ``remove()`` takes it away."""

    def __init__(self, path: Path, name: str) -> None:
        self.path = path
        #: Its name in the hierarchy, as ``/proc/PID/cgroup`` shows it ("0::NAME").
        self.name = name

    @classmethod
    def create(cls) -> CommandCgroup | None:
        """A fresh cgroup v2 beside this process's own, or None (``why_not`` says why)."""
        global why_not
        why_not = None
        if os.environ.get(CGROUP_ENV, "1").strip() == "0":
            why_not = f"{CGROUP_ENV}=0"
            return None
        try:
            found = _cgroup2_home()
        except OSError as exc:
            why_not = f"cannot read this process's cgroup: {exc.strerror}"
            return None
        if found is None:
            why_not = "no cgroup v2 hierarchy for this process"
            return None
        home, own = found
        sweep(home)
        leaf = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        path = home / leaf
        try:
            path.mkdir()
        except OSError as exc:
            why_not = f"cannot create a cgroup in {home}: {exc.strerror}"
            return None
        if not (path / "cgroup.procs").exists():
            with contextlib.suppress(OSError):
                path.rmdir()
            why_not = f"{home} is not a cgroup v2 folder"
            return None
        return cls(path, own.rstrip("/") + "/" + leaf)

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is (or, a zombie, was) in this cgroup: a zombie is no longer
        listed in ``cgroup.procs`` but its /proc/PID/cgroup still names the cgroup."""
        try:
            with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
                return any(line.strip() == f"0::{self.name}" for line in f)
        except OSError:
            return False

    def procs_fd(self) -> int:
        """An open ``cgroup.procs`` to write ``0`` into from the child before it execs."""
        return os.open(self.path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def pids(self) -> list[int]:
        """Live processes in the cgroup (zombies are not listed)."""
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def populated(self) -> bool:
        """Whether any live process is in the cgroup."""
        try:
            text = (self.path / "cgroup.events").read_text()
        except OSError:
            return bool(self.pids())
        return "populated 1" in text

    def _write(self, name: str, value: str) -> bool:
        try:
            with open(self.path / name, "w", encoding="ascii") as f:
                f.write(value)
        except OSError:
            return False
        return True

    def signal(self, sig: int) -> int:
        """Send ``sig`` to every process in the cgroup; how many it was sent to. For
        SIGTERM: a pid listed here that exits and is reused in between would get it, in
        the microseconds between the read and the kill (``kill()`` has no such window)."""
        count = 0
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                count += 1
        return count

    def kill(self, timeout: float = 5.0) -> bool:
        """SIGKILL everything in the cgroup, forks in flight included; True once empty."""
        deadline = time.monotonic() + timeout
        if (self.path / "cgroup.kill").exists():
            self._write("cgroup.kill", "1")
        else:  # Linux < 5.14: freeze, so nothing forks between the listing and the kills
            frozen = self._write("cgroup.freeze", "1")
            while self.pids() and time.monotonic() < deadline:
                self.signal(signal.SIGKILL)
                time.sleep(_POLL)
            if frozen:
                self._write("cgroup.freeze", "0")
        while self.populated():
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL)
        return True

    def remove(self) -> None:
        """Remove the cgroup once it is empty; left for a later sweep when it is not."""
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def __repr__(self) -> str:
        return f"CommandCgroup({str(self.path)!r})"


def sweep(home: Path) -> None:
    """Remove empty guard cgroups left by guards that no longer run (killed with -9: the
    watchdog emptied the cgroup, nobody removed it). A populated one is left alone: its
    processes were left running on purpose (``--leave-group``) or are still being killed."""
    try:
        names = os.listdir(home)
    except OSError:
        return
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(OSError):
            (home / name).rmdir()  # fails while populated


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
