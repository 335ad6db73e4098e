"""``.to()`` (and ``.half()``, ``.cuda()``: ``nn.Module._apply``) of a model auto holds
released: taken without loading it. The everyday lines: ``pipe.to(device)`` right after
``from_pretrained``, ``pipe.to(dtype)`` between calls, and accelerate's model offloading
(``enable_model_cpu_offload``), which moves each model at every call. Before, each such
move loaded the model: ``pipe.to("cpu")`` read every component at once, and offloading
made 15 reloads for 1 in two calls (a design-reading helper's finding). Reference for
every output: the same lines without auto, this process, torch on one thread."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import stageload.autostage  # noqa: E402
from stageload import ListSink  # noqa: E402
from stageload.autostage import AutoSession, auto  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SD = FAMILIES["sd"]
#: Room for two of tiny SD's three components: each call releases one.
BUDGET = 400_000


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    return folder(SD, tmp_path_factory.mktemp("to"))


def run(
    path: Path,
    script: Callable[[Any, Callable[[], list[str]]], list[Any]],
    *,
    on: bool,
    sink: ListSink | None = None,
    budget: int = BUDGET,
    **load: Any,
):
    """``script(pipe, loads)`` with auto on or off; ``loads()`` lists the loads and reloads
    so far (empty without auto). Returns the script's outputs and the loads."""
    sink = sink if sink is not None else ListSink()

    def loads() -> list[str]:
        return [f"{e.kind} {e.model}" for e in sink.events if e.kind in ("load", "reload")]

    def body() -> list[Any]:
        pipe = SD.load(path, **load)
        pipe.set_progress_bar_config(disable=True)
        return script(pipe, loads)

    if not on:
        return body(), []
    with auto(budget=budget, events=sink, prefetch=False):
        return body(), loads()


def held(pipe: Any) -> int:
    """The bytes the pipeline's components hold in memory now (their storages, once)."""
    seen: dict[int, int] = {}
    for name in ("text_encoder", "unet", "vae"):
        for t in [*getattr(pipe, name).parameters(), *getattr(pipe, name).buffers()]:
            storage = t.untyped_storage()
            if storage.data_ptr():
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def image(pipe: Any, seed: int = 0) -> torch.Tensor:
    return pipe(**SD.call(seed))[0]


def both(path: Path, script: Callable[..., list[Any]]) -> list[str]:
    """Run ``script`` eager and under auto; the outputs must be equal bit for bit."""
    want, _ = run(path, script, on=False)
    got, loads = run(path, script, on=True)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w) if isinstance(g, torch.Tensor) else g == w, (g, w)
    return loads


def test_pipe_to_right_after_from_pretrained_reads_nothing(path: Path):
    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        pipe.to("cpu")
        read = loads()
        return [read == [], image(pipe)]

    both(path, script)  # eager's first item is [] == [] too


def test_pipe_to_a_dtype_between_calls_reloads_nothing_and_gives_eagers_output(path: Path):
    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        first = image(pipe)
        before = loads()
        pipe.to(torch.float64)
        moved = loads() == before
        # the released components answer the new dtype (diffusers casts inputs by it)
        dtypes = [pipe.unet.dtype, pipe.text_encoder.dtype, pipe.vae.dtype]
        return [first, moved, dtypes, image(pipe), image(pipe, 1)]

    both(path, script)


@pytest.mark.parametrize("when", ["before the first call", "between calls"])
def test_a_round_trip_through_bfloat16_keeps_its_rounding(path: Path, when: str):
    """float32 -> bfloat16 -> float32 changes the values (rounded); a reload must give the
    rounded ones, whether the trip was made before the first load (replayed on it) or
    while the models were released (recorded in the dtypes each reload goes through)."""

    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        out = [] if when == "before the first call" else [image(pipe)]
        pipe.to(torch.bfloat16)
        pipe.to(torch.float32)
        return [*out, image(pipe), image(pipe, 1)]

    both(path, script)


def test_a_round_trip_while_a_model_is_loaded_leaves_it_staged(path: Path):
    """The VAE is loaded when the script rounds it through bfloat16 (the last model of
    the call, with room for nothing): its reload must give the rounded values, and the
    model must go on being released. The round trip read as a change by the script: the
    VAE was kept loaded for good (a new-user helper's finding)."""
    sink = ListSink()

    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        first = image(pipe)
        pipe.to(torch.bfloat16)
        pipe.to(torch.float32)
        return [first, image(pipe), image(pipe, 1)]

    want, _ = run(path, script, on=False)
    got, _ = run(path, script, on=True, sink=sink, budget=1)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert [e.note for e in sink.events if "kept loaded" in (e.note or "")] == []
    # released at each of the two later calls (the text encoder needs the room)
    assert sum(e.kind == "release" and e.model == "vae" for e in sink.events) == 2


@pytest.mark.parametrize("when", ["before the first call", "after a call"])
def test_the_budget_holds_when_the_script_converts_models_to_a_larger_dtype(path: Path, when: str):
    """Loaded in bfloat16, then ``pipe.to(torch.float32)``: each model doubles. Auto kept
    the sizes of the loads and checked the budget only at loads: all three stayed loaded,
    6 % over it, call after call (a new-user helper's finding)."""

    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        out = []
        if when == "after a call":
            out.append(image(pipe))
        pipe.to(torch.float32)
        for seed in range(3):
            out.append(image(pipe, seed))
            out.append(held(pipe) <= BUDGET)
        return out

    want, _ = run(path, script, on=False, torch_dtype=torch.bfloat16)
    got, _ = run(path, script, on=True, torch_dtype=torch.bfloat16)
    images = [g for g in got if isinstance(g, torch.Tensor)]
    wanted = [w for w in want if isinstance(w, torch.Tensor)]
    assert all(torch.equal(g, w) for g, w in zip(images, wanted, strict=True))
    assert [g for g in got if not isinstance(g, torch.Tensor)] == [True] * 3


def test_control_without_taking_the_conversion_of_a_loaded_model_the_budget_is_over(
    path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(AutoSession, "converted_loaded", lambda self, model: None)

    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        image(pipe)
        pipe.to(torch.float32)
        return [held(pipe) for seed in range(3) if image(pipe, seed) is not None]

    got, _ = run(path, script, on=True, torch_dtype=torch.bfloat16)
    assert max(got) > BUDGET


def test_model_cpu_offload_moves_released_models_without_reloading_them(path: Path):
    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        pipe.enable_model_cpu_offload(device="cpu")
        return [image(pipe), image(pipe, 1)]

    loads = both(path, script)
    assert sum(x.startswith("reload") for x in loads) <= 1, loads


def offload_after_a_call(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
    """A call, then ``enable_model_cpu_offload(device="cpu")``, then two more; with where
    the UNet's weights sit (address mod 64) as its forward runs at the second call."""
    first = image(pipe)
    pipe.enable_model_cpu_offload(device="cpu")
    seen: list[list[int]] = []

    def where(*_: Any) -> None:
        if not seen:
            seen.append([t.data_ptr() % 64 for t in pipe.unet.state_dict().values()])

    pipe.unet.conv_in.register_forward_pre_hook(where)
    return [first, image(pipe), image(pipe, 1), seen[0]]


def test_model_cpu_offload_enabled_after_a_call_gives_eagers_output(path: Path):
    """Offloading moves each model to ``cpu:0`` at every call, and torch copies a CPU
    tensor for it (``cpu:0`` is not ``cpu``): eager's weights sit in fresh, 64-byte aligned
    memory. A released UNet took the move as no change, and its reload left each weight
    mapped at its file offset (8 to 56 mod 64): the second call differed from eager's by
    2.7e-7 (a helper's finding; the alignment differs on every CPU, the rounding here)."""
    both(path, offload_after_a_call)


def test_control_without_the_copy_of_a_move_to_cpu_0_the_weights_sit_elsewhere(
    path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(stageload.autostage, "fresh_memory", lambda *a: set())
    want, _ = run(path, offload_after_a_call, on=False)
    got, _ = run(path, offload_after_a_call, on=True)
    assert set(want[-1]) == {0}
    assert got[-1] != want[-1]


def test_a_memory_format_conversion_of_a_released_model_loads_it_first(path: Path):
    """channels_last cannot be taken on meta (a 1x1 kernel is contiguous in both formats,
    so the strides are not the dtype's to record): the unet loads, then converts."""

    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        first = image(pipe)
        pipe.unet.to(memory_format=torch.channels_last)
        return [first, image(pipe)]

    both(path, script)


def test_control_loading_for_each_move_reloads_at_every_offload(
    path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The checks above can fail: with moves of released models taken by loading them (as
    before), offloading reloads at every call, and ``pipe.to`` reads everything."""
    monkeypatch.setattr(AutoSession, "convert_released", lambda *a, **k: False)

    def offload(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        pipe.enable_model_cpu_offload(device="cpu")
        return [image(pipe), image(pipe, 1)]

    _, loads = run(path, offload, on=True)
    assert sum(x.startswith("reload") for x in loads) > 5, loads

    def to(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        pipe.to("cpu")
        return [loads()]

    (read,), _ = run(path, to, on=True)
    assert read, "pipe.to loaded nothing"


def test_a_move_to_a_device_there_is_not_raises_without_loading(path: Path):
    """``.to("cuda:999")`` of a released model raises torch's own error at once, as eager
    does, and loads nothing for it; the pipeline goes on as before."""
    sink = ListSink()

    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        first = image(pipe)
        before = loads()
        with pytest.raises((RuntimeError, AssertionError)):  # no CUDA / no such device
            pipe.text_encoder.to("cuda:999")
        return [first, loads() == before, image(pipe, 1)]

    want, _ = run(path, script, on=False)
    got, _ = run(path, script, on=True, sink=sink, budget=1)  # the text encoder released
    assert got[1] is True
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
