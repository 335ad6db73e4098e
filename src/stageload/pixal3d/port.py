"""Find the user's Pixal3D-mac checkout and import it, checking it has the API we fit.

The port is not a package: ``generate_mps.py`` sits at the root of its repository next to
the ``pixal3d`` package. We put that folder first on ``sys.path`` and import both.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import StageloadError
from .plan import EXTRACTOR_KEYS

#: Environment variable naming the port's folder when ``--port`` is not given.
PORT_ENV = "STAGELOAD_PIXAL3D_PORT"

#: The port commit this adapter was written and measured against.
PORT_COMMIT = "0be9e69"

GENERATE_FUNCTIONS: tuple[str, ...] = (
    "parse_args",
    "load_runtime_deps",
    "init_pipeline",
    "load_pipeline",
    "image_to_asset",
    "asset_to_glb",
    "build_image_cond_model",
    "_load_naf",
)

PIPELINE_MODULE = "pixal3d.pipelines.pixal3d_image_to_3d"
PIPELINE_CLASS = "Pixal3DImageTo3DPipeline"
PIPELINE_METHODS: tuple[str, ...] = (
    "from_pretrained",
    "to",
    "run",
    "preprocess_image",
    "get_proj_cond_ss",
    "get_proj_cond_shape",
    "sample_sparse_structure",
    "sample_shape_slat",
    "sample_tex_slat",
    "decode_latent",
    "decode_shape_slat",
    "decode_tex_slat",
)

BACKBONE_CLASS = "DINOv3ViTModel"
EXTRACTOR_CLASS = "DinoV3ProjFeatureExtractor"

# Module names the port owns; a copy imported from another folder is dropped first.
_PORT_MODULES = ("generate_mps", "pixal3d")
_inserted: list[str] = []  # port folders this process put on sys.path


class PortError(StageloadError, RuntimeError):
    """The port cannot be found, cannot be imported, or lacks part of the expected API."""


def find_port(port: str | os.PathLike[str] | None = None) -> Path:
    """The port's folder, from ``port`` or ``$STAGELOAD_PIXAL3D_PORT``; checked to exist."""
    if port is None or str(port) == "":
        env = os.environ.get(PORT_ENV, "")
        if not env:
            raise PortError(
                f"no Pixal3D port given: pass --port DIR or set {PORT_ENV} to your "
                "Pixal3D-mac checkout (the folder that holds generate_mps.py)"
            )
        port, where = env, f"${PORT_ENV}"
    else:
        where = "--port"
    path = Path(port).expanduser()
    if not path.is_dir():
        raise PortError(
            f"{where} {str(port)!r} is not a folder; give the Pixal3D-mac checkout "
            "(the folder that holds generate_mps.py and pixal3d/)"
        )
    missing = [n for n in ("generate_mps.py", "pixal3d") if not (path / n).exists()]
    if missing:
        raise PortError(
            f"{where} {str(port)!r} is not a Pixal3D-mac checkout: it has no "
            f"{' and no '.join(missing)}; give the folder that holds generate_mps.py"
        )
    return path.resolve()


@dataclass
class Port:
    """The imported port: its entry script, model registry, pipeline and backbone classes."""

    path: Path
    generate: ModuleType  # generate_mps
    models: ModuleType  # pixal3d.models, whose from_pretrained the pipeline calls
    pipeline_class: type
    backbone_class: type | None  # DINOv3ViTModel, shared between the extractors

    def parse_args(self, argv: list[str]) -> Any:
        return self.generate.parse_args(argv)


def _is_from(module: ModuleType, folder: Path) -> bool:
    files = [getattr(module, "__file__", None), *list(getattr(module, "__path__", []) or [])]
    return any(file and Path(file).resolve().is_relative_to(folder) for file in files)


def _forget_other_ports(folder: Path) -> None:
    """Drop port modules imported from another folder, and that folder from sys.path."""
    for name in list(sys.modules):
        if name.split(".")[0] in _PORT_MODULES:
            module = sys.modules[name]
            if module is not None and not _is_from(module, folder):
                del sys.modules[name]
    for old in list(_inserted):
        if old != str(folder) and old in sys.path:
            sys.path.remove(old)
            _inserted.remove(old)


def import_port(path: str | os.PathLike[str]) -> Port:
    """Import the port at ``path`` and check its API; raises :class:`PortError`."""
    folder = Path(path).resolve()
    _forget_other_ports(folder)
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    if str(folder) not in _inserted:
        _inserted.append(str(folder))
    importlib.invalidate_caches()
    try:
        generate = importlib.import_module("generate_mps")
        if callable(getattr(generate, "load_runtime_deps", None)):
            generate.load_runtime_deps()  # imports torch, PIL and the pipeline class
        models = importlib.import_module("pixal3d.models")
        pipeline_module = importlib.import_module(PIPELINE_MODULE)
    except PortError:
        raise
    except Exception as exc:
        raise PortError(
            f"importing the Pixal3D port from {str(folder)!r} failed: "
            f"{type(exc).__name__}: {exc}. Install the port's requirements in this "
            "environment (stageload runs inside the port's Python)"
        ) from exc
    pipeline_class = getattr(pipeline_module, PIPELINE_CLASS, None)
    missing = [
        f"generate_mps.{n}" for n in GENERATE_FUNCTIONS if not callable(getattr(generate, n, None))
    ]
    configs = getattr(generate, "IMAGE_COND_CONFIGS", None)
    if not isinstance(configs, dict):
        missing.append("generate_mps.IMAGE_COND_CONFIGS")
    else:
        missing += [
            f"generate_mps.IMAGE_COND_CONFIGS[{k!r}]" for k in EXTRACTOR_KEYS if k not in configs
        ]
    if not callable(getattr(models, "from_pretrained", None)):
        missing.append("pixal3d.models.from_pretrained")
    if pipeline_class is None:
        missing.append(f"{PIPELINE_MODULE}.{PIPELINE_CLASS}")
    else:
        missing += [
            f"{PIPELINE_CLASS}.{m}"
            for m in PIPELINE_METHODS
            if not callable(getattr(pipeline_class, m, None))
        ]
    if missing:
        raise api_mismatch(folder, missing)
    return Port(folder, generate, models, pipeline_class, find_backbone_class(generate))


def api_mismatch(folder: Path, missing: list[str]) -> PortError:
    return PortError(
        f"the Pixal3D port at {str(folder)!r} does not have the API stageload.pixal3d was "
        f"written for (Pixal3D-mac commit {PORT_COMMIT}): missing {', '.join(missing)}. "
        f"Check out that commit of the port, or update stageload"
    )


def find_backbone_class(generate: ModuleType) -> type | None:
    """The class whose ``from_pretrained`` each extractor calls for its DINOv3 backbone.

    Looked up where the port may import it from: the entry script, the extractor's own
    module, any ``pixal3d`` module, then ``transformers``, which defines the real class.
    Sharing patches the class itself, so every module that imported it sees the share.
    """
    candidates: list[Any] = [generate]
    extractor = getattr(generate, EXTRACTOR_CLASS, None)
    if extractor is not None:
        candidates.append(sys.modules.get(getattr(extractor, "__module__", ""), None))
    candidates += [m for n, m in sorted(sys.modules.items()) if n.split(".")[0] == "pixal3d"]
    for module in candidates:
        cls = getattr(module, BACKBONE_CLASS, None)
        if isinstance(cls, type) and callable(getattr(cls, "from_pretrained", None)):
            return cls
    try:
        transformers = importlib.import_module("transformers")
        cls = getattr(transformers, BACKBONE_CLASS, None)
    except Exception:
        return None
    return cls if isinstance(cls, type) else None


def check_device(device: str) -> None:
    """Refuse a device this machine doesn't have, before anything is built."""
    import torch

    kind = torch.device(device).type
    if kind == "mps" and not torch.backends.mps.is_available():
        raise PortError(
            f"device {device!r} is not available here (torch.backends.mps.is_available() "
            "is False); pass --device cpu"
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise PortError(f"device {device!r} is not available here; pass --device cpu")


def config_build(models: ModuleType, config_file: Path, kwargs: dict[str, Any]) -> Any:
    """How the port's ``pixal3d.models.from_pretrained(path, **kwargs)`` builds its model
    before reading ``{path}.safetensors`` whole: ``getattr(pixal3d.models, config["name"])
    (**config["args"], **kwargs)``, from ``{path}.json`` (``config_file``). Returns the
    build, a function of no arguments, or the class name the file gives when ``models``
    has no such class (or the file no ``args`` dict)."""
    config = json.loads(config_file.read_text())
    name = config.get("name") if isinstance(config, dict) else None
    cls = getattr(models, name, None) if isinstance(name, str) else None
    args = config.get("args", {}) if isinstance(config, dict) else None
    if not callable(cls) or not isinstance(args, dict):
        return str(name)
    args, kwargs = dict(args), dict(kwargs)
    return lambda: cls(**args, **kwargs)


def stand_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What the port's ``pixal3d.models.from_pretrained(*args, **kwargs)`` returns, with its
    weights on ``meta``, nothing read but ``{path}.json`` (``stageload.auto``'s stand-in
    for it: the model is read at its first use); None where that cannot be built the
    same: a path without its local ``.json`` and ``.safetensors``, other arguments.

    Built on ``meta``, it draws no random number where the port's CPU build draws its
    initial weights (a computed buffer's draws are given back too): for a run that seeds
    before it samples, as the port's ``image_to_asset`` does, and as the staged build,
    which builds nothing at setup, also takes."""
    from ..core.rng import preserved_rng
    from ..load.meta import build_on_meta

    if len(args) != 1 or not isinstance(args[0], (str, os.PathLike)):
        return None
    path = os.fspath(args[0])
    config_file = Path(f"{path}.json")
    if not (config_file.is_file() and Path(f"{path}.safetensors").is_file()):
        return None
    build = config_build(importlib.import_module("pixal3d.models"), config_file, kwargs)
    if isinstance(build, str):
        return None
    with preserved_rng():
        return build_on_meta(build)
