"""Every stage a diffusers pipeline goes through shows, staged or not (issue 26).

A Qwen-Image 2.1 fixture whose VAE is far under ``_plan.STAGE_FRACTION`` of the
transformer: the VAE is not staged, yet the first use of it begins ``decode``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from stageload import ListSink  # noqa: E402
from stageload.diffusers import _marks, _plan, staged_pipeline  # noqa: E402
from stageload.testing import diffusers as fixtures  # noqa: E402
from stageload.testing.diffusers import Size  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()

CALL = {"height": 64, "width": 64, "num_inference_steps": 2, "output_resolution": 64}
PROMPT = "a photo of a cat sitting on a red chair"
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def small_vae(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text encoder and transformer of ~8-9 MB each, VAE of ~50 KB (0.6 % of the largest)."""
    root = tmp_path_factory.mktemp("marks")
    path = fixtures.build("qwen-image-2.1", root / "qwen", size=Size(hidden=256), vae_dim=4)
    sizes = fixtures.model_bytes(path)
    assert sizes["vae"] < _plan.STAGE_FRACTION * max(sizes.values()), sizes
    return path


# Tiny models run faster on one thread than on two contended ones (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")


def _call(pipe: Any, seed: int = 0) -> torch.Tensor:
    return pipe(PROMPT, generator=torch.Generator().manual_seed(seed), output_type="pt", **CALL)[0]


def _stages(sink: ListSink) -> list[str | None]:
    return [e.stage for e in sink.events if e.kind == "stage"]


def test_a_resident_vae_begins_decode_and_staged_equals_eager(small_vae: Path) -> None:
    """Reference: eager, ``QwenImage21Pipeline.from_pretrained`` with no stageload, in this
    process. torch on one thread on both sides (conftest's ``one_thread``)."""
    sink = ListSink()
    pipe = staged_pipeline(diffusers.QwenImage21Pipeline, small_vae, events=sink)
    assert pipe.stageload.plan == {
        "encode": ("text_encoder",),
        "denoise": ("transformer",),
        "decode": (),
    }
    assert "vae" not in pipe.stageload.models  # the staging decision is unchanged
    first, second = _call(pipe), _call(pipe)
    assert _stages(sink) == ["encode", "denoise", "decode"] * 2
    # Entering decode releases the transformer: decoding runs without it, as staged.
    releases = [(e.model, e.stage) for e in sink.events if e.kind == "release"]
    assert ("transformer", "decode") in releases
    eager = _call(diffusers.QwenImage21Pipeline.from_pretrained(small_vae))
    assert torch.equal(first, eager) and torch.equal(second, eager)


def test_a_batch_enters_decode_once_and_each_output_equals_its_call_alone(
    small_vae: Path,
) -> None:
    """Reference: each call run alone on the same staged pipeline (not eager), in this
    process. torch on one thread on both sides (conftest's ``one_thread``)."""
    sink = ListSink()
    pipe = staged_pipeline(diffusers.QwenImage21Pipeline, small_vae, events=sink)
    alone = [_call(pipe, seed) for seed in (0, 1)]
    sink.events.clear()
    calls = [
        dict(CALL, prompt=PROMPT, generator=torch.Generator().manual_seed(s), output_type="pt")
        for s in (0, 1)
    ]
    outs = pipe.stageload.map(calls)
    assert _stages(sink) == ["encode", "denoise", "decode"]  # stage-major: each once
    assert all(torch.equal(o[0], a) for o, a in zip(outs, alone, strict=True))


def test_a_use_before_denoising_does_not_begin_decode() -> None:
    """``vae.encode`` of an input image (img2img) runs in ``encode``, before denoising:
    it belongs there, as ``refine`` decides for a staged VAE. After denoising, it begins
    decode; in the next call's order, an encoder's first use begins encode."""
    order = ["encode", "denoise", "decode"]
    assert not _plan.mark_begins(order, "encode", "decode")
    assert not _plan.mark_begins(order, None, "decode")
    assert _plan.mark_begins(order, "denoise", "decode")  # control: the same use, later
    assert _plan.mark_begins(order, "decode", "encode")
    assert not _plan.mark_begins(order, "decode", "decode")
    wan = ["encode", "denoise", "denoise_2", "decode"]
    assert _plan.mark_begins(wan, "denoise_2", "decode")
    assert not _plan.mark_begins(wan, "denoise", "decode")


def test_a_component_in_several_stages_marks_none() -> None:
    plan = {"encode": ["te"], "denoise": ["t", "cn"], "denoise_2": ["t2", "cn"], "decode": ["vae"]}
    assert _plan.marks(plan, ["te", "t", "t2"]) == {"vae": "decode"}


def test_a_stages_plan_is_the_callers_own(small_vae: Path) -> None:
    sink = ListSink()
    stages = {"encode": ["text_encoder"], "denoise": ["transformer"]}
    pipe = staged_pipeline(diffusers.QwenImage21Pipeline, small_vae, stages=stages, events=sink)
    _call(pipe)
    assert _stages(sink) == ["encode", "denoise"]


SCRIPT = """
import sys, torch, diffusers
from stageload.diffusers import _marks, qwen_processor, staged_pipeline  # the fixture's
diffusers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
if sys.argv[2] == "off":  # the control: no marks attached
    _marks.attach = lambda *args, **kwargs: None
pipe = staged_pipeline(diffusers.QwenImage21Pipeline, sys.argv[1])
pipe({prompt!r}, generator=torch.Generator().manual_seed(0), output_type="pt", **{call!r})
"""


@pytest.mark.parametrize("marks", ["on", "off"])
def test_report_of_a_metered_run_has_a_decode_row(
    small_vae: Path, tmp_path: Path, marks: str
) -> None:
    """``stageload meter -- python gen.py`` then ``stageload report``, real processes;
    with the marks off (the control), the decode row is missing."""
    script = tmp_path / "gen.py"
    script.write_text(textwrap.dedent(SCRIPT.format(prompt=PROMPT, call=CALL)))
    trace = tmp_path / "run.jsonl"
    pythonpath = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    meter = [sys.executable, "-m", "stageload", "meter", "-o", str(trace), "--interval", "0.02"]
    run = subprocess.run(
        [*meter, "--", sys.executable, str(script), str(small_vae), marks],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = subprocess.run(
        [sys.executable, "-m", "stageload", "report", str(trace), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    stages = json.loads(report.stdout)["stages"]
    if marks == "on":
        assert stages == ["setup", "encode", "denoise", "decode"]
        table = subprocess.run(
            [sys.executable, "-m", "stageload", "report", str(trace)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        rows = [line.strip("| ").split("|")[0].strip() for line in table.splitlines()]
        assert "decode" in rows, table
    else:
        assert stages == ["setup", "encode", "denoise"]


def test_the_mark_is_a_hook_of_the_one_protocol(small_vae: Path) -> None:
    from stageload.hooks.registry import HookRegistry

    pipe = staged_pipeline(diffusers.QwenImage21Pipeline, small_vae)
    for sub in pipe.vae.modules():
        registry = HookRegistry.of(sub)
        assert registry is not None and isinstance(registry.get(_marks.MARK), _marks.StageMark)


def _leaf(module: torch.nn.Module) -> torch.nn.Module:
    """A submodule that takes any tensor (an activation): calling it runs its hooks."""
    kinds = (torch.nn.SiLU, torch.nn.GELU, torch.nn.ReLU, torch.nn.Dropout, torch.nn.Identity)
    return next(m for m in module.modules() if isinstance(m, kinds))


def test_a_replaced_or_copied_component_marks_nothing(small_vae: Path) -> None:
    import copy

    sink = ListSink()
    pipe = staged_pipeline(diffusers.QwenImage21Pipeline, small_vae, events=sink)
    old = pipe.vae
    pipe.stageload.models.enter("denoise")
    copied = copy.deepcopy(old)  # copies the hooks, not the stager (it holds locks)
    _leaf(copied)(torch.zeros(2))
    assert _stages(sink) == ["denoise"]  # the copy is not the pipeline's VAE
    _leaf(old)(torch.zeros(2))
    assert _stages(sink) == ["denoise", "decode"]  # the control: the pipeline's VAE marks
    pipe.stageload.models.enter("denoise")
    pipe.vae = copied
    _leaf(old)(torch.zeros(2))
    assert _stages(sink) == ["denoise", "decode", "denoise"]  # replaced: it marks no more


def saved_resident_vae(small_vae: Path) -> tuple[Any, Any]:
    """``torch.save`` then ``torch.load`` of the pipeline's resident (marked) VAE. Returns
    (the loaded copy, the pipeline's VAE)."""
    import io

    pipe = staged_pipeline(diffusers.QwenImage21Pipeline, small_vae)
    saved = io.BytesIO()
    torch.save(pipe.vae, saved)
    saved.seek(0)
    return torch.load(saved, weights_only=False), pipe.vae


def test_a_resident_component_saves_with_its_weights_and_no_mark(small_vae: Path) -> None:
    """It raised: the mark's weak reference to the stager, then a ModuleList's hooked
    forward (pickled by the name ``_forward_unimplemented``, which it cannot be found by)."""
    from stageload.hooks.registry import HookRegistry

    copied, vae = saved_resident_vae(small_vae)
    pairs = zip(copied.state_dict().values(), vae.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert all(_marks.MARK not in (HookRegistry.of(m) or ()) for m in copied.modules())


@pytest.mark.parametrize("broken", ["mark copied", "forward pickled as bound"])
def test_control_a_copied_mark_or_a_bound_forward_cannot_be_saved(
    small_vae: Path, monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    from stageload.hooks import registry

    if broken == "mark copied":
        monkeypatch.setattr(_marks.StageMark, "copied", True)
    else:
        monkeypatch.setattr(registry._HookedForward, "__reduce_ex__", object.__reduce_ex__)
    with pytest.raises((TypeError, AttributeError), match="pickle|_forward_unimplemented"):
        saved_resident_vae(small_vae)
