"""pipe.stageload.map: N calls of real local diffusers pipelines, stage-major, each equal to
that call run alone (bit for bit), each component loaded once per batch.

Reference: each call run alone on the same staged pipeline (not eager), in this process.
torch on one thread on both sides (conftest's ``one_thread``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import stageload.diffusers  # noqa: E402
from stageload import BatchError, ListSink  # noqa: E402
from stageload.diffusers import staged_pipeline  # noqa: E402
from stageload.testing import diffusers as fixtures  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()


# Tiny models run faster on one thread than on two contended ones (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("batch-pipelines")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = fixtures.build(family, root / family.replace(".", "_"))
        return cache[family]

    return get


def qwen_call(i: int, *, steps: int = 2, size: int = 64) -> dict[str, Any]:
    return {
        "prompt": f"a photo of cat number {i} on a red chair",
        "height": size,
        "width": size,
        "output_resolution": size,
        "num_inference_steps": steps,
        "output_type": "pt",
        "generator": torch.Generator().manual_seed(i),
    }


def wan_call(i: int, *, steps: int = 4) -> dict[str, Any]:
    return {
        "prompt": f"a cat number {i} walking",
        "height": 32,
        "width": 32,
        "num_frames": 5,
        "num_inference_steps": steps,
        "max_sequence_length": 16,
        "output_type": "pt",
        "generator": torch.Generator().manual_seed(i),
    }


def _loads(events: list[Any]) -> list[str]:
    return sorted(e.model for e in events if e.kind in ("load", "reload"))


def test_qwen_image_21_map_equals_each_call_alone_with_one_load_per_component(built: Any):
    sink = ListSink()
    pipe = staged_pipeline(
        diffusers.QwenImage21Pipeline, built("qwen-image-2.1"), keep=(), events=sink
    )
    calls = [qwen_call(0), qwen_call(1, steps=3), qwen_call(2, size=32)]
    alone = [pipe(**call).images for call in calls]
    for call, i in zip(calls, range(3), strict=True):  # fresh generators, same seeds
        call["generator"] = torch.Generator().manual_seed(i)
    before = len(sink.events)
    out = pipe.stageload.map(calls)
    assert [o.images.shape for o in out] == [a.shape for a in alone]
    assert all(torch.equal(o.images, a) for o, a in zip(out, alone, strict=True))
    events = sink.events[before:]
    assert [e.stage for e in events if e.kind == "stage"] == ["encode", "denoise", "decode"]
    assert _loads(events) == ["text_encoder", "transformer", "vae"]
    notes = [e for e in events if e.kind == "note" and e.note.startswith("batch:")]
    assert notes[-1].bytes > 0  # latents of three parked calls before decode


def test_wan22_switches_models_inside_the_loop_and_calls_keep_their_own_scheduler(built: Any):
    """Wan 2.2 enters denoise_2 in the middle of its denoising loop, so calls park there
    with their scheduler half-way; each call needs its own scheduler copy (control below)."""
    sink = ListSink()
    pipe = staged_pipeline(diffusers.WanPipeline, built("wan2.2"), keep=(), events=sink)

    def calls() -> list[dict[str, Any]]:
        return [wan_call(0), wan_call(1, steps=6)]

    alone = [pipe(**call).frames for call in calls()]
    before = len(sink.events)
    out = pipe.stageload.map(calls())
    assert all(torch.equal(o.frames, a) for o, a in zip(out, alone, strict=True))
    events = sink.events[before:]
    stages = [e.stage for e in events if e.kind == "stage"]
    assert stages == ["encode", "denoise", "denoise_2", "decode"]
    assert _loads(events) == ["text_encoder", "transformer", "transformer_2", "vae"]

    # Control: all calls on the one pipeline and scheduler.
    original = stageload.diffusers._own_copy
    stageload.diffusers._own_copy = lambda pipe: pipe
    try:
        broken = pipe.stageload.map(calls(), return_exceptions=True)
    finally:
        stageload.diffusers._own_copy = original
    same = [
        not isinstance(b, BaseException) and torch.equal(b.frames, a)
        for b, a in zip(broken, alone, strict=True)
    ]
    assert not all(same)


def test_sd3_negative_prompt_reentry_is_served_once_for_the_batch(built: Any):
    """One stage per kind of text encoder: each call goes clip, t5, clip, t5 (the negative
    prompt). The batch follows the same path once, whatever the number of calls."""
    stages = {
        "clip": ["text_encoder", "text_encoder_2"],
        "t5": ["text_encoder_3"],
        "denoise": ["transformer"],
        "decode": ["vae"],
    }
    sink = ListSink()
    pipe = staged_pipeline(
        diffusers.StableDiffusion3Pipeline, built("sd3"), stages=stages, keep=(), events=sink
    )

    def calls() -> list[dict[str, Any]]:
        return [
            {
                "prompt": f"a photo of cat number {i}",
                "height": 32,
                "width": 32,
                "num_inference_steps": 2,
                "max_sequence_length": 16,
                "output_type": "pt",
                "generator": torch.Generator().manual_seed(i),
            }
            for i in range(2)
        ]

    alone = [pipe(**call).images for call in calls()]
    one_call = [e.stage for e in sink.events if e.kind == "stage"][-6:]
    before = len(sink.events)
    out = pipe.stageload.map(calls())
    assert all(torch.equal(o.images, a) for o, a in zip(out, alone, strict=True))
    events = sink.events[before:]
    assert [e.stage for e in events if e.kind == "stage"] == one_call
    assert one_call == ["clip", "t5", "clip", "t5", "denoise", "decode"]
    loads = _loads(events)
    assert loads.count("text_encoder_3") == 2 and loads.count("transformer") == 1


def test_bad_calls_fail_before_running_and_a_failing_call_spares_the_others(built: Any):
    pipe = staged_pipeline(diffusers.WanPipeline, built("wan2.2"), keep=())
    with pytest.raises(TypeError, match="list of keyword-argument dicts"):
        pipe.stageload.map({"prompt": "a cat"})
    with pytest.raises(TypeError, match=r"calls\[1\] must be a dict"):
        pipe.stageload.map([wan_call(0), "a cat"])
    with pytest.raises(BatchError, match="items \\[1\\]") as info:
        pipe.stageload.map([wan_call(0), {**wan_call(1), "bogus_argument": 1}])
    assert isinstance(info.value.results[0].frames, torch.Tensor)


# -- torch.autocast around map ---------------------------------------------------------------------
def map_under_autocast(root: Path) -> tuple[list[Any], list[Any], list[Any]]:
    """Two seeded calls of a Stable Diffusion (``stageload.testing.families``) inside
    ``torch.autocast`` (bfloat16, the CPU's): by ``pipe.stageload.map``, by the eager
    pipeline one by one, and by the eager pipeline without autocast."""
    from stageload.testing.families import FAMILIES, folder

    sd = FAMILIES["sd"]
    path = folder(sd, root)
    ref, pipe = sd.load(path), staged_pipeline(sd.cls, path, keep=())
    calls = [sd.call(0), sd.call(1)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = [out[0] for out in pipe.stageload.map(calls)]
        want = [ref(**sd.call(i))[0] for i in range(2)]
    full = [ref(**sd.call(i))[0] for i in range(2)]
    return got, want, full


def test_map_inside_autocast_runs_each_call_under_it_as_eager(tmp_path: Path):
    """Reference: eager, the same calls one by one in the same autocast block."""
    got, want, full = map_under_autocast(tmp_path)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not any(torch.equal(g, f) for g, f in zip(got, full, strict=True))


def test_control_without_the_callers_autocast_map_computes_in_full_precision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr("stageload.core.batch._autocasts", lambda: ())
    got, want, full = map_under_autocast(tmp_path)
    assert not any(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(torch.equal(g, f) for g, f in zip(got, full, strict=True))
