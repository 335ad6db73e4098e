"""Run the Pixal3D-mac image-to-3D port with staged loading (``stageload-pixal3d``).

The port is imported at run time from the user's checkout (``--port DIR`` or
``$STAGELOAD_PIXAL3D_PORT``). Importing this package stays light: torch and the port load
only when a run starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "Pixal3DRun": "adapter",
    "RunResult": "adapter",
    "StopRun": "adapter",
    "run": "adapter",
    "Port": "port",
    "PortError": "port",
    "PORT_ENV": "port",
    "find_port": "port",
    "import_port": "port",
    "UnsupportedPipelineError": "plan",
    "PLAN_1024_CASCADE": "plan",
    "STAGES": "plan",
    "plan_for": "plan",
}

__all__ = [
    "PLAN_1024_CASCADE",
    "PORT_ENV",
    "Pixal3DRun",
    "Port",
    "PortError",
    "RunResult",
    "STAGES",
    "StopRun",
    "UnsupportedPipelineError",
    "find_port",
    "import_port",
    "plan_for",
    "run",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stageload.pixal3d' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from .adapter import Pixal3DRun, RunResult, StopRun, run
    from .plan import PLAN_1024_CASCADE, STAGES, UnsupportedPipelineError, plan_for
    from .port import PORT_ENV, Port, PortError, find_port, import_port
