"""An interrupted load leaves the registry as it was (issue 33, item 2).

A loader ended by a BaseException (Ctrl-C's KeyboardInterrupt, SystemExit) left its
pending load behind, and the next ``models[name]`` waited on it forever. Now the
interruption reaches the caller as it is, and the next access loads again. Each check
has its control: the same with the clean-up (``StagedModels._interrupted``) taken away.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch import nn

import stageload
from stageload import StagedModels

CHILD = Path(__file__).parents[1] / "fixtures" / "interrupt_child.py"
SRC = Path(stageload.__file__).resolve().parents[1]
#: How long the next access may take before it counts as hung. The fixed path returns at
#: once (a Linear(2, 2)); only the control waits this long.
HANG = 10.0


def interrupt_in_loader(*flags: str) -> dict[str, object]:
    """Start the child, wait until its loader runs, send it SIGINT, read its report."""
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    with subprocess.Popen(
        [sys.executable, str(CHILD), str(HANG), *flags],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "loading"  # the loader runs now
        proc.send_signal(signal.SIGINT)
        try:  # bounded: the child reports within HANG seconds, or something is wrong
            out, _ = proc.communicate(timeout=HANG + 110)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("the child never reported after SIGINT") from None
        assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_in_a_loader_then_the_next_access_loads_again():
    assert interrupt_in_loader() == {"interrupted": True, "reloaded": True, "loads": 2}


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_control_ctrl_c_without_the_clean_up_leaves_the_next_access_hanging():
    assert interrupt_in_loader("--control") == {
        "interrupted": True,
        "reloaded": False,
        "loads": 1,
    }


def interrupting_loader(exc: type[BaseException]) -> tuple[dict[str, int], object]:
    calls = {"n": 0}

    def loader() -> nn.Module:
        calls["n"] += 1
        if calls["n"] == 1:
            raise exc()
        return nn.Linear(2, 2)

    return calls, loader


def next_access(models: StagedModels, name: str) -> list[object]:
    """``models[name]`` on a thread, given HANG seconds: an empty list means it hung."""
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(models[name]), daemon=True)
    thread.start()
    thread.join(HANG)
    return box


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_loader_raising_a_base_exception_leaves_nothing_behind(exc):
    calls, loader = interrupting_loader(exc)
    models = StagedModels({"m": loader}, stages={"s": ["m"]})
    models.enter("s")
    with pytest.raises(exc):  # the interruption itself, not wrapped
        models["m"]
    assert models.loaded() == []
    box = next_access(models, "m")
    assert box and isinstance(box[0], nn.Linear)
    assert calls["n"] == 2 and models.loaded() == ["m"]


def test_control_without_the_clean_up_the_next_access_hangs(monkeypatch):
    monkeypatch.setattr(StagedModels, "_interrupted", lambda self, job, exc: None)
    calls, loader = interrupting_loader(KeyboardInterrupt)
    models = StagedModels({"m": loader}, stages={"s": ["m"]})
    models.enter("s")
    with pytest.raises(KeyboardInterrupt):
        models["m"]
    assert next_access(models, "m") == []  # still waiting on the interrupted load
    assert calls["n"] == 1
