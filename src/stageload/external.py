"""Every private or version-dependent API of torch, diffusers, accelerate and transformers
that stageload relies on, named in one place. ``tests/package/test_external.py`` pins the behaviour
each one is used for, so an upgrade that changes it fails there, not deep in a run.

Nothing here is imported at ``import stageload``: each function imports its library.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def version_at_least(distribution: str, version: str) -> bool:
    """Whether the installed ``distribution`` is at least ``version`` (False if absent).

    The one version check: transformers 4.56 renamed ``torch_dtype`` to ``dtype`` in
    ``from_pretrained``, transformers 5 loads weights in the checkpoint's dtype by default,
    and diffusers 0.42 spells the pipeline's dtype argument ``dtype``.
    """
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from packaging.version import Version

    try:
        return Version(installed(distribution)) >= Version(version)
    except PackageNotFoundError:
        return False


#: Held while stageload runs a library's ``from_pretrained`` or builds a model with
#: accelerate's ``init_empty_weights``, which patches ``nn.Module.register_parameter`` for
#: every thread and puts back what it found when it ends: two at once on two threads leave
#: it patched for good (the first to end puts back the second's patch), and every parameter
#: registered after, in any module, goes to meta (a tied T5 embedding came out untied). A
#: script loads on one thread; stageload loads at the calls, on the callers' threads (a
#: server's), so it runs these one at a time: auto's loads, the diffusers adapter's first
#: loads and its skeletons. Reentrant: a pipeline's factory loads its components inside.
BUILD_LOCK = threading.RLock()


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers that ``state_dict()`` leaves out (computed in
    ``__init__``, such as rotary tables): torch keeps them in a private set."""
    return set(module._non_persistent_buffers_set)


def on_parameter_registration(hook: Callable[[nn.Module, str, Any], Any]) -> Callable[[], None]:
    """Call ``hook(module, name, param)`` at every parameter any module registers (each
    ``self.weight = nn.Parameter(...)`` goes through ``register_parameter``, which calls
    it); a non-None return is registered instead. torch's global registration hook: every
    thread's modules see it. Returns the function that removes it."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    return register_module_parameter_registration_hook(hook).remove


#: The one ``nn.Module`` method that ``to``, ``cpu``, ``cuda``, ``half``, ``float``,
#: ``bfloat16``, ``double`` and ``type`` all call with a conversion function: overriding it
#: sees every conversion of a module, whichever method asked.
CONVERT_METHOD = "_apply"


def tensor_version(tensor: Any) -> int:
    """How many in-place changes ``tensor`` has seen: torch's private version counter, the
    one autograd checks. Changes through ``tensor.data`` are not counted (that view has a
    counter of its own), nor a new ``tensor.data = ...``."""
    return int(tensor._version)


def written_in_place(tensors: list[Any]) -> None:
    """Tell autograd that ``tensors`` were written through their memory (a read into their
    storage), as an in-place op would: a graph that saved one raises at ``backward``.
    ``torch.autograd.graph.increment_version`` takes one tensor before torch 2.5 (a list
    after); inference tensors have no counter and are left out."""
    from torch.autograd.graph import increment_version

    for t in tensors:
        if not t.is_inference():
            increment_version(t)


def transformers_from_config(cls: type, config: Any) -> nn.Module:
    """A transformers model built from ``config`` with no weights read: ``_from_config`` is
    the constructor ``from_pretrained`` itself uses (it applies the config's dtype and
    attention implementation), where plain ``cls(config)`` does not."""
    return cls._from_config(config)  # type: ignore[attr-defined]


def keep_in_fp32_modules(cls: type, dtype: Any) -> tuple[str, ...]:
    """Names (parts of a parameter's name, or dotted paths in it) that ``cls``'s
    ``from_pretrained`` keeps in float32 when it loads in ``dtype``: diffusers keeps its
    ``_keep_in_fp32_modules`` under float16 and bfloat16; transformers keeps that list
    under float16 only, and its ``_keep_in_fp32_modules_strict`` under both."""
    import torch

    def names(attribute: str) -> tuple[str, ...]:
        found = getattr(cls, attribute, None) or ()
        return (found,) if isinstance(found, str) else tuple(found)

    if dtype not in (torch.float16, torch.bfloat16):
        return ()
    if hasattr(cls, "_keep_in_fp32_modules_strict"):  # a transformers model
        loose = names("_keep_in_fp32_modules") if dtype == torch.float16 else ()
        return loose + names("_keep_in_fp32_modules_strict")
    return names("_keep_in_fp32_modules")


def kept_in_float32(name: str, keep: tuple[str, ...]) -> bool:
    """Whether the parameter at the full dotted ``name`` is one that ``keep`` (from
    :func:`keep_in_fp32_modules`) names, as the libraries match: a part of the name (so one
    of the model itself counts too: Wan's top ``scale_shift_table``), or a dotted path
    inside it (transformers' ``"indexer.weights_proj"``)."""
    return any(f".{k}." in f".{name}." for k in keep)


def library_model(cls: type) -> str | None:
    """``"diffusers"`` for a diffusers ``ModelMixin``, ``"transformers"`` for a transformers
    ``PreTrainedModel``, else None: told by the names of ``cls``'s bases, so that asking
    imports neither library."""
    for base in cls.__mro__:
        if base.__name__ == "ModelMixin" and base.__module__.startswith("diffusers."):
            return "diffusers"
        if base.__name__ == "PreTrainedModel" and base.__module__.startswith("transformers."):
            return "transformers"
    return None


def from_pretrained_dtype(cls: type, torch_dtype: Any) -> Any:
    """The dtype ``cls.from_pretrained(..., torch_dtype=torch_dtype)`` gives its floating
    weights, or None where they keep the checkpoint's own.

    A diffusers model loads at ``torch_dtype`` when it is a ``torch.dtype``, at float32 for
    any other value (``"auto"`` included, with a warning), and at torch's default dtype
    without one. A transformers model loads at ``torch_dtype`` (``"auto"``: the
    checkpoint's), and without one at the default dtype before transformers 5 and at the
    checkpoint's from 5 on. Any other class: ``torch_dtype``, or as stored.
    """
    import torch

    library = library_model(cls)
    if library == "diffusers":
        if torch_dtype is None:
            return torch.get_default_dtype()
        return torch_dtype if isinstance(torch_dtype, torch.dtype) else torch.float32
    if torch_dtype is None and library == "transformers":
        return None if version_at_least("transformers", "5") else torch.get_default_dtype()
    return None if torch_dtype == "auto" else torch_dtype


#: accelerate's hook attribute: diffusers' ``apply_forward_hook`` (``encode``/``decode``)
#: calls ``module._hf_hook.pre_forward(module)``, ``DiffusionPipeline._execution_device``
#: reads ``_hf_hook.execution_device``, and ``remove_all_hooks`` calls
#: ``_hf_hook.detach_hook(module)`` before deleting it.
HF_HOOK_ATTR = "_hf_hook"


#: The function of ``diffusers.pipelines.auto_pipeline`` through which an AutoPipeline's
#: ``from_pretrained`` picks its pipeline class, once its own arguments (``controlnet=``,
#: ``enable_pag=``) have named the family's variant; it then calls that class's
#: ``from_pretrained`` with the arguments it passes on. A stand-in for it shows the choice
#: before anything loads.
AUTO_PIPELINE_PICK = "_get_task_class"


def progress_bars_disabled(pipeline: Any) -> bool:
    """Whether ``pipeline.set_progress_bar_config(disable=True)`` was called: diffusers
    keeps the settings in a private dict that it passes to every ``tqdm`` of the pipeline."""
    config = getattr(pipeline, "_progress_bar_config", None)
    return bool(config.get("disable", False)) if isinstance(config, dict) else False


def own_tensor_tables(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """``module``'s own parameters and buffers by name (``_parameters``, ``_buffers``; a
    value may be None): one walk of a model's submodules lists all its tensors, where
    ``named_parameters`` and ``named_buffers`` walk it twice."""
    return module._parameters, module._buffers


def torch_function_off() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called: inside
    one, the plain operation runs (torch's ``DisableTorchFunctionSubclass``)."""
    import torch

    return torch._C.DisableTorchFunctionSubclass()


def as_subclass(cls: type, data: Any, requires_grad: bool) -> Any:
    """``data`` as an instance of the tensor subclass ``cls`` (``Tensor._make_subclass``, as
    ``nn.Parameter.__new__`` does), sharing its storage."""
    import torch

    return torch.Tensor._make_subclass(cls, data, requires_grad)


def module_call_code() -> Any:
    """The code object of ``nn.Module._call_impl``, the body of every module call: a thread's
    stack with a frame running it is inside a module call (``hooks.registry`` reads thread
    stacks for it while it waits for calls in flight)."""
    from torch import nn

    return nn.Module._call_impl.__code__


def storage_use_count(storage: Any) -> int:
    """How many references hold ``storage`` (an ``UntypedStorage``) in torch's C++ core:
    one per tensor on it (views included) and one per Python storage object. torch's
    private ``_storage_Use_Count``; ``stageload.auto`` reads it to tell weights that code
    outside the model still holds (a view) before it frees them."""
    import torch

    return int(torch._C._storage_Use_Count(storage._cdata))


def tensor_use_count(tensor: Any) -> int:
    """How many references hold ``tensor``'s TensorImpl in torch's C++ core: one for its
    Python object, one per autograd node that saved it for a backward still to come (a
    LayerNorm's or a convolution's weight, saved as it is, no view: the storage count
    misses it) and per gradient accumulator of a graph alive. torch's private
    ``Tensor._use_count``."""
    return int(tensor._use_count())
