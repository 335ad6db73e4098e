"""Pins the behaviour of every private or version-dependent API in ``stageload.external``:
an upgrade of torch, diffusers, accelerate or transformers that changes one fails here."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from stageload import external


def test_version_at_least_reads_the_installed_distribution() -> None:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert external.version_at_least("torch", f"{major}.{minor}")
    assert not external.version_at_least("torch", f"{major + 1}.0")
    assert not external.version_at_least("no-such-distribution-here", "0")


def test_non_persistent_buffers_are_the_ones_state_dict_leaves_out() -> None:
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(2))
    module.register_buffer("computed", torch.ones(2), persistent=False)
    assert external.non_persistent_buffers(module) == {"computed"}
    assert set(module.state_dict()) == {"kept"}


class _Recording(nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.calls: list[str] = []

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(external.CONVERT_METHOD)
        return super()._apply(fn, *args, **kwargs)


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.to(torch.float16),
        lambda m: m.to("cpu"),
        lambda m: m.half(),
        lambda m: m.float(),
        lambda m: m.bfloat16(),
        lambda m: m.double(),
        lambda m: m.type(torch.float16),
        lambda m: m.cpu(),
    ],
)
def test_every_conversion_goes_through_one_method(convert: Any) -> None:
    module = _Recording()
    assert getattr(nn.Module, external.CONVERT_METHOD)  # the method exists
    convert(module)
    assert module.calls == [external.CONVERT_METHOD]


def test_the_version_counter_counts_in_place_changes_but_not_through_data() -> None:
    """The placeholder's change detection relies on both halves: the counter catches
    in-place changes, and a sampled fingerprint catches those made through ``.data``."""
    p = nn.Parameter(torch.ones(4))
    start = external.tensor_version(p)
    with torch.no_grad():
        p.mul_(2)
    assert external.tensor_version(p) == start + 1
    p.data.mul_(2)
    assert external.tensor_version(p) == start + 1


def test_written_in_place_makes_a_saved_tensor_fail_backward() -> None:
    """load_weights' in-place reads rely on it; inference tensors are skipped, not an
    error."""
    p = nn.Parameter(torch.ones(4))
    loss = (p * p).sum()  # saves p
    external.written_in_place([p])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.inference_mode():
        frozen = torch.ones(4)
    external.written_in_place([frozen])


def test_swap_tensors_keeps_the_objects_and_swaps_their_contents() -> None:
    """Releases and refills rely on it: a module keeps its tensor objects for life."""
    module = nn.Linear(2, 2)
    weight = module.weight
    meta = nn.Parameter(torch.empty_like(weight, device="meta"))
    torch.utils.swap_tensors(weight, meta)
    assert module.weight is weight and weight.is_meta and not meta.is_meta


def test_load_state_dict_assign_takes_the_tensors_themselves() -> None:
    """``fill`` relies on it: the placeholder ends up holding the loaded tensors, tied
    ones staying one tensor."""
    with torch.device("meta"):
        skeleton = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    skeleton[1].weight = skeleton[0].weight
    loaded = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    loaded[1].weight = loaded[0].weight
    state = loaded.state_dict(keep_vars=True)
    skeleton.load_state_dict(state, assign=True)
    assert skeleton[0].weight is loaded[0].weight
    assert skeleton[1].weight is skeleton[0].weight


def test_keep_in_fp32_modules_follows_each_librarys_rule() -> None:
    """transformers keeps its list in float32 under float16 only; diffusers under both
    half precisions; nothing under float32."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    from diffusers import WanTransformer3DModel
    from transformers import T5EncoderModel

    assert "wo" in external.keep_in_fp32_modules(T5EncoderModel, torch.float16)
    assert "wo" not in external.keep_in_fp32_modules(T5EncoderModel, torch.bfloat16)
    for dtype in (torch.float16, torch.bfloat16):
        assert "scale_shift_table" in external.keep_in_fp32_modules(WanTransformer3DModel, dtype)
    assert external.keep_in_fp32_modules(WanTransformer3DModel, torch.float32) == ()
    assert external.keep_in_fp32_modules(nn.Linear, torch.float16) == ()


@pytest.mark.parametrize("given", [None, torch.bfloat16, "auto"])
def test_from_pretrained_dtype_is_what_from_pretrained_gives(tmp_path, given) -> None:
    """Checked against the libraries: a float16 checkpoint of each kind, loaded with no
    dtype, ``"auto"`` and bfloat16 (None means the checkpoint's own)."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKL
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    made = {
        GPT2Model: GPT2Model(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16)),
        AutoencoderKL: AutoencoderKL(block_out_channels=(8,), norm_num_groups=8),
    }
    for cls, model in made.items():
        model.half().save_pretrained(tmp_path / cls.__name__)
        kwargs = {} if given is None else {"torch_dtype": given}
        loaded = cls.from_pretrained(tmp_path / cls.__name__, **kwargs)
        assert external.library_model(cls) == cls.__module__.split(".")[0]
        expected = external.from_pretrained_dtype(cls, given) or torch.float16
        assert loaded.dtype == expected, cls
    assert external.library_model(nn.Linear) is None
    assert external.from_pretrained_dtype(nn.Linear, None) is None


def test_transformers_from_config_builds_without_reading_weights() -> None:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    with torch.device("meta"):
        model = external.transformers_from_config(GPT2Model, config)
    assert isinstance(model, GPT2Model)
    assert all(p.is_meta for p in model.parameters())


def test_diffusers_reads_accelerates_hook_attribute() -> None:
    """``apply_forward_hook`` (encode/decode) calls ``_hf_hook.pre_forward``,
    ``_execution_device`` reads ``_hf_hook.execution_device``, and ``remove_all_hooks``
    calls ``_hf_hook.detach_hook``: the three things a placeholder's hook answers."""
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline

    class Hook:
        execution_device = torch.device("cpu")

        def __init__(self) -> None:
            self.seen: list[str] = []

        def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
            self.seen.append("pre_forward")
            return args, kwargs

        def post_forward(self, module: Any, output: Any) -> Any:
            return output

        def detach_hook(self, module: Any) -> Any:
            self.seen.append("detach_hook")
            return module

    vae = AutoencoderKL(
        block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=8
    )
    hook = Hook()
    setattr(vae, external.HF_HOOK_ATTR, hook)
    vae.decode(torch.zeros(1, 4, 4, 4))
    assert hook.seen == ["pre_forward"]
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=None,
        scheduler=DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    hook.execution_device = torch.device("meta")  # a value only the hook could give
    assert pipe._execution_device == torch.device("meta")
    pipe.remove_all_hooks()
    assert hook.seen == ["pre_forward", "detach_hook"]


def test_set_progress_bar_config_is_read_back_from_the_pipeline() -> None:
    diffusers = pytest.importorskip("diffusers")
    pipe = diffusers.DDPMPipeline(unet=None, scheduler=diffusers.DDPMScheduler())
    assert not external.progress_bars_disabled(pipe)
    pipe.set_progress_bar_config(disable=True)
    assert external.progress_bars_disabled(pipe)
    pipe.set_progress_bar_config(disable=False)
    assert not external.progress_bars_disabled(pipe)


def test_every_parameter_assignment_calls_the_registration_hook_which_may_replace_it() -> None:
    """``stageload.load.meta`` relies on it: a constructor's ``self.weight = Parameter(...)``
    reaches the hook, and what the hook returns is what the module keeps."""
    seen: list[str] = []
    given: list[nn.Parameter] = []

    def hook(module: nn.Module, name: str, param: Any) -> Any:
        seen.append(name)
        if name == "bias":
            given.append(nn.Parameter(torch.empty_like(param, device="meta")))
            return given[-1]
        return None

    remove = external.on_parameter_registration(hook)
    try:
        linear = nn.Linear(2, 3)
    finally:
        remove()
    assert seen == ["weight", "bias"]
    assert linear.bias is given[0] and linear.bias.is_meta and not linear.weight.is_meta
    nn.Linear(2, 3)
    assert seen == ["weight", "bias"]  # removed: not called again


def test_own_tensor_tables_are_a_modules_own_parameters_and_buffers() -> None:
    module = torch.nn.BatchNorm1d(3)
    params, buffers = external.own_tensor_tables(module)
    assert set(params) == {"weight", "bias"}
    assert set(buffers) == {"running_mean", "running_var", "num_batches_tracked"}
    assert params["weight"] is module.weight


def test_torch_function_off_and_as_subclass() -> None:
    seen: list[object] = []

    class Watched(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            seen.append(func)
            with external.torch_function_off():
                return func(*args, **(kwargs or {}))

    t = external.as_subclass(Watched, torch.zeros(2), False)
    assert type(t) is Watched and not t.requires_grad
    t.add(1)
    assert seen  # the subclass sees torch functions...
    seen.clear()
    with external.torch_function_off():
        t.add(1)
    assert not seen  # ... and not inside torch_function_off


def test_module_call_code_is_on_the_stack_of_a_module_call():
    """hooks.registry finds calls in flight by this code object in thread stacks."""
    import sys

    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            frame, codes = sys._getframe(), []
            while frame is not None:
                codes.append(frame.f_code)
                frame = frame.f_back
            seen.append(external.module_call_code() in codes)
            return x

    Probe()(torch.zeros(1))
    Probe().forward(torch.zeros(1))  # control: a direct forward() is not a module call
    assert seen == [True, False]


def test_a_tensor_saved_for_backward_as_it_is_counts_in_its_use_count() -> None:
    """What ``stageload.auto`` reads to keep a model whose weights a graph saved (a
    LayerNorm's weight: no view, so its storage count does not move)."""
    norm = nn.LayerNorm(4)
    assert external.tensor_use_count(norm.weight) == 1
    out = norm(torch.ones(2, 4, requires_grad=True))
    storage = norm.weight.untyped_storage()
    assert external.tensor_use_count(norm.weight) > 1
    assert external.storage_use_count(storage) == 2  # the weight and this object only
    out.sum().backward()
    assert external.tensor_use_count(norm.weight) > 1  # the graph is alive, out holds it
    del out
    assert external.tensor_use_count(norm.weight) == 1


@pytest.mark.parametrize(
    ("kwargs", "picked"),
    [
        ({}, "StableDiffusionPipeline"),
        ({"controlnet": "cn"}, "StableDiffusionControlNetPipeline"),
        ({"enable_pag": True}, "StableDiffusionPAGPipeline"),
    ],
)
def test_an_auto_pipeline_picks_its_class_through_one_function(tmp_path, kwargs, picked) -> None:
    """AutoPipeline's ``from_pretrained`` names the class through
    ``external.AUTO_PIPELINE_PICK``, then calls that class's ``from_pretrained`` with what
    it passes on (``enable_pag`` taken, ``controlnet`` passed)."""
    pytest.importorskip("diffusers")
    import json

    import diffusers.pipelines.auto_pipeline as auto

    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline"})
    )
    seen: list[Any] = []

    class Stop(Exception):
        pass

    def pick(mapping: Any, name: str, *args: Any, **kw: Any) -> Any:
        class Picked:
            @staticmethod
            def from_pretrained(path: Any, **passed: Any) -> Any:
                seen.append((name, passed))
                raise Stop

        return Picked

    real = getattr(auto, external.AUTO_PIPELINE_PICK)
    setattr(auto, external.AUTO_PIPELINE_PICK, pick)
    try:
        with pytest.raises(Stop):
            auto.AutoPipelineForText2Image.from_pretrained(str(tmp_path), **kwargs)
    finally:
        setattr(auto, external.AUTO_PIPELINE_PICK, real)
    [(name, passed)] = seen
    assert name == picked
    assert "enable_pag" not in passed and passed.get("controlnet") == kwargs.get("controlnet")
