"""The demo's pipeline: three models, their weights in a cache folder, and the staged run.

Weights are generated once from a fixed seed and saved as safetensors; ``make_models`` gives
the registry for one mode (eager or staged) and ``run_pipeline`` runs the three stages.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..units import format_duration, format_size

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..core.staged import StagedModels

MODELS = ("encoder", "denoiser", "decoder")
STAGES: dict[str, tuple[str, ...]] = {
    "encode": ("encoder",),
    "denoise": ("denoiser",),
    "decode": ("decoder",),
}
MODES = ("eager", "staged")
# Bump when the weight layout or generation changes, so old caches are not reused.
_WEIGHTS_VERSION = 1


@dataclass(frozen=True)
class DemoSize:
    """Shapes of the demo: width, layers per model, batch and denoising steps."""

    name: str
    dim: int
    layers: tuple[int, int, int]  # encoder, denoiser, decoder
    batch: int
    encode_passes: int
    steps: int
    seed: int = 20241004

    def model_layers(self, model: str) -> int:
        return self.layers[MODELS.index(model)]

    def model_bytes(self, model: str) -> int:
        """float32 bytes of one model's weights and biases."""
        return self.model_layers(model) * (self.dim * self.dim + self.dim) * 4

    def fingerprint(self) -> str:
        data = json.dumps({**asdict(self), "v": _WEIGHTS_VERSION}, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:10]


SIZES: dict[str, DemoSize] = {
    # About 268 + 336 + 268 MiB of float32 weights; ~1 min on 2 cores, weights made once.
    "default": DemoSize("default", dim=4096, layers=(4, 5, 4), batch=32, encode_passes=6, steps=8),
    # A few MB per model, for the test suite.
    "small": DemoSize("small", dim=512, layers=(3, 4, 3), batch=8, encode_passes=2, steps=4),
}


# -- weights ----------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/stageload/demo``, or ``~/.cache/stageload/demo``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stageload" / "demo"


def weights_dir(size: DemoSize, cache: Path) -> Path:
    return cache / f"{size.name}-{size.fingerprint()}"


def _expected_shapes(size: DemoSize, model: str) -> dict[str, tuple[int, ...]]:
    # Keys of nn.Sequential(Linear, Tanh, Linear, Tanh, ...): Linears sit at even indices.
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(size.model_layers(model)):
        shapes[f"{2 * i}.weight"] = (size.dim, size.dim)
        shapes[f"{2 * i}.bias"] = (size.dim,)
    return shapes


def weights_valid(size: DemoSize, folder: Path) -> bool:
    """Whether ``folder`` holds complete weights for ``size``: manifest, sizes and headers."""
    from safetensors import safe_open

    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != size.fingerprint():
        return False
    for model in MODELS:
        path = folder / f"{model}.safetensors"
        try:
            if path.stat().st_size != manifest["files"][model]:
                return False
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except Exception:  # a truncated or foreign file: regenerate rather than fail
            return False
        if shapes != _expected_shapes(size, model):
            return False
    return True


def ensure_weights(
    size: DemoSize, cache: Path, progress: Callable[[str], None] = lambda _: None
) -> tuple[Path, bool]:
    """Make sure the demo weights exist in ``cache``; return their folder and whether they
    were generated now (False when a valid cached copy was reused)."""
    folder = weights_dir(size, cache)
    if weights_valid(size, folder):
        return folder, False

    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").unlink(missing_ok=True)  # invalid until every file is written
    files: dict[str, int] = {}
    for index, model in enumerate(MODELS):
        started = time.perf_counter()
        # One generator per model, from a fixed seed: the same weights on every machine.
        gen = torch.Generator().manual_seed(size.seed + index)
        scale = 1.5 / size.dim**0.5  # keeps tanh activations away from saturation
        tensors = {}
        for key, shape in _expected_shapes(size, model).items():
            std = scale if key.endswith("weight") else 0.01
            tensors[key] = torch.randn(shape, generator=gen).mul_(std)
        path = folder / f"{model}.safetensors"
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial))
        del tensors
        partial.replace(path)  # atomic: a killed run never leaves a half file under the name
        files[model] = path.stat().st_size
        progress(
            f"generated {model}: {format_size(files[model])} in "
            f"{format_duration(time.perf_counter() - started)}"
        )
    manifest = {"fingerprint": size.fingerprint(), "size": asdict(size), "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return folder, True


# -- the pipeline -----------------------------------------------------------------------


def build_model(size: DemoSize, model: str) -> nn.Module:
    """An untrained model: Linear+Tanh layers. Its random init draws from torch's global RNG."""
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(size.model_layers(model)):
        layers += [nn.Linear(size.dim, size.dim), nn.Tanh()]
    return nn.Sequential(*layers)


def load_model(size: DemoSize, folder: Path, model: str) -> nn.Module:
    """Build ``model`` and copy its weights in from safetensors, one tensor at a time."""
    import torch
    from safetensors import safe_open

    module = build_model(size, model)  # random init first, as from_pretrained-style code does
    with safe_open(str(folder / f"{model}.safetensors"), framework="pt") as f, torch.no_grad():
        for key, tensor in module.state_dict().items():
            # Copy into the module's own storage: the weights live in anonymous memory,
            # which the footprint counts, not in the file's page cache.
            tensor.copy_(f.get_tensor(key))
    return module.eval().requires_grad_(False)


def run_pipeline(
    models: Mapping[str, nn.Module],
    size: DemoSize,
    enter: Callable[[str], None],
    say: Callable[[str], None] = lambda _: None,
) -> torch.Tensor:
    """Encode, denoise in a loop, decode. Seeds once; every stage draws its own noise right
    after fetching its model, so a model built mid-run must not disturb the RNG."""
    import torch

    torch.manual_seed(size.seed)
    with torch.inference_mode():
        enter("encode")
        encoder = models["encoder"]
        prompt = torch.randn(size.batch, size.dim)
        cond = prompt
        for _ in range(size.encode_passes):
            cond = encoder(cond)
        say("encode done")

        enter("denoise")
        denoiser = models["denoiser"]
        x = torch.randn(size.batch, size.dim)
        for step in range(size.steps):
            x = x - denoiser(x + cond) / size.steps
            if (step + 1) % max(1, size.steps // 4) == 0:
                say(f"denoise step {step + 1}/{size.steps}")

        enter("decode")
        decoder = models["decoder"]
        out = decoder(x + 0.01 * torch.randn(size.batch, size.dim))
        say("decode done")
    return out


def make_models(
    mode: str,
    size: DemoSize,
    folder: Path,
    events: Any | None = None,
    *,
    preserve_rng: bool = True,
) -> StagedModels:
    """The model registry for ``mode``: eager keeps every model (all pinned), staged releases.

    ``preserve_rng=False`` is the control that shows why loads must not touch the RNG.
    """
    from ..core.staged import StagedModels

    if mode not in MODES:
        raise ValueError(f"unknown demo mode {mode!r}: use 'eager' or 'staged'")
    loaders = {m: (lambda m=m: load_model(size, folder, m)) for m in MODELS}
    pinned = MODELS if mode == "eager" else ()
    return StagedModels(
        loaders, stages=STAGES, pinned=pinned, events=events, preserve_rng=preserve_rng
    )
