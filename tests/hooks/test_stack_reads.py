"""A release reads the other threads' stacks (calls of modules without hooks, begun before
it) without crashing or hanging the process: a new-user helper's streamed model crashed
(segfault, or ``'function' object has no attribute 'f_code'``) within seconds with no
thread of its own, and releases in a ``releasing()`` block hung while threads started.
Each runs in a child process, with the read as it was before as the control."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).parents[1] / "fixtures" / "stack_reads.py"


def run(args: list[str], timeout: float) -> str:
    """``done`` or what went wrong: the exit code, or 'hung' past ``timeout``."""
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "hung"
    if done.returncode == 0 and done.stdout.startswith("done"):
        return "done"
    return f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"


def streamed(tmp: Path) -> list[str]:
    return ["streamed", str(tmp / "stack.safetensors"), "200"]


def test_a_streamed_model_whose_releases_read_other_threads_stacks_runs_on(tmp_path: Path):
    assert run(streamed(tmp_path), timeout=240) == "done"


def test_control_the_previous_read_crashes(tmp_path: Path) -> None:
    """Up to 3 tries: the crash came within 2 s in every run tried here, on CPython 3.11;
    a run that hangs past 30 s fails as well (the previous read hung or crashed; the
    fixed read takes about 5 s here, 6 x less). (The
    hang of ``grouped`` needs about 20,000 releases with the previous read: checked by
    hand, not here.)"""
    if sys.version_info >= (3, 12):
        pytest.skip("the frame races were read on CPython 3.11")
    results: list[str] = []
    for _ in range(3):
        results.append(run([*streamed(tmp_path), "--previous"], timeout=30))
        if results[-1] != "done":
            break
    assert results[-1] != "done", results
