"""on_call(): wraps one instance's method, keeps its name and signature, removes cleanly."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import pytest

from stageload import on_call
from stageload.hooks.registry import ModuleHook


class Pipeline:
    def encode_prompt(self, prompt: str, *, scale: float = 1.0) -> str:
        """Encode a prompt."""
        return prompt.upper()


def test_before_and_after_run_around_the_call_with_its_arguments():
    pipe = Pipeline()
    calls: list[tuple] = []
    on_call(
        pipe,
        "encode_prompt",
        before=lambda *a, **k: calls.append(("before", a, k)),
        after=lambda result, *a, **k: calls.append(("after", result, a)),
    )
    assert pipe.encode_prompt("cat", scale=2.0) == "CAT"
    assert calls == [("before", ("cat",), {"scale": 2.0}), ("after", "CAT", ("cat",))]


def test_wrapper_keeps_name_doc_and_signature():
    pipe = Pipeline()
    original = inspect.signature(pipe.encode_prompt)
    on_call(pipe, "encode_prompt", before=lambda *a, **k: None)
    assert pipe.encode_prompt.__name__ == "encode_prompt"
    assert pipe.encode_prompt.__doc__ == "Encode a prompt."
    assert inspect.signature(pipe.encode_prompt) == original


def test_only_this_instance_is_wrapped_and_remove_restores_it():
    pipe, other = Pipeline(), Pipeline()
    seen: list[str] = []
    remove = on_call(pipe, "encode_prompt", before=lambda p, **k: seen.append(p))
    other.encode_prompt("x")
    pipe.encode_prompt("y")
    remove()
    pipe.encode_prompt("z")
    assert seen == ["y"]
    assert "encode_prompt" not in vars(pipe)


def test_removing_out_of_order_leaves_the_other_wrapper_working():
    pipe = Pipeline()
    seen: list[str] = []
    remove_a = on_call(pipe, "encode_prompt", before=lambda *a, **k: seen.append("a"))
    remove_b = on_call(pipe, "encode_prompt", before=lambda *a, **k: seen.append("b"))
    remove_a()  # a is under b: it becomes a pass-through
    pipe.encode_prompt("x")
    assert seen == ["b"]
    remove_b()
    pipe.encode_prompt("x")
    assert seen == ["b"]


def test_clear_errors_for_missing_method_and_missing_callbacks():
    with pytest.raises(AttributeError, match="no method 'decode'"):
        on_call(Pipeline(), "decode", before=print)
    with pytest.raises(ValueError, match="before=, after="):
        on_call(Pipeline(), "encode_prompt")
    with pytest.raises(TypeError, match="before= must be callable, got 3"):
        on_call(Pipeline(), "encode_prompt", before=3)  # was taken, and failed at the call


def test_a_class_instead_of_an_instance_is_a_clear_error():
    original = vars(Pipeline)["encode_prompt"]
    with pytest.raises(TypeError, match=r"one instance, got the class Pipeline; pass an instance"):
        on_call(Pipeline, "encode_prompt", before=lambda *a, **k: None)
    assert vars(Pipeline)["encode_prompt"] is original


def test_a_deep_copy_of_a_hooked_module_runs_its_own_forward_with_the_hooks() -> None:
    """The registry is copied with the module; the copy's forward is the copy's own."""
    import copy

    torch = pytest.importorskip("torch")

    from stageload.hooks.registry import HookRegistry, ModuleHook

    calls: list[int] = []

    class Count(ModuleHook):
        def pre_call(self, module: Any, args: Any, kwargs: Any) -> Any:
            calls.append(id(module))
            return None

    module = torch.nn.Linear(2, 2)
    HookRegistry.attach(module).add("count", Count())
    twin = copy.deepcopy(module)
    assert torch.equal(twin(torch.ones(1, 2)), module(torch.ones(1, 2)))
    assert calls == [id(twin), id(module)]
    HookRegistry.remove(twin, "count")
    assert "forward" not in vars(twin)  # its class's forward again, as before the hook


def test_a_hook_name_taken_twice_raises_and_replace_keeps_its_place():
    """Two features must not overwrite each other's hook by name (as in diffusers' registry);
    ``replace=True`` is the explicit way, and keeps the hook's place in the call order."""
    from torch import nn

    from stageload.hooks.registry import HookRegistry, ModuleHook

    module = nn.Linear(2, 2)
    registry = HookRegistry.attach(module)
    first, second, other = ModuleHook(), ModuleHook(), ModuleHook()
    registry.add("a", first)
    registry.add("b", other)
    with pytest.raises(ValueError, match="already has a hook named 'a'.*replace=True"):
        registry.add("a", second)
    assert registry.hooks() == [first, other]  # unchanged by the refused add
    registry.add("a", second, replace=True)
    assert registry.hooks() == [second, other]
    HookRegistry.remove(module, "a")
    HookRegistry.remove(module, "b")
    assert HookRegistry.of(module) is None and "forward" not in module.__dict__


# -- a copy of a patched object ------------------------------------------------------------------
class _WithOwn:
    """An object whose patched attribute is its own (a partial), not its class's."""

    def __init__(self) -> None:
        import functools

        self.cb = functools.partial(max, 0)


class _WithMethod:
    def helper(self, x: int) -> int:
        return x + 1


def copies_of_patched(obj: object, attr: str) -> list[object]:
    """``obj`` with ``attr`` patched by ``on_call`` (a hook that counts its runs): its
    ``copy.deepcopy`` and its pickle round trip."""
    import copy
    import pickle

    on_call(obj, attr, before=lambda *a, **k: None)
    return [copy.deepcopy(obj), pickle.loads(pickle.dumps(obj))]


def test_a_copy_of_a_patched_object_has_the_attribute_as_it_was_before_the_patch():
    """An attribute of the object's own is copied with it (copy and pickle raised
    AttributeError); a class's method is bound to the copy, not the original."""
    for copied in copies_of_patched(_WithOwn(), "cb"):
        assert copied.cb(3) == 3
    original = _WithMethod()
    for copied in copies_of_patched(original, "helper"):
        assert copied.helper(1) == 2 and copied.helper.__self__ is copied


def test_control_copied_as_the_class_attribute_an_own_attribute_is_lost(monkeypatch):
    from stageload.hooks import registry

    def as_class(self: object) -> tuple:
        return getattr, (self.chain.owner_ref(), self.chain.attr)

    monkeypatch.setattr(registry._Dispatch, "__reduce__", as_class)
    with pytest.raises(AttributeError, match="cb"):
        copies_of_patched(_WithOwn(), "cb")


# -- a file of a hooked module ---------------------------------------------------------------------
_LOAD_WITHOUT_STAGELOAD = """
import sys

class NoStageload:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'stageload':
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, NoStageload())
import torch
m = torch.load(sys.argv[1], weights_only=False)
torch.save(m(torch.ones(1, 2)), sys.argv[2])
print(sorted(vars(m)))
"""


class _NotCopied(ModuleHook):
    copied = False


def saved_and_loaded_elsewhere(tmp_path: Path, own_forward: bool) -> tuple[Any, ...]:
    """``torch.save`` of a module with a hook no copy keeps (auto's, a staged
    component's), then ``torch.load`` in a process where stageload cannot be imported (a
    deployment box). ``own_forward``: the module had a forward of its own (an instance
    attribute) before the hook. Returns (the output there, here, the loader's stdout)."""
    import subprocess
    import sys

    import torch

    from stageload.hooks.registry import HookRegistry

    torch.manual_seed(0)
    module = torch.nn.Linear(2, 2)
    if own_forward:
        module.forward = functools.partial(torch.nn.functional.linear, weight=module.weight)
    HookRegistry.attach(module).add("staged", _NotCopied())
    saved, out = tmp_path / "m.pt", tmp_path / "out.pt"
    torch.save(module, saved)
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_STAGELOAD, saved, out],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-600:]
    return torch.load(out), module(torch.ones(1, 2)), done.stdout


@pytest.mark.parametrize("own_forward", [False, True], ids=["class-forward", "own-forward"])
def test_a_saved_hooked_module_loads_where_stageload_is_not_installed(
    tmp_path: Path, own_forward: bool
) -> None:
    """It pickled the registry and its forward wrapper: torch.load raised "No module named
    'stageload'". A module whose hooks no copy keeps is saved as it is without them."""
    import torch

    there, here, attributes = saved_and_loaded_elsewhere(tmp_path, own_forward)
    assert torch.equal(there, here)
    assert "_stageload_hooks" in attributes  # as None: the key cannot be left out


def test_control_a_registry_pickled_as_it_is_needs_stageload(tmp_path: Path, monkeypatch) -> None:
    from stageload.hooks.registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "__reduce_ex__", object.__reduce_ex__)
    with pytest.raises(AssertionError, match="No module named 'stageload"):
        saved_and_loaded_elsewhere(tmp_path, own_forward=False)


def test_a_copy_of_a_hooked_module_list_pickles_again() -> None:
    """A copy's forward was a method bound to the copy, which pickles by its function's
    name: a ModuleList's (``_forward_unimplemented``) cannot be found by it, so an EMA
    ``deepcopy`` of a model whose parts auto hooked could not be saved."""
    import copy
    import io

    import torch

    from stageload.hooks.registry import HookRegistry

    blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    HookRegistry.attach(blocks).add("staged", _NotCopied())
    saved = io.BytesIO()
    torch.save(copy.deepcopy(blocks), saved)
    saved.seek(0)
    again = torch.load(saved, weights_only=False)
    assert torch.equal(again[0].weight, blocks[0].weight) and HookRegistry.of(again) is None


def test_control_a_copy_bound_by_name_does_not_pickle(monkeypatch) -> None:
    from stageload.hooks import registry

    monkeypatch.setattr(registry, "_as_it_was", lambda owner, attr, own: (getattr, (owner, attr)))
    with pytest.raises(AttributeError, match="_forward_unimplemented"):
        test_a_copy_of_a_hooked_module_list_pickles_again()
