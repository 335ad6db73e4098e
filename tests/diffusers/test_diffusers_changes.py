"""A user's changes to a staged component survive every release and reload (LoRA, peft
adapters, textual inversion, fused weights, weights edited in place, replaced submodules),
each compared bit for bit with the same change made to the eagerly loaded pipeline, over
two calls; a change that cannot be kept fails with a clear error, never a wrong image.

Locally built pipelines: Stable Diffusion (UNet) and Flux (a transformer family).

Reference: eager, ``fam.load``: the pipeline loaded by diffusers' ``from_pretrained`` with no
stageload, in this process, with the same change and called plainly (also for the ``map``
mode). torch on one thread on both sides (conftest's ``one_thread``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from fixtures.lora import ATTENTION, lora  # noqa: E402
from stageload import ListSink, ModelLoadError  # noqa: E402
from stageload.diffusers import StagedChangeError, staged_pipeline  # noqa: E402
from stageload.load import refill  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()


# Tiny models run faster on one thread than on two contended ones (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("changes")


def run(pipe: Any, family: str, mode: str) -> torch.Tensor:
    fam = FAMILIES[family]
    if mode == "map" and hasattr(pipe, "stageload"):
        return pipe.stageload.map([fam.call(0)])[0][0]
    return pipe(**fam.call(0))[0]


def staged(family: str, root: Path, mode: str, sink: ListSink | None = None) -> Any:
    fam = FAMILIES[family]
    budget = "1G" if mode == "budget" else None
    return staged_pipeline(fam.cls, folder(fam, root), keep=(), budget=budget, events=sink)


def compare(
    family: str, root: Path, mode: str, steps: list[Callable[[Any], Any]], *, warm: bool = True
) -> list[torch.Tensor]:
    """Apply each step to an eager and a staged pipeline, then compare two staged calls
    with the eager call after each step. ``warm``: one call first, so the staged
    components are released when the first change is made."""
    fam = FAMILIES[family]
    eager = fam.load(folder(fam, root))
    pipe = staged(family, root, mode)
    if warm:
        run(pipe, family, mode)
    outs = []
    for step in steps:
        step(eager)
        step(pipe)
        want = run(eager, family, mode)
        for _ in range(2):
            assert torch.equal(run(pipe, family, mode), want)
        outs.append(want)
    return outs


def load(pipe: Any, *names: str) -> None:
    """Staged pipelines load the components a change reads first; eager ones have them."""
    if hasattr(pipe, "stageload"):
        pipe.stageload.load(*names)


@pytest.mark.parametrize("mode", ["default", "budget", "map"])
@pytest.mark.parametrize("warm", [False, True], ids=["before-first-call", "after-a-call"])
def test_a_lora_is_kept(root: Path, mode: str, warm: bool) -> None:
    a = lora("sd", root, "unet", seed=0)
    fam = FAMILIES["sd"]
    base = run(fam.load(folder(fam, root)), "sd", mode)
    (with_lora,) = compare(
        "sd", root, mode, [lambda p: p.load_lora_weights(dict(a), adapter_name="a")], warm=warm
    )
    assert not torch.equal(with_lora, base)  # control: dropping the LoRA changes the image


def test_several_adapters_weights_disable_enable_delete_unload(root: Path) -> None:
    a, b = lora("sd", root, "unet", seed=0), lora("sd", root, "unet", seed=1)
    outs = compare(
        "sd",
        root,
        "default",
        [
            lambda p: p.load_lora_weights(dict(a), adapter_name="a"),
            lambda p: p.load_lora_weights(dict(b), adapter_name="b"),
            lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.5, 0.7]),
            lambda p: p.disable_lora(),
            lambda p: p.enable_lora(),
            lambda p: p.delete_adapters("a"),
            lambda p: p.unload_lora_weights(),
        ],
    )
    assert len({o.sum().item() for o in outs}) >= 4  # the steps really change the image


def test_fuse_and_unfuse_after_loading(root: Path) -> None:
    a = lora("sd", root, "unet", seed=0)
    compare(
        "sd",
        root,
        "default",
        [
            lambda p: p.load_lora_weights(dict(a), adapter_name="a"),
            lambda p: (load(p, "unet", "text_encoder"), p.fuse_lora()),
            lambda p: (load(p, "unet", "text_encoder"), p.unfuse_lora()),
        ],
    )


def test_fuse_and_unfuse_of_an_unloaded_component_load_it(root: Path) -> None:
    """fuse_lora reads the base weights (``base_layer.weight.data``): on a released UNet
    that read loads it first (tests/diffusers/test_diffusers_everyday.py has the control)."""
    a = lora("sd", root, "unet", seed=0)
    compare(
        "sd",
        root,
        "default",
        [
            lambda p: p.load_lora_weights(dict(a), adapter_name="a"),
            lambda p: p.fuse_lora(),
            lambda p: p.unfuse_lora(),
        ],
    )


@pytest.mark.parametrize("loaded", [True, False], ids=["loaded", "unloaded"])
def test_a_peft_adapter_added_is_kept(root: Path, loaded: bool) -> None:
    """Unloaded, peft builds the adapter's tensors where the base weights answer they are:
    where the component runs (on meta they would never get values)."""
    from peft import LoraConfig

    def add(pipe: Any) -> None:
        if loaded:
            load(pipe, "unet")
        pipe.unet.add_adapter(LoraConfig(r=4, target_modules=ATTENTION), adapter_name="p")
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():  # B starts at zero: give the adapter an effect
            for name, param in pipe.unet.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)

    compare("sd", root, "default", [add])


def test_control_an_adapter_added_on_meta_fails_clearly(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the empty weights answering ``meta`` for ``.device``, peft builds the adapter
    there: nothing can give those tensors values, and stageload says so."""
    from peft import LoraConfig

    from stageload.diffusers._placeholder import StageHook

    monkeypatch.setattr(StageHook, "run_device", None)
    fam = FAMILIES["sd"]
    pipe = staged("sd", root, "default")
    run(pipe, "sd", "default")
    with pytest.raises((ModelLoadError, StagedChangeError)) as info:
        pipe.unet.add_adapter(LoraConfig(r=4, target_modules=ATTENTION), adapter_name="p")
        pipe(**fam.call(0))
    assert "while it was not loaded" in str(info.value)
    assert "pipe.stageload.load('unet')" in str(info.value)


def test_textual_inversion_is_kept(root: Path) -> None:
    embedding = torch.randn(32, generator=torch.Generator().manual_seed(5))

    def invert(pipe: Any) -> None:
        load(pipe, "text_encoder")
        pipe.load_textual_inversion({"<cat-toy>": embedding.clone()}, token="<cat-toy>")

    fam = FAMILIES["sd"]
    eager = fam.load(folder(fam, root))
    pipe = staged("sd", root, "default")
    run(pipe, "sd", "default")
    invert(eager)
    invert(pipe)
    call = {**fam.call(0), "prompt": "a <cat-toy> on a chair"}
    want = eager(**call)[0]
    for _ in range(2):
        assert torch.equal(pipe(**{**fam.call(0), "prompt": "a <cat-toy> on a chair"})[0], want)


def test_weights_edited_in_place_and_replaced_submodules_are_kept(root: Path) -> None:
    def edit(pipe: Any) -> None:
        load(pipe, "unet", "vae")
        block = pipe.unet.down_blocks[1].attentions[0].transformer_blocks[0]
        block.attn1.to_q.weight.data.mul_(1.5)  # through .data: torch does not count it
        with torch.no_grad():
            block.attn1.to_k.weight.mul_(0.5)  # counted
        conv = pipe.vae.decoder.conv_out
        generator = torch.Generator().manual_seed(7)
        replacement = torch.nn.Conv2d(conv.in_channels, conv.out_channels, 3, padding=1)
        with torch.no_grad():
            replacement.weight.copy_(torch.randn(replacement.weight.shape, generator=generator))
            replacement.bias.zero_()
        pipe.vae.decoder.conv_out = replacement

    compare("sd", root, "default", [edit])


def test_a_lora_on_a_transformer_family_is_kept(root: Path) -> None:
    a = lora("flux", root, "transformer", seed=0)
    fam = FAMILIES["flux"]
    base = run(fam.load(folder(fam, root)), "flux", "default")
    (with_lora,) = compare(
        "flux", root, "default", [lambda p: p.load_lora_weights(dict(a), adapter_name="a")]
    )
    assert not torch.equal(with_lora, base)


def test_what_is_kept_stays_in_memory_and_the_rest_is_released(root: Path) -> None:
    """The LoRA's tensors stay across a release (they are small); the UNet's own weights go."""
    a = lora("sd", root, "unet", seed=0)
    sink = ListSink()
    pipe = staged("sd", root, "default", sink)
    pipe.load_lora_weights(dict(a), adapter_name="a")
    run(pipe, "sd", "default")  # the UNet is released on entering decode
    kept = {n: p for n, p in pipe.unet.named_parameters() if not p.is_meta}
    assert kept and all("lora_" in n for n in kept)
    assert sum(p.nbytes for p in kept.values()) == sum(v.nbytes for v in a.values())


def test_attention_processors_and_fused_projections_are_kept(root: Path) -> None:
    from diffusers.models.attention_processor import AttnProcessor

    compare(
        "sd",
        root,
        "default",
        [
            lambda p: p.unet.set_attn_processor(AttnProcessor()),
            lambda p: (load(p, "unet", "vae"), p.fuse_qkv_projections()),
        ],
    )


def test_fusing_projections_of_an_unloaded_component_loads_it(root: Path) -> None:
    """fuse_qkv_projections concatenates the weights' values: reading them loads them."""
    compare("sd", root, "default", [lambda p: p.fuse_qkv_projections()])


@pytest.mark.parametrize("held", [True, False], ids=["kept", "control"])
def test_a_state_dict_the_script_keeps_and_edits_reaches_the_component(
    root: Path, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sd = pipe.unet.state_dict()`` kept across a call, then edited in place: in eager
    the edit is the UNet's (its tensors alias the weights). Staged, the tensors held
    outside stay in memory through releases, so the edit reaches every later call, and
    that is said once (helper-56: the next calls silently used the checkpoint's bias,
    0.05 off). Control: a release that takes them too."""
    from stageload.diffusers._placeholder import StageHook

    if not held:
        monkeypatch.setattr(StageHook, "retain", lambda self, module: self.tracked.retain(module))
    fam = FAMILIES["sd"]
    sink = ListSink()
    outs = []
    for pipe in (fam.load(folder(fam, root)), staged("sd", root, "default", sink)):
        sd = pipe.unet.state_dict()
        first = run(pipe, "sd", "default")  # staged: the UNet is released at decode
        with torch.no_grad():
            sd["conv_out.bias"].add_(0.5)
        outs.append([first, run(pipe, "sd", "default"), run(pipe, "sd", "default")])
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True)) == held
    notes = [e.note for e in sink.events if e.kind == "note" and "held outside" in e.note]
    assert len(notes) == held


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
@pytest.mark.parametrize("conversion", ["round-trip", "cpu:0"])
def test_a_held_state_dict_stays_the_components_across_a_replayed_conversion(
    root: Path, conversion: str, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ``pipe.to(bfloat16).to(float32)`` (or ``pipe.to("cpu:0")``), every reload
    replays the conversion. It replayed it on the tensors that stayed in memory too: a
    ``state_dict()`` the script holds then lost them (a conversion gives a tensor new
    memory), and its edit after the next calls went nowhere (0.05 off eager). A reload
    converts what its files filled only. Control: the conversion on every tensor."""
    if not fixed:
        monkeypatch.setattr(refill, "_aside", lambda aside: contextlib.nullcontext())
    fam = FAMILIES["sd"]
    outs = []
    for pipe in (fam.load(folder(fam, root)), staged("sd", root, "default")):
        run(pipe, "sd", "default")
        if conversion == "round-trip":
            pipe.to(torch.bfloat16)
            pipe.to(torch.float32)
        else:
            pipe.to("cpu:0")
        sd = pipe.unet.state_dict()
        first = run(pipe, "sd", "default")  # staged: the UNet reloads, converted again
        with torch.no_grad():
            sd["conv_out.bias"].add_(0.5)
        outs.append([first, run(pipe, "sd", "default"), run(pipe, "sd", "default")])
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True)) == fixed


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name, persistent or not."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
@pytest.mark.parametrize("loaded", [True, False], ids=["loaded", "released"])
def test_half_float_double_are_replayed_as_called_not_as_to_dtype(
    root: Path, loaded: bool, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unet.double()`` then ``.float()`` (as ``.half()``, ``.bfloat16()``) convert only
    floating tensors; the adapter recorded them as ``.to(float64)``, ``.to(float32)``,
    which convert complex ones too: a complex buffer the script put on the UNet became
    real, its imaginary part dropped (torch warns once), where eager's stays complex64. Now the
    conversion ``_apply`` was given is made itself, now and at each load: after two calls
    every tensor of the UNet equals eager's, dtype and values, and so do the images.
    Control: the old recording, the dtype alone (replayed as ``.to(dtype)``)."""
    from fixtures.old_dtype_recording import record_dtype_alone

    if not fixed:
        record_dtype_alone(monkeypatch)
    phase = torch.complex(torch.arange(4.0), torch.ones(4))
    seen = []
    for pipe in (FAMILIES["sd"].load(folder(FAMILIES["sd"], root)), staged("sd", root, "default")):
        run(pipe, "sd", "default")  # staged: the UNet is released after the call
        if loaded:
            load(pipe, "unet")
        pipe.unet.register_buffer("phase", phase.clone(), persistent=False)
        pipe.unet.double()
        pipe.unet.float()
        images = [run(pipe, "sd", "default") for _ in range(2)]  # staged: two reloads
        load(pipe, "unet")
        tensors = {n: t.clone() for n, t in _tensors(pipe.unet).items()}
        seen.append((images, tensors))
    (want, eager), (got, staged_tensors) = seen
    assert eager["phase"].dtype == torch.complex64 and torch.equal(eager["phase"], phase)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))  # phase is unused
    same = staged_tensors.keys() == eager.keys() and all(
        t.dtype == eager[n].dtype and torch.equal(t, eager[n]) for n, t in staged_tensors.items()
    )
    assert same is fixed
    assert (staged_tensors["phase"].dtype == torch.complex64) is fixed  # control: float32


def test_a_lora_loaded_and_unloaded_while_another_thread_calls(root: Path) -> None:
    """A server's pattern: one thread serves calls while another loads and unloads a LoRA.
    Each change waits for the call in flight and each call for the change, so every call
    sees the pipeline with or without the LoRA, as eager's one-at-a-time calls do, and
    nothing fails. Before, the changes ran inside the calls' loads and releases: 8 of 10
    LoRA loads failed ("tensors still on meta", "returned a module that was already
    released") and 4 of 8 calls raised StagedChangeError, where eager gave no error.

    Reference: the eager pipeline (diffusers' ``from_pretrained``, no stageload), called
    with and without the LoRA, in this process."""
    import threading

    a = lora("sd", root, "unet", seed=0)
    fam = FAMILIES["sd"]
    ref = fam.load(folder(fam, root))
    plain = run(ref, "sd", "default")
    ref.load_lora_weights(dict(a), adapter_name="a")
    with_lora = run(ref, "sd", "default")
    assert not torch.equal(plain, with_lora)
    pipe = staged("sd", root, "default")
    outs: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for _ in range(3):
                outs.append(run(pipe, "sd", "default"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    server = threading.Thread(target=serve)
    server.start()
    changes = 0
    while server.is_alive() and changes < 40:
        pipe.load_lora_weights(dict(a), adapter_name="a")
        pipe.unload_lora_weights()
        changes += 1
    server.join()
    assert errors == []
    assert len(outs) == 3
    assert all(torch.equal(o, plain) or torch.equal(o, with_lora) for o in outs)
    pipe.load_lora_weights(dict(a), adapter_name="a")
    assert torch.equal(run(pipe, "sd", "default"), with_lora)
