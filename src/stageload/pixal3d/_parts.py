"""Small stand-ins the adapter puts into the port: placeholders, recipes, holders, proxies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Unloaded(nn.Module):
    """What ``pixal3d.models.from_pretrained`` returns while the adapter builds the pipeline:
    the checkpoint path and arguments, no weights. The port's own code may call ``eval()``
    or ``to()`` on it; calling it is an error, because the real model lives in StagedModels.
    """

    def __init__(self, path: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.path = path
        self.call_args = args
        self.call_kwargs = kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"the model from {str(self.path)!r} was never loaded: the port used the "
            "placeholder stageload put in while building the pipeline; get models from "
            "pipeline.models instead of keeping references made during construction"
        )

    def extra_repr(self) -> str:
        return f"path={str(self.path)!r}"


class NafRecipe:
    """What ``_load_naf(...)`` returns while the pipeline is built: its arguments."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs


class ExtractorRecipe:
    """What ``build_image_cond_model(...)`` returns while the pipeline is built.

    Records its arguments and what ``init_pipeline`` then does to the extractor (attribute
    assignments such as attaching a NAF upsampler, and method calls), to replay them on the
    real extractor when a stage first needs it.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_kwargs", kwargs)
        object.__setattr__(self, "_ops", [])

    def __setattr__(self, name: str, value: Any) -> None:
        self._ops.append(("set", name, (value,), {}))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)

        def record(*args: Any, **kwargs: Any) -> ExtractorRecipe:
            self._ops.append(("call", name, args, kwargs))
            return self

        return record

    def build_bare(self, build: Callable[..., Any]) -> Any:
        """Build the extractor without replaying what ``init_pipeline`` did to it."""
        return build(*self._args, **self._kwargs)

    def nafs(self) -> list[NafRecipe]:
        """The NAF upsamplers ``init_pipeline`` attached to this extractor."""
        values = [v for _, _, args, kwargs in self._ops for v in (*args, *kwargs.values())]
        return [v for v in values if isinstance(v, NafRecipe)]

    def build(self, build: Callable[..., Any], naf: Callable[[NafRecipe], Any]) -> Any:
        """Build the extractor with ``build`` and replay the recorded operations on it,
        with each recorded NAF replaced by ``naf(recipe)``."""
        extractor = build(*self._args, **self._kwargs)

        def real(value: Any) -> Any:
            return naf(value) if isinstance(value, NafRecipe) else value

        for kind, name, args, kwargs in self._ops:
            args = tuple(real(a) for a in args)
            kwargs = {k: real(v) for k, v in kwargs.items()}
            if kind == "set":
                setattr(extractor, name, *args)
            else:
                getattr(extractor, name)(*args, **kwargs)
        return extractor


class Holder(nn.Module):
    """Registers a plain object's modules (e.g. a background remover that is not an
    ``nn.Module`` but holds one) so StagedModels can measure and release them."""

    def __init__(self, obj: Any) -> None:
        super().__init__()
        self.obj = obj
        for name, value in vars(obj).items():
            if isinstance(value, nn.Module):
                self.add_module(name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.obj(*args, **kwargs)

    @staticmethod
    def wrap(obj: Any) -> nn.Module:
        """``obj`` itself if it is a module, else a Holder of it."""
        return obj if isinstance(obj, nn.Module) else Holder(obj)


def unwrap(module: nn.Module) -> Any:
    return module.obj if isinstance(module, Holder) else module


class LazyEntry:
    """Stands in a pipeline attribute (an extractor, the background remover) and fetches
    the object from StagedModels on first use, so checks like ``is None`` load nothing."""

    __slots__ = ("_models", "_name")

    def __init__(self, models: Any, name: str) -> None:
        object.__setattr__(self, "_models", models)
        object.__setattr__(self, "_name", name)

    def _target(self) -> Any:
        return unwrap(self._models[self._name])

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._target(), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._target(), attr, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<staged {self._name!r}>"


def build_on_device(
    build: Callable[[], Any], device: str | torch.device, *, on_device: bool = True
) -> tuple[Any, str | None]:
    """Build a model directly on ``device``; where its constructor can't (or with
    ``on_device=False``), on the CPU and move it. Returns the model and, after a
    fallback, why."""
    device = torch.device(device)
    if not on_device:
        return _to(build(), device), None
    if device.type == "cpu":
        return build(), None  # where the port builds anyway: nothing to try
    try:
        with device:
            return _to(build(), device), None
    except Exception as exc:  # a constructor that needs the CPU (custom ops, numpy)
        why = f"{type(exc).__name__}: {exc}"
    return _to(build(), device), why


def _to(model: Any, device: torch.device) -> Any:
    to = getattr(model, "to", None)
    if callable(to):
        moved = to(device)
        return model if moved is None else moved  # some wrappers' to() returns nothing
    return model
