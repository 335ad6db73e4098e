"""A model of its own class with every weight on ``meta``, built from its saved config.

The one placeholder both loaders start from: the diffusers adapter builds each staged
component this way (``staged_pipeline``), and ``stageload.auto`` builds a model a library's
``from_pretrained`` would load (:func:`stand_in`), so the model is read once, at its first
use, and not at the factory call and again at that use. The object answers ``.config``,
``.dtype`` and every structural attribute without loading; its weights are filled in place
later, from a real ``from_pretrained`` or straight from the files.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..external import (
    BUILD_LOCK,
    from_pretrained_dtype,
    keep_in_fp32_modules,
    kept_in_float32,
    library_model,
    transformers_from_config,
)
from .checkpoint import DTYPES, pretrained_checkpoint, read_entries, read_header
from .weights import Target, like, named_tensors, place, put, targets

if TYPE_CHECKING:
    import torch
    from torch import nn

#: ``from_pretrained`` arguments a stand-in builds the same model with, whatever their value.
STAND_IN_KWARGS = frozenset(
    {
        "torch_dtype",
        "dtype",
        "subfolder",
        "variant",
        "use_safetensors",
        "local_files_only",
        "disable_mmap",
        "config",
        "_from_auto",
        "trust_remote_code",
        "cache_dir",
        "force_download",
        "proxies",
        "token",
    }
)
#: Arguments a stand-in allows only at the value that asks nothing (what diffusers'
#: pipelines and transformers' auto classes pass): any other value changes the model
#: (``add_pooling_layer=False``, ``use_cache=False``) or where it goes, so it loads at
#: the call.
STAND_IN_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "device_map": (None,),
    "max_memory": (None,),
    "offload_folder": (None,),
    "offload_state_dict": (None, False),
    "use_flashpack": (False,),
    "low_cpu_mem_usage": (None, True),
    "revision": (None,),
    "quantization_config": (None,),
    "adapter_kwargs": ({}, {"revision": None}),
    "output_loading_info": (False,),
}


def skeleton_dtype(cls: type, folder: Path, torch_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``cls.from_pretrained(folder, torch_dtype=...)`` gives the weights
    (:func:`stageload.external.from_pretrained_dtype`; the checkpoint's own is read from
    its headers)."""
    import torch

    return (
        from_pretrained_dtype(cls, torch_dtype)
        or _checkpoint_dtype(folder)
        or torch.get_default_dtype()
    )


def is_transformers_model(cls: type) -> bool:
    return library_model(cls) == "transformers"


def _checkpoint_dtype(folder: Path) -> torch.dtype | None:
    """The dtype of the first floating tensor in the folder's safetensors files (headers)."""
    import torch

    for file in sorted(folder.glob("*.safetensors")):
        for entry in read_header(file).values():
            if entry.is_floating:
                return getattr(torch, DTYPES[entry.dtype][0])
    return None


def can_stage(cls: type) -> bool:
    """Whether a placeholder can be built for ``cls`` from its saved config."""
    return is_transformers_model(cls) or (
        hasattr(cls, "load_config") and hasattr(cls, "from_config")
    )


def build_empty(
    cls: type,
    folder: Path,
    dtype: torch.dtype,
    config: Any = None,
    *,
    meta: bool = False,
    name_or_path: str | Path | None = None,
) -> nn.Module:
    """``cls`` built from the config in ``folder`` (or ``config``, a transformers config
    the caller loaded) with every parameter on ``meta`` in the dtype ``from_pretrained``
    would give it (float32 where the class keeps modules in float32). ``meta``: build a
    transformers model under ``torch.device("meta")``, as its ``from_pretrained`` does (no
    number drawn from the CPU generator, nothing patched for other threads), where
    accelerate's ``init_empty_weights`` otherwise builds it as diffusers builds its own.
    ``name_or_path``: the path ``from_pretrained`` was given, recorded in the config as it
    records it (and, for a transformers model, the dtype with it); default ``folder``."""
    import torch
    from accelerate import init_empty_weights

    if is_transformers_model(cls):
        if config is None:
            config = cls.config_class.from_pretrained(str(folder))
        else:
            config = copy.deepcopy(config)  # from_pretrained does not change the caller's
        if name_or_path is not None:  # named and typed as from_pretrained sets them
            config.name_or_path, config.dtype = name_or_path, dtype
        with BUILD_LOCK, torch.device("meta") if meta else init_empty_weights():
            model = transformers_from_config(cls, config)
    elif hasattr(cls, "load_config") and hasattr(cls, "from_config"):
        config = cls.load_config(str(folder))
        with BUILD_LOCK, init_empty_weights():
            model = cls.from_config(config)
        # As from_pretrained records it.
        given = str(folder) if name_or_path is None else name_or_path
        model.register_to_config(_name_or_path=given)
    else:
        raise TypeError(
            f"cannot stage a {cls.__module__}.{cls.__qualname__}: it is neither a diffusers "
            f"ModelMixin nor a transformers PreTrainedModel; keep it loaded (leave it out of "
            f"stages=)"
        )
    keep_fp32 = keep_in_fp32_modules(cls, dtype)
    with torch.no_grad(), _as_loaded(cls):
        for module_name, sub in model.named_modules():
            for key, param in list(sub.named_parameters(recurse=False)):
                if not param.is_floating_point():
                    continue
                full = f"{module_name}.{key}" if module_name else key
                want = torch.float32 if kept_in_float32(full, keep_fp32) else dtype
                meta = torch.empty_like(param, device="meta", dtype=want)
                setattr(sub, key, torch.nn.Parameter(meta, requires_grad=param.requires_grad))
    model.eval()
    return model


def _as_loaded(cls: type) -> Any:
    """The mode the library's loader makes the weights in: transformers reads them on
    worker threads, outside the caller's ``inference_mode``, so a placeholder's weights
    answer ``is_inference()`` as the loaded ones will (its buffers, built by the
    constructor in the caller's mode, already do)."""
    import contextlib

    import torch

    return torch.inference_mode(False) if is_transformers_model(cls) else contextlib.nullcontext()


def stand_in(cls: type, args: tuple, kwargs: Mapping[str, Any]) -> nn.Module | str:
    """What ``cls.from_pretrained(*args, **kwargs)`` would return, with its weights on
    ``meta`` and nothing read but configs and headers; or why it cannot be built the
    same (then the caller loads it as it is).

    Only a plain load: a local folder of safetensors files; arguments the library gives
    the same model with (:data:`STAND_IN_KWARGS`, and :data:`STAND_IN_DEFAULTS` at the
    value that asks nothing); torch's default dtype and device as they start; and a
    checkpoint that holds every tensor the model keeps, so ``from_pretrained`` draws no
    random number for a missing one (a draw deferred to the model's first use would move
    the script's random stream).

    The global random stream moves as ``from_pretrained``'s does: a diffusers model is
    built as diffusers builds it (its constructor's draws, PixArt's ``scale_shift_table``,
    are drawn here as they would be there), a transformers model under ``meta`` (none)."""
    import torch

    if len(args) != 1 or not isinstance(args[0], (str, Path)):
        return "not one local folder"
    for key, value in kwargs.items():
        if key not in STAND_IN_KWARGS and value not in STAND_IN_DEFAULTS.get(key, ()):
            return f"from_pretrained was given {key}={value!r}"
    if torch.get_default_dtype() != torch.float32 or torch.get_default_device().type != "cpu":
        return "torch's default dtype or device is set"  # the first use would see another
    if not can_stage(cls):
        return f"{cls.__qualname__} is not a diffusers or transformers model"
    folder = Path(args[0]) / (kwargs.get("subfolder") or "")
    if not (folder / "config.json").is_file() or (folder / "adapter_config.json").exists():
        return "no config.json, or a peft adapter in the folder"
    files = pretrained_checkpoint(folder, kwargs)
    if isinstance(files, str):
        return files
    dtype = kwargs.get("torch_dtype", kwargs.get("dtype"))
    if dtype is not None and not isinstance(dtype, torch.dtype) and dtype != "auto":
        return f"dtype={dtype!r}"  # a dict per module
    transformers = is_transformers_model(cls)
    config = kwargs.get("config")
    if config is not None and not (transformers and hasattr(config, "to_dict")):
        return "config= is not a transformers config"
    weights = skeleton_dtype(cls, folder, dtype)
    model = build_empty(cls, folder, weights, config, meta=True, name_or_path=args[0])
    if transformers:
        model.tie_weights()  # as from_pretrained ties them: a T5 stores its embedding once
        if getattr(model, "can_generate", lambda: False)():
            _generation_config(model, folder)
    differs = uncovered(model, files)
    if differs is not None:
        return f"its checkpoint {differs}"
    return model


def uncovered(model: nn.Module, files: list[Path]) -> str | None:
    """Why ``from_pretrained`` would not fill ``model`` from ``files`` as they are: the
    first tensor the model saves that no file holds under any of its names (tied weights
    count once), or one the files hold in another shape (a config that disagrees with its
    weights, which ``from_pretrained`` refuses at the call); None when they match."""
    stored = read_entries(files)
    names: dict[int, list[str]] = {}
    tensors: dict[int, Any] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    for ident, found in names.items():
        held = [n for n in found if n in stored]
        if not held:
            return f"lacks {found[0]}"
        shape = tuple(tensors[ident].shape)
        for name in held:
            if stored[name].shape != shape:
                return f"holds {name} of shape {list(stored[name].shape)}, not {list(shape)}"
    return None


def _generation_config(model: nn.Module, folder: Path) -> None:
    """The generation config ``from_pretrained`` reads from the folder, when it has one."""
    if not (folder / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(str(folder))


def fill_from(
    module: nn.Module,
    fresh: nn.Module,
    *,
    missing: Callable[[str], BaseException],
    names: Mapping[str, str] | None = None,
    skip: Callable[[str, torch.Tensor], bool] | None = None,
    loaded_too: bool = False,
) -> None:
    """Give the placeholder ``module`` the tensors of ``fresh``, the same model just loaded
    (by ``from_pretrained``, or by the script's factory), by name; ``fresh`` is spent.

    Each of ``module``'s tensor objects takes the fresh tensor's data itself where torch
    allows (``swap_tensors``), so what the script holds (a buffer it read, a tied weight,
    an adapter's reference) is live again; where something else holds it, the fresh object
    takes its place under every name. Tensors tied in ``fresh`` end up tied in ``module``
    (transformers ties them in ``from_pretrained``; the config's build may not), and
    tensors it left untied, untied.

    Only empty tensors are filled, unless ``loaded_too`` (a stand-in's buffers its
    constructor computed, whose dtype the load may change). ``names``: a tensor's name in
    ``fresh`` where it differs (parts the script wrapped: peft's ``base_layer``). ``skip``:
    tensors to leave as they are (the user's own). ``missing(name)``: the error for an
    empty tensor ``fresh`` lacks.
    """
    import torch

    sources = dict(named_tensors(fresh))
    given: dict[int, Target] = {}  # a fresh tensor's id -> the target that took it
    with torch.no_grad():
        for target in targets(module):
            t = target.tensor
            if not (t.is_meta or loaded_too):
                continue
            # The names of one tensor of ``module`` by the fresh tensor each takes: one
            # group where ``fresh`` ties them as ``module`` does; several where the loader
            # left them untied (transformers 5 unties a checkpoint's embedding and head
            # that hold different values, where the config's build ties them).
            parts: dict[int, tuple[torch.Tensor, Target]] = {}
            for where, name in zip(target.places, target.names, strict=True):
                if skip is not None and skip(name, t):
                    continue
                source = sources.get(names.get(name, name) if names else name)
                if source is None:
                    if t.is_meta:
                        raise missing(name)
                    continue
                part = parts.setdefault(id(source), (source, Target(t)))[1]
                part.places.append(where)
                part.names.append(name)
            for first, (source, part) in enumerate(parts.values()):
                tied = given.get(id(source))
                if tied is not None:  # tied in fresh to one placed before: tied the same way
                    place(part, tied.tensor)
                    continue
                given[id(source)] = part
                if first == 0 and t.is_meta:
                    put(part, source)  # the object itself takes the data
                else:
                    place(part, like(t, source))
