"""stageload: load each model of a multi-stage PyTorch pipeline only while its stages run.

``import stageload`` stays light (no torch, matplotlib or diffusers): the public names
below are resolved on first access, so the CLI and the guard start fast.
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import ModuleSpec
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public API, defined once: public name -> submodule that defines it. ``__all__``,
# ``__dir__`` and the lazy ``__getattr__`` all read it; the TYPE_CHECKING imports at the
# end mirror it for type checkers (tests/test_imports.py checks that they match).
_EXPORTS: dict[str, str] = {
    "StagedModels": "staged",
    "ReleaseUnlisted": "policy",
    "ResidencyPolicy": "policy",
    "FurthestNextUse": "policy",
    "rng_free": "policy",
    "ModelLoadError": "staged",
    "BatchError": "batch",
    "preserved_rng": "rng",
    "on_call": "hooks",
    "share": "share",
    "release": "release",
    "ReleasedModuleError": "release",
    "return_memory_to_os": "release",
    "Event": "events",
    "EventSink": "events",
    "ListSink": "events",
    "TeeSink": "events",
    "MemoryMeter": "meter",
    "GuardConfig": "guard",
    "GuardResult": "guard",
    "run_guard": "guard",
    "run_queued": "guard.runner",
    "parse_size": "units",
    "format_size": "units",
    "load_weights": "load",
    "from_safetensors": "load",
    "checkpoint_bytes": "load",
    "CheckpointError": "load",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def _export_from(module: str) -> None:
    imported = importlib.import_module(f".{module}", __name__)
    for name, home in _EXPORTS.items():
        if home == module:
            globals()[name] = getattr(imported, name)


# A submodule named like a public name (``release``, ``share``) is imported now: importing
# it later (e.g. by StagedModels) would bind ``stageload.release`` to the module instead of
# the function. Both import torch only inside their functions.
for _module in sorted({home for home in _EXPORTS.values() if home in _EXPORTS}):
    _export_from(_module)
del _module


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stageload' has no attribute {name!r}")
    _export_from(module)  # caches every name of that module: later lookups skip this
    return globals()[name]


def __dir__() -> list[str]:
    return __all__


# Module paths the docs named before the package was split into folders (issue 9), kept
# importable as aliases of the modules' new homes. A finder, not a stub file at each old
# path, so that one table lists them and no old file lingers beside its moved contents.
_MOVED: dict[str, str] = {
    "stageload.trace": "stageload.report.trace",
    "stageload.tracefile": "stageload.meter.tracefile",
    "stageload.plot": "stageload.report.plot",
    "stageload.diffusers.fixtures": "stageload.testing.diffusers",
}


class _MovedModuleFinder:
    """Import each old name in ``_MOVED`` as the very module object at its new path."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        return ModuleSpec(name, _MovedModuleFinder) if name in _MOVED else None

    @staticmethod
    def create_module(spec: ModuleSpec) -> Any:
        return importlib.import_module(_MOVED[spec.name])

    @staticmethod
    def exec_module(module: Any) -> None:
        pass  # already executed under its new name


if not any(f is _MovedModuleFinder for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder)  # last: real files always win


if TYPE_CHECKING:  # let type checkers and IDEs see the real objects
    from .batch import BatchError
    from .events import Event, EventSink, ListSink, TeeSink
    from .guard import GuardConfig, GuardResult, run_guard
    from .guard.runner import run_queued
    from .hooks import on_call
    from .load import CheckpointError, checkpoint_bytes, from_safetensors, load_weights
    from .meter import MemoryMeter
    from .policy import FurthestNextUse, ReleaseUnlisted, ResidencyPolicy, rng_free
    from .release import ReleasedModuleError, release, return_memory_to_os
    from .rng import preserved_rng
    from .share import share
    from .staged import ModelLoadError, StagedModels
    from .units import format_size, parse_size
