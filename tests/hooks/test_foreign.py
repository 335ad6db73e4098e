"""Every attribute stageload sets on objects it does not own, listed: a new one fails here.

The one hook protocol (``stageload.hooks.registry``) keeps them few: on a module, the hook
registry and the ``forward`` it wraps; on an object whose attribute is patched (``on_call``,
``share``), that attribute, until the patch is removed. The diffusers adapter adds
accelerate's ``_hf_hook`` on a placeholder (diffusers reads it), a patch of its
``save_pretrained``, and ``pipe.stageload``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stageload import StagedModels, load_weights, on_call, release, share
from stageload.external import CONVERT_METHOD, HF_HOOK_ATTR
from stageload.hooks.registry import HOOKS_ATTR

#: On any module stageload hooks (a released one, a placeholder's parts).
ON_MODULES = {HOOKS_ATTR, "forward"}
#: On a diffusers placeholder itself, besides: accelerate's hook protocol, the patch that
#: loads the component around its own save_pretrained, and the one that records
#: conversions (nn.Module._apply).
ON_PLACEHOLDERS = {HF_HOOK_ATTR, "save_pretrained", CONVERT_METHOD}
#: On a staged diffusers pipeline: the handle users reach the stager by.
ON_PIPELINES = {"stageload"}


def added(before: dict[str, Any], obj: Any) -> set[str]:
    return set(vars(obj)) - set(before)


def snapshot(module: nn.Module) -> dict[str, dict[str, Any]]:
    return {name: dict(vars(sub)) for name, sub in module.named_modules()}


def added_in_tree(before: dict[str, dict[str, Any]], module: nn.Module) -> set[str]:
    return {key for name, sub in module.named_modules() for key in added(before[name], sub)}


def test_release_and_refill_set_only_the_registry(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    save_file(model.state_dict(), tmp_path / "m.safetensors")
    before = snapshot(model)
    release(model, name="m")
    assert added_in_tree(before, model) == ON_MODULES
    load_weights(model, tmp_path / "m.safetensors")
    assert added_in_tree(before, model) == set()  # live again: nothing of ours is left


def test_staged_models_set_only_the_registry_on_a_loaded_model() -> None:
    # A loaded model carries the hook that counts its calls in flight (a release waits for
    # them): the registry and the forward it wraps, nothing else; its submodules nothing.
    model = nn.Sequential(nn.Linear(2, 2))
    before = snapshot(model)
    with StagedModels({"m": lambda: model}, stages={"a": ["m"], "b": []}) as models:
        models.enter("a")
        models["m"](torch.zeros(1, 2))
        assert added(before[""], model) == ON_MODULES
        assert added(before["0"], model[0]) == set()
        models.enter("b")
        assert added_in_tree(before, model) == ON_MODULES


class Owner:
    def method(self, x: int) -> int:
        return x + 1

    @classmethod
    def build(cls, x: int) -> list[int]:
        return [x]


def test_patches_set_only_the_patched_attribute_and_take_it_back() -> None:
    obj = Owner()
    before_obj, before_cls = dict(vars(obj)), dict(vars(Owner))
    remove = on_call(obj, "method", before=lambda x: None)
    assert added(before_obj, obj) == {"method"}
    with share(Owner, "build"):
        assert set(vars(Owner)) == set(before_cls)  # replaced, not added
        assert Owner.build(1) is Owner.build(1)
    remove()
    assert vars(obj) == before_obj
    assert dict(vars(Owner)) == before_cls


def test_a_staged_diffusers_pipeline_sets_only_the_listed_attributes(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from diffusers import QwenImage21Pipeline

    from stageload.diffusers import staged_pipeline
    from stageload.testing.diffusers import build

    path = build("qwen-image-2.1", tmp_path / "qwen")
    eager = QwenImage21Pipeline.from_pretrained(path)
    pipe = staged_pipeline(QwenImage21Pipeline, path, keep=())
    call = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 1}
    for run in (eager, pipe):  # a call sets the pipeline's own per-call attributes
        run(**call, output_resolution=64, generator=torch.Generator().manual_seed(0))
    assert added(vars(eager), pipe) <= ON_PIPELINES
    for name in pipe.stageload.models:
        staged, reference = getattr(pipe, name), getattr(eager, name)
        reference_subs = dict(reference.named_modules())
        for sub_name, sub in staged.named_modules():
            extra = added(vars(reference_subs[sub_name]), sub)
            allowed = ON_MODULES | (ON_PLACEHOLDERS if sub is staged else set())
            assert extra <= allowed, f"{name}.{sub_name}: {sorted(extra - allowed)}"
