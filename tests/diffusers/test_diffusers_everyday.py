"""Everyday diffusers code on a staged pipeline, written as users write it, each scenario
against the same code on the eagerly loaded pipeline (``torch.equal``, two calls), each
with a control that fails once the mechanism it relies on is taken away (issue 34).

A locally built Stable Diffusion (UNet, CLIP text encoder, VAE) with ``keep=()``, so every
component is released between stages and reloaded at its next use.

Reference: eager, ``SD.load``: the pipeline loaded by diffusers' ``from_pretrained`` with no
stageload, in this process. torch on one thread on both sides (conftest's ``one_thread``)."""

from __future__ import annotations

import _thread
import contextlib
import gc
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import stageload.hooks.empty  # noqa: E402
import stageload.hooks.registry  # noqa: E402
from stageload import ModelLoadError, StageloadError  # noqa: E402
from stageload.diffusers import _placeholder, staged_pipeline  # noqa: E402
from stageload.external import tensor_version  # noqa: E402
from stageload.load import changes  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()

pytestmark = pytest.mark.usefixtures("one_thread")

SD = FAMILIES["sd"]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return folder(SD, tmp_path_factory.mktemp("everyday"))


def eager(path: Path) -> Any:
    return SD.load(path)


def staged(path: Path) -> Any:
    return staged_pipeline(SD.cls, path, keep=())


def image(pipe: Any, **overrides: Any) -> torch.Tensor:
    return pipe(**{**SD.call(0), **overrides})[0]


def same_twice(pipe: Any, want: torch.Tensor, **overrides: Any) -> bool:
    return all(torch.equal(image(pipe, **overrides), want) for _ in range(2))


def empty(module: torch.nn.Module) -> bool:
    return all(p.is_meta for p in module.parameters())


# -- a copy of a staged component -----------------------------------------------------------------
def copy_of_the_vae(path: Path, loaded: bool, how: str = "deepcopy") -> tuple[Any, ...]:
    """A copy (``copy.deepcopy``: an EMA copy; ``torch.save``, ``torch.load``) of
    ``pipe.vae`` of a staged pipeline, its VAE not loaded yet or loaded, then converted to
    float64. Returns (the copy, its decode of a latent before the conversion, eager's, the
    pipeline's image after, eager's)."""
    import copy
    import io

    want_pipe = eager(path)
    pipe = staged(path)
    if loaded:
        pipe.stageload.load("vae")
    if how == "deepcopy":
        copied = copy.deepcopy(pipe.vae)
    else:
        saved = io.BytesIO()
        torch.save(pipe.vae, saved)
        saved.seek(0)
        copied = torch.load(saved, weights_only=False)
    z = torch.randn(
        1, copied.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        got, want = copied.decode(z).sample, want_pipe.vae.decode(z).sample
    copied.to(torch.float64)  # the copy's, not the pipeline's (a patch on the copy took it)
    assert copied.dtype == torch.float64
    return copied, got, want, image(pipe), image(want_pipe)


@pytest.mark.parametrize("how", ["deepcopy", "save"])
@pytest.mark.parametrize("loaded", [False, True], ids=["unloaded", "loaded"])
def test_a_copy_of_a_staged_component_is_the_users_own_with_its_weights(
    path: Path, loaded: bool, how: str
) -> None:
    """The copy holds the weights (an unloaded VAE loads first) and is not staged; the
    pipeline's own VAE still is (the copy failed: the stager's thread-local state)."""
    from stageload.diffusers._placeholder import stage_hook

    copied, got, want, after, eager_image = copy_of_the_vae(path, loaded, how)
    assert not empty(copied) and stage_hook(copied) is None
    assert torch.equal(got, want) and torch.equal(after, eager_image)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_whole_staged_pipeline_says_what_to_do_instead(path: Path, how: str) -> None:
    """Refused with the way out (it raised "cannot pickle '_thread.RLock' object"); the
    pipeline still works."""
    import copy
    import pickle

    pipe = staged(path)
    copier = copy.deepcopy if how == "deepcopy" else pickle.dumps
    with pytest.raises(
        TypeError, match=r"staged pipeline cannot be copied.*copy.deepcopy\(pipe.unet\)"
    ):
        copier(pipe)
    assert torch.equal(image(pipe), image(eager(path)))


def test_control_a_stage_hook_copied_as_it_is_cannot_be(path: Path, monkeypatch: Any) -> None:
    from stageload.diffusers._placeholder import StageHook

    monkeypatch.delattr(StageHook, "__reduce__")
    with pytest.raises(TypeError, match="pickle"):
        copy_of_the_vae(path, loaded=True)


def test_control_a_patch_copied_with_the_component_converts_the_pipelines(
    path: Path, monkeypatch: Any
) -> None:
    """The copy's ``.to(float64)`` went through the original's patched ``_apply``: it
    recorded the move for the pipeline's VAE and left the copy in float32."""
    from stageload.hooks import registry

    monkeypatch.delattr(registry._Dispatch, "__reduce__")
    with pytest.raises(AssertionError):
        copy_of_the_vae(path, loaded=True)


# -- a staged component is the component's own class and object ---------------------------------
def test_a_staged_component_is_its_own_class_on_meta_and_answers_without_loading(
    path: Path,
) -> None:
    ref, pipe = eager(path), staged(path)
    for name in ("unet", "text_encoder", "vae"):
        component, reference = getattr(pipe, name), getattr(ref, name)
        assert type(component) is type(reference)
        assert empty(component)  # nothing loaded yet
        assert component.device == reference.device  # what eager answers, while on meta
        assert component.dtype == reference.dtype
        assert component.config == reference.config
        assert empty(component)  # and the reads loaded nothing
    assert pipe._execution_device == ref._execution_device


def test_control_without_the_device_answer_an_unloaded_component_says_meta(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_placeholder.StageHook, "run_device", None)
    pipe = staged(path)
    assert pipe.unet.device.type == "meta"
    assert pipe.text_encoder.device.type == "meta"


def moved_to_cpu_0(pipe: Any) -> list[Any]:
    """A call, ``pipe.to("cpu:0")``, two calls; with where the UNet's weights sit (address
    mod 64) as its forward runs at the second call."""
    first = image(pipe)
    pipe.to("cpu:0")
    seen: list[list[int]] = []

    def where(*_: Any) -> None:
        if not seen:
            seen.append([t.data_ptr() % 64 for t in pipe.unet.state_dict().values()])

    pipe.unet.conv_in.register_forward_pre_hook(where)
    return [first, image(pipe), image(pipe), seen[0]]


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "control"])
def test_a_move_to_cpu_0_gives_eagers_images(path: Path, fresh: bool, monkeypatch) -> None:
    """``pipe.to("cpu:0")`` copies each CPU weight (torch tells ``cpu:0`` from ``cpu``), so
    eager's sit in fresh 64-byte aligned memory from then on; a reload put them at the
    file's offsets, and the images differed by 2.7e-7 here (alignment changes a kernel's
    summation order, on any CPU). Now each load copies them as eager did: equal images, the
    same alignment. Control: without that copy, the weights sit elsewhere than eager's."""
    if not fresh:
        monkeypatch.setattr(_placeholder, "fresh_memory", lambda *a: set())
    want, got = moved_to_cpu_0(eager(path)), moved_to_cpu_0(staged(path))
    assert set(want[-1]) == {0}
    if fresh:
        assert all(torch.equal(a, b) for a, b in zip(got[:-1], want[:-1], strict=True))
        assert got[-1] == want[-1]
    else:
        assert got[-1] != want[-1]


def inputs_placed_by_a_parameter(pipe: Any) -> tuple[torch.device, torch.Tensor]:
    """The everyday way to place a component's inputs: where its first parameter is."""
    device = next(pipe.vae.parameters()).device
    latents = torch.ones(1, pipe.vae.config.latent_channels, 8, 8)
    with torch.no_grad():
        return device, pipe.vae.decode(latents.to(device)).sample


def test_a_released_components_parameters_answer_where_it_runs(path: Path) -> None:
    """``next(pipe.vae.parameters()).device`` said ``meta`` before the first load (auto's
    models said ``cpu``): the decode of inputs sent there failed (issue 38's review)."""
    device, out = inputs_placed_by_a_parameter(staged(path))
    want_device, want = inputs_placed_by_a_parameter(eager(path))
    assert device == want_device
    assert torch.equal(out, want)


def test_control_answering_meta_the_inputs_go_to_meta(path: Path, monkeypatch: Any) -> None:
    from stageload.diffusers._placeholder import StageHook

    monkeypatch.setattr(StageHook, "run_device", None)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        inputs_placed_by_a_parameter(staged(path))


# -- inference_mode and no_grad ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_calls_under_inference_mode_and_no_grad_equal_eager(path: Path, mode: str) -> None:
    ref, pipe = eager(path), staged(path)
    with getattr(torch, mode)():
        want = image(ref)
        assert same_twice(pipe, want)
    # The weights loaded in there are normal tensors, as eager's: an in-place edit outside
    # works (the VAE, loaded last, is still in memory).
    assert not empty(pipe.vae)
    for p in (ref, pipe):
        with torch.no_grad():
            p.vae.decoder.conv_out.weight.mul_(1.5)
    assert same_twice(pipe, image(ref))


def test_control_change_tracking_by_version_counters_fails_under_inference_mode(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(changes, "version", tensor_version)
    monkeypatch.setattr("stageload.diffusers._normal_tensors", contextlib.nullcontext)
    pipe = staged(path)
    with torch.inference_mode(), pytest.raises((ModelLoadError, RuntimeError), match="nference"):
        image(pipe)


def test_control_loads_inside_inference_mode_refuse_a_later_edit(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("stageload.diffusers._normal_tensors", contextlib.nullcontext)
    pipe = staged(path)
    with torch.inference_mode():
        image(pipe)
    with torch.no_grad(), pytest.raises(RuntimeError, match="nference"):
        pipe.vae.decoder.conv_out.weight.mul_(1.5)


# -- from_pipe -----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sd-img2img", "sd-inpaint"])
def test_from_pipe_builds_a_staged_pipeline_equal_to_eager(path: Path, family: str) -> None:
    fam = FAMILIES[family]
    ref, pipe = fam.cls.from_pipe(eager(path)), fam.cls.from_pipe(staged(path))
    assert type(pipe) is type(ref)
    want = ref(**fam.call(0))[0]
    for _ in range(2):
        assert torch.equal(pipe(**fam.call(0))[0], want)
        assert empty(pipe.unet)  # still staged: released after denoising


def fresh_img2img() -> type:
    """An img2img pipeline class no stager patched (patches last for the process, and
    another test may have patched the family's class): a subclass with its own
    ``__call__``, the family's as diffusers wrote it."""
    base = FAMILIES["sd-img2img"].cls
    call = base.__dict__["__call__"]
    patched = call.__code__.co_filename == stageload.hooks.registry.__file__  # its dispatch
    original = call.__wrapped__ if patched else call
    return type("FreshImg2Img", (base,), {"__call__": original})


@pytest.mark.parametrize("build", ["from_pipe", "constructor"])
def test_a_pipeline_of_another_class_built_on_staged_components_runs_its_calls_batched(
    path: Path, build: str
) -> None:
    """``from_pipe`` to another class, or that class given ``pipe.components``: its calls
    go through the stager's gather (so calls from several threads take turns, stage-major),
    as the staged pipeline's own do. (A helper found that they ran unlocked.)"""
    pipe, cls = staged(path), fresh_img2img()
    other = cls.from_pipe(pipe) if build == "from_pipe" else cls(**pipe.components)
    other.set_progress_bar_config(disable=True)
    before = list(pipe.stageload.gather.batches)
    other(**FAMILIES["sd-img2img"].call(0))
    assert pipe.stageload.gather.batches == [*before, 1]


def test_control_without_following_new_pipelines_their_calls_bypass_the_gather(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe, cls = staged(path), fresh_img2img()
    monkeypatch.setattr("stageload.diffusers._serialize_calls", lambda cls: None)
    other = cls.from_pipe(pipe)
    other.set_progress_bar_config(disable=True)
    before = list(pipe.stageload.gather.batches)
    other(**FAMILIES["sd-img2img"].call(0))
    assert pipe.stageload.gather.batches == before


def test_control_a_placeholder_subclass_breaks_from_pipe(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = _placeholder.build_empty

    def as_subclass(cls: type, *args: Any) -> torch.nn.Module:
        model = build(cls, *args)
        model.__class__ = type(cls.__name__, (cls,), {})  # what the placeholder used to be
        return model

    monkeypatch.setattr(_placeholder, "build_empty", as_subclass)
    with pytest.raises(ValueError):
        FAMILIES["sd-img2img"].cls.from_pipe(staged(path))


# -- channels_last ---------------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["before the first call", "after a call"])
def test_channels_last_holds_through_every_load(path: Path, when: str) -> None:
    """``unet.to(memory_format=torch.channels_last)``, diffusers' own speed tip, on a staged
    unet released or never loaded: made at each load (its 1x1 kernels' strides too). It
    was dropped: a 1-element probe saw no change, and the output moved by 3e-7."""
    ref, pipe = eager(path), staged(path)
    if when == "after a call":
        assert torch.equal(image(pipe), image(ref))
        assert empty(pipe.unet)
    for p in (ref, pipe):
        p.unet.to(memory_format=torch.channels_last)
    assert same_twice(pipe, image(ref))
    assert pipe.unet.conv_in.weight.stride() == ref.unet.conv_in.weight.stride()


def test_control_a_one_element_probe_drops_channels_last(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_element(fn: Any, dtypes: set[Any], device: Any) -> dict[Any, Any]:
        return {d: fn(torch.zeros(1, dtype=d, device=device)) for d in dtypes}

    monkeypatch.setattr(_placeholder, "conversion_probes", one_element)
    ref, pipe = eager(path), staged(path)
    for p in (ref, pipe):
        p.unet.to(memory_format=torch.channels_last)
    assert not torch.equal(image(pipe), image(ref))


# -- weight edits, LoRA, textual inversion: loaded or not ---------------------------------------
def edit(pipe: Any) -> None:
    pipe.unet.conv_out.weight.data.mul_(1.5)
    with torch.no_grad():
        pipe.text_encoder.final_layer_norm.weight.mul_(0.5)


@pytest.mark.parametrize("warm", [False, True], ids=["before-first-call", "after-a-call"])
def test_weights_edited_on_an_unloaded_component_are_kept(path: Path, warm: bool) -> None:
    ref, pipe = eager(path), staged(path)
    unedited = image(ref)
    if warm:
        image(pipe)
    assert empty(pipe.unet)
    edit(ref)
    edit(pipe)
    want = image(ref)
    assert not torch.equal(want, unedited)
    assert same_twice(pipe, want)


def test_control_without_loading_on_use_an_edit_of_an_unloaded_component_is_lost(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stageload.hooks.empty, "_on_use", lambda *args: None)
    ref, pipe = eager(path), staged(path)
    edit(ref)
    edit(pipe)
    assert not torch.equal(image(pipe), image(ref))


def freeze(pipe: Any, how: str) -> None:
    """A training script's first lines: the pipeline's models take no gradients."""
    for part in (pipe.unet, pipe.text_encoder):
        if how == "method":
            part.requires_grad_(False)
        else:
            for p in part.parameters():
                p.requires_grad = False


def frozen_through_calls(path: Path, how: str) -> tuple[list[Any], list[tuple[bool, bool]]]:
    """A staged pipeline frozen before its first call (``how``), then called twice.
    Returns the loads before the first call, and (any of the UNet's parameters wanting a
    gradient, any of the VAE's) after each call."""
    pipe = staged(path)
    freeze(pipe, how)
    before = pipe.stageload.models.loaded()
    wants = []
    for _ in range(2):
        image(pipe)
        wants.append(
            tuple(any(p.requires_grad for p in m.parameters()) for m in (pipe.unet, pipe.vae))
        )
    return before, wants


@pytest.mark.parametrize("how", ["method", "setter"])
def test_a_pipeline_frozen_before_its_first_call_stays_frozen_and_loads_nothing(
    path: Path, how: str
) -> None:
    ref = eager(path)
    freeze(ref, how)
    want = [any(p.requires_grad for p in m.parameters()) for m in (ref.unet, ref.vae)]
    before, wants = frozen_through_calls(path, how)
    assert before == []  # setting a flag reads no weights
    assert [list(w) for w in wants] == [want, want] == [[False, True], [False, True]]


@pytest.mark.parametrize(
    "undone", ["fill", "setter"], ids=["the-flag-left-to-the-load", "the-setter-loading"]
)
def test_control_a_freeze_before_the_first_call_is_lost_or_loads(
    path: Path, monkeypatch: pytest.MonkeyPatch, undone: str
) -> None:
    if undone == "fill":  # the load's own flags win
        monkeypatch.setattr(_placeholder, "_frozen", lambda skeleton: set())
        _, wants = frozen_through_calls(path, "method")
        assert wants[0][0]
    else:  # the setter not taken for metadata: it reads the component
        without = stageload.hooks.empty._metadata() - {torch.Tensor.requires_grad.__set__}
        monkeypatch.setattr(stageload.hooks.empty, "_metadata", lambda: without)
        before, _ = frozen_through_calls(path, "setter")
        assert before != []


@pytest.fixture(scope="module")
def adapter(path: Path) -> dict[str, torch.Tensor]:
    pytest.importorskip("peft")
    from fixtures.lora import lora

    return lora("sd", path.parent, "unet", seed=0)


@pytest.mark.parametrize("warm", [False, True], ids=["before-first-call", "after-a-call"])
def test_lora_set_adapters_fuse_and_unfuse_loaded_or_not(
    path: Path, adapter: dict[str, torch.Tensor], warm: bool
) -> None:
    ref, pipe = eager(path), staged(path)
    if warm:
        image(pipe)
    steps = [
        lambda p: p.load_lora_weights(dict(adapter), adapter_name="a"),
        lambda p: p.set_adapters(["a"], adapter_weights=[0.6]),
        lambda p: p.fuse_lora(),  # the UNet is out here: fusing loads it
        lambda p: p.unfuse_lora(),
    ]
    seen = []
    for step in steps:
        step(ref)
        step(pipe)
        want = image(ref)
        assert same_twice(pipe, want)
        seen.append(want.sum().item())
    assert len(set(seen)) >= 2  # the steps change the image


def test_control_without_loading_on_use_fusing_into_an_unloaded_unet_fails(
    path: Path, adapter: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stageload.hooks.empty, "_on_use", lambda *args: None)
    pipe = staged(path)
    pipe.load_lora_weights(dict(adapter), adapter_name="a")
    image(pipe)
    pipe.fuse_lora()
    with pytest.raises(ModelLoadError, match="fused"):
        image(pipe)


EMBEDDING = {"<cat-toy>": torch.randn(32, generator=torch.Generator().manual_seed(5))}


@pytest.mark.parametrize("warm", [False, True], ids=["before-first-call", "after-a-call"])
def test_textual_inversion_before_or_after_the_first_call(path: Path, warm: bool) -> None:
    ref, pipe = eager(path), staged(path)
    if warm:
        image(pipe)
    for p in (ref, pipe):
        p.load_textual_inversion({k: v.clone() for k, v in EMBEDDING.items()}, token="<cat-toy>")
    want = image(ref, prompt="a <cat-toy> on a chair")
    assert same_twice(pipe, want, prompt="a <cat-toy> on a chair")


def test_control_answering_meta_textual_inversion_fails(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new embedding is built on the old one's device: ``meta`` without the answer."""
    monkeypatch.setattr(_placeholder.StageHook, "run_device", None)
    pipe = staged(path)
    with pytest.raises((RuntimeError, NotImplementedError, ModelLoadError)):
        pipe.load_textual_inversion({k: v.clone() for k, v in EMBEDDING.items()}, token="<cat-toy>")
        image(pipe, prompt="a <cat-toy> on a chair")


def training_step(pipe: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of textual inversion as diffusers' example trains it: the token embeddings
    trained, the text encoder, UNet and VAE frozen, the loss backward through the UNet and
    the text encoder. Returns (loss, the embeddings' gradient)."""
    torch.manual_seed(0)
    for part in (pipe.unet, pipe.vae, pipe.text_encoder):
        part.requires_grad_(False)
    embeddings = pipe.text_encoder.get_input_embeddings().weight
    embeddings.requires_grad_(True)
    tokenizer = pipe.tokenizer
    ids = tokenizer(["a <cat-toy>"], padding="max_length", return_tensors="pt").input_ids
    hidden = pipe.text_encoder(ids)[0]
    latents = torch.randn(1, pipe.unet.config.in_channels, 8, 8)
    noise = pipe.unet(latents, torch.tensor([10]), encoder_hidden_states=hidden).sample
    loss = noise.pow(2).mean()
    loss.backward()
    return loss.detach(), embeddings.grad


def test_a_training_step_through_a_released_text_encoder_is_refused_and_said(
    path: Path,
) -> None:
    """keep=() releases the text encoder when the UNet loads, under the graph that saved
    its weights: the backward is refused (autograd's own check), where it read the freed
    weights. The control, the same release without the refusal, is in
    tests/hooks/test_release_autograd.py."""
    with (
        pytest.warns(UserWarning, match="model 'text_encoder' was released while an autograd"),
        pytest.raises(RuntimeError, match="modified by an inplace operation"),
    ):
        training_step(staged(path))


def test_a_training_step_with_the_text_encoder_kept_equals_eager(path: Path) -> None:
    want = training_step(eager(path))
    got = training_step(staged_pipeline(SD.cls, path, keep=("text_encoder",)))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def accumulated(pipe: Any) -> dict[str, torch.Tensor]:
    """Full fine-tuning of the UNet with two micro-batches per optimizer step, the VAE
    encoding the second one's images in between (as ``train_text_to_image`` does): on a
    staged pipeline, the VAE's stage releases the UNet between the two backward passes.
    Returns the accumulated gradients."""
    torch.manual_seed(0)
    unet = pipe.unet
    unet.requires_grad_(True)
    hidden = torch.randn(1, 77, pipe.text_encoder.config.hidden_size)
    for _ in range(2):
        with torch.no_grad():
            latents = pipe.vae.encode(torch.rand(1, 3, 32, 32)).latent_dist.mean
        unet(latents, 10, encoder_hidden_states=hidden).sample.pow(2).mean().backward()
    return {n: p.grad for n, p in unet.named_parameters() if p.grad is not None}


def test_gradients_accumulated_across_a_release_are_kept(path: Path) -> None:
    """Before the optimizer's first step nothing in the UNet had changed, so its release
    dropped every tensor, gradients included: the step then used the second micro-batch's
    alone (helper-46), silently."""
    want, got = accumulated(eager(path)), accumulated(staged(path))
    assert want.keys() == got.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_control_a_release_that_keeps_no_gradient_loses_the_first_micro_batch(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _placeholder.Tracked.retain

    def without_gradients(self: Any, module: Any) -> list[Any]:
        grads = {}
        for p in module.parameters():
            grads[p], p.grad = p.grad, None
        try:
            return real(self, module)
        finally:
            for p, g in grads.items():
                p.grad = g

    monkeypatch.setattr(_placeholder.Tracked, "retain", without_gradients)
    want, got = accumulated(eager(path)), accumulated(staged(path))
    assert not all(torch.equal(got[n], want[n]) for n in want)


def test_prompt_embeddings_made_with_gradients_on_warn_at_the_scripts_call(path: Path) -> None:
    """``encode_prompt`` outside ``torch.no_grad()``, then the pipeline with the
    embeddings: the text encoder's release frees its weights under the embeddings' graph.
    One warning, at this file's ``pipe(...)`` line (not diffusers'), and images equal."""
    ref, pipe = eager(path), staged(path)

    def run(p: Any) -> list[torch.Tensor]:
        args = {k: v for k, v in SD.call(0).items() if k != "prompt"}
        embeds, negative = p.encode_prompt("a cat", "cpu", 1, True)
        return [p(prompt_embeds=embeds, negative_prompt_embeds=negative, **args)[0]]

    want = run(ref)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        got = run(pipe)
    assert torch.equal(got[0], want[0])
    where = [(w.filename, str(w.message)[:40]) for w in said if "autograd" in str(w.message)]
    assert [f for f, _ in where] == [__file__], where


# -- schedulers, callbacks, VAE tiling ------------------------------------------------------------
@pytest.mark.parametrize("warm", [False, True], ids=["unloaded", "after-a-call"])
def test_a_dtype_round_trip_keeps_its_rounding(path: Path, warm: bool) -> None:
    """``pipe.to(bfloat16)`` then ``pipe.to(float32)``: eager's weights keep bfloat16's
    rounding; a staged reload converts through every dtype in turn. The VAE upcast in
    float32 after a half-precision cast (decoding in float32) is the same case."""
    ref, pipe = eager(path), staged(path)
    if warm:
        image(pipe)
    for p in (ref, pipe):
        p.to(torch.bfloat16)
        p.to(torch.float32)
    want = image(ref)
    assert same_twice(pipe, want)


def warnings_of_a_cast(path: Path, pipe: Any) -> list[str]:
    """The warnings diffusers logs for ``pipe.to(bfloat16)`` and two calls."""
    import logging

    from diffusers.utils import logging as diffusers_logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                said.append(record.getMessage()[:60])

    logger = diffusers_logging.get_logger("diffusers")
    handler = Keep()
    logger.addHandler(handler)
    level = diffusers_logging.get_verbosity()  # other test modules set "error"
    diffusers_logging.set_verbosity_warning()
    try:
        pipe.to(torch.bfloat16)
        image(pipe)
        image(pipe)
    finally:
        diffusers_logging.set_verbosity(level)
        logger.removeHandler(handler)
    return said


def test_a_cast_warns_as_often_as_eager(path: Path) -> None:
    """diffusers warns at each ``ModelMixin.to(dtype)``: once per component for the
    user's cast, not again at each load of a staged one (it came at every load)."""
    want = warnings_of_a_cast(path, eager(path))
    assert want and warnings_of_a_cast(path, staged(path)) == want


def test_control_a_load_that_casts_through_the_library_warns_again(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def library_to(module: Any, *args: Any, **kwargs: Any) -> Any:
        with _placeholder.passthrough(module):
            return module.to(*args, **kwargs)

    monkeypatch.setattr(_placeholder, "real_to", library_to)
    # A cast is replayed by the conversion it was (``via``), not real_to: record the dtype
    # alone, so the replay is real_to's, through the library.
    from fixtures.old_dtype_recording import record_dtype_alone

    record_dtype_alone(monkeypatch)
    want = warnings_of_a_cast(path, eager(path))
    assert len(warnings_of_a_cast(path, staged(path))) > len(want)


def test_an_upcast_vae_each_call_equals_eager(path: Path) -> None:
    """A bfloat16 pipeline whose VAE is sent to float32 and back at every call (as SDXL's
    pipeline does with ``force_upcast``), three calls, the VAE released between them."""
    ref = SD.cls.from_pretrained(path, torch_dtype=torch.bfloat16)
    pipe = staged_pipeline(SD.cls, path, keep=(), torch_dtype=torch.bfloat16)
    for _ in range(3):
        for p in (ref, pipe):
            p.vae.to(torch.float32)
            p.vae.to(torch.bfloat16)
        assert torch.equal(image(pipe), image(ref))


def test_control_converted_to_the_last_dtype_alone_the_output_differs(path: Path) -> None:
    """What a reload at the last dtype alone gave (the weights never rounded through
    bfloat16): not eager's output."""
    ref, pipe = eager(path), staged(path)
    ref.to(torch.bfloat16)
    ref.to(torch.float32)
    pipe.to(torch.float32)
    assert not torch.equal(image(pipe), image(ref))


def test_a_new_scheduler_a_callback_and_vae_tiling_equal_eager(path: Path) -> None:
    from diffusers import DPMSolverMultistepScheduler

    ref, pipe = eager(path), staged(path)
    for p in (ref, pipe):
        p.scheduler = DPMSolverMultistepScheduler.from_config(p.scheduler.config)
        p.vae.enable_tiling()
    steps: list[int] = []

    def on_step(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        steps.append(i)
        return {"latents": kwargs["latents"] * 0.99}

    want = image(ref, callback_on_step_end=on_step)
    assert same_twice(pipe, want, callback_on_step_end=on_step)
    assert len(steps) == 3 * SD.call(0)["num_inference_steps"]


# -- no leaks ------------------------------------------------------------------------------------
CYCLES = 50


def cycle(path: Path, make: Any) -> tuple[weakref.ref[Any], weakref.ref[Any]]:
    pipe = make(path)
    image(pipe)
    refs = weakref.ref(pipe), weakref.ref(pipe.unet)
    del pipe
    gc.collect()
    return refs


def footprint() -> int:
    """RssAnon of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


def growth(path: Path, make: Any, cycles: int) -> int:
    """Footprint after ``cycles`` build-call-drop cycles, less after the first few; each
    dropped pipeline and its UNet must be gone."""
    for _ in range(3):
        cycle(path, make)
    start = footprint()
    for _ in range(cycles):
        pipe, unet = cycle(path, make)
        assert pipe() is None and unet() is None
    return footprint() - start


def test_building_calling_and_dropping_a_staged_pipeline_frees_everything(path: Path) -> None:
    eager_growth = growth(path, eager, 10)
    staged_growth = growth(path, staged, CYCLES)
    # 2.3 MiB a cycle leaked before (115 MiB over 50); malloc keeps some slack of its own.
    assert staged_growth < max(eager_growth, 0) + 24 * 2**20, (staged_growth, eager_growth)


def test_control_a_patch_table_holding_its_objects_leaks_them(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stageload.hooks import registry

    monkeypatch.setattr(registry, "_chains", {})  # keyed by id(), holding each chain
    pipe, unet = cycle(path, staged)
    assert unet() is not None


# -- torch.autocast -------------------------------------------------------------------------------
def calls_under_autocast(path: Path, calls: int) -> tuple[bool, list[str], int]:
    """``calls`` calls of the eager and the staged pipeline, in turn, inside one
    ``torch.autocast`` block (bfloat16, the CPU's), as scripts write it around the call.
    Returns (each staged image equals eager's, the warnings the staged calls gave, the
    growth of the footprint over the calls after the first four)."""
    ref, pipe = eager(path), staged(path)
    equal, said, start = True, [], 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(calls):
            want = image(ref)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                equal = torch.equal(image(pipe), want) and equal
            said += [str(w.message) for w in caught]
            if i == 3:
                gc.collect()
                start = footprint()
    gc.collect()
    return equal, said, footprint() - start


def test_calls_under_autocast_equal_eager_warn_nothing_and_keep_no_casts(path: Path) -> None:
    equal, said, growth = calls_under_autocast(path, 12)
    assert equal
    assert not [s for s in said if "autograd graph" in s], said
    # The casts of released weights piled up by about 1.1 MiB a call before (8.8 MiB over 8).
    assert growth < 3 * 2**20, growth


def test_control_keeping_autocasts_cache_warns_at_each_release_and_piles_up_casts(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stageload.hooks import release

    monkeypatch.setattr(release, "drop_autocast_casts", lambda: None)
    equal, said, growth = calls_under_autocast(path, 12)
    assert equal
    assert [s for s in said if "model 'unet' was released while an autograd graph" in s]
    assert growth > 3 * 2**20, growth


# -- torch.compile ---------------------------------------------------------------------------------
# backend="eager": dynamo's tracing, guards and graph breaks, which is where staging meets
# torch.compile; inductor's code generation takes minutes per model on this machine's
# shared cores and changes nothing of that meeting.
def compile_unet(pipe: Any, how: str) -> None:
    if how == "method":
        pipe.unet.compile(backend="eager")
    else:
        pipe.unet = torch.compile(pipe.unet, backend="eager")


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("how", ["method", "assign"])
@pytest.mark.parametrize("warm", [False, True], ids=["before-first-call", "after-a-call"])
def test_a_compiled_unet_equals_eager_and_is_still_released(
    path: Path, how: str, warm: bool
) -> None:
    ref, pipe = eager(path), staged(path)
    if warm:
        image(pipe)
    compile_unet(ref, how)
    compile_unet(pipe, how)
    want = image(ref)
    for _ in range(2):
        assert torch.equal(image(pipe), want)
        assert empty(pipe.unet)  # released between stages, compiled or not


def counting_backend(graphs: list[int]) -> Any:
    """A dynamo backend that runs each graph as traced and notes its size (nodes)."""

    def backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    return backend


def fullgraph(pipe: Any, how: str, graphs: list[int]) -> None:
    if how == "method":
        pipe.unet.compile(backend=counting_backend(graphs), fullgraph=True)
    else:
        pipe.unet = torch.compile(pipe.unet, backend=counting_backend(graphs), fullgraph=True)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("how", ["method", "assign"])
def test_a_unet_compiled_with_fullgraph_is_one_graph_as_eager_and_still_released(
    path: Path, how: str
) -> None:
    """diffusers' own advice, ``torch.compile(pipe.unet, fullgraph=True)``: the staging runs
    around the compiled forward (hooks.registry._keep_out_of_compiled_graphs), so the UNet
    compiles to the one graph eager's does, no recompile after a release and reload. Its
    control: tests/hooks/test_compile.py."""
    ref, pipe = eager(path), staged(path)
    want_graphs: list[int] = []
    fullgraph(ref, how, want_graphs)
    want = image(ref)
    graphs: list[int] = []
    fullgraph(pipe, how, graphs)
    for _ in range(2):
        assert torch.equal(image(pipe), want)
        assert empty(pipe.unet)
    assert graphs == want_graphs and len(graphs) == 1


@pytest.mark.usefixtures("fresh_dynamo")
def test_control_a_compiled_unet_taken_for_a_replacement_stays_loaded(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "stageload.diffusers._is_component", lambda value, skeleton: value is skeleton
    )
    pipe = staged(path)
    image(pipe)
    compile_unet(pipe, "assign")
    with pytest.warns(UserWarning, match="no longer staged"):
        image(pipe)
    assert not empty(pipe.unet)


# -- threads ---------------------------------------------------------------------------------------
def test_threads_calling_one_staged_pipeline_each_get_their_lone_output(path: Path) -> None:
    """Reference: each seed's call run alone on the eager pipeline (``fixtures.concurrent_calls``:
    ``from_pretrained`` with no stageload), in this process. torch on one thread on both
    sides (conftest's ``one_thread``)."""
    from fixtures.concurrent_calls import CALLS, THREADS, run

    result = run(path)
    assert result == {"equal": [True] * (THREADS * CALLS), "errors": []}


def test_calls_that_overlap_run_as_one_batch_each_equal_to_eager(path: Path) -> None:
    """Reference: each seed's call run alone on the eager pipeline (``SD.load``: diffusers'
    ``from_pretrained`` with no stageload), in this process. torch on one thread on both
    sides (conftest's ``one_thread``)."""
    ref, pipe = eager(path), staged(path)
    want = {seed: image(ref, generator=torch.Generator().manual_seed(seed)) for seed in range(4)}
    holding, go = threading.Event(), threading.Event()

    def hold(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        holding.set()  # the first call is inside its denoising loop...
        go.wait()  # ... until the other three wait for the next batch
        return {}

    got: dict[int, torch.Tensor] = {}

    def client(seed: int, **extra: Any) -> None:
        got[seed] = image(pipe, generator=torch.Generator().manual_seed(seed), **extra)

    first = threading.Thread(target=client, args=(0,), kwargs={"callback_on_step_end": hold})
    first.start()
    assert holding.wait(120)
    others = [threading.Thread(target=client, args=(seed,)) for seed in (1, 2, 3)]
    for thread in others:
        thread.start()
    assert pipe.stageload.gather.wait_for_waiting(3, timeout=120)
    go.set()
    for thread in [first, *others]:
        thread.join()
    assert pipe.stageload.gather.batches == [1, 3]  # the three that overlapped: one batch
    for seed in range(4):
        assert torch.equal(got[seed], want[seed])


def overlapping_in_modes(path: Path) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Seed 0's call holds inside its denoising loop while seeds 1, 2 and 3 queue, in that
    order, on three threads: 1 and 3 inside ``torch.autocast`` (bfloat16), 2 outside it
    and 3 in ``inference_mode`` too. They run as one batch that seed 1's thread leads.
    The outputs, and the batches' sizes."""
    pipe = staged(path)
    holding, go = threading.Event(), threading.Event()

    def hold(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        holding.set()
        go.wait()
        return {}

    got: dict[int, torch.Tensor] = {}

    def client(seed: int, **extra: Any) -> None:
        modes = contextlib.ExitStack()
        if seed in (1, 3):
            modes.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        if seed == 3:
            modes.enter_context(torch.inference_mode())
        with modes:
            got[seed] = image(pipe, generator=torch.Generator().manual_seed(seed), **extra)

    first = threading.Thread(target=client, args=(0,), kwargs={"callback_on_step_end": hold})
    first.start()
    assert holding.wait(120)
    others = []
    for seed in (1, 2, 3):  # queued in this order: seed 1's thread leads the batch
        others.append(threading.Thread(target=client, args=(seed,)))
        others[-1].start()
        assert pipe.stageload.gather.wait_for_waiting(seed, timeout=120)
    go.set()
    for thread in [first, *others]:
        thread.join()
    return got, pipe.stageload.gather.batches


def eager_in_modes(path: Path) -> dict[int, torch.Tensor]:
    ref = eager(path)
    want = {}
    for seed in range(4):
        with contextlib.ExitStack() as modes:
            if seed in (1, 3):
                modes.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            want[seed] = image(ref, generator=torch.Generator().manual_seed(seed))
    return want


def test_overlapping_calls_in_one_batch_each_run_in_their_callers_autocast(path: Path) -> None:
    """A web server's requests, some inside ``torch.autocast``: each call of the batch
    runs in its own caller's modes, not in those of the call that leads the batch.
    Reference: each seed's call alone on the eager pipeline, in the same modes."""
    got, batches = overlapping_in_modes(path)
    assert batches == [1, 3]
    want = eager_in_modes(path)
    assert [torch.equal(got[seed], want[seed]) for seed in range(4)] == [True] * 4


def test_control_in_the_leaders_modes_a_call_outside_autocast_runs_inside_it(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stageload.diffusers as adapter

    monkeypatch.setattr(adapter, "entered", lambda modes: contextlib.nullcontext())
    got, batches = overlapping_in_modes(path)
    assert batches == [1, 3]
    want = eager_in_modes(path)
    # seed 2 ran in seed 1's autocast; seeds 1 and 3 in their own (the leader's)
    assert [torch.equal(got[seed], want[seed]) for seed in range(4)] == [True, True, False, True]


def test_control_unserialized_a_running_call_sees_its_model_released(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the gathering (no stager found, so no batch and no lock) and without
    release's wait for calls in flight (hooks.registry.hold_calls), a second call runs while
    the first is inside its UNet's forward: its stages release that UNet under the running
    forward. Unheld, such races crashed the process (exit 139) in 2 of 3 runs of
    tests/fixtures/concurrent_calls.py --no-lock; here the first call waits at a known
    point and looks. (With the wait alone, the second call's release waits for the first
    call, which here waits for the second: the wait is tested in tests/core/test_threads.py.)"""
    monkeypatch.setattr("stageload.diffusers._stagers", lambda pipe: [])
    monkeypatch.setattr("stageload.hooks.release.hold_calls", lambda *a, **k: None)
    pipe = staged(path)
    holding, go = threading.Event(), threading.Event()
    seen: list[bool] = []

    def hold(module: torch.nn.Module, args: Any) -> None:
        if threading.current_thread() is thread and not holding.is_set():
            holding.set()  # inside the UNet's forward, before its last layer
            go.wait()
            seen.append(pipe.unet.conv_out.weight.is_meta)

    pipe.unet.conv_out.register_forward_pre_hook(hold)
    thread = threading.Thread(target=image, args=(pipe,))
    thread.start()
    assert holding.wait(120)
    image(pipe, generator=torch.Generator().manual_seed(1))  # runs at once: nothing holds it
    go.set()
    thread.join()
    assert seen == [True]  # the running forward's model was released under it


# -- a Ctrl-C on a thread that serves calls ----------------------------------------------------
def holding_call(pipe: Any) -> tuple[threading.Thread, threading.Event]:
    """A call on another thread, held inside its denoising loop until the event is set."""
    holding, go = threading.Event(), threading.Event()

    def hold(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        holding.set()
        go.wait()
        return {}

    first = threading.Thread(target=image, args=(pipe,), kwargs={"callback_on_step_end": hold})
    first.start()
    assert holding.wait(120)
    return first, go


def interrupted_while_waiting(path: Path) -> Any:
    """The main thread's call waits for another thread's running call and is interrupted
    there (``_thread.interrupt_main``, as a Ctrl-C); then the other call ends. Returns the
    pipeline."""
    pipe = staged(path)
    first, go = holding_call(pipe)

    def ctrl_c() -> None:
        assert pipe.stageload.gather.wait_for_waiting(1, timeout=120)
        _thread.interrupt_main()

    interrupter = threading.Thread(target=ctrl_c)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        image(pipe, generator=torch.Generator().manual_seed(1))
    interrupter.join()
    go.set()
    first.join()
    return pipe


def next_call(pipe: Any, timeout: float) -> torch.Tensor | None:
    """The next call, on a thread of its own: its image, or None if it did not end."""
    out: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: out.append(image(pipe)), daemon=True)
    thread.start()
    thread.join(timeout)
    return out[0] if out else None


def test_a_call_interrupted_while_it_waits_its_turn_leaves_the_next_calls_served(path: Path):
    """Found by a new-user helper: a Ctrl-C on the main thread while its call waited for
    another thread's left it in the queue, the next batch was handed to it, no thread ran
    it, and every later call waited for good. Reference: eager's image."""
    want = image(eager(path))
    got = next_call(interrupted_while_waiting(path), timeout=120)
    assert got is not None and torch.equal(got, want)


def test_control_an_interrupted_call_left_queued_hangs_every_later_call(
    path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr("stageload.diffusers._Gather._withdraw", lambda self, mine: None)
    assert next_call(interrupted_while_waiting(path), timeout=10) is None  # else < 1 s


def interrupted_batch(path: Path) -> dict[int, Any]:
    """The main thread runs the batch of its call and two others' (its call waited first)
    and is interrupted while it runs them. Returns what the two other calls got."""
    pipe = staged(path)
    first, go = holding_call(pipe)
    got: dict[int, Any] = {}

    def client(seed: int) -> None:
        try:
            got[seed] = image(pipe, generator=torch.Generator().manual_seed(seed))
        except Exception as exc:  # noqa: BLE001 - what the call raised is its result
            got[seed] = exc

    others = [threading.Thread(target=client, args=(seed,)) for seed in (1, 2)]

    def start_others() -> None:  # once the main thread's call waits first
        assert pipe.stageload.gather.wait_for_waiting(1, timeout=120)
        for thread in others:
            thread.start()
        assert pipe.stageload.gather.wait_for_waiting(3, timeout=120)
        go.set()

    once = threading.Event()

    def ctrl_c(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if not once.is_set():  # the main thread runs the batch: its scheduler
            once.set()
            _thread.interrupt_main()
        return {}

    starter = threading.Thread(target=start_others)
    starter.start()
    with pytest.raises(KeyboardInterrupt):
        image(pipe, generator=torch.Generator().manual_seed(0), callback_on_step_end=ctrl_c)
    for thread in [starter, first, *others]:
        thread.join()
    assert pipe.stageload.gather.batches == [1, 3]
    return got


def test_the_other_calls_of_an_interrupted_batch_raise_and_say_why(path: Path):
    """Found by a new-user helper: they returned None (a server handed ``None.images`` on)."""
    got = interrupted_batch(path)
    assert sorted(got) == [1, 2]
    for result in got.values():
        assert isinstance(result, StageloadError)
        assert "interrupted (KeyboardInterrupt)" in str(result)
        assert "call the pipeline again" in str(result)


def test_control_undelivered_the_other_calls_return_none(
    path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Each got None for its output (``pipe(...)[0]`` of it raises)."""
    monkeypatch.setattr("stageload.diffusers._Gather._undelivered", staticmethod(lambda *a: None))
    got = interrupted_batch(path)
    assert [str(got[seed]) for seed in (1, 2)] == ["'NoneType' object is not subscriptable"] * 2


# -- diffusers' AutoPipeline classes -------------------------------------------------------------
@pytest.mark.parametrize("task", ["sd", "sd-img2img"])
@pytest.mark.parametrize("resolved", [True, False], ids=["resolved", "control"])
def test_an_auto_pipeline_class_stages_the_pipeline_it_would_load(
    path: Path, task: str, resolved: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``staged_pipeline(AutoPipelineForText2Image, path)``, as users write
    ``AutoPipelineForText2Image.from_pretrained(path)`` (helper-56: refused): the class its
    ``from_pretrained`` picks from the folder (Stable Diffusion, or its img2img pipeline),
    staged, with eager's images. Control: the AutoPipeline class itself is refused."""
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForText2Image

    import stageload.diffusers as sd

    auto_cls = AutoPipelineForText2Image if task == "sd" else AutoPipelineForImage2Image
    if not resolved:
        monkeypatch.setattr(sd, "_is_auto_pipeline", lambda cls: False)
        with pytest.raises(TypeError, match="not a diffusers.DiffusionPipeline"):
            staged_pipeline(auto_cls, path, keep=())
        return
    family = FAMILIES[task]
    eager_pipe = auto_cls.from_pretrained(path)
    pipe = staged_pipeline(auto_cls, path, keep=())
    assert type(pipe) is type(eager_pipe) is family.cls
    want = eager_pipe(**family.call(0))[0]
    assert all(torch.equal(pipe(**family.call(0))[0], want) for _ in range(2))


@pytest.mark.parametrize("own", [True, False], ids=["own-thread", "control"])
def test_an_eager_auto_pipeline_on_another_thread_while_one_is_picked_loads_as_eager(
    path: Path, own: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A web server's eager ``AutoPipelineForText2Image.from_pretrained(path)`` on one thread
    while ``staged_pipeline(AutoPipelineForText2Image, path)`` picks its class on another:
    the eager one gets its pipeline, loaded, as without stageload (the pick's stand-in was
    process-wide: the eager call got it and failed inside diffusers). Made to overlap
    deterministically: the eager call runs to its end inside the staged pick. Control: the
    stand-in answering every thread, the eager call fails."""
    import threading
    import types

    import diffusers.pipelines.auto_pipeline as auto
    from diffusers import AutoPipelineForText2Image

    from stageload import external
    from stageload.diffusers import _args
    from stageload.hooks.registry import patch

    if not own:  # every thread is the picking one
        monkeypatch.setattr(_args, "threading", types.SimpleNamespace(get_ident=lambda: 0))
    main = threading.get_ident()
    eager: list[object] = []

    def run_eager() -> None:
        try:
            eager.append(AutoPipelineForText2Image.from_pretrained(path))
        except BaseException as exc:  # noqa: BLE001 - the control's failure, checked below
            eager.append(exc)

    def overlap(pick):
        def picking(*args, **kwargs):
            if threading.get_ident() == main and not eager:
                other = threading.Thread(target=run_eager)
                other.start()
                other.join()
            return pick(*args, **kwargs)

        return picking

    unpatch = patch(auto, external.AUTO_PIPELINE_PICK, overlap)
    try:
        pipe = staged_pipeline(AutoPipelineForText2Image, path, keep=())
    finally:
        unpatch()
    assert type(pipe) is SD.cls
    [got] = eager
    if own:
        assert type(got) is SD.cls
        assert got.unet.device.type == "cpu"  # loaded, not a stand-in
    else:
        assert isinstance(got, BaseException)


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_weights_under_a_variant_only_are_said_at_the_build(
    path: Path, tmp_path: Path, checked: bool, sharded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder saved with ``variant="fp16"`` loaded without ``variant=``: eager's
    ``from_pretrained`` raises at once; so does ``staged_pipeline``, saying the variant to
    pass (helper-56: it built, and the first call failed in a component's load). Sharded
    too (``model.fp16-00001-of-00002.safetensors`` beside ``model.safetensors.index.fp16
    .json``, whose index the check took for a plain file). Control: without the check, the
    build goes through."""
    import stageload.diffusers as sd

    saved = tmp_path / "fp16"
    shards = {"max_shard_size": "100KB"} if sharded else {}
    SD.load(path).save_pretrained(saved, variant="fp16", **shards)
    if sharded:
        assert list(saved.glob("unet/*.fp16-00001-of-*.safetensors"))
    with pytest.raises(OSError):
        SD.cls.from_pretrained(saved)
    if not checked:
        monkeypatch.setattr(sd, "_check_variant", lambda folder, names, kwargs: None)
        staged_pipeline(SD.cls, saved, keep=())
        return
    with pytest.raises(OSError, match="variant only \\(fp16\\).*pass variant='fp16'"):
        staged_pipeline(SD.cls, saved, keep=())
    want = image(SD.cls.from_pretrained(saved, variant="fp16"))
    assert same_twice(staged_pipeline(SD.cls, saved, keep=(), variant="fp16"), want)


@pytest.mark.parametrize("quiet", [True, False], ids=["once", "control"])
def test_a_bin_checkpoints_messages_are_said_once_as_eager_says_them(
    path: Path, tmp_path: Path, quiet: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline saved without safetensors (``.bin``): diffusers logs "An error occurred
    while trying to fetch ..." and "Defaulting to unsafe serialization" for the UNet and
    the VAE, once in eager (at its build); staged, once too, at their first load, not at
    each reload (helper-56: on every call of a server). Control: reloads as loud."""
    import logging

    import stageload.diffusers._args as args

    if not quiet:
        monkeypatch.setattr(args, "_libraries_quiet", contextlib.nullcontext)
    saved = tmp_path / "bin"
    SD.load(path).save_pretrained(saved, safe_serialization=False)
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger = diffusers.utils.logging.get_logger("diffusers")
    handler = Keep()
    logger.addHandler(handler)
    level = diffusers.utils.logging.get_verbosity()  # this module sets "error"
    diffusers.utils.logging.set_verbosity_warning()  # a user's default
    try:
        eager_pipe = SD.load(saved)
        want = [image(eager_pipe) for _ in range(3)]
        eager_said, said[:] = list(said), []
        pipe = staged_pipeline(SD.cls, saved, keep=())
        got = [image(pipe) for _ in range(3)]
    finally:
        diffusers.utils.logging.set_verbosity(level)
        logger.removeHandler(handler)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for text in ("An error occurred while trying to fetch", "unsafe serialization"):
        assert sum(text in m for m in eager_said) == 2  # the UNet's and the VAE's
        assert (sum(text in m for m in said) == 2) == quiet, said


@pytest.mark.parametrize("per_thread", [True, False], ids=["this-thread", "control"])
def test_a_reloads_quiet_drops_its_own_threads_messages_alone(
    per_thread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a reload is quiet (the messages its first load gave, not again), what another
    thread logs to diffusers or transformers meanwhile still reaches the handlers: a
    server's other requests. Control: the quiet for every thread (as the loggers' level
    made it) drops the other thread's warning too."""
    import logging

    import stageload.diffusers._args as args

    if not per_thread:
        monkeypatch.setattr(args._Quiet, "filter", lambda self, r: r.levelno >= logging.CRITICAL)
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep()
    loggers = [logging.getLogger(n) for n in ("diffusers", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
    try:
        with args._libraries_quiet():
            for name in ("diffusers.models.x", "transformers.modeling_utils"):
                logging.getLogger(name).warning(f"reload {name}")
                other = threading.Thread(
                    target=logging.getLogger(name).warning, args=(f"other {name}",)
                )
                other.start()
                other.join()
            logging.getLogger("diffusers.models.x").critical("reload critical")
        logging.getLogger("diffusers.models.x").warning("after")
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    others = ["other diffusers.models.x", "other transformers.modeling_utils"]
    assert said == [*(others if per_thread else []), "reload critical", "after"], said


@pytest.mark.parametrize("extra", ["controlnet", "enable_pag"])
@pytest.mark.parametrize("followed", [True, False], ids=["followed", "control"])
def test_an_auto_pipeline_picks_by_its_arguments_as_its_from_pretrained(
    path: Path, extra: str, followed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AutoPipelineForText2Image.from_pretrained(path, controlnet=cn)`` loads a ControlNet
    pipeline, and ``enable_pag=True`` a PAG one; staged, the class was picked from
    model_index.json alone: a plain StableDiffusionPipeline, which ignored the argument
    (diffusers logs 'will be ignored') and made another image. Control: the class picked
    from model_index.json alone, every argument passed on."""
    from diffusers import AutoPipelineForText2Image, ControlNetModel

    import stageload.diffusers as sd

    if not followed:
        real = sd._concrete_pipeline
        monkeypatch.setattr(
            sd, "_concrete_pipeline", lambda cls, found, kw: (real(cls, found, {})[0], kw)
        )
    if extra == "controlnet":
        family = FAMILIES["sd-controlnet"]
        net = folder(family, path.parent) / "controlnet"
        kwargs: dict[str, Any] = {"controlnet": ControlNetModel.from_pretrained(net)}
    else:
        family = SD
        kwargs = {"enable_pag": True}
    eager_pipe = AutoPipelineForText2Image.from_pretrained(path, **kwargs)
    pipe = staged_pipeline(AutoPipelineForText2Image, path, keep=(), **kwargs)
    assert (type(pipe) is type(eager_pipe)) == followed
    want = eager_pipe(**family.call(0))[0]
    assert torch.equal(pipe(**family.call(0))[0], want) == followed


def test_an_auto_pipeline_with_no_pipeline_for_the_folder_says_which_class_to_pass(
    path: Path, tmp_path: Path
) -> None:
    """A model_index.json class that AutoPipelineForInpainting has no pipeline for: a
    TypeError naming the class to pass."""
    import json
    import shutil

    from diffusers import AutoPipelineForInpainting

    other = tmp_path / "other"
    shutil.copytree(path, other)
    index = json.loads((other / "model_index.json").read_text())
    index["_class_name"] = "AudioLDM2Pipeline"
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(TypeError, match="has no pipeline for AudioLDM2Pipeline"):
        staged_pipeline(AutoPipelineForInpainting, other, keep=())
