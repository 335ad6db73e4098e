"""The stage plan of a diffusers pipeline: which component each stage uses, read from the
pipeline class's ``model_cpu_offload_seq`` and the checkpoint's ``model_index.json``."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: Stage names of the default plan, in pipeline order (``denoise_2`` etc. follow ``denoise``).
ENCODE, DENOISE, DECODE = "encode", "denoise", "decode"

#: Components under this fraction of the largest staged component stay loaded by default.
SMALL_FRACTION = 0.1

# The denoiser proper: transformer, unet or prior, optionally numbered (Wan 2.2's
# transformer_2 runs the low-noise steps). Other denoise-time models (controlnet, ...)
# run beside it within each step, so they join every denoise stage.
_DENOISER = re.compile(r"^(transformer|unet|prior)(?:_(\d+))?$")


def read_index(path: Path) -> dict[str, tuple[str, str]]:
    """Components of a saved pipeline: name -> (library, class name), skipping empty slots."""
    index_file = path / "model_index.json"
    try:
        index = json.loads(index_file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{str(path)!r} has no model_index.json; pass a folder written by "
            f"pipeline.save_pretrained() or a hub id"
        ) from None
    out: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library, class_name = value
        if library is None or class_name is None:
            continue
        out[name] = (library, class_name)
    return out


def component_class(library: str, class_name: str) -> Any:
    """Import the class a ``model_index.json`` entry names, or None if it can't be found."""
    import sys

    module = sys.modules.get(library)
    if module is None and library in ("diffusers", "transformers"):
        module = importlib.import_module(library)
    if module is None:
        try:
            diffusers_pipelines = importlib.import_module("diffusers.pipelines")
            module = getattr(diffusers_pipelines, library, None)
        except ImportError:
            module = None
    return getattr(module, class_name, None) if module is not None else None


def model_components(path: Path) -> dict[str, type]:
    """The components of the checkpoint at ``path`` that are models (``nn.Module`` classes
    with ``from_pretrained``), name -> class, in ``model_index.json`` order."""
    from torch import nn

    out: dict[str, type] = {}
    for name, (library, class_name) in read_index(path).items():
        cls = component_class(library, class_name)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "from_pretrained"):
            out[name] = cls
    return out


def check_fits(pipeline_cls: type, path: Path, given: Iterable[str]) -> None:
    """Raise a ValueError before any loading when the checkpoint at ``path`` lacks a
    component that ``pipeline_cls`` requires and the caller did not pass it."""
    import inspect

    index = json.loads((path / "model_index.json").read_text())
    params = inspect.signature(pipeline_cls.__init__).parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return  # DiffusionPipeline itself: the checkpoint names the class
    required = [
        name
        for name, p in params.items()
        if name != "self" and p.default is inspect.Parameter.empty
    ]
    optional = set(getattr(pipeline_cls, "_optional_components", None) or ())
    present = {k for k in index if not k.startswith("_")} | set(given)
    missing = [name for name in required if name not in present and name not in optional]
    if missing:
        saved = index.get("_class_name", "?")
        raise ValueError(
            f"{str(path)!r} holds a {saved} checkpoint without {', '.join(map(repr, missing))}, "
            f"which {pipeline_cls.__name__} needs; pass the pipeline class it was saved from "
            f"({saved}) or give the missing components as arguments ({missing[0]}=...)"
        )


def weight_bytes(path: Path, names: Iterable[str]) -> dict[str, int]:
    """Bytes of weight files on disk per component folder."""
    out: dict[str, int] = {}
    for name in names:
        folder = path / name
        files = [*folder.glob("*.safetensors"), *folder.glob("*.bin")] if folder.is_dir() else []
        out[name] = sum(f.stat().st_size for f in files)
    return out


def component_sizes(
    path: Path, dtypes: Mapping[str, Any], variant: str | None = None
) -> dict[str, int]:
    """Bytes each component takes once loaded as ``dtypes[name]``, from its safetensors
    headers alone (no weights read). A component without safetensors files is left out:
    its size is learned at its first load."""
    from ..load import checkpoint_bytes

    out: dict[str, int] = {}
    for name, dtype in dtypes.items():
        files = []
        for file in sorted((path / name).glob("*.safetensors")):
            stem = file.name[: -len(".safetensors")].split("-0")[0]  # shards: name-00001-of-...
            has = "." in stem
            if (variant is None and not has) or (variant and stem.endswith(f".{variant}")):
                files.append(file)
        if files:
            float_dtype = dtype if getattr(dtype, "is_floating_point", False) else None
            try:
                out[name] = checkpoint_bytes(files, dtype=float_dtype)
            except (OSError, ValueError):
                continue  # an unusual header: the first load measures it instead
    return out


def _is_autoencoder(name: str, cls: type) -> bool:
    return name in ("vae", "movq") or cls.__name__.startswith(("Autoencoder", "VQModel"))


def default_plan(seq: str | None, models: Mapping[str, type]) -> dict[str, list[str]]:
    """encode: the encoders; denoise: the denoiser (one stage per numbered denoiser, so
    Wan 2.2's ``transformer_2`` replaces ``transformer`` mid-loop); decode: the VAE.

    Only models named in ``model_cpu_offload_seq`` are staged (diffusers lists there the
    models that run one after another); without a sequence, every model is.
    """
    order = [n.strip() for n in seq.split("->")] if seq else list(models)
    order = [n for n in order if n in models]
    encoders: list[str] = []
    denoisers: dict[str, list[str]] = {}  # stage -> the denoiser it is for
    helpers: list[str] = []
    decoders: list[str] = []
    for name in order:
        cls = models[name]
        if _is_autoencoder(name, cls):
            decoders.append(name)
        elif "encoder" in name and not denoisers and not helpers:
            encoders.append(name)
        elif (match := _DENOISER.match(name)) is not None:
            stage = DENOISE if match.group(2) in (None, "1") else f"{DENOISE}_{match.group(2)}"
            denoisers.setdefault(stage, []).append(name)
        else:
            helpers.append(name)
    plan: dict[str, list[str]] = {}
    if encoders:
        plan[ENCODE] = encoders
    if not denoisers and helpers:
        denoisers[DENOISE] = []
    for stage, names in denoisers.items():
        plan[stage] = [*names, *helpers]
    if decoders:
        plan[DECODE] = decoders
    return plan


def check_plan(stages: Any, models: Mapping[str, type]) -> dict[str, list[str]]:
    """Validate a user's ``stages=``: a mapping of stage name -> component names."""
    if not isinstance(stages, Mapping):
        raise TypeError(
            f"stages must map each stage to the components it uses, e.g. "
            f"{{'encode': ['text_encoder'], 'denoise': ['transformer'], 'decode': ['vae']}}; "
            f"got {stages!r}"
        )
    plan: dict[str, list[str]] = {}
    for stage, names in stages.items():
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise TypeError(
                f"stage {stage!r} must list component names, e.g. [{names!r}]; got {names!r}"
            )
        names = list(names)
        for name in names:
            if name not in models:
                raise ValueError(
                    f"stage {stage!r} lists {name!r}, which is not a model component of this "
                    f"checkpoint; its models are: {', '.join(models) or '(none)'}"
                )
        plan[str(stage)] = names
    return plan


def default_keep(sizes: Mapping[str, int], *, fraction: float = SMALL_FRACTION) -> list[str]:
    """Staged components small next to the largest (the VAE beside a 16 GB text encoder):
    reloading them every call would cost time and save little memory."""
    if not sizes:
        return []
    largest = max(sizes.values())
    return [name for name, size in sizes.items() if size < fraction * largest]
