"""staged_pipeline on 19 pipeline families it was never written for, each built locally with
tiny random parts (stageload.testing.families): staged equals eager bit for bit on two
calls, every large component is staged and loads once per call, and the stages follow
the order in which the pipeline really uses its models.

Reference: eager, ``Family.load``: the pipeline loaded by diffusers' ``from_pretrained``
with no stageload, in this process. torch on one thread on both sides (conftest's
``one_thread``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from stageload import CheckpointError, ListSink, ModelLoadError  # noqa: E402
from stageload.diffusers import StagingRemovedError, staged_pipeline  # noqa: E402
from stageload.diffusers._plan import SMALL_FRACTION  # noqa: E402
from stageload.testing.diffusers import model_bytes  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()

# Per family, one call as the events show it: each stage entered, in order, with the models
# that load on entering it. Image-input pipelines (img2img, inpaint, SVD, LTX i2v) encode
# their image with the VAE while encoding the prompt; the VAE then stays until it decodes.
_T2I = "encode: text_encoder | denoise: {d} | decode: {v}"
_I2I = "encode: text_encoder vae | denoise: {d} | decode:"
EXPECTED = {
    "sd": _T2I.format(d="unet", v="vae"),
    "sd-img2img": _I2I.format(d="unet"),
    "sd-inpaint": _I2I.format(d="unet"),
    "lcm": _T2I.format(d="unet", v="vae"),
    # Missing from its model_cpu_offload_seq; it runs beside the UNet in every step.
    "sd-controlnet": _T2I.format(d="controlnet unet", v="vae"),
    "sdxl": "encode: text_encoder text_encoder_2 | denoise: unet | decode: vae",
    # The prior encodes a zero image after its loop: the image encoder runs in denoise.
    "kandinsky2.2-prior": "encode: text_encoder | denoise: prior image_encoder",
    "kandinsky2.2": "denoise: unet | decode: movq",
    "kandinsky2.2-combined": (
        "prior_encode: prior_text_encoder | prior_denoise: prior_prior prior_image_encoder"
        " | denoise: unet | decode: movq"
    ),
    "stable-cascade-prior": "encode: text_encoder | denoise: prior",
    # Its denoiser is named decoder, its VQ-GAN vqgan.
    "stable-cascade": "encode: text_encoder | denoise: decoder | decode: vqgan",
    "pixart-sigma": _T2I.format(d="transformer", v="vae"),
    "svd": "encode: image_encoder vae | denoise: unet | decode:",
    # Reads vae.latents_mean/std (buffers) before vae.decode.
    "ltx": _T2I.format(d="transformer", v="vae"),
    "ltx-i2v": _I2I.format(d="transformer"),
    # get_text_features on CLAP; projection and GPT-2 (no known role) join encode.
    "audioldm2": (
        "encode: text_encoder text_encoder_2 projection_model language_model"
        " | denoise: unet | decode: vae vocoder"
    ),
    "flux": "encode: text_encoder text_encoder_2 | denoise: transformer | decode: vae",
    "wan2.2": (
        "encode: text_encoder | denoise: transformer | denoise_2: transformer_2 | decode: vae"
    ),
}


# Tiny models run faster on one thread than on two contended ones (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the family folders are built, each once per module."""
    return tmp_path_factory.mktemp("families")


def _out(pipe: Any, name: str) -> torch.Tensor:
    return pipe(**FAMILIES[name].call())[0]


def _calls(events: list[Any], first_stage: str) -> list[list[Any]]:
    """Events split into calls: each call begins where its first stage is entered."""
    out: list[list[Any]] = []
    for event in events:
        if event.kind == "note":
            continue
        if not out or (event.kind == "stage" and event.stage == first_stage):
            out.append([])
        out[-1].append(event)
    return out


def _shape(call: list[Any]) -> str:
    """``"encode: a b | denoise: c"``: stages entered and the models loaded in each."""
    parts: list[str] = []
    for event in call:
        if event.kind == "stage":
            parts.append(f"{event.stage}:")
        elif event.kind in ("load", "reload"):
            parts[-1] += f" {event.model}"
    return " | ".join(parts)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_family_staged_equals_eager_loads_once_per_call_in_order_of_use(
    root: Path, name: str
) -> None:
    family = FAMILIES[name]
    path = folder(family, root)
    expected = _out(family.load(path), name)
    assert expected.float().std() > 0  # not a constant output: equality means something

    sink = ListSink()
    pipe = staged_pipeline(family.cls, path, keep=(), events=sink, **family.load_args())
    first, second = _out(pipe, name), _out(pipe, name)
    assert torch.equal(first, expected)
    assert torch.equal(second, expected)

    # Every large component is staged (and nothing else is left loaded with the pipeline).
    sizes = model_bytes(path)
    staged = set(pipe.stageload.models)
    large = {n for n, size in sizes.items() if size >= SMALL_FRACTION * max(sizes.values())}
    assert large <= staged, f"not staged: {sorted(large - staged)}"

    calls = _calls(sink.events, first_stage=EXPECTED[name].split(":")[0])
    assert len(calls) == 2
    assert _shape(calls[0]) == EXPECTED[name]
    plan = pipe.stageload.plan
    resident = {n for n in staged if all(n in names for names in plan.values())}
    for call in calls:
        loads = [e.model for e in call if e.kind in ("load", "reload")]
        assert len(loads) == len(set(loads)), f"a model loaded twice in one call: {loads}"
        used = {e.model for e in calls[0] if e.kind == "load"}
        assert set(loads) == used - (resident if call is calls[1] else set())
    # The plan lists the stages in the order the pipeline entered them.
    entered = [e.stage for e in calls[0] if e.kind == "stage"]
    assert [s for s in plan if s in entered] == entered


def _rewrite(file: Path, change: Any) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def _unet_file(path: Path) -> Path:
    return next((path / "unet").glob("*.safetensors"))


@pytest.mark.parametrize("fault", ["one weight perturbed", "another checkpoint"])
def test_control_a_wrong_fill_breaks_equality(
    root: Path, tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bit-for-bit check can fail: the same staged run, with the UNet's file changed on
    disk after the pipeline was built (so the placeholder fills from it), differs. A file
    changed since the build now raises at the first load (test_auto_deferred): that check
    is off here."""
    monkeypatch.setattr("stageload.load.checkpoint.changed_file", lambda stamps: None)
    family = FAMILIES["sd"]
    path = tmp_path / "sd"
    shutil.copytree(folder(family, root), path)
    expected = _out(family.load(path), "sd")
    pipe = staged_pipeline(family.cls, path, keep=())

    def perturb(tensors: dict[str, torch.Tensor]) -> None:
        key = next(k for k in sorted(tensors) if k.endswith("conv_in.weight"))
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[0] += 1e-3

    def other(tensors: dict[str, torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(1234)
        for key, value in tensors.items():
            if value.ndim > 1:
                tensors[key] = torch.randn(value.shape, generator=gen) * 0.02

    _rewrite(_unet_file(path), perturb if fault == "one weight perturbed" else other)
    assert not torch.equal(_out(pipe, "sd"), expected)


def replaced_before_the_first_call(sd: Path, tmp_path: Path) -> Any:
    """The diffusers adapter: the UNet's file replaced with other weights between
    ``staged_pipeline`` (which read the components' configs and own tensors) and the first
    call. Returns the staged output, or the call's error."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "sd"
    shutil.copytree(sd, copy)
    pipe = staged_pipeline(FAMILIES["sd"].cls, copy, keep=())
    (unet,) = (copy / "unet").glob("*.safetensors")
    tensors = {k: v * 0.5 for k, v in load_file(unet).items()}
    save_file(tensors, tmp_path / "new.safetensors", metadata={"format": "pt"})
    os.replace(tmp_path / "new.safetensors", unet)
    try:
        return pipe(**FAMILIES["sd"].call(0))[0]
    except ModelLoadError as exc:
        return exc.__cause__


def test_a_file_replaced_before_the_first_use_fails_the_load_and_names_it(
    root: Path, tmp_path: Path
) -> None:
    """auto raised there; the adapter read the new file silently (issue 38's review)."""
    err = replaced_before_the_first_call(folder(FAMILIES["sd"], root), tmp_path)
    assert isinstance(err, CheckpointError)
    assert "unet" in err.path and "replaced since the staged pipeline was built" in str(err)


def test_control_unchecked_the_first_load_reads_the_new_file(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = folder(FAMILIES["sd"], root)
    monkeypatch.setattr("stageload.load.checkpoint.changed_file", lambda stamps: None)
    want = FAMILIES["sd"].load(sd)(**FAMILIES["sd"].call(0))[0]
    got = replaced_before_the_first_call(sd, tmp_path)
    assert isinstance(got, torch.Tensor) and not torch.equal(got, want)


def test_buffer_read_answers_the_checkpoint_without_loading(root: Path) -> None:
    """LTX-Video reads vae.latents_mean before decoding: a component's own tensors (not
    its submodules') stay resident, read from the checkpoint when the placeholder is built,
    so the read gives eager's values and loads nothing."""
    family = FAMILIES["ltx"]
    path = folder(family, root)
    eager = family.load(path)
    sink = ListSink()
    pipe = staged_pipeline(family.cls, path, keep=(), events=sink)
    assert pipe.vae.latents_mean.is_meta is False
    assert torch.equal(pipe.vae.latents_mean, eager.vae.latents_mean)
    assert [e for e in sink.events if e.kind == "load"] == []


def test_control_without_resident_own_tensors_the_read_loads_the_vae(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stageload.diffusers import _placeholder

    monkeypatch.setattr(_placeholder, "keep_own", lambda *args: None)
    family = FAMILIES["ltx"]
    sink = ListSink()
    pipe = staged_pipeline(family.cls, folder(family, root), keep=(), events=sink)
    assert pipe.vae.latents_mean.is_meta  # empty: a use of its values loads the VAE
    torch.equal(pipe.vae.latents_mean, family.load(folder(family, root)).vae.latents_mean)
    assert [e.model for e in sink.events if e.kind == "load"] == ["vae"]


def test_running_methods_load_and_structural_ones_do_not(root: Path) -> None:
    """Methods that compute (get_text_features, generate) run a submodule, whose hook loads
    the component; methods that only change settings (enable_tiling) load nothing."""
    family = FAMILIES["audioldm2"]
    pipe = staged_pipeline(family.cls, folder(family, root), keep=())
    pipe.vae.enable_tiling()
    assert pipe.stageload.models.loaded() == []
    ids = pipe.tokenizer(["a cat"], return_tensors="pt")
    features = pipe.text_encoder.get_text_features(**ids)  # loads, then runs
    assert pipe.stageload.models.loaded() == ["text_encoder"]
    assert pipe.stageload.stage == "encode"
    eager = family.load(folder(family, root))
    assert torch.equal(_tensor(features), _tensor(eager.text_encoder.get_text_features(**ids)))
    inputs = torch.zeros(1, 3, dtype=torch.long)
    out = pipe.language_model.generate(inputs, max_new_tokens=2, do_sample=False)
    assert torch.equal(
        out, eager.language_model.generate(inputs, max_new_tokens=2, do_sample=False)
    )


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value.pooler_output


@pytest.mark.parametrize(
    ("cast", "dtype"),
    [
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("double", torch.float64),
        ("to", torch.bfloat16),
        ("type", torch.float16),
    ],
)
def test_casts_on_a_placeholder_persist_across_loads(root: Path, cast: str, dtype: Any) -> None:
    family = FAMILIES["sd"]
    pipe = staged_pipeline(family.cls, folder(family, root), keep=())
    vae = pipe.vae
    returned = getattr(vae, cast)(dtype) if cast in ("to", "type") else getattr(vae, cast)()
    assert returned is vae and vae.dtype == dtype
    assert pipe.stageload.models.loaded() == []  # a cast alone loads nothing
    for _ in range(2):  # the first load and a reload after a release
        loaded = pipe.stageload.models["vae"]
        assert {p.dtype for p in loaded.parameters()} == {dtype}
        pipe.stageload.models.evict("vae")
    vae.float()
    assert pipe.stageload.models["vae"].dtype == torch.float32


def test_offload_calls_that_strip_hooks_fail_clearly_and_leave_staging(root: Path) -> None:
    family = FAMILIES["sd"]
    path = folder(family, root)
    pipe = staged_pipeline(family.cls, path, keep=())
    for strip in (pipe.remove_all_hooks, lambda: pipe.enable_model_cpu_offload(device="cpu")):
        with pytest.raises(StagingRemovedError, match="remove_all_hooks.*drop the offload"):
            strip()
    assert torch.equal(_out(pipe, "sd"), _out(family.load(path), "sd"))


def test_empty_stages_is_an_error(root: Path) -> None:
    family = FAMILIES["sd"]
    with pytest.raises(ValueError, match=r"stages is empty \(\{\}\)"):
        staged_pipeline(family.cls, folder(family, root), stages={})


def test_map_refines_the_plan_too(root: Path) -> None:
    """pipe.stageload.map (stage-major calls): the img2img VAE's encode is labelled and
    kept as in a single call, so every model loads once for the batch."""
    family = FAMILIES["sd-img2img"]
    path = folder(family, root)
    eager = family.load(path)
    expected = [eager(**family.call(seed))[0] for seed in (0, 1)]
    sink = ListSink()
    pipe = staged_pipeline(family.cls, path, keep=(), events=sink)
    outputs = pipe.stageload.map([family.call(0), family.call(1)])
    assert all(torch.equal(out[0], exp) for out, exp in zip(outputs, expected, strict=True))
    assert _shape(_calls(sink.events, "encode")[0]) == EXPECTED["sd-img2img"]
