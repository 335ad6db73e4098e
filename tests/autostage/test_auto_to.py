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


def run(path: Path, script: Callable[[Any, Callable[[], list[str]]], list[Any]], *, on: bool):
    """``script(pipe, loads)`` with auto on or off; ``loads()`` lists the loads and reloads
    so far (empty without auto). Returns the script's outputs and the loads."""
    sink = ListSink()

    def loads() -> list[str]:
        return [f"{e.kind} {e.model}" for e in sink.events if e.kind in ("load", "reload")]

    def body() -> list[Any]:
        pipe = SD.load(path)
        pipe.set_progress_bar_config(disable=True)
        return script(pipe, loads)

    if not on:
        return body(), []
    with auto(budget=BUDGET, events=sink, prefetch=False):
        return body(), loads()


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


def test_model_cpu_offload_moves_released_models_without_reloading_them(path: Path):
    def script(pipe: Any, loads: Callable[[], list[str]]) -> list[Any]:
        pipe.enable_model_cpu_offload(device="cpu")
        return [image(pipe), image(pipe, 1)]

    loads = both(path, script)
    assert sum(x.startswith("reload") for x in loads) <= 1, loads


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
