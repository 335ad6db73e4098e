"""A staged pipeline stays a whole pipeline: ``save_pretrained`` at any moment, components
replaced after staging, components shared with another pipeline class, ``pipe.to(...)``.
Locally built Stable Diffusion and Flux pipelines, compared bit for bit with eager ones.

Reference: eager, ``fam.load``: the pipeline loaded by diffusers' ``from_pretrained`` with no
stageload, in this process. torch on one thread on both sides (conftest's ``one_thread``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from stageload import ListSink  # noqa: E402
from stageload.diffusers import staged_pipeline  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()


# Tiny models run faster on one thread than on two contended ones (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


def out(pipe: Any, family: str = "sd") -> torch.Tensor:
    return pipe(**FAMILIES[family].call(0))[0]


def staged(family: str, root: Path, **kwargs: Any) -> Any:
    fam = FAMILIES[family]
    return staged_pipeline(fam.cls, folder(fam, root), keep=(), **kwargs)


@pytest.mark.parametrize("family", ["sd", "flux"])
@pytest.mark.parametrize("when", ["before-first-call", "between-calls"])
def test_save_pretrained_round_trips(root: Path, tmp_path: Path, family: str, when: str) -> None:
    fam = FAMILIES[family]
    expected = out(fam.load(folder(fam, root)), family)
    sink = ListSink()
    pipe = staged(family, root, events=sink)
    if when == "between-calls":
        assert torch.equal(out(pipe, family), expected)
    loaded_before = pipe.stageload.models.loaded()
    sink.events.clear()
    pipe.save_pretrained(tmp_path / "saved")
    assert pipe.stageload.models.loaded() == loaded_before  # nothing left loaded
    # One component at a time: each load is released before the next one loads.
    held: set[str] = set()
    for event in sink.events:
        if event.kind in ("load", "reload"):
            held.add(event.model)
            assert len(held - set(loaded_before)) <= 1, held
        elif event.kind == "release":
            held.discard(event.model)
    saved = fam.cls.from_pretrained(tmp_path / "saved", **fam.load_args())
    assert torch.equal(out(saved, family), expected)
    assert torch.equal(out(pipe, family), expected)  # the staged pipeline still works


def test_save_pretrained_keeps_a_fused_lora(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from fixtures.lora import lora

    a = lora("sd", root, "unet", seed=0)
    fam = FAMILIES["sd"]
    eager = fam.load(folder(fam, root))
    pipe = staged("sd", root)
    for p in (eager, pipe):
        p.load_lora_weights(dict(a), adapter_name="a")
        if hasattr(p, "stageload"):
            p.stageload.load("unet", "text_encoder")
        p.fuse_lora()
        p.unload_lora_weights()  # the fused weights stay, the LoRA layers go
    expected = out(eager)
    assert torch.equal(out(pipe), expected)
    pipe.save_pretrained(tmp_path / "saved")
    assert torch.equal(out(fam.cls.from_pretrained(tmp_path / "saved")), expected)
    assert torch.equal(out(pipe), expected)


def test_a_component_replaced_after_staging_is_said_and_no_longer_staged(root: Path) -> None:
    fam = FAMILIES["sd"]
    path = folder(fam, root)
    expected = out(fam.load(path))
    sink = ListSink()
    pipe = staged("sd", root, events=sink)
    out(pipe)
    pipe.vae = diffusers.AutoencoderKL.from_pretrained(path / "vae")
    with pytest.warns(UserWarning, match="vae was replaced after staging"):
        assert torch.equal(out(pipe), expected)
    assert all("vae" not in names for names in pipe.stageload.plan.values())
    notes = [e.note for e in sink.kinds("note") if e.model == "vae"]
    assert any("no longer staged" in n for n in notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert torch.equal(out(pipe), expected)


def test_a_component_replaced_with_none_is_said(root: Path) -> None:
    pipe = staged("sd", root)
    pipe.safety_checker = None  # not staged: nothing to say
    pipe.vae = None
    with pytest.warns(UserWarning, match="vae was replaced after staging with None"):
        pipe.stageload.use("unet")
    assert all("vae" not in names for names in pipe.stageload.plan.values())


def test_components_shared_with_another_pipeline_class(root: Path) -> None:
    fam = FAMILIES["sd-img2img"]
    eager = fam.load(folder(fam, root))
    expected = [eager(**fam.call(seed))[0] for seed in (0, 1)]
    pipe = staged("sd", root)
    img2img = diffusers.StableDiffusionImg2ImgPipeline(**pipe.components)
    for seed, want in zip((0, 1), expected, strict=True):
        assert torch.equal(img2img(**fam.call(seed))[0], want)


def test_pipe_to_dtype_answers_and_loads_like_eager(root: Path) -> None:
    fam = FAMILIES["sd"]
    eager = fam.load(folder(fam, root)).to(torch.float64)
    pipe = staged("sd", root).to(torch.float64)
    assert pipe.dtype == eager.dtype == torch.float64
    assert pipe.stageload.models.loaded() == []  # a conversion alone loads nothing
    expected = out(eager)
    assert torch.equal(out(pipe), expected)
    assert torch.equal(out(pipe), expected)


def test_pipe_device_answers_like_eager(root: Path) -> None:
    fam = FAMILIES["sd"]
    eager = fam.load(folder(fam, root))
    pipe = staged("sd", root).to("cpu")
    assert pipe.device == eager.device
    assert pipe._execution_device == eager._execution_device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pipe_to_cuda_loads_there(root: Path) -> None:  # pragma: no cover - no GPU in CI
    fam = FAMILIES["sd"]
    eager = fam.load(folder(fam, root)).to("cuda")
    pipe = staged("sd", root).to("cuda")
    assert pipe.device.type == "cuda" and pipe.stageload.models.loaded() == []
    assert torch.equal(out(pipe), out(eager))
    assert all(p.device.type == "cuda" for p in pipe.unet.parameters() if not p.is_meta)
