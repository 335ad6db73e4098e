"""One module object per staged component, for the pipeline's whole life.

The pipeline's attribute (``pipe.transformer``) is an instance of the component's real
class, built from the checkpoint's config with its parameters on ``meta``: a skeleton that
answers ``.config``, ``.dtype``, ``.device`` and every structural attribute without
loading. Loading fills that same object in place from a freshly loaded model
(:func:`fill`); releasing empties it again (``stageload.release`` moves its tensors to
``meta``). Because the object never changes, whatever the pipeline attached to it before
the load survives: Qwen-Image registers a forward hook on a text-encoder submodule and
then calls the encoder, and that hook must fire on the real weights.

The skeleton's class (``_component_class.staged_class``) is a subclass of the real one
that makes the component ready before any use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..release import unmark_released
from ._component_class import (
    DEVICE_ATTR,
    MOVE_ATTR,
    USE_ATTR,
    StageHook,
    _module_type,
    staged_class,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

# Per submodule: the plain attributes as they were after the last fill, to tell which ones
# the pipeline or the user changed since (``vae.enable_tiling()``) and must keep.
_SNAPSHOT_ATTR = "_stageload_snapshot"

# nn.Module's hook registries. The skeleton's dict objects are kept (RemovableHandles point
# at them by weakref). A fill takes out the hooks the model itself registered (its
# constructor, on the skeleton or the last load) and adds the loaded model's; hooks the
# pipeline or the user registered on the skeleton stay.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_SLOTS = ("_parameters", "_buffers")
# Per submodule: hook registry name -> keys of the hooks the model registered itself.
_MODEL_HOOKS_ATTR = "_stageload_model_hooks"
# Set on the skeleton by us or by stageload.release; never taken from a loaded model.
_OWN = frozenset(
    {
        USE_ATTR,
        DEVICE_ATTR,
        MOVE_ATTR,
        _SNAPSHOT_ATTR,
        _MODEL_HOOKS_ATTR,
        "_hf_hook",
        "_stageload_released",
    }
)
_NOT_PLAIN = frozenset({*_HOOK_DICTS, *_SLOTS, "_modules", "forward", *_OWN})


def skeleton_dtype(cls: type, folder: Path, torch_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``cls.from_pretrained(folder, torch_dtype=...)`` gives the weights.

    diffusers models load as ``torch_dtype`` or else float32; transformers models as
    ``torch_dtype`` or else, from transformers 5 on, the checkpoint's own dtype.
    """
    import torch

    if torch_dtype is not None:
        return torch_dtype
    if _is_transformers_model(cls) and _transformers_major() >= 5:
        return _checkpoint_dtype(folder) or torch.get_default_dtype()
    return torch.get_default_dtype()


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _is_transformers_model(cls: type) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return issubclass(cls, PreTrainedModel)


def _checkpoint_dtype(folder: Path) -> torch.dtype | None:
    """The dtype of the first floating tensor in the folder's safetensors files (header only)."""
    import json

    import torch

    names = {
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F64": torch.float64,
    }
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key != "__metadata__" and info.get("dtype") in names:
                return names[info["dtype"]]
    return None


def can_stage(cls: type) -> bool:
    """Whether a placeholder can be built for ``cls`` from its saved config."""
    return _is_transformers_model(cls) or (
        hasattr(cls, "load_config") and hasattr(cls, "from_config")
    )


def build_skeleton(cls: type, folder: Path, dtype: torch.dtype) -> nn.Module:
    """An instance of ``staged_class(cls)`` built from the config in ``folder``, with every
    parameter on ``meta`` in ``dtype`` (float32 where the class keeps modules in float32)."""
    import torch
    from accelerate import init_empty_weights

    if _is_transformers_model(cls):
        config = cls.config_class.from_pretrained(str(folder))
        with init_empty_weights():
            model = cls._from_config(config)
    elif hasattr(cls, "load_config") and hasattr(cls, "from_config"):
        config = cls.load_config(str(folder))
        with init_empty_weights():
            model = cls.from_config(config)
    else:
        raise TypeError(
            f"cannot stage a {cls.__module__}.{cls.__qualname__}: it is neither a diffusers "
            f"ModelMixin nor a transformers PreTrainedModel; keep it loaded (leave it out of "
            f"stages=)"
        )
    keep_fp32 = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for module_name, sub in model.named_modules():
            in_fp32 = any(k in module_name.split(".") for k in keep_fp32)
            for key, param in list(sub._parameters.items()):
                if param is None or not param.is_floating_point():
                    continue
                want = (
                    torch.float32 if in_fp32 and dtype in (torch.float16, torch.bfloat16) else dtype
                )
                meta = torch.empty_like(param, device="meta", dtype=want)
                sub._parameters[key] = torch.nn.Parameter(meta, requires_grad=param.requires_grad)
    model.eval()
    model.__class__ = staged_class(cls)
    _snapshot_all(model)
    return model


def fill(skeleton: nn.Module, loaded: nn.Module) -> nn.Module:
    """Move everything ``loaded`` holds into ``skeleton``, keeping every module object of the
    skeleton (and the hooks on them). Returns ``skeleton``; ``loaded`` is spent."""
    base = getattr(type(skeleton), "_stageload_base", type(skeleton))
    if not isinstance(loaded, base):
        raise TypeError(
            f"loaded a {type(loaded).__qualname__} for a {base.__qualname__} placeholder; the "
            f"checkpoint's class changed since the pipeline was built"
        )
    _fill_module(skeleton, loaded, {})
    return skeleton


def _fill_module(dst: nn.Module, src: nn.Module, memo: dict[int, nn.Module]) -> None:
    memo[id(src)] = dst
    dst_children = dst.__dict__["_modules"]
    for key, child in src.__dict__["_modules"].items():
        if child is None:
            dst_children[key] = None
        elif id(child) in memo:  # shared submodule: keep it shared
            dst_children[key] = memo[id(child)]
        elif type(dst_children.get(key)) is type(child):
            _fill_module(dst_children[key], child, memo)
        else:  # the structure differs here: take the loaded module as it is
            dst_children[key] = child
            memo[id(child)] = child
    for key in [k for k in dst_children if k not in src.__dict__["_modules"]]:
        del dst_children[key]

    d, s = dst.__dict__, src.__dict__
    unmark_released(dst)  # the module is live again
    for slot in _SLOTS:
        # One assignment, not clear() then update(): a prefetch fills on a background
        # thread, and a pipeline reading .dtype meanwhile must never see an empty slot.
        d[slot] = s[slot]
    model_hooks = d.get(_MODEL_HOOKS_ATTR, {})
    for name in _HOOK_DICTS:
        for key in model_hooks.get(name, ()):
            d.get(name, {}).pop(key, None)  # the last load's (or the build's) own hooks
        if name in s and s[name]:
            d.setdefault(name, type(s[name])()).update(s[name])
    d[_MODEL_HOOKS_ATTR] = _hook_keys(s)
    # The snapshot holds each attribute as the last load (or the build) gave it; a value on
    # the placeholder that differs was set since, by the pipeline or the user: keep it.
    snapshot = d.get(_SNAPSHOT_ATTR, {})
    given: dict[str, Any] = {}
    for key, value in s.items():
        if key in _NOT_PLAIN:
            if key == "forward":  # the loaded model had its own instance forward
                d[key] = value
            continue
        if isinstance(value, _module_type()) and id(value) in memo:
            value = memo[id(value)]
        given[key] = value
        if key in d and key in snapshot and d[key] is not snapshot[key]:
            continue
        d[key] = value
    d[_SNAPSHOT_ATTR] = given


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in _NOT_PLAIN}


def _hook_keys(d: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    return {name: tuple(d[name]) for name in _HOOK_DICTS if d.get(name)}


def _snapshot_all(model: nn.Module) -> None:
    for sub in model.modules():
        sub.__dict__[_SNAPSHOT_ATTR] = _plain(sub.__dict__)
        sub.__dict__[_MODEL_HOOKS_ATTR] = _hook_keys(sub.__dict__)


def attach(
    skeleton: nn.Module,
    use: Callable[[], None],
    move: Callable[[torch.device | None, torch.dtype | None], None],
    device: torch.device,
    name: str = "?",
) -> None:
    """Route the skeleton's uses through ``use`` and ``.to()`` through ``move``."""
    d = skeleton.__dict__
    d[USE_ATTR] = use
    d[MOVE_ATTR] = move
    d["_hf_hook"] = StageHook(use, device, name)
    set_device(skeleton, device)


def set_device(skeleton: nn.Module, device: torch.device) -> None:
    """The device the skeleton answers and the execution device its hook reports."""
    skeleton.__dict__[DEVICE_ATTR] = device
    hook = skeleton.__dict__.get("_hf_hook")
    if isinstance(hook, StageHook):
        hook.execution_device = device


def real_to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """``.to()`` of the component's real class, past the stager."""
    base = getattr(type(module), "_stageload_base", type(module))
    return base.to(module, *args, **kwargs)


def cast_empty(module: nn.Module, dtype: torch.dtype) -> None:
    """Give the floating parameters of an empty (meta) module a new dtype."""
    import torch

    twins: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for key, param in list(sub._parameters.items()):
            if param is None or not param.is_floating_point() or not param.is_meta:
                continue
            if id(param) not in twins:
                meta = torch.empty_like(param, dtype=dtype, device="meta")
                twins[id(param)] = torch.nn.Parameter(meta, requires_grad=param.requires_grad)
            sub._parameters[key] = twins[id(param)]
