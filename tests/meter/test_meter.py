"""MemoryMeter and ``stageload meter``: real processes, real /proc counters, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fixtures.traces import MIB
from stageload.cli import main
from stageload.core.events import Event
from stageload.meter import MemoryMeter, count_samples
from stageload.meter.tracefile import read_records

SRC = str(Path(__file__).resolve().parents[2] / "src")
TESTS = str(Path(__file__).resolve().parents[1])

needs_proc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, TESTS, env.get("PYTHONPATH", "")])
    return env


def _types(records: list[dict]) -> list[str]:
    return [r["type"] for r in records]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` no longer runs (a detached sampler is reaped by init)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:  # a zombie waiting for init to reap it no longer runs either
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _wait_samples(path: Path, n: int, timeout: float = 30.0) -> None:
    """Wait until the trace at ``path`` holds ``n`` sample records."""
    deadline = time.monotonic() + timeout
    while (count_samples(path) or 0) < n:
        assert time.monotonic() < deadline, f"fewer than {n} samples in {timeout} s"
        time.sleep(0.01)


def _tiny_staged(tmp_path: Path, meter: MemoryMeter):
    from fixtures.tiny import load_block, save_block
    from stageload.core.staged import StagedModels

    files = {
        name: save_block(tmp_path / f"{name}.safetensors", seed=i)
        for i, name in enumerate(["encoder", "decoder"])
    }
    loaders = {name: (lambda p=path: load_block(p)) for name, path in files.items()}
    return StagedModels(
        loaders, stages={"encode": ["encoder"], "decode": ["decoder"]}, events=meter
    )


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_meter_records_samples_events_marks_and_end(tmp_path: Path, sampler: str) -> None:
    import torch

    path = tmp_path / "run.jsonl"
    with MemoryMeter(path, 0.02, sampler=sampler, meta={"label": "staged"}) as meter:
        assert meter.sampler == sampler
        models = _tiny_staged(tmp_path, meter)
        models.enter("encode")
        models["encoder"](torch.ones(2, 32))
        models.enter("decode")
        models["decoder"](torch.ones(2, 32))
        meter.mark("decoded")
        _wait_samples(path, 2)  # a state, not a sleep: the stop adds the third
    models.close()  # after the meter stopped: its events are dropped, not an error
    records = read_records(path)
    start, end = records[0], records[-1]
    assert start["type"] == "start" and end["type"] == "end"
    assert start["sampler"] == sampler and start["pid"] == os.getpid()
    assert start["meta"] == {"label": "staged"} and start["interval"] == 0.02
    assert start["total"] > 0 and "footprint" in start["sources"]
    assert start["versions"]["torch"] == torch.__version__
    events = [(r["kind"], r.get("model"), r.get("stage")) for r in records if r["type"] == "event"]
    assert events == [
        ("stage", None, "encode"),
        ("load", "encoder", "encode"),
        ("stage", None, "decode"),
        ("release", "encoder", "decode"),
        ("load", "decoder", "decode"),
    ]
    samples = [r for r in records if r["type"] == "sample"]
    assert end["samples"] == len(samples) == meter.samples >= 3
    assert all(s["footprint"] > 10 * MIB and s["available"] > 0 for s in samples)
    assert all(0 < s["available_pct"] <= 100 for s in samples)
    assert [r["label"] for r in records if r["type"] == "mark"] == ["decoded"]
    assert not [r for r in records if r["type"] == "error"]
    ts = [r["t"] for r in records[1:]]
    assert all(0 <= t <= end["t"] for t in ts)
    if sampler == "process":
        assert start["sampler_pid"] != os.getpid()
        assert _gone(start["sampler_pid"])


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_stop_takes_a_closing_sample_in_both_modes(tmp_path: Path, sampler: str) -> None:
    """With an interval longer than the run, the samples are the first one and the closing
    one taken at stop, after the last mark: the process sampler used to skip the latter."""
    path = tmp_path / "run.jsonl"
    with MemoryMeter(path, 60, sampler=sampler) as meter:
        assert meter.sampler == sampler
        meter.mark("last")
    records = read_records(path)
    samples = [r for r in records if r["type"] == "sample"]
    (mark,) = [r for r in records if r["type"] == "mark"]
    assert len(samples) == records[-1]["samples"] == 2
    assert samples[0]["t"] <= mark["t"] <= samples[1]["t"] <= records[-1]["t"]


@needs_proc
def test_sampler_process_is_outside_the_measured_tree_and_loads_no_torch(tmp_path: Path) -> None:
    import psutil
    import torch  # noqa: F401  (imported here, so the sampler would inherit it if it could)

    with MemoryMeter(tmp_path / "run.jsonl", 0.05) as meter:
        sampler_pid = meter.start_record["sampler_pid"]  # type: ignore[index]
        children = [c.pid for c in psutil.Process().children(recursive=True)]
        assert sampler_pid not in children  # else the tree footprint would count it
        maps = Path(f"/proc/{sampler_pid}/maps").read_text()
        assert "libtorch" not in maps and "python" in maps
    assert _gone(sampler_pid)


_PEAK = textwrap.dedent(
    """
    import json, sys, threading, time
    from stageload.meter import MemoryMeter

    # list.sort(key=bytearray) builds one zeroed (touched) 64 MiB bytearray per item as its
    # sort key, compares them and frees them, all inside one C call that holds the GIL.
    items = [64 << 20] * 16
    gaps, stop = [], threading.Event()

    def ticker():  # proves the GIL was held: this thread could not run meanwhile
        last = time.monotonic()
        while not stop.wait(0.005):
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    with MemoryMeter(sys.argv[1], 0.02, sampler="process"), \\
            MemoryMeter(sys.argv[2], 0.02, sampler="thread"):
        tick = threading.Thread(target=ticker)
        tick.start()
        time.sleep(0.2)
        durations = []
        for _ in range(2):
            began = time.monotonic()
            items.sort(key=bytearray)
            durations.append(time.monotonic() - began)
            time.sleep(0.2)
        stop.set()
        tick.join()
    print(json.dumps({"durations": durations, "max_gap": max(gaps)}))
    """
)


@needs_proc
def test_process_sampler_sees_a_peak_that_the_thread_sampler_misses(tmp_path: Path) -> None:
    """A 1 GiB peak that lives only inside one GIL-holding C call."""
    by_process, by_thread = tmp_path / "process.jsonl", tmp_path / "thread.jsonl"
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(by_process), str(by_thread)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout)
    # The premise: each call held the GIL from start to end, so no thread ran during it.
    assert result["max_gap"] >= 0.9 * min(result["durations"])

    def growth(path: Path) -> int:
        footprints = [r["footprint"] for r in read_records(path) if r["type"] == "sample"]
        return max(footprints) - min(footprints)

    assert growth(by_process) >= 512 * MIB
    assert growth(by_thread) < 128 * MIB


# The events are the ones StagedModels emits for encode -> decode, sent by hand: importing
# torch would triple this child's start-up, and the path into the trace (meter.emit) is the
# same; test_meter_records_samples_events_marks_and_end covers StagedModels itself.
_KILLED = textwrap.dedent(
    """
    import sys, time
    from stageload.core.events import Event
    from stageload.meter import MemoryMeter

    meter = MemoryMeter(sys.argv[1], 0.02, sampler=sys.argv[2]).start()
    meter.emit(Event("stage", stage="encode"))
    meter.emit(Event("load", model="encoder", stage="encode", bytes=4096, seconds=0.01))
    meter.emit(Event("stage", stage="decode"))
    meter.emit(Event("release", model="encoder", stage="decode", bytes=4096, seconds=0.01))
    meter.mark("before kill")
    time.sleep(0.2)
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_trace_survives_sigkill_of_the_metered_process(tmp_path: Path, sampler: str) -> None:
    path = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(path), sampler],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = read_records(path)  # raises if any line but a half last one is broken
    types = _types(records)
    assert types[0] == "start" and "end" not in types
    assert types.count("sample") >= 3
    kinds = [r["kind"] for r in records if r["type"] == "event"]
    assert kinds == ["stage", "load", "stage", "release"]
    assert {"type": "mark", "label": "before kill"}.items() <= next(
        r for r in records if r["type"] == "mark"
    ).items()
    if sampler == "process":
        # The sampler notices its parent is gone and stops writing.
        assert _gone(records[0]["sampler_pid"])
        size = path.stat().st_size
        time.sleep(0.1)
        assert path.stat().st_size == size


def test_falls_back_to_a_thread_when_no_sampler_process_can_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    path = tmp_path / "run.jsonl"
    with pytest.warns(RuntimeWarning, match="sampling from a thread"):
        meter = MemoryMeter(path, 0.02).start()
    meter.stop()
    records = read_records(path)
    assert records[0]["sampler"] == "thread" and meter.sampler == "thread"
    (error,) = [r for r in records if r["type"] == "error"]
    assert error["field"] == "sampler" and "no-python-here" in error["message"]
    assert _types(records).count("sample") >= 2  # the first one and the one at stop


def test_meter_of_another_process_measures_that_process(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; x = b'1' * (200 << 20); print(1, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "1\n"
        with MemoryMeter(tmp_path / "run.jsonl", 0.02, pid=child.pid, tree=False) as meter:
            _wait_samples(meter.path, 2)
    finally:
        child.kill()
        child.wait()
    records = read_records(meter.path)
    assert records[0]["pid"] == child.pid and records[0]["tree"] is False
    footprints = [r["footprint"] for r in records if r["type"] == "sample"]
    assert min(footprints) >= 200 * MIB


def test_bad_arguments_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sampler must be 'process' or 'thread', got 'fork'"):
        MemoryMeter(tmp_path / "t.jsonl", sampler="fork")
    with pytest.raises(ValueError, match="interval must be from 0.01 s .* got 0"):
        MemoryMeter(tmp_path / "t.jsonl", 0)
    with pytest.raises(ValueError, match="invalid duration 'soon'"):
        MemoryMeter(tmp_path / "t.jsonl", "soon")
    with pytest.raises(ValueError, match="pid must be a positive process id, got -1"):
        MemoryMeter(tmp_path / "t.jsonl", pid=-1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(ValueError, match=f"no process with pid {dead.pid}"):
        MemoryMeter(tmp_path / "t.jsonl", pid=dead.pid).start()
    meter = MemoryMeter(tmp_path / "t.jsonl", 0.05, sampler="thread")
    with pytest.raises(RuntimeError, match="not running"):
        meter.mark("too early")
    meter.emit(Event("note", note="before start: dropped"))
    with meter, pytest.raises(RuntimeError, match="already started"):
        meter.start()
    meter.stop()  # twice is fine
    assert _types(read_records(meter.path)) == ["start", "sample", "sample", "end"]


def test_end_record_names_an_exception_that_ended_the_block(tmp_path: Path) -> None:
    with pytest.raises(KeyError), MemoryMeter(tmp_path / "t.jsonl", 0.05):
        raise KeyError("boom")
    end = read_records(tmp_path / "t.jsonl")[-1]
    assert end["type"] == "end" and end["exception"] == "KeyError: 'boom'"


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_cuda_memory_reaches_the_samples(tmp_path: Path, sampler: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    block = torch.ones(64 * MIB, device="cuda")  # 256 MiB
    with MemoryMeter(tmp_path / "t.jsonl", 0.02, sampler=sampler):
        time.sleep(0.2)
    del block
    records = read_records(tmp_path / "t.jsonl")
    assert "cuda_allocated" in records[0]["sources"]
    allocated = [r.get("cuda_allocated") for r in records if r["type"] == "sample"]
    assert max(a or 0 for a in allocated) >= 256 * MIB


# -- stageload meter -------------------------------------------------------------------


def _meter(tmp_path: Path, *code_or_cmd: str, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = list(code_or_cmd)
    if len(cmd) == 1:
        cmd = [sys.executable, "-c", cmd[0]]
    return ["meter", "-o", str(tmp_path / "t.jsonl"), "--interval", "0.02", *extra, "--", *cmd]


# A command holds its memory until the trace (flushed line by line; its path in
# $STAGELOAD_TEST_TRACE) has a sample that saw it: a state. Sleeping 0.3 s was a guess
# that a busy machine can break (the sampler's process gets no CPU in time). Bounded: 120 s.
WAIT_SAMPLED = (
    "import json, os, time; end = time.monotonic() + 120\n"
    "from stageload.traceformat import line_prefix\n"
    "def seen():\n"
    "    try:\n"
    "        lines = open(os.environ['STAGELOAD_TEST_TRACE'], 'rb').read().splitlines()\n"
    "    except OSError:\n"
    "        return False\n"
    "    for line in lines:\n"
    "        if line.startswith(line_prefix('sample')):\n"
    "            try:\n"
    "                if (json.loads(line).get('footprint') or 0) >= {mib} << 20: return True\n"
    "            except ValueError:\n"
    "                pass\n"
    "    return False\n"
    "while not seen() and time.monotonic() < end: time.sleep(0.005)\n"
)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (f"x = b'1' * (100 << 20); {WAIT_SAMPLED.format(mib=100)}", 0),
        ("raise SystemExit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + 9),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", 128 + 15),
    ],
)
def test_meter_command_passes_the_exit_code_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], code: str, expected: int, monkeypatch
) -> None:
    monkeypatch.setenv("STAGELOAD_TEST_TRACE", str(tmp_path / "t.jsonl"))
    assert main(_meter(tmp_path, code, extra=("--label", "x"))) == expected
    records = read_records(tmp_path / "t.jsonl")
    assert records[0]["meta"] == {"label": "x"}
    assert records[0]["command"] == [sys.executable, "-c", code]
    assert records[-1]["type"] == "end" and records[-1]["exit_code"] == expected
    if expected > 128:
        assert records[-1]["signal"] == signal.Signals(expected - 128).name
    err = capsys.readouterr().err
    assert f"stageload meter: exit {expected} after" in err
    assert "peak footprint" in err and "lowest available" in err
    if expected == 0:  # a short command still gets samples: the sampler starts first
        # A sample taken while the child is exiting cannot read it: that value is null, not 0.
        footprints = [r["footprint"] for r in records if r["type"] == "sample"]
        assert max((f for f in footprints if f is not None), default=0) >= 100 * MIB


def test_meter_command_measures_the_whole_tree(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STAGELOAD_TEST_TRACE", str(tmp_path / "t.jsonl"))
    grandchild = f"x = b'1' * (150 << 20); {WAIT_SAMPLED.format(mib=150)}"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"
    assert main(_meter(tmp_path, code, extra=("--sampler", "thread"))) == 0
    records = read_records(tmp_path / "t.jsonl")
    assert records[0]["sampler"] == "thread"
    # A sample taken while the command exits cannot read it: null, not 0 (failed once here).
    footprints = [r["footprint"] for r in records if r["type"] == "sample"]
    assert max((f for f in footprints if f is not None), default=0) >= 150 * MIB


def test_missing_command_exits_127(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_meter(tmp_path, "no-such-command-xyz", "arg")) == 127
    err = capsys.readouterr().err
    assert "stageload meter: cannot run 'no-such-command-xyz'" in err
    assert "Traceback" not in err
    assert not (tmp_path / "t.jsonl").exists()  # no empty trace left for 'report' to trip on


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["meter", "-o", "t.jsonl"], "no command given; put it after '--'"),
        (["meter", "--interval", "0", "--", "true"], "interval must be more than 0 seconds"),
        (["meter", "--interval", "soon", "--", "true"], "invalid duration 'soon'"),
        (["meter", "--sampler", "fork", "--", "true"], "invalid choice: 'fork'"),
        (["meter", "-o", "no/such/dir/t.jsonl", "--", "true"], "folder 'no/such/dir' does not"),
        (["meter", "-o", ".", "--", "true"], "-o '.': '.' is a folder; give the path of a file"),
        (
            ["meter", "-o", "", "--", "true"],
            "-o '': the file name is empty; give the path of a file",
        ),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_has_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["meter", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "stageload meter -o staged.jsonl" in out and "128+N" in out


# Default SIGINT handling, so that the command dies from the signal (exit 130) quietly.
_WAITS = (
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "print('ready', flush=True); time.sleep(30)"
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_meter_command_forwards_signals_to_the_command(tmp_path: Path, sig: int) -> None:
    path = tmp_path / "t.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stageload",
            "meter",
            "-o",
            str(path),
            "--",
            sys.executable,
            "-c",
            _WAITS,
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the child of `meter` gets the signal only if forwarded
    )
    try:
        # The command runs, so meter's forwarder is in (installed before it starts).
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig
    assert "Traceback" not in err
    end = read_records(path)[-1]
    assert end["type"] == "end" and end["exit_code"] == 128 + sig


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_readme_example_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fixed: bool,
) -> None:
    """The Python example of docs/meter.md, as written, then `stageload report` on it. It
    warns of nothing: it ran the models with gradients on, so the encoder's release warned
    of the autograd graph that held its weights. Control: the example without no_grad."""
    import warnings

    text = (Path(__file__).resolve().parents[2] / "docs" / "meter.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    if not fixed:
        broken = code.replace("with torch.no_grad():", "if True:", 1)
        assert broken != code
        code = broken
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        exec(compile(code, "docs/meter.md", "exec"), {"__name__": "__readme__"})
    assert (not said) is fixed, [str(w.message) for w in said]
    assert fixed or any("an autograd graph held" in str(w.message) for w in said)
    records = read_records(tmp_path / "staged.jsonl")
    kinds = [r["kind"] for r in records if r["type"] == "event"]
    assert kinds == ["stage", "load", "stage", "release", "load"]
    assert [r["label"] for r in records if r["type"] == "mark"] == ["done"]
    assert main(["report", str(tmp_path / "staged.jsonl")]) == 0
    assert "decode" in capsys.readouterr().out


_COUNTS_SIGINT = textwrap.dedent(
    """
    import signal, sys, time
    got = []
    signal.signal(signal.SIGINT, lambda *_: got.append(1))
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # room for a second, forwarded SIGINT to arrive
    sys.exit(10 + len(got))
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_ctrl_c_in_a_terminal_reaches_the_command_once(tmp_path: Path) -> None:
    """Ctrl-C signals the terminal's whole foreground group; meter must not send it again."""
    import pty

    path = tmp_path / "t.jsonl"
    argv = [
        sys.executable,
        "-m",
        "stageload",
        "meter",
        "-o",
        str(path),
        "--",
        sys.executable,
        "-c",
        _COUNTS_SIGINT,
    ]
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        try:
            os.execve(sys.executable, argv, _env())
        finally:
            os._exit(99)
    output = b""
    try:
        deadline = time.monotonic() + 60
        while b"ready" not in output and time.monotonic() < deadline:
            output += os.read(fd, 1024)
        assert b"ready" in output, output  # the command runs: meter's handlers are in
        os.write(fd, b"\x03")  # Ctrl-C, turned into SIGINT by the terminal driver
        while True:
            try:
                chunk = os.read(fd, 1024)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            output += chunk
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 11, output
    assert read_records(path)[-1]["exit_code"] == 11


def test_unwritable_trace_fails_clearly_and_leaves_no_sampler(tmp_path: Path) -> None:
    import psutil

    path = tmp_path / "no-such-dir" / "t.jsonl"
    meter = MemoryMeter(path)  # kept alive: its pipe to the sampler must be closed on purpose
    with pytest.raises(OSError, match="cannot open trace file .*no-such-dir"):
        meter.start()

    def samplers() -> list[int]:
        found = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            if str(path) in (proc.info["cmdline"] or []) and proc.info["status"] != "zombie":
                found.append(proc.pid)
        return found

    deadline = time.monotonic() + 10
    while samplers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert samplers() == []
    assert not meter.running


def test_unreadable_footprint_of_a_live_process_is_recorded_not_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root every /proc/PID/status is readable, so the unreadable footprint is faked; the
    process, the writer and the sampler are real. It must not look like 'process gone'."""
    import stageload.meter.sampler as meter_sampler
    from stageload.memory import ProcessMemory
    from stageload.meter.tracefile import TraceWriter

    unreadable = ProcessMemory(None, 0, {"footprint": "faked"}, {"footprint": "permission denied"})
    monkeypatch.setattr(meter_sampler, "read_process", lambda pid, tree=False: unreadable)
    with TraceWriter(tmp_path / "t.jsonl") as writer:
        sampler = meter_sampler.Sampler(writer, os.getpid())
        assert sampler.sample() and sampler.sample()
    records = read_records(tmp_path / "t.jsonl")
    samples = [r for r in records if r["type"] == "sample"]
    assert len(samples) == 2 and all(s["footprint"] is None for s in samples)
    errors = [r for r in records if r["type"] == "error"]
    assert errors == [{**errors[0], "field": "footprint", "message": "permission denied"}]


def test_a_gone_process_writes_no_sample(tmp_path: Path) -> None:
    from stageload.meter.sampler import Sampler
    from stageload.meter.tracefile import TraceWriter

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    with TraceWriter(tmp_path / "t.jsonl") as writer:
        assert not Sampler(writer, child.pid).sample()
    assert read_records(tmp_path / "t.jsonl") == []


def test_sampler_kill_spares_a_process_that_reused_its_pid(tmp_path: Path) -> None:
    """The detached sampler is reaped by init, so its pid can name another process later."""
    import psutil

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        meter = MemoryMeter(tmp_path / "t.jsonl", sampler="thread")
        created = psutil.Process(other.pid).create_time()
        meter._sampler_pid, meter._sampler_created = other.pid, created - 1.0  # not ours
        meter._kill_sampler()
        time.sleep(0.1)
        assert other.poll() is None
        meter._sampler_created = created  # the same process: it goes
        meter._kill_sampler()
        assert other.wait(timeout=10) == -signal.SIGKILL
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()


def test_count_samples_counts_the_sample_records_the_reader_reads(tmp_path: Path) -> None:
    """``count_samples`` matches lines by their start (``traceformat.line_prefix``), not by
    parsing: checked against the reader on a real trace, and on a file it cannot read."""
    path = tmp_path / "t.jsonl"
    with MemoryMeter(path, interval=0.01) as meter:
        meter.mark("inside")
    records = read_records(path)
    samples = sum(r["type"] == "sample" for r in records)
    assert samples >= 1 and count_samples(path) == samples
    assert len(records) > samples  # start, mark and end are not counted
    assert count_samples(tmp_path / "missing.jsonl") is None
