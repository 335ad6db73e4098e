"""Reload Pixal3D's pipeline models from ``{path}.safetensors`` at read speed.

The port's ``pixal3d.models.from_pretrained(path)`` builds the model from ``{path}.json``
and copies ``{path}.safetensors`` into it. Its first load stays the reference; after it,
each reload refills the released model in place with ``load_weights`` (see
:mod:`stageload.load.refill`), or keeps the port's loader when the model does not match the file,
with a ``note`` event saying why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..hooks.release import is_released
from ..load.refill import Recipe, learn, reload

if TYPE_CHECKING:
    from torch import nn


class FastReload:
    """The models learned so far, by name; ``note`` reports why one cannot be reloaded."""

    def __init__(self, device: Any, note: Callable[[str, str], None]) -> None:
        self.device = device
        self._note = note
        self._models: dict[str, tuple[nn.Module, Recipe]] = {}

    def reload(self, name: str) -> nn.Module | None:
        """The released model of ``name`` filled again, or None when it must be built."""
        import torch

        known = self._models.get(name)
        if known is None or not is_released(known[0]):
            return None
        module, recipe = known
        reload(module, recipe, torch.device(self.device), name=name)
        return module

    def learned(self, name: str, module: nn.Module, path: Any) -> None:
        """After a load by the port's ``from_pretrained(path)``: may it be refilled later?"""
        file = Path(f"{os.fspath(path)}.safetensors")
        learned = (
            learn(module, [file]) if file.is_file() else f"no local checkpoint file {str(file)!r}"
        )
        if isinstance(learned, str):
            self._models.pop(name, None)
            self._note(name, f"{name} reloads with the port's from_pretrained: {learned}")
        else:
            self._models[name] = (module, learned)
