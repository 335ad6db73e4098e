"""Many diffusers pipeline families, built locally with tiny random components, and the
arguments of one small call of each: what ``staged_pipeline`` is tested against.

Several families share one folder (Stable Diffusion's text-to-image, img2img, inpainting
and LCM pipelines load the same parts), so :func:`folder` builds each folder once per
``root``::

    from stageload.testing.families import FAMILIES, folder
    family = FAMILIES["sd-img2img"]
    pipe = family.load(folder(family, tmp_path))
    image = pipe(**family.call())[0]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _families_image as image
from . import _families_media as media

PROMPT = "a photo of a cat sitting on a red chair"


def _flux(path: Path, *, seed: int = 0) -> Path:
    from . import diffusers as fixtures

    return fixtures.build("flux", path)


def _wan22(path: Path, *, seed: int = 0) -> Path:
    from . import diffusers as fixtures

    return fixtures.build("wan2.2", path)


#: Folder builders: name -> ``build(path) -> path``. Family.folder names one of these.
BUILDERS: dict[str, Callable[..., Path]] = {
    "sd": image.build_sd,
    "sd-controlnet": image.build_sd_controlnet,
    "sdxl": image.build_sdxl,
    "kandinsky2.2": image.build_kandinsky22,
    "stable-cascade": image.build_stable_cascade,
    "pixart-sigma": image.build_pixart_sigma,
    "svd": media.build_svd,
    "ltx": media.build_ltx,
    "audioldm2": media.build_audioldm2,
    "flux": _flux,
    "wan2.2": _wan22,
}


def _generator(seed: int = 0) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


def _picture(channels: int = 3, side: int = 32, seed: int = 1) -> Any:
    """A fixed image tensor in [0, 1], as image processors take it."""
    import torch

    return torch.rand(1, channels, side, side, generator=torch.Generator().manual_seed(seed))


def _mask(side: int = 32) -> Any:
    import torch

    mask = torch.zeros(1, 1, side, side)
    mask[..., side // 2 :] = 1.0
    return mask


def _randn(*shape: int, seed: int = 2) -> Any:
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class Family:
    """One pipeline class on one built folder, and how to call it cheaply."""

    pipeline: str  # the diffusers class name
    folder: str  # a BUILDERS key
    args: Callable[[], dict[str, Any]]  # the call's arguments except the generator
    subfolder: str = ""
    #: Extra from_pretrained arguments (objects, so each load gets fresh ones).
    load_args: Callable[[], dict[str, Any]] = field(default=dict)

    @property
    def cls(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline)

    def call(self, seed: int = 0) -> dict[str, Any]:
        """Arguments of one call, with a fresh generator seeded ``seed``."""
        return {**self.args(), "generator": _generator(seed)}

    def load(self, path: Path, **kwargs: Any) -> Any:
        """The pipeline loaded eagerly, as a user would."""
        return self.cls.from_pretrained(path, **self.load_args(), **kwargs)


def _image_call(**extra: Any) -> Callable[[], dict[str, Any]]:
    def args() -> dict[str, Any]:
        base = {"prompt": PROMPT, "num_inference_steps": 2, "output_type": "pt"}
        return {**base, "height": 32, "width": 32, **{k: v() for k, v in extra.items()}}

    return args


def _const(value: Any) -> Callable[[], Any]:
    return lambda: value


def _lcm_scheduler() -> dict[str, Any]:
    from diffusers import LCMScheduler

    return {"scheduler": LCMScheduler(beta_schedule="scaled_linear")}


#: Family name -> Family. Calls take 2 denoising steps at 32 x 32 (or the model's minimum).
FAMILIES: dict[str, Family] = {
    "sd": Family("StableDiffusionPipeline", "sd", _image_call()),
    "sd-img2img": Family(
        "StableDiffusionImg2ImgPipeline",
        "sd",
        _image_call(image=_picture, strength=_const(1.0)),
    ),
    "sd-inpaint": Family(
        "StableDiffusionInpaintPipeline",
        "sd",
        _image_call(image=_picture, mask_image=_mask, strength=_const(1.0)),
    ),
    "lcm": Family("LatentConsistencyModelPipeline", "sd", _image_call(), load_args=_lcm_scheduler),
    "sd-controlnet": Family(
        "StableDiffusionControlNetPipeline", "sd-controlnet", _image_call(image=_picture)
    ),
    "sdxl": Family("StableDiffusionXLPipeline", "sdxl", _image_call()),
    "kandinsky2.2-prior": Family(
        "KandinskyV22PriorPipeline",
        "kandinsky2.2",
        lambda: {"prompt": PROMPT, "num_inference_steps": 2, "output_type": "pt"},
        subfolder="prior",
    ),
    "kandinsky2.2": Family(
        "KandinskyV22Pipeline",
        "kandinsky2.2",
        lambda: {
            "image_embeds": _randn(1, 32, seed=3),
            "negative_image_embeds": _randn(1, 32, seed=4),
            "height": 32,
            "width": 32,
            "num_inference_steps": 2,
            "output_type": "pt",
        },
        subfolder="decoder",
    ),
    "kandinsky2.2-combined": Family(
        "KandinskyV22CombinedPipeline",
        "kandinsky2.2",
        _image_call(prior_num_inference_steps=_const(2)),
        subfolder="combined",
    ),
    "stable-cascade-prior": Family(
        "StableCascadePriorPipeline",
        "stable-cascade",
        _image_call(height=_const(256), width=_const(256)),
        subfolder="prior",
    ),
    "stable-cascade": Family(
        "StableCascadeDecoderPipeline",
        "stable-cascade",
        lambda: {
            "image_embeddings": _randn(1, 16, 4, 4, seed=5),
            "prompt": PROMPT,
            "num_inference_steps": 2,
            "output_type": "pt",
        },
        subfolder="decoder",
    ),
    "pixart-sigma": Family(
        "PixArtSigmaPipeline",
        "pixart-sigma",
        _image_call(use_resolution_binning=_const(False), max_sequence_length=_const(16)),
    ),
    "svd": Family(
        "StableVideoDiffusionPipeline",
        "svd",
        lambda: {
            "image": _picture(),
            "height": 32,
            "width": 32,
            "num_frames": 2,
            "decode_chunk_size": 2,
            "num_inference_steps": 2,
            "output_type": "pt",
        },
    ),
    "ltx": Family(
        "LTXPipeline",
        "ltx",
        _image_call(num_frames=_const(9), max_sequence_length=_const(16)),
    ),
    "ltx-i2v": Family(
        "LTXImageToVideoPipeline",
        "ltx",
        _image_call(image=_picture, num_frames=_const(9), max_sequence_length=_const(16)),
    ),
    "audioldm2": Family(
        "AudioLDM2Pipeline",
        "audioldm2",
        lambda: {"prompt": PROMPT, "num_inference_steps": 2, "output_type": "pt"},
    ),
    "flux": Family("FluxPipeline", "flux", _image_call(max_sequence_length=_const(16))),
    "wan2.2": Family(
        "WanPipeline",
        "wan2.2",
        _image_call(num_frames=_const(5), max_sequence_length=_const(16)),
    ),
}


def folder(family: Family | str, root: str | Path) -> Path:
    """The saved pipeline folder for ``family`` under ``root``, built on first request."""
    if isinstance(family, str):
        try:
            family = FAMILIES[family]
        except KeyError:
            raise ValueError(
                f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}"
            ) from None
    base = Path(root) / family.folder
    if not (base / "done").exists():
        BUILDERS[family.folder](base)
        (base / "done").touch()
    return base / family.subfolder if family.subfolder else base
