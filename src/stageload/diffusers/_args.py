"""Checks of ``staged_pipeline``'s arguments, each failing with a message that says the fix,
and the ``from_pretrained`` arguments as each library version spells them."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import external
from ..external import version_at_least
from ..hooks.registry import patch
from ..load.skeleton import is_transformers_model

if TYPE_CHECKING:
    import torch
    from torch import nn


def _check_pipeline_cls(pipeline_cls: Any) -> None:
    """A diffusers pipeline class, or a TypeError that says what was passed instead."""
    from diffusers import DiffusionPipeline

    if isinstance(pipeline_cls, type) and issubclass(pipeline_cls, DiffusionPipeline):
        return
    if isinstance(pipeline_cls, DiffusionPipeline):
        name = type(pipeline_cls).__name__
        raise TypeError(
            f"pipeline_cls must be a pipeline class, got a {name} instance; pass the class "
            f"itself: staged_pipeline({name}, path)"
        )
    what = (
        f"the class {pipeline_cls.__module__}.{pipeline_cls.__qualname__}, which is not a "
        f"diffusers.DiffusionPipeline"
        if isinstance(pipeline_cls, type)
        else repr(pipeline_cls)
    )
    raise TypeError(
        f"pipeline_cls must be a diffusers pipeline class such as QwenImage21Pipeline "
        f"(from diffusers import QwenImage21Pipeline), got {what}"
    )


#: diffusers' AutoPipeline classes, each with the mapping its ``from_pretrained`` picks the
#: pipeline from (by the folder's ``model_index.json``).
_AUTO_PIPELINES = {
    "AutoPipelineForText2Image": "AUTO_TEXT2IMAGE_PIPELINES_MAPPING",
    "AutoPipelineForImage2Image": "AUTO_IMAGE2IMAGE_PIPELINES_MAPPING",
    "AutoPipelineForInpainting": "AUTO_INPAINT_PIPELINES_MAPPING",
}


def _is_auto_pipeline(pipeline_cls: Any) -> bool:
    return (
        isinstance(pipeline_cls, type)
        and pipeline_cls.__name__ in _AUTO_PIPELINES
        and pipeline_cls.__module__.startswith("diffusers.")
    )


def _concrete_pipeline(
    pipeline_cls: type, folder: Path, kwargs: Mapping[str, Any]
) -> tuple[type, dict[str, Any]]:
    """The pipeline class diffusers' AutoPipeline ``pipeline_cls`` loads from ``folder``
    given ``kwargs`` (``AutoPipelineForText2Image`` on a Stable Diffusion folder:
    ``StableDiffusionPipeline``; with ``controlnet=``: ``StableDiffusionControlNetPipeline``;
    with ``enable_pag=True``: ``StableDiffusionPAGPipeline``), and ``kwargs`` less those its
    ``from_pretrained`` takes for itself (``enable_pag``). Picked by that ``from_pretrained``
    itself, stopped before it loads anything: picked from model_index.json alone, a
    ``controlnet=`` went to a pipeline without one (ignored, another image than eager's).
    A TypeError naming the class to pass where it has none."""
    import json

    import diffusers.pipelines.auto_pipeline as auto

    try:
        name = json.loads((folder / "model_index.json").read_text())["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TypeError(
            f"{pipeline_cls.__name__} reads the pipeline's class from {folder}/model_index.json, "
            f"which cannot be read ({exc!r}); pass the pipeline class itself"
        ) from None
    none = TypeError(
        f"{pipeline_cls.__name__} has no pipeline for {name} (from {folder}/model_index.json); "
        f"pass the pipeline class itself, e.g. staged_pipeline({name}, path)"
    )
    if getattr(auto, external.AUTO_PIPELINE_PICK, None) is None:  # another diffusers
        raise none
    picked: list[tuple[type, dict[str, Any]]] = []
    me = threading.get_ident()

    class Picked(Exception):
        pass

    def stop(pick: Callable[..., Any]) -> Callable[..., Any]:
        # For this thread's call only: another thread's AutoPipeline.from_pretrained in
        # the meantime (a web server's eager request) picks and loads as it would without
        # stageload, through the same chain.
        def picking(mapping: Any, class_name: str, *args: Any, **kw: Any) -> Any:
            found = pick(mapping, class_name, *args, **kw)
            if threading.get_ident() != me:
                return found

            class Stop:
                @staticmethod
                def from_pretrained(_path: Any, **passed: Any) -> Any:
                    picked.append((found, passed))
                    raise Picked

            return Stop

        return picking

    unpatch = patch(auto, external.AUTO_PIPELINE_PICK, stop)
    try:
        with external.BUILD_LOCK:  # a from_pretrained, as each build's
            pipeline_cls.from_pretrained(os.fspath(folder), **kwargs)
    except Picked:
        pass
    except ValueError:  # diffusers' "AutoPipeline can't find a pipeline linked to"
        raise none from None
    finally:
        unpatch()
    if not picked:
        raise none
    cls, passed = picked[0]
    return cls, {k: v for k, v in kwargs.items() if k in passed}


#: A weight file diffusers or transformers saves, plain or under a variant: whole
#: (``model.safetensors``, ``model.fp16.safetensors``), a shard (``model-00001-of-00002
#: .safetensors``, ``model.fp16-00001-of-00002.safetensors``) or a shard index
#: (``model.safetensors.index.json``, ``model.safetensors.index.fp16.json``).
_WEIGHT_FILE = re.compile(
    r"(?:diffusion_pytorch_model|model|pytorch_model)"
    r"(?:(?:\.(?P<variant>[^.]+?))?(?:-\d+-of-\d+)?\.(?:safetensors|bin)"
    r"|\.(?:safetensors|bin)\.index(?:\.(?P<index_variant>[^.]+))?\.json)"
)


def _check_variant(folder: Path, names: Iterable[str], kwargs: Mapping[str, Any]) -> None:
    """Before any loading: an OSError, as eager's ``from_pretrained`` raises at once, when a
    staged component has only weights saved under a variant and none was given (the first
    call failed instead, deep in its first load: helper-56)."""
    if kwargs.get("variant"):
        return
    for name in names:
        sub = folder / name
        found = sorted(p.name for p in sub.iterdir() if p.is_file()) if sub.is_dir() else []
        matches = [m for m in map(_WEIGHT_FILE.fullmatch, found) if m is not None]
        variants = {m["variant"] or m["index_variant"] for m in matches}
        if variants and None not in variants:  # None: a plain weight file
            shown = sorted(variants)
            raise OSError(
                f"{name}: {sub} holds weights saved under a variant only "
                f"({', '.join(shown)}), and no variant was given; pass "
                f"variant={shown[0]!r}, as from_pretrained needs it"
            )


def _check_device(device: Any) -> torch.device:
    import torch

    if device is None:
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"device must be a torch device such as 'cpu', 'cuda', 'cuda:1' or 'mps', "
            f"got {device!r}"
        ) from None


def _resolve_folder(pipeline_cls: type, path: Any, kwargs: Mapping[str, Any]) -> Path:
    """The local checkpoint folder: ``path`` itself, or a hub id's downloaded snapshot."""
    try:
        text = os.fspath(path)
    except TypeError:
        raise TypeError(
            f"path must be a folder or a hub id such as 'Qwen/Qwen-Image-2.1', got {path!r}"
        ) from None
    folder = Path(text)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise NotADirectoryError(
            f"{text!r} is a file; pass the folder that pipeline.save_pretrained() wrote (the "
            f"one holding model_index.json), or a hub id"
        )
    advice = "pass a folder written by pipeline.save_pretrained() or a hub id such as "
    advice += "'Qwen/Qwen-Image-2.1'"
    # A hub id is "name" or "owner/name"; anything else, or "models/flux" where ./models is
    # a folder, is a local path (the hub's own error would only say the id is malformed).
    local_parent = folder.parent != Path(".") and folder.parent.is_dir()
    if not _looks_like_hub_id(text) or local_parent:
        raise FileNotFoundError(f"no folder at {text!r}; {advice}")
    # A well-formed id: the hub's errors (not cached, offline, gated) name it themselves.
    download = {k: v for k, v in kwargs.items() if k in ("variant", "revision")}
    return Path(pipeline_cls.download(text, **download))


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return (
        0 < len(parts) <= 2
        and all(parts)
        and not text.startswith((".", "~"))
        and "\\" not in text
        and ".." not in text
    )


def check_keep(keep: Any, staged: list[str], folder: Path) -> list[str]:
    """``keep=`` checked against the staged components; by default the small ones."""
    from ._plan import default_keep, weight_bytes

    if keep is None:
        return default_keep(weight_bytes(folder, staged))
    if isinstance(keep, str):
        raise TypeError(f"keep must list component names, e.g. [{keep!r}]; got {keep!r}")
    if not isinstance(keep, Iterable):
        raise TypeError(f"keep must list component names, e.g. ['vae']; got {keep!r}")
    keep = list(keep)
    for name in keep:
        if name not in staged:
            raise ValueError(
                f"keep lists {name!r}, which the plan does not stage; staged components: "
                f"{', '.join(staged) or '(none)'}"
            )
    return keep


# from_pretrained arguments that also apply to each component's own from_pretrained.
_MODEL_KWARGS = (
    "variant",
    "use_safetensors",
    "low_cpu_mem_usage",
    "device_map",
    "revision",
    "disable_mmap",
)


def _load_component(
    cls: type,
    folder: Path,
    torch_dtype: torch.dtype | None,
    kwargs: Mapping[str, Any],
    *,
    quiet: bool = False,
) -> nn.Module:
    """``cls.from_pretrained`` the way DiffusionPipeline.from_pretrained calls it. ``quiet``:
    a reload, whose warnings the first load gave (a ``.bin`` checkpoint's "no file named
    ...safetensors" and "unsafe serialization", on every call: helper-56)."""
    kwargs = dict(kwargs)
    if is_transformers_model(cls):
        # As the pipeline's loader passes it: transformers 4.56 renamed torch_dtype to dtype,
        # and None means each version's default (5.x: the checkpoint's dtype).
        key = "dtype" if version_at_least("transformers", "4.56") else "torch_dtype"
        kwargs[key] = torch_dtype
    else:
        kwargs["torch_dtype"] = torch_dtype
    # A call's first load, on the caller's thread.
    with external.BUILD_LOCK, _libraries_quiet() if quiet else contextlib.nullcontext():
        return cls.from_pretrained(str(folder), **kwargs)


@contextlib.contextmanager
def _libraries_quiet() -> Iterator[None]:
    """This thread's messages to diffusers' and transformers' loggers dropped but for
    critical ones: a reload is the first load's call again, which said what it logs
    (diffusers logs a ``.bin`` checkpoint's missing safetensors file as an error, and then
    loads it). A filter on the handlers those messages reach, not the loggers' level: that
    is process-wide, and dropped what other threads logged meanwhile (a server's other
    requests)."""
    quiet = _Quiet(threading.get_ident())
    handlers = _handlers_reached(logging.getLogger("diffusers"), logging.getLogger("transformers"))
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


class _Quiet:
    """A logging filter: one thread's records below CRITICAL are dropped."""

    def __init__(self, thread: int) -> None:
        self.thread = thread

    def filter(self, record: Any) -> bool:
        return record.levelno >= logging.CRITICAL or record.thread != self.thread


def _handlers_reached(*loggers: Any) -> list[Any]:
    """The handlers a record logged to ``loggers`` (or their children) reaches, as
    ``Logger.callHandlers`` finds them: up the parents while they propagate, else Python's
    last resort."""
    found: list[Any] = []
    for logger in loggers:
        own: list[Any] = []
        while logger is not None:
            own += logger.handlers
            logger = logger.parent if logger.propagate else None
        if not own and logging.lastResort is not None:
            own = [logging.lastResort]
        found += [h for h in own if h not in found]
    return found


def _dtype_kwarg(torch_dtype: torch.dtype | None) -> dict[str, Any]:
    """The pipeline's dtype argument: ``dtype`` from diffusers 0.42 (``torch_dtype`` warns
    there), ``torch_dtype`` before."""
    if torch_dtype is None:
        return {}
    return {"dtype" if version_at_least("diffusers", "0.42") else "torch_dtype": torch_dtype}
