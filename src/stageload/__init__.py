"""stageload: load each model of a multi-stage PyTorch pipeline only while its stages run.

``import stageload`` stays light (no torch, matplotlib or diffusers): the public names
below are resolved on first access, so the CLI and the guard start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# The public API, defined once: public name -> submodule that defines it. ``__all__``,
# ``__dir__`` and the lazy ``__getattr__`` all read it; the TYPE_CHECKING imports at the
# end mirror it for type checkers (tests/package/test_imports.py checks that they match).
_EXPORTS: dict[str, str] = {
    "StagedModels": "core.staged",
    "ModelLoadError": "core.staged",
    "BatchError": "core.batch",
    "Plan": "core.plan",
    "ReleaseUnlisted": "core.policy",
    "ResidencyPolicy": "core.policy",
    "FurthestNextUse": "core.policy",
    "rng_free": "load.loaders",
    "auto": "autostage",
    "AutoError": "autostage",
    "preserved_rng": "core.rng",
    "Event": "core.events",
    "EventSink": "core.events",
    "ListSink": "core.events",
    "TeeSink": "core.events",
    "on_call": "hooks.on_call",
    "share": "hooks.share",
    "release": "hooks.release",
    "ReleasedModuleError": "hooks.release",
    "return_memory_to_os": "hooks.release",
    "load_weights": "load.weights",
    "from_safetensors": "load.weights",
    "streamed": "core.streamed",
    "stream_of": "core.streamed",
    "StreamError": "core.streamed",
    "checkpoint_bytes": "load.checkpoint",
    "CheckpointError": "load.checkpoint",
    "StageloadError": "errors",
    "MemoryMeter": "meter",
    "GuardConfig": "guard",
    "GuardResult": "guard",
    "run_guard": "guard",
    "run_queued": "guard.runner",
    "parse_size": "units",
    "format_size": "units",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    home = _EXPORTS.get(name)
    if home is None:
        raise AttributeError(f"module 'stageload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # let type checkers and IDEs see the real objects
    from .autostage import AutoError, auto
    from .core.batch import BatchError
    from .core.events import Event, EventSink, ListSink, TeeSink
    from .core.plan import Plan
    from .core.policy import FurthestNextUse, ReleaseUnlisted, ResidencyPolicy
    from .core.rng import preserved_rng
    from .core.staged import ModelLoadError, StagedModels
    from .core.streamed import StreamError, stream_of, streamed
    from .errors import StageloadError
    from .guard import GuardConfig, GuardResult, run_guard
    from .guard.runner import run_queued
    from .hooks.on_call import on_call
    from .hooks.release import ReleasedModuleError, release, return_memory_to_os
    from .hooks.share import share
    from .load.checkpoint import CheckpointError, checkpoint_bytes
    from .load.loaders import rng_free
    from .load.weights import from_safetensors, load_weights
    from .meter import MemoryMeter
    from .units import format_size, parse_size
