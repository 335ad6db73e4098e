"""Memory readers against real counters: /proc, free -b, real subprocesses and mmapped files.

Recorded /proc and cgroup folders in tmp_path stand in only for what this machine cannot
show (a memory limit, cgroup v1 and v2 at once, missing kernel files); macOS counters are
checked on macOS and their byte parsers on fixed inputs everywhere.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from stageload import memory
from stageload.memory import _macos, read_device, read_process, read_system

MiB = 1 << 20
GiB = 1 << 30
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux readers")
macos_only = pytest.mark.skipif(sys.platform != "darwin", reason="macOS readers")

# A child that reports its pid, then allocates and touches N bytes on each "alloc N" line.
CHILD = """
import sys
held = []
print("ready", flush=True)
for line in sys.stdin:
    held.append(b"x" * int(line.split()[1]))  # bytes * n writes every page
    print("done", flush=True)
"""


class Child:
    """A real Python child process that allocates memory on request."""

    def __init__(self, argv_prefix: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [*argv_prefix, sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def alloc(self, size: int) -> None:
        self.proc.stdin.write(f"alloc {size}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def child():
    c = Child()
    yield c
    c.close()


def retry(check: Callable[[], None], tries: int = 5) -> None:
    """Run ``check`` until it passes; system counters move between two reads (psutil habit)."""
    for attempt in range(tries):
        try:
            check()
            return
        except AssertionError:
            if attempt == tries - 1:
                raise
            time.sleep(0.1)


# --- Linux: against the kernel and independent tools -----------------------------------------


def _free_b() -> dict[str, list[int]]:
    out = subprocess.run(["free", "-b"], capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines()[1:]:
        name, *values = line.split()
        rows[name.rstrip(":")] = [int(v) for v in values]
    return rows


@pytest.mark.alone  # reads the machine's available memory
@linux_only
@pytest.mark.skipif(shutil.which("free") is None, reason="needs free(1) from procps")
def test_system_agrees_with_free():
    def check() -> None:
        s = read_system()
        free = _free_b()
        mem_total, *_, mem_available = free["Mem"]
        swap_total, swap_used, _ = free["Swap"]
        assert not s.errors or set(s.errors) == {"pressure"}, s.errors
        if "cgroup" in s.sources["available"]:  # capped: free shows the uncapped host numbers
            assert s.total <= mem_total and s.available <= mem_available + 64 * MiB
        else:
            assert s.total == mem_total
            assert abs(s.available - mem_available) < 64 * MiB
        assert s.swap_total == swap_total
        assert abs(s.swap_used - swap_used) < 64 * MiB
        assert s.available_percent == pytest.approx(100 * s.available / s.total)

    retry(check)


@pytest.mark.alone  # reads the machine's available memory
@linux_only
def test_system_agrees_with_psutil():
    def check() -> None:
        s, vm, sw = read_system(), psutil.virtual_memory(), psutil.swap_memory()
        assert s.total == vm.total or "cgroup" in s.sources["total"]
        assert s.available <= vm.available + 64 * MiB
        if "cgroup" not in s.sources["available"]:
            assert abs(s.available - vm.available) < 64 * MiB
        assert abs(s.swap_used - sw.used) < 64 * MiB

    retry(check)


@linux_only
def test_pressure_matches_proc_pressure():
    path = Path("/proc/pressure/memory")
    if not path.exists():
        pytest.skip("this kernel has no PSI")
    s = read_system()
    if s.pressure is None:  # present but disabled (booted with psi=0): EOPNOTSUPP
        assert "cannot read" in s.errors["pressure"]
        pytest.skip(s.errors["pressure"])
    assert s.sources["pressure"] == "/proc/pressure/memory:some avg10"
    assert 0.0 <= s.pressure <= 100.0
    line = path.read_text().splitlines()[0]
    assert line.startswith("some avg10=")


def test_allocating_1gib_adds_1gib_footprint(child):
    before = read_process(child.proc.pid)
    child.alloc(GiB)
    after = read_process(child.proc.pid)
    assert before.errors == after.errors == {}
    assert after.pids == 1
    assert after.footprint - before.footprint >= GiB


@linux_only
def test_footprint_agrees_with_smaps_rollup(child):
    """The kernel's page-table walk (smaps_rollup) and status's counters see the same memory."""
    child.alloc(256 * MiB)

    def check() -> None:
        footprint = read_process(child.proc.pid).footprint
        rollup = Path(f"/proc/{child.proc.pid}/smaps_rollup").read_text()
        kib = {m[1]: int(m[2]) * 1024 for m in re.finditer(r"^(\w+):\s+(\d+) kB", rollup, re.M)}
        assert abs(footprint - (kib["Anonymous"] + kib["Swap"])) < 16 * MiB

    retry(check)


def test_child_memory_appears_in_tree_reading():
    # sh -c 'python ...; exit': the allocating process is a grandchild of this one.
    c = Child(("sh", "-c", '"$@"; exit $?', "sh"))
    try:
        assert psutil.Process(c.proc.pid).children(), "expected sh -> python"
        me = os.getpid()
        before = read_process(me, tree=True)
        c.alloc(256 * MiB)
        after = read_process(me, tree=True)
        alone = read_process(me)
        assert after.errors == {}
        assert after.pids >= 2 and alone.pids == 1
        assert after.footprint - before.footprint >= 256 * MiB
        assert after.footprint >= alone.footprint + 256 * MiB
    finally:
        c.close()


@linux_only
def test_tree_reading_survives_a_zombie_child():
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "child never exited"
            time.sleep(0.02)
        reading = read_process(tree=True)
        assert reading.errors == {}
        assert reading.pids >= 2  # the zombie counted, holding nothing
    finally:
        zombie.wait()


@linux_only
def test_footprint_excludes_mmapped_file_pages(tmp_path):
    if _fs_type(tmp_path) == "tmpfs":
        pytest.skip("tmp_path is on tmpfs, whose file pages are shmem and do count")
    path = tmp_path / "weights.bin"
    size = 256 * MiB
    with open(path, "wb") as f:
        chunk = b"\x01" * MiB
        for _ in range(size // MiB):
            f.write(chunk)
    proc = psutil.Process()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        rss_before, before = proc.memory_info().rss, read_process().footprint
        touched = sum(m[i] for i in range(0, size, mmap.PAGESIZE))  # fault in every page
        rss_after, after = proc.memory_info().rss, read_process().footprint
    assert touched == size // mmap.PAGESIZE
    assert rss_after - rss_before >= 200 * MiB  # RSS counts the mapped file...
    assert after - before < 32 * MiB  # ...the footprint does not


def _fs_type(path: Path) -> str:
    best, fs = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        mount = left.split()[4]
        if str(path).startswith(mount) and len(mount) > len(best):
            best, fs = mount, right.split()[0]
    return fs


# --- Linux: recorded /proc and cgroup folders -------------------------------------------------

MEMINFO = """\
MemTotal:       16384000 kB
MemFree:         1000000 kB
MemAvailable:    8192000 kB
Buffers:           10000 kB
SwapTotal:       2097152 kB
SwapFree:        1048576 kB
HugePages_Total:       0
"""
PSI = """\
some avg10=1.25 avg60=0.50 avg300=0.10 total=123456
full avg10=0.75 avg60=0.25 avg300=0.05 total=65432
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _status(anon_kib: int, shmem_kib: int = 0, swap_kib: int = 0, state: str = "S") -> str:
    return (
        f"Name:\tpython\nState:\t{state} (sleeping)\nVmRSS:\t{anon_kib + 5000} kB\n"
        f"RssAnon:\t{anon_kib} kB\nRssFile:\t5000 kB\nRssShmem:\t{shmem_kib} kB\n"
        f"VmSwap:\t{swap_kib} kB\n"
    )


def _stat(pid: int, ppid: int) -> str:
    return f"{pid} (odd) name) S {ppid} {pid} {pid} 0 -1 4194304 0 0 0 0\n"


@pytest.fixture
def roots(tmp_path):
    procfs, cgroupfs = tmp_path / "proc", tmp_path / "cgroup"
    _write(procfs, {"meminfo": MEMINFO, "pressure/memory": PSI})
    cgroupfs.mkdir()
    return procfs, cgroupfs


def _linux_system(procfs: Path, cgroupfs: Path):
    from stageload.memory import _linux

    return _linux.read_system(procfs=str(procfs), cgroupfs=str(cgroupfs))


def test_recorded_meminfo_without_cgroup(roots):
    procfs, cgroupfs = roots
    _write(procfs, {"self/cgroup": "0::/\n"})
    s = _linux_system(procfs, cgroupfs)
    assert s.errors == {}
    assert s.total == 16384000 * 1024
    assert s.available == 8192000 * 1024
    assert s.available_percent == pytest.approx(50.0)
    assert s.swap_total == 2 * GiB and s.swap_used == GiB
    assert s.pressure == 1.25
    assert s.sources["available"] == f"{procfs}/meminfo:MemAvailable"


def test_recorded_cgroup_v2_limit_caps_total_and_available(roots):
    procfs, cgroupfs = roots
    _write(procfs, {"self/cgroup": "0::/system.slice/job.scope\n"})
    _write(
        cgroupfs,
        {
            "cgroup.controllers": "cpu memory pids\n",
            "system.slice/memory.max": "max\n",
            "system.slice/memory.current": f"{5 * GiB}\n",
            "system.slice/job.scope/memory.max": f"{2 * GiB}\n",
            "system.slice/job.scope/memory.current": f"{1536 * MiB}\n",
            "system.slice/job.scope/memory.stat": f"anon 1000\ninactive_file {256 * MiB}\n",
        },
    )
    s = _linux_system(procfs, cgroupfs)
    assert s.total == 2 * GiB
    # limit - (usage - inactive file cache): 2048 - (1536 - 256) MiB
    assert s.available == 768 * MiB
    assert s.available_percent == pytest.approx(37.5)
    assert "cgroup2:" in s.sources["available"] and "job.scope" in s.sources["available"]
    assert "memory.max" in s.sources["total"]


def test_recorded_cgroup_v2_parent_limit_applies(roots):
    procfs, cgroupfs = roots
    _write(procfs, {"self/cgroup": "0::/parent/leaf\n"})
    _write(
        cgroupfs,
        {
            "cgroup.controllers": "memory\n",
            "parent/memory.max": f"{GiB}\n",
            "parent/memory.current": f"{900 * MiB}\n",
            "parent/leaf/memory.max": "max\n",
            "parent/leaf/memory.current": f"{100 * MiB}\n",
        },
    )
    s = _linux_system(procfs, cgroupfs)
    assert s.total == GiB
    assert s.available == 124 * MiB


def test_recorded_cgroup_v2_unlimited_is_no_cap(roots):
    procfs, cgroupfs = roots
    _write(procfs, {"self/cgroup": "0::/a\n"})
    _write(cgroupfs, {"cgroup.controllers": "memory\n", "a/memory.max": "max\n"})
    s = _linux_system(procfs, cgroupfs)
    assert s.total == 16384000 * 1024 and s.available == 8192000 * 1024


def test_recorded_cgroup_v1_limit_on_hybrid_system(roots):
    procfs, cgroupfs = roots
    _write(
        procfs,
        {"self/cgroup": "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/\n0::/\n"},
    )
    _write(
        cgroupfs,
        {
            "unified/cgroup.procs": "",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/docker/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/docker/abc/memory.limit_in_bytes": f"{4 * GiB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{3 * GiB}\n",
            "memory/docker/abc/memory.stat": f"cache 5\ntotal_inactive_file {512 * MiB}\n",
        },
    )
    s = _linux_system(procfs, cgroupfs)
    assert s.total == 4 * GiB
    assert s.available == 4 * GiB - (3 * GiB - 512 * MiB)
    assert "cgroup1:" in s.sources["available"]


def test_recorded_cgroup_v1_huge_limit_is_no_cap(roots):
    procfs, cgroupfs = roots
    _write(procfs, {"self/cgroup": "4:memory:/x\n"})
    _write(
        cgroupfs,
        {
            "memory/x/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/x/memory.usage_in_bytes": f"{GiB}\n",
        },
    )
    s = _linux_system(procfs, cgroupfs)
    assert s.total == 16384000 * 1024 and s.available == 8192000 * 1024
    assert not s.sources["available"].startswith("min(")


def test_recorded_cgroup_seen_from_inside_a_container(roots):
    """/proc/self/cgroup names the host path, but the container mounts its cgroup as root."""
    procfs, cgroupfs = roots
    _write(procfs, {"self/cgroup": "0::/kubepods/pod1/ctr\n"})
    _write(
        cgroupfs,
        {
            "cgroup.controllers": "memory\n",
            "memory.max": f"{GiB}\n",
            "memory.current": f"{256 * MiB}\n",
        },
    )
    s = _linux_system(procfs, cgroupfs)
    assert s.total == GiB and s.available == 768 * MiB


def test_missing_files_give_none_and_a_reason(tmp_path):
    from stageload.memory import _linux

    s = _linux.read_system(procfs=str(tmp_path), cgroupfs=str(tmp_path))
    for name in ("total", "available", "available_percent", "swap_used", "swap_total"):
        assert getattr(s, name) is None
        assert "meminfo" in s.errors[name]
    assert s.pressure is None and "PSI" in s.errors["pressure"]
    sample = memory.to_sample(s)
    assert sample["available"] is None and sample["swap_used"] is None
    assert set(memory.sample_errors(s)) == {"available", "available_pct", "swap_used", "pressure"}

    p = _linux.read_process(4242, procfs=str(tmp_path))
    assert p.footprint is None and p.pids == 0
    assert "no process 4242" in p.errors["footprint"]


def test_meminfo_without_memavailable(roots):
    procfs, cgroupfs = roots
    _write(procfs, {"meminfo": MEMINFO.replace("MemAvailable", "Other")})
    s = _linux_system(procfs, cgroupfs)
    assert s.available is None and "MemAvailable" in s.errors["available"]
    assert s.available_percent is None and "available_percent" in s.errors
    assert s.total == 16384000 * 1024  # the rest still reads


def test_recorded_status_without_rssanon(tmp_path):
    from stageload.memory import _linux

    # A live process (its stat without PF_EXITING) on a kernel older than 4.5.
    status = "Name:\tpython\nState:\tS (sleeping)\nVmRSS:\t100 kB\n"
    _write(tmp_path, {"7/status": status, "7/stat": _stat(7, 1)})
    p = _linux.read_process(7, procfs=str(tmp_path))
    assert p.footprint is None and "RssAnon" in p.errors["footprint"]
    assert "Linux >= 4.5" in p.errors["footprint"]


# /proc/PID/status and stat of a python process freeing 1 GiB as it exits (Linux 6.18):
# not a zombie yet ("State: R"), PF_EXITING (0x4) set in stat's flags (4194316), and no
# Vm*/Rss* lines any more. Recorded because the window (~0.1 s, while the pages are freed)
# cannot be hit on demand; trimmed to the lines the reader looks at.
DYING_STATUS = (
    "Name:\tpython\nUmask:\t0022\nState:\tR (running)\nTgid:\t4590\nNgid:\t0\n"
    "Pid:\t4590\nPPid:\t4589\nTracerPid:\t0\nFDSize:\t256\nKthread:\t0\nThreads:\t1\n"
    "voluntary_ctxt_switches:\t0\nnonvoluntary_ctxt_switches:\t186\n"
)
DYING_STAT = (
    "4590 (python) R 4589 4585 1045 0 -1 4194316 263115 0 0 0 5 57 0 0 20 0 1 0 7989644 0 0 "
    "18446744073709551615 0 0 0 0 0 0 0 16781312 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
)


@pytest.mark.parametrize("seen", [True, False], ids=["fixed", "control"])
def test_a_dying_child_does_not_null_the_tree_reading(tmp_path, monkeypatch, seen):
    """A child sampled while it exits (recorded texts above) has no Rss* lines and is not
    a zombie yet: it counts as exited (0), and the tree's footprint is the others'. Also
    one gone before its stat is read. Control: with only "State: Z" taken as exiting, the
    whole sample is None and blames the kernel ("needs Linux >= 4.5")."""
    from stageload.memory import _linux

    if not seen:
        monkeypatch.setattr(_linux, "_exiting", lambda pid, procfs: False)
    _write(
        tmp_path,
        {
            "4589/stat": _stat(4589, 1),
            "4589/status": _status(1000),
            "4590/stat": DYING_STAT,
            "4590/status": DYING_STATUS,
            "4591/stat": _stat(4591, 4589),
            "4591/status": _status(2000),
        },
    )
    tree = _linux.read_process(4589, tree=True, procfs=str(tmp_path))
    alone = _linux.read_process(4590, procfs=str(tmp_path))
    (tmp_path / "4590" / "stat").unlink()  # gone between its status and its stat
    gone = _linux.read_process(4590, procfs=str(tmp_path))
    if seen:
        assert tree.errors == {} and tree.footprint == (1000 + 2000) * 1024
        assert (alone.footprint, alone.errors, gone.footprint, gone.errors) == (0, {}, 0, {})
    else:
        assert tree.footprint is None and "Linux >= 4.5" in tree.errors["footprint"]
        assert alone.footprint is None and gone.footprint is None


def test_recorded_tree_sums_descendants_and_skips_vanished(tmp_path):
    from stageload.memory import _linux

    _write(
        tmp_path,
        {
            "10/stat": _stat(10, 1),
            "10/status": _status(1000, shmem_kib=24, swap_kib=100),
            "11/stat": _stat(11, 10),
            "11/status": _status(2000),
            "12/stat": _stat(12, 11),  # grandchild
            "12/status": _status(3000, swap_kib=1000),
            "13/stat": _stat(13, 10),  # exited after listing: no status any more
            "14/stat": _stat(14, 10),  # zombie: no memory lines
            "14/status": "Name:\tpython\nState:\tZ (zombie)\n",
            "20/stat": _stat(20, 1),  # not in the tree
            "20/status": _status(99999),
        },
    )
    alone = _linux.read_process(10, procfs=str(tmp_path))
    assert alone.footprint == (1000 + 24 + 100) * 1024 and alone.pids == 1
    whole = _linux.read_process(10, tree=True, procfs=str(tmp_path))
    assert whole.errors == {}
    assert whole.footprint == (1124 + 2000 + 4000) * 1024
    assert whole.pids == 4  # 10, 11, 12 and the zombie 14
    assert "tree" in whole.sources["footprint"]


def test_parsers_on_fixed_text():
    from stageload.memory import _linux

    fields = _linux.parse_kib_fields(MEMINFO)
    assert fields["MemTotal"] == 16384000 * 1024 and "HugePages_Total" not in fields
    assert _linux.parse_psi_some_avg10(PSI) == 1.25
    with pytest.raises(ValueError, match="avg10"):
        _linux.parse_psi_some_avg10("full avg10=1.00\n")


# --- macOS: byte parsers everywhere, live readers on macOS ------------------------------------

# struct rusage_info_v2 (<sys/resource.h>): uuid[16], then 18 uint64 fields; phys_footprint is
# the 8th field. The values are the field numbers, so a wrong offset reads a wrong number.
RUSAGE_V2 = bytes(range(16)) + b"".join(struct.pack("<Q", n) for n in range(1, 19))
RUSAGE_V2_REAL_FOOTPRINT = bytes(16) + bytes(7 * 8) + (4509715660).to_bytes(8, "little") + bytes(80)


def test_macos_parse_rusage_v2():
    assert len(RUSAGE_V2) == _macos.RUSAGE_INFO_V2_SIZE == 160
    assert _macos.parse_rusage_v2(RUSAGE_V2) == 8
    assert _macos.parse_rusage_v2(RUSAGE_V2_REAL_FOOTPRINT) == 4509715660  # 4.2 GiB
    with pytest.raises(ValueError, match="160 bytes"):
        _macos.parse_rusage_v2(RUSAGE_V2[:100])


def test_macos_parse_memorystatus_level():
    assert _macos.parse_memorystatus_level(b"\x2a\x00\x00\x00") == 42
    with pytest.raises(ValueError, match="4-byte"):
        _macos.parse_memorystatus_level(b"\x2a")
    with pytest.raises(ValueError, match="percentage"):
        _macos.parse_memorystatus_level(struct.pack("<i", 250))


def _parse_swapusage_text(text: str) -> dict[str, int]:
    """``sysctl -n vm.swapusage`` text, e.g. 'total = 2048.00M  used = 1024.50M  free = ...'."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return {
        m[1]: int(float(m[2]) * units[m[3]]) for m in re.finditer(r"(\w+) = ([\d.]+)([KMG])", text)
    }


def test_swapusage_text_parser_for_the_macos_check():
    text = "total = 2048.00M  used = 1024.50M  free = 1023.50M  (encrypted)"
    assert _parse_swapusage_text(text) == {
        "total": 2 * GiB,
        "used": int(1024.5 * MiB),
        "free": int(1023.5 * MiB),
    }


def test_macos_module_imports_anywhere_without_loading_libraries():
    code = (
        "import ctypes, sys\n"
        "loaded = []\n"
        "ctypes.CDLL = lambda *a, **k: loaded.append(a)\n"
        "import stageload.memory._macos\n"
        "assert loaded == [], loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@macos_only
def test_macos_system_agrees_with_sysctl():
    def check() -> None:
        s = read_system()
        assert s.errors == {}
        level = int(subprocess.check_output(["sysctl", "-n", "kern.memorystatus_level"]))
        assert abs(s.available_percent - level) <= 5
        memsize = int(subprocess.check_output(["sysctl", "-n", "hw.memsize"]))
        assert s.total == memsize
        swap = _parse_swapusage_text(
            subprocess.check_output(["sysctl", "-n", "vm.swapusage"], text=True)
        )
        assert abs(s.swap_used - swap["used"]) < 64 * MiB
        assert abs(s.swap_total - swap["total"]) < MiB

    retry(check)


@macos_only
def test_macos_footprint_is_phys_footprint():
    p = read_process()
    assert p.errors == {} and p.footprint > 0
    assert p.sources["footprint"] == "proc_pid_rusage:phys_footprint"


# --- device and sample helpers ----------------------------------------------------------------


def test_device_reader_never_imports_torch():
    code = (
        "import sys\n"
        "from stageload.memory import read_device, read_process, read_system\n"
        "d = read_device(); read_process(tree=True); read_system()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert d.sources == d.errors == {} and d.cuda_allocated is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_device_reader_leaves_cuda_uninitialised():
    code = (
        "import torch\n"
        "from stageload.memory import read_device\n"
        "d = read_device()\n"
        "assert not torch.cuda.is_initialized(), 'read_device initialised CUDA'\n"
        "assert 'cuda_allocated' not in d.sources and d.cuda_allocated is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sample_helpers_flatten_readings():
    system = memory.SystemMemory(
        total=100,
        available=40,
        available_percent=40.0,
        swap_used=None,
        swap_total=10,
        pressure=None,
        sources={"total": "t", "available": "a", "available_percent": "p", "swap_total": "st"},
        errors={"swap_used": "gone"},
    )
    process = memory.ProcessMemory(7, 2, {"footprint": "f"}, {})
    device = memory.DeviceMemory(cuda_allocated=5, sources={"cuda_allocated": "c"})
    sample = memory.to_sample(system, process, device)
    # pressure (this platform has none) and unused device fields are left out; swap_used is
    # unreadable so it is present as None.
    assert sample == {
        "available": 40,
        "available_pct": 40.0,
        "swap_used": None,
        "footprint": 7,
        "cuda_allocated": 5,
    }
    assert memory.sample_sources(system, process, device) == {
        "available": "a",
        "available_pct": "p",
        "footprint": "f",
        "cuda_allocated": "c",
    }
    assert memory.sample_errors(system, process, device) == {"swap_used": "gone"}


def test_live_sample_has_the_trace_keys():
    sample = memory.to_sample(read_system(), read_process(tree=True), read_device())
    assert {"footprint", "available", "available_pct", "swap_used"} <= set(sample)
    assert all(v is None or v >= 0 for v in sample.values())
    assert isinstance(sample["footprint"], int) and sample["footprint"] > 0
