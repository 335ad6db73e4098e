"""staged_pipeline with a memory budget and prefetch, on the Qwen-Image 2.1 fixture: sizes
from checkpoint headers, fewer loads, and outputs bit for bit equal to eager."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from stageload import ListSink  # noqa: E402
from stageload.diffusers import _plan, staged_pipeline  # noqa: E402
from stageload.testing import diffusers as fixtures  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()

CALL = {"height": 64, "width": 64, "num_inference_steps": 2, "output_resolution": 64}
PROMPT = "a lighthouse at night"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield fixtures.build("qwen-image-2.1", tmp_path_factory.mktemp("qwen") / "p")
    torch.set_num_threads(threads)


def _call(pipe: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe(PROMPT, generator=generator, output_type="pt", **CALL)[0]


def _staged(path: Path, **kwargs: Any) -> tuple[Any, ListSink]:
    sink = ListSink()
    pipe = staged_pipeline(diffusers.QwenImage21Pipeline, path, keep=(), events=sink, **kwargs)
    return pipe, sink


@pytest.fixture(scope="module")
def expected(qwen: Path) -> torch.Tensor:
    return _call(diffusers.QwenImage21Pipeline.from_pretrained(qwen))


def test_a_budget_that_fits_all_loads_each_component_once_with_sizes_from_headers(
    qwen: Path, expected: torch.Tensor
) -> None:
    pipe, sink = _staged(qwen, budget="1G")
    given = dict(pipe.stageload.models._given_sizes)
    assert set(given) == {"text_encoder", "transformer", "vae"}
    outs = [_call(pipe) for _ in range(3)]
    assert all(torch.equal(out, expected) for out in outs)
    loads = [e for e in sink.events if e.kind in ("load", "reload")]
    assert sorted(e.model for e in loads) == ["text_encoder", "transformer", "vae"]
    assert sink.kinds("release") == []
    # Header sizes within 1 % of the bytes really held: buffers a model computes (rotary
    # tables) are not in the checkpoint; the first load's measure replaces the header's.
    held = {e.model: e.bytes for e in loads}
    assert all(given[n] <= held[n] <= given[n] * 1.01 for n in given), (given, held)
    # bf16 from an fp32 checkpoint: half the bytes, still without reading weights.
    halves = _plan.component_sizes(qwen, dict.fromkeys(given, torch.bfloat16))
    assert all(abs(halves[n] * 2 - given[n]) <= given[n] // 100 for n in given)
    # Control: without a budget, every call reloads what the next stage does not list.
    pipe, sink = _staged(qwen)
    [_call(pipe) for _ in range(3)]
    assert len([e for e in sink.events if e.kind in ("load", "reload")]) == 9


def test_prefetch_under_a_tight_budget_is_bit_identical(qwen: Path, expected: torch.Tensor) -> None:
    sizes = _plan.component_sizes(
        qwen, dict.fromkeys(["text_encoder", "transformer", "vae"], torch.float32)
    )
    budget = sizes["text_encoder"] + sizes["transformer"]  # two of the three
    pipe, sink = _staged(qwen, budget=budget, prefetch=True)
    loaders = pipe.stageload.models._loaders
    assert all(getattr(f, "draws_random", True) is False for f in loaders.values())
    outs = [_call(pipe) for _ in range(3)]
    assert all(torch.equal(out, expected) for out in outs)
    assert sink.kinds("prefetch"), [(e.kind, e.model, e.stage) for e in sink.events]
    assert {e.reason for e in sink.kinds("release")} <= {"budget"}
