"""Where a diffusers component's checkpoint files are, for :mod:`stageload._refill`.

The first load of a staged component goes through ``from_pretrained``; later loads refill
the placeholder in place from these files (see ``_refill``), or stay on ``from_pretrained``
with a ``note`` event saying why.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._checkpoint import checkpoint_files
from .._refill import can_reload, learn, reload

__all__ = ["can_reload", "checkpoint_of", "learn", "reload"]


def checkpoint_of(folder: Path, kwargs: Mapping[str, Any]) -> list[Path] | str:
    """The safetensors files ``from_pretrained`` reads in ``folder``, or why there are none."""
    if kwargs.get("use_safetensors") is False:
        return "use_safetensors=False"
    variant = kwargs.get("variant")
    for stem in ("diffusion_pytorch_model", "model"):
        if variant:
            names = [
                f"{stem}.{variant}.safetensors",
                f"{stem}.safetensors.index.{variant}.json",
                f"{stem}.{variant}.safetensors.index.json",
            ]
        else:
            names = [f"{stem}.safetensors", f"{stem}.safetensors.index.json"]
        for name in names:
            if (folder / name).is_file():
                return checkpoint_files(folder / name)
    return f"no safetensors checkpoint{f' for variant {variant!r}' if variant else ''} in {folder}"
