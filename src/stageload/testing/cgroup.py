"""Real memory cgroups for tests and benchmarks: create one with a limit, run a command or a
Python function inside it, read what it charged, and remove it.

A machine too small for a pipeline is made, not faked: the kernel enforces the limit, and
its OOM killer fires as it would on a small machine. Needs write access to the cgroup tree
(root, as CI runs); elsewhere ``MemoryCgroup`` raises ``CgroupUnavailable`` with the reason,
and ``cgroup_or_skip`` turns that into a pytest skip.

    with MemoryCgroup(512 * 2**20) as cg:
        run = cg.run([sys.executable, "-c", "b = bytearray(2**30)"])
        run.returncode, run.usage.oom_kills      # -9, 1

The cgroup is made inside this process's own memory cgroup, so the limits above it still
apply and nothing leaves the hierarchy it was given. cgroup v1 (``memory.limit_in_bytes``,
``memory.max_usage_in_bytes``, ``memory.failcnt``, ``memory.oom_control``) and v2
(``memory.max``, ``memory.peak``, ``memory.events``) are both handled, with swap shut off
for the cgroup where the machine has swap (v1 ``memory.memsw.limit_in_bytes``, v2
``memory.swap.max``). Only memory charged after a process entered counts: pages it touched
before stay charged where they were (neither version moves charges by default).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StageloadError

CGROUP_ROOT = "/sys/fs/cgroup"
#: Folder names of the cgroups made here: prefix, creating pid, a counter.
PREFIX = "stageload-test-"
#: Set to 1 (as CI may) to make ``cgroup_or_skip`` fail instead of skipping.
REQUIRE_ENV = "STAGELOAD_REQUIRE_CGROUP"

_counter = itertools.count()
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-\d+")


class CgroupUnavailable(StageloadError, RuntimeError):
    """No memory cgroup can be made or entered here; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CgroupRun:
    """A command that ran inside a cgroup: how it ended and what the cgroup charged."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    usage: CgroupUsage

    @property
    def oom_killed(self) -> bool:
        """Killed by the kernel's OOM killer in this cgroup (SIGKILL and a counted kill)."""
        return self.returncode == -signal.SIGKILL and bool(self.usage.oom_kills)


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


def _parent(root: str) -> tuple[str, Path]:
    """This process's memory cgroup folder and its version, or CgroupUnavailable."""
    from ..memory import memory_cgroups

    try:
        version, levels = memory_cgroups(cgroupfs=root)
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read /proc/self/cgroup: {exc}") from None
    if not levels:
        raise CgroupUnavailable(f"no memory cgroup hierarchy under {root} for this process")
    parent = Path(levels[0])
    if version == "cgroup2":
        controllers = parent / "cgroup.subtree_control"
        try:
            if "memory" not in _read(controllers).split():
                _write(controllers, "+memory")
        except OSError as exc:
            # v2 lets a cgroup hand controllers to children only while it holds no processes
            # of its own (the root cgroup excepted): a shell inside a systemd scope cannot.
            raise CgroupUnavailable(
                f"cannot enable the memory controller for children of {parent}: {exc}"
            ) from None
    return version, parent


class MemoryCgroup:
    """A fresh memory cgroup with ``limit`` bytes, made inside this process's own cgroup.

    Use it as a context manager (or call ``remove()``): leaving kills whatever still runs in
    it and removes the folder, also when the body raised. ``popen``/``run`` start a command
    inside it, ``call`` runs a Python function inside it, ``read`` returns its counters.
    """

    def __init__(
        self, limit: int, *, root: str = CGROUP_ROOT, parent: str | os.PathLike[str] | None = None
    ) -> None:
        if not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"limit must be a positive number of bytes, got {limit!r}")
        if not os.path.isdir(root):
            raise CgroupUnavailable(f"no cgroup filesystem at {root}")
        if parent is None:
            self.version, where = _parent(root)
        else:
            where = Path(parent)
            self.version = "cgroup2" if (where / "memory.max").exists() else "cgroup1"
        sweep(where)
        self.limit = limit
        #: Whether swap is shut off for this cgroup (only done where the machine has swap).
        self.swap_off = False
        self.path = where / f"{PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            self.path.mkdir()
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create a cgroup in {where}: {exc}") from None
        if not (self.path / "cgroup.procs").exists():  # a plain folder, not a cgroupfs one
            self.path.rmdir()
            raise CgroupUnavailable(f"{where} is not in a cgroup filesystem")
        try:
            self._set_limit(limit)
        except OSError as exc:
            self.remove()
            raise CgroupUnavailable(f"cannot set a memory limit on {self.path}: {exc}") from None

    def _set_limit(self, limit: int) -> None:
        v1 = self.version == "cgroup1"
        _write(self.path / ("memory.limit_in_bytes" if v1 else "memory.max"), str(limit))
        import psutil

        if not psutil.swap_memory().total:
            # memsw = memory + swap, so with no swap its limit adds nothing, and on recent
            # kernels it hides the hits: they count in memsw.failcnt, which stays 0 (6.18).
            return
        swap = self.path / ("memory.memsw.limit_in_bytes" if v1 else "memory.swap.max")
        if swap.exists():  # v1 without swap accounting has no memsw files
            _write(swap, str(limit) if v1 else "0")
            self.swap_off = True

    # -- running inside -----------------------------------------------------------------

    def _enter(self) -> Callable[[], None]:
        procs = os.fsencode(self.path / "cgroup.procs")

        def enter() -> None:  # in the child, between fork and exec: "0" moves the writer
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

        return enter

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` whose process enters this cgroup before it execs."""
        enter, theirs = self._enter(), kwargs.pop("preexec_fn", None)

        def preexec() -> None:
            enter()
            if theirs is not None:
                theirs()

        try:
            return subprocess.Popen(list(args), preexec_fn=preexec, **kwargs)
        except subprocess.SubprocessError as exc:  # the write to cgroup.procs failed
            raise CgroupUnavailable(f"cannot move a process into {self.path}: {exc}") from None

    def run(self, args: Sequence[str], *, timeout: float | None = None, **kwargs: Any) -> CgroupRun:
        """Run ``args`` inside the cgroup to its end; stdout and stderr are captured as text.

        On ``timeout`` whatever runs in the cgroup is killed and TimeoutExpired raised.
        """
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        start = time.perf_counter()
        with self.popen(args, text=True, **kwargs) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                proc.communicate()
                raise
        seconds = time.perf_counter() - start
        return CgroupRun(list(args), proc.returncode, out or "", err or "", seconds, self.read())

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """``fn(*args)`` in a fresh Python process inside the cgroup; returns its result.

        ``fn`` and the result must pickle (a module-level function). An exception in ``fn``
        is raised here as ``ChildProcessError`` with the child's traceback; a child killed
        (e.g. by the OOM killer) raises ``ChildProcessError`` naming the signal.
        """
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_call_inside, args=(str(self.path), fn, args, send))
        child.start()
        send.close()
        try:
            if not receive.poll(timeout):
                self.kill()
                raise TimeoutError(f"{fn!r} ran past {timeout} s inside {self.path}")
            status, value = receive.recv()
        except EOFError:
            status, value = "died", None
        finally:
            receive.close()
            child.join(5)
        if status == "ok":
            return value
        if status == "cgroup":
            raise CgroupUnavailable(value)
        if status == "error":
            raise ChildProcessError(f"{fn.__qualname__} failed inside {self.path}:\n{value}")
        code = child.exitcode
        how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit {code}"
        raise ChildProcessError(
            f"{fn.__qualname__} died inside {self.path} ({how}); the cgroup read {self.read()}"
        )

    # -- reading --------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Processes in the cgroup now (empty once it is gone)."""
        try:
            return [int(p) for p in _read(self.path / "cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def read(self) -> CgroupUsage:
        """The cgroup's counters now: usage, peak, limit hits and OOM kills."""
        return read_usage(self.path, self.version, self.limit)

    # -- cleanup ----------------------------------------------------------------------------

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the cgroup, and wait until none is left in it."""
        kill_file = self.path / "cgroup.kill"  # v2, Linux >= 5.14: the kernel does it all
        deadline = time.monotonic() + timeout
        while self.pids():
            if kill_file.exists():
                _write(kill_file, "1")
            else:
                for pid in self.pids():
                    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                        os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {self.pids()} outlived SIGKILL in {self.path}")
            time.sleep(0.02)

    def remove(self, timeout: float = 5.0) -> None:
        """Kill what is left inside, then remove the cgroup (retrying while the kernel
        finishes the exits). Does nothing once it is gone."""
        if not self.path.exists():
            return
        self.kill(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.remove()
        except (OSError, RuntimeError) as err:
            if exc is None:
                raise
            warnings.warn(f"could not remove {self.path}: {err}", RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"MemoryCgroup({self.path}, limit={self.limit}, {self.version})"


def _call_inside(path: str, fn: Callable[..., Any], args: tuple[Any, ...], send: Any) -> None:
    """The ``call`` child: enter the cgroup, run ``fn``, send back its result or error."""
    import traceback

    try:
        _write(Path(path) / "cgroup.procs", "0")
    except OSError as exc:
        send.send(("cgroup", f"cannot move a process into {path}: {exc}"))
        return
    try:
        result = ("ok", fn(*args))
    except BaseException:
        result = ("error", traceback.format_exc())
    send.send(result)


def sweep(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove cgroups left in ``parent`` by processes that no longer run (a test run killed
    before its cleanup); returns those removed."""
    import psutil

    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        path = Path(parent) / name
        try:
            for pid in _read(path / "cgroup.procs").split():
                os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)
            path.rmdir()
            removed.append(path)
        except OSError:
            continue  # another sweeper got it, or it still empties; the next sweep retries
    return removed


def cgroup_or_skip(limit: int, **kwargs: Any) -> MemoryCgroup:
    """A ``MemoryCgroup``, or ``pytest.skip`` naming why none can be made here.

    With ``STAGELOAD_REQUIRE_CGROUP=1`` in the environment the test fails instead, for a CI
    that runs as root and must not skip these tests silently.
    """
    import pytest

    try:
        return MemoryCgroup(limit, **kwargs)
    except CgroupUnavailable as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but no memory cgroup: {exc.reason}")
        pytest.skip(f"no memory cgroup here: {exc.reason}")


# -- what the kernel charged to a cgroup, read from its counter files ---------------------------
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
