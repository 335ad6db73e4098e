"""release(): weights go to meta, memory goes back to the OS, released modules fail clearly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stageload import ReleasedModuleError, release
from stageload.hooks.registry import HookRegistry, ModuleHook
from stageload.hooks.release import is_released, module_bytes

TESTS = Path(__file__).parents[1]


def run_script(code: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter (memory figures need a clean process)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


RESIDENT = """
import os, sys, psutil
def resident():
    # Anonymous resident memory: the weights are anonymous, and unlike RSS this
    # leaves out file pages the interpreter maps.
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["RssAnon"].split()[0]) * 1024
    return psutil.Process().memory_info().rss
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_release_returns_memory_to_the_os_while_a_reference_is_held():
    out = run_script(
        RESIDENT
        + """
from fixtures.tiny import big_model
from stageload import release
model = big_model(256 * 2**20)            # 256 small 64 KiB tensors + 16 MiB ones
held = model                              # other code still holds the module...
weight = model.large[0]                   # ...and one of its tensors
before = resident()
freed = release(model, name="big", stage="next")
after = resident()
print(freed, before - after, 0 if weight.is_meta else weight.untyped_storage().nbytes())
"""
    )
    freed, dropped, held_bytes = map(int, out.split())
    assert freed >= 256 * 2**20
    assert dropped >= 0.9 * freed, (
        f"only {dropped / 2**20:.0f} MiB of {freed / 2**20:.0f} MiB came back"
    )
    assert held_bytes == 0  # the held tensor is released too (meta, or its storage empty)


LEAK_LOOPS = """
import torch
from safetensors.torch import load_file, save_file
from stageload import StagedModels
from fixtures.tiny import big_model
path = {path!r}
save_file(big_model(32 * 2**20).state_dict(), path)
kept = []

def loop(leak, cycles):
    def load():
        with torch.device("meta"):
            model = big_model(32 * 2**20)
        # Every byte into anonymous memory: load_state_dict copies into the fresh storage.
        # (assign=True would keep safetensors' file-backed mmap, which RssAnon never shows.)
        model.to_empty(device="cpu").load_state_dict(load_file(path))
        if leak:  # the control: a loader that keeps a copy of its weights
            kept.append([t.clone() for t in model.state_dict().values()])
        return model

    models = StagedModels({{"m": load}}, stages={{"use": ["m"], "idle": []}})
    def cycle():
        models.enter("use"); models["m"]; models.enter("idle")
    cycle()
    start = resident()
    for _ in range(cycles - 1):
        cycle()
    print(start, resident())

loop(leak=False, cycles=100)
loop(leak=True, cycles=5)  # five are enough (each keeps 32 MiB) and keep memory small
"""


@pytest.fixture(scope="module")
def leak_loops(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, int]]:
    """Anonymous resident memory after the first and the last load/release cycle: 100
    cycles with a clean loader, then 5 with a leaking one, in one fresh process."""
    path = str(tmp_path_factory.mktemp("leak") / "m.safetensors")
    out = run_script(RESIDENT + LEAK_LOOPS.format(path=path), 300)
    clean, leaking = (tuple(map(int, line.split())) for line in out.split("\n")[:2])
    return {"clean": clean, "leaking": leaking}  # type: ignore[dict-item]


def grew(start: int, end: int) -> str | None:
    """The leak check: why it failed, or None."""
    if end <= start * 1.10:
        return None
    return f"resident memory grew from {start >> 20} MiB to {end >> 20} MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_hundred_load_release_cycles_do_not_leak(leak_loops):
    assert grew(*leak_loops["clean"]) is None, grew(*leak_loops["clean"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_leak_check_catches_a_loader_that_keeps_its_weights(leak_loops):
    """Control: the same loop and check with a leaking loader must fail."""
    assert grew(*leak_loops["leaking"]) is not None, leak_loops["leaking"]


def test_calling_released_module_or_submodule_raises_clear_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    inner = model[0]
    release(model, name="decoder", stage="export")
    x = torch.zeros(1, 4)
    for target in (model, inner, model[2]):
        with pytest.raises(ReleasedModuleError, match="'decoder'.*'export'") as info:
            target(x)
        assert info.value.name == "decoder" and info.value.stage == "export"
    with pytest.raises(ReleasedModuleError):
        inner.forward(x)  # direct forward calls too, not only __call__
    assert all(p.is_meta for p in model.parameters())
    assert is_released(model) and is_released(inner)


def test_released_module_keeps_shapes_and_dtypes_on_meta():
    model = nn.Linear(8, 3).to(torch.float64)
    release(model)
    assert model.weight.shape == (8, 3)[::-1] and model.weight.dtype == torch.float64
    assert isinstance(model.weight, nn.Parameter)


def released_in_inference_mode_answers() -> set[bool]:
    """A model made under ``torch.inference_mode()`` (a script's whole run is often in
    one), released outside it: what its tensors' ``is_inference()`` answer."""
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert {t.is_inference() for t in model.state_dict().values()} == {True}
    release(model)
    return {t.is_inference() for t in model.state_dict().values()}


def test_a_released_tensor_answers_is_inference_as_it_did():
    assert released_in_inference_mode_answers() == {True}


def test_control_a_twin_made_in_the_callers_mode_answers_false(monkeypatch):
    import stageload.hooks.release as release_module

    def twin(t: torch.Tensor) -> torch.Tensor:
        meta = torch.empty_like(t, device="meta")
        return (
            nn.Parameter(meta, requires_grad=t.requires_grad)
            if isinstance(t, nn.Parameter)
            else meta
        )

    monkeypatch.setattr(release_module, "_meta_twin", twin)
    assert released_in_inference_mode_answers() == {False}


def test_shared_storage_with_kept_module_survives():
    backbone = nn.Linear(16, 16)
    a = nn.Sequential(backbone, nn.Linear(16, 4))
    b = nn.Sequential(backbone, nn.Linear(16, 2))
    x = torch.randn(3, 16)
    expected = b(x)
    freed = release(a, name="a", keep=[b])
    assert freed == module_bytes(nn.Linear(16, 4))  # only a's own head
    assert torch.equal(b(x), expected)  # b still works, backbone intact
    assert not is_released(backbone)
    with pytest.raises(ReleasedModuleError):
        a(x)


def test_shared_tensor_storage_across_distinct_modules_survives():
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = a.weight  # tied: same Parameter in two different modules
    release(a, keep=[b])
    assert not b.weight.is_meta and b.weight.untyped_storage().nbytes() == 8 * 8 * 4


def test_tied_weights_are_counted_once_and_stay_tied():
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert release(model) == 100 * 16 * 4
    assert model["emb"].weight is model["head"].weight


def test_release_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        release(torch.zeros(3))  # type: ignore[arg-type]


def test_unmark_released_restores_only_our_forward():
    from stageload.hooks.release import unmark_released

    model = nn.Linear(2, 2)
    release(model)
    unmark_released(model)
    assert not is_released(model) and "forward" not in vars(model)
    other = nn.Linear(2, 2)
    custom = lambda x: x  # noqa: E731
    other.forward = custom
    unmark_released(other)
    assert other.forward is custom


def _sigint_at(monkeypatch: pytest.MonkeyPatch, nth: int) -> list[int]:
    """A real SIGINT when the ``nth`` tensor goes to meta (Python's handler raises
    KeyboardInterrupt there, as a Ctrl-C does); returns the count of tensors moved."""
    import signal

    import stageload.hooks.release as release_module

    real, moved = release_module._to_meta, []

    def interrupted(*args: object) -> object:
        moved.append(1)
        if len(moved) == nth:
            signal.raise_signal(signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(release_module, "_to_meta", interrupted)
    return moved


def _three_layers() -> tuple[nn.Module, list[str]]:
    class Told(ModuleHook):
        def released(self, module: nn.Module) -> None:
            told.append("released")

    told: list[str] = []
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    HookRegistry.attach(model).add("told", Told())
    return model, told


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_inside_a_release_is_raised_once_the_module_is_released_whole(monkeypatch):
    """The interrupt lands after the first tensor went to meta: the release goes on to
    the last tensor and tells the module's hooks, then the interrupt is raised."""
    model, told = _three_layers()
    moved = _sigint_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        release(model, name="m")
    assert len(moved) == 7  # six tensors; the second again, as the interrupt came first
    assert all(t.is_meta for t in model.state_dict().values())
    assert is_released(model) and told == ["released"]
    with pytest.raises(ReleasedModuleError):
        model(torch.zeros(1, 8))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_control_without_finishing_a_ctrl_c_leaves_the_module_half_on_meta(monkeypatch):
    import stageload.hooks.release as release_module

    def once(step: Callable[[], None]) -> BaseException | None:
        try:
            step()
        except KeyboardInterrupt as exc:
            return exc
        return None

    monkeypatch.setattr(release_module, "to_the_end", once)
    model, told = _three_layers()
    _sigint_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        release(model, name="m")
    on_meta = [t.is_meta for t in model.state_dict().values()]
    assert any(on_meta) and not all(on_meta) and told == []


def test_ctrl_c_as_a_tensor_went_to_meta_still_frees_its_storage_and_keeps_ties(monkeypatch):
    """The interrupt lands just after the first tensor went to meta (CPython raises a
    signal's exception as a call returns): the next pass skips that tensor, now on meta,
    yet its storage is emptied, and a weight tied to it stays tied. Views held elsewhere
    make each tensor take the twin path (``swap_tensors`` refuses a tensor so held)."""
    import stageload.hooks.release as release_module

    real, calls = release_module._to_meta, []

    def interrupted_after(*args: Any) -> Any:
        out = real(*args)
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(release_module, "_to_meta", interrupted_after)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    model[1].weight = model[0].weight  # tied
    views = [p.detach() for p in model.parameters()]
    with pytest.raises(KeyboardInterrupt):
        release(model)
    assert all(v.untyped_storage().nbytes() == 0 for v in views)
    assert model[1].weight is model[0].weight and model[0].weight.is_meta
