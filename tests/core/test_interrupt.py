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


def _sigint_in_a_release(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A real SIGINT while ``name``'s second tensor goes to meta."""
    import stageload.hooks.release as release_module

    real, moved = release_module._to_meta, []

    def interrupted(sub: nn.Module, *args: object) -> object:
        if getattr(sub, "tag", None) == name:
            moved.append(1)
            if len(moved) == 2:
                signal.raise_signal(signal.SIGINT)
        return real(sub, *args)

    monkeypatch.setattr(release_module, "_to_meta", interrupted)


def _tagged(name: str) -> nn.Module:
    layer = nn.Linear(4, 4)
    layer.tag = name
    return layer


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_in_a_stage_change_releases_every_model_it_decided_to(monkeypatch):
    """Entering stage b releases x and y; a Ctrl-C lands inside x's release. Both end
    released (y's memory is not left waiting for some later access), the trace says
    both, and the next access of x loads it again."""
    sink = stageload.ListSink()
    models = StagedModels(
        {n: (lambda n=n: _tagged(n)) for n in "xyz"},
        stages={"a": ["x", "y"], "b": ["z"]},
        events=sink,
    )
    models.enter("a")
    x, y = models["x"], models["y"]
    _sigint_in_a_release(monkeypatch, "x")
    with pytest.raises(KeyboardInterrupt):
        models.enter("b")
    assert all(t.is_meta for t in [*x.parameters(), *y.parameters()])
    released = [e for e in sink.events if e.kind == "release"]
    assert [e.model for e in released] == ["x", "y"]
    assert released[0].bytes is None and "interrupted" in (released[0].note or "")
    assert models.loaded() == []
    assert not any(t.is_meta for t in models["x"].parameters())


def test_control_a_drain_that_stops_at_the_first_raise_leaves_the_other_loaded(monkeypatch):
    """The check above can fail: an error (not an interrupt) ends the drain at once, as
    an interrupt did before, and y stays loaded."""
    import stageload.hooks.release as release_module

    def failing(sub: nn.Module, *args: object) -> object:
        raise RuntimeError("stop")

    models = StagedModels(
        {n: (lambda n=n: _tagged(n)) for n in "xyz"}, stages={"a": ["x", "y"], "b": ["z"]}
    )
    models.enter("a")
    y = models["y"]
    monkeypatch.setattr(release_module, "_to_meta", failing)
    with pytest.raises(RuntimeError):
        models.enter("b")
    assert not any(t.is_meta for t in y.parameters())


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_while_a_release_waits_for_a_call_in_flight_leaves_the_model_loaded():
    """Another thread's call of x is in flight; entering stage b waits for it before
    releasing x, and Ctrl-C lands there: x was not touched, so it stays loaded and listed,
    and once the call ends the next stage change releases it."""
    inside, leave = threading.Event(), threading.Event()

    class Blocking(nn.Linear):
        def forward(self, x: object) -> object:
            inside.set()
            leave.wait(HANG)
            return super().forward(x)

    class InterruptOnWait:
        def emit(self, event: object) -> None:
            if "waits for" in (getattr(event, "note", None) or ""):
                signal.raise_signal(signal.SIGINT)

    models = StagedModels(
        {"x": lambda: Blocking(4, 4), "z": lambda: nn.Linear(4, 4)},
        stages={"a": ["x"], "b": ["z"]},
        events=InterruptOnWait(),
    )
    models.enter("a")
    x = models["x"]
    import torch

    caller = threading.Thread(target=x, args=(torch.zeros(1, 4),))
    caller.start()
    assert inside.wait(HANG)
    with pytest.raises(KeyboardInterrupt):
        models.enter("b")
    assert "x" in models.loaded()
    assert not any(t.is_meta for t in x.parameters())
    leave.set()
    caller.join(HANG)
    models.enter("b")
    assert all(t.is_meta for t in x.parameters()) and models.loaded() == []
