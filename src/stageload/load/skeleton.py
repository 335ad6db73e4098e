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
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..external import (
    from_pretrained_dtype,
    keep_in_fp32_modules,
    kept_in_float32,
    library_model,
    transformers_from_config,
)
from .checkpoint import DTYPES, pretrained_checkpoint, read_entries, read_header

if TYPE_CHECKING:
    import torch
    from torch import nn

#: ``from_pretrained`` arguments a stand-in builds the same model with (each value allowed).
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
        "low_cpu_mem_usage",
    }
)


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


def build_empty(cls: type, folder: Path, dtype: torch.dtype, config: Any = None) -> nn.Module:
    """``cls`` built from the config in ``folder`` (or ``config``, a transformers config
    the caller loaded) with every parameter on ``meta`` in the dtype ``from_pretrained``
    would give it (float32 where the class keeps modules in float32)."""
    import torch
    from accelerate import init_empty_weights

    if is_transformers_model(cls):
        if config is None:
            config = cls.config_class.from_pretrained(str(folder))
        else:
            config = copy.deepcopy(config)  # from_pretrained does not change the caller's
        with init_empty_weights():
            model = transformers_from_config(cls, config)
    elif hasattr(cls, "load_config") and hasattr(cls, "from_config"):
        config = cls.load_config(str(folder))
        with init_empty_weights():
            model = cls.from_config(config)
        model.register_to_config(_name_or_path=str(folder))  # as from_pretrained records it
    else:
        raise TypeError(
            f"cannot stage a {cls.__module__}.{cls.__qualname__}: it is neither a diffusers "
            f"ModelMixin nor a transformers PreTrainedModel; keep it loaded (leave it out of "
            f"stages=)"
        )
    keep_fp32 = keep_in_fp32_modules(cls, dtype)
    with torch.no_grad():
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


def stand_in(cls: type, args: tuple, kwargs: Mapping[str, Any]) -> nn.Module | str:
    """What ``cls.from_pretrained(*args, **kwargs)`` would return, with its weights on
    ``meta`` and nothing read but configs and headers; or why it cannot be built the
    same (then the caller loads it as it is).

    Only a plain load: a local folder of safetensors files, arguments the library gives
    the same model with (:data:`STAND_IN_KWARGS`, others only at their "none" value), and
    a checkpoint that holds every tensor the model keeps, so ``from_pretrained`` draws no
    random number for a missing one (a draw deferred to the model's first use would move
    the script's random stream)."""
    import torch

    if len(args) != 1 or not isinstance(args[0], (str, Path)):
        return "not one local folder"
    extra = sorted(k for k, v in kwargs.items() if k not in STAND_IN_KWARGS and not _none(v))
    if extra:
        return f"from_pretrained was given {extra[0]}="
    if kwargs.get("low_cpu_mem_usage") is False:  # initialises every weight at random first
        return "low_cpu_mem_usage=False"
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
    config = kwargs.get("config")
    if config is not None and not (is_transformers_model(cls) and hasattr(config, "to_dict")):
        return "config= is not a transformers config"
    model = build_empty(cls, folder, skeleton_dtype(cls, folder, dtype), config)
    if is_transformers_model(cls):
        model.tie_weights()  # as from_pretrained ties them: a T5 stores its embedding once
    missing = uncovered(model, files)
    if missing is not None:
        return f"its checkpoint lacks {missing}"
    if is_transformers_model(cls):
        model.config.name_or_path = str(args[0])
        if getattr(model, "can_generate", lambda: False)():
            _generation_config(model, folder)
    return model


def uncovered(model: nn.Module, files: list[Path]) -> str | None:
    """The first tensor ``model`` saves that no file holds under any of its names (tied
    weights count once), or None."""
    stored = read_entries(files).keys()
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    for found in names.values():
        if not any(n in stored for n in found):
            return found[0]
    return None


def _generation_config(model: nn.Module, folder: Path) -> None:
    """The generation config ``from_pretrained`` reads from the folder, when it has one."""
    if not (folder / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(str(folder))


def _none(value: Any) -> bool:
    """An argument at its "nothing asked" value: None, False, "", or a dict of such."""
    if isinstance(value, dict):
        return all(_none(v) for v in value.values())
    return value is None or value is False or value == ""
