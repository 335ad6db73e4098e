"""Real diffusers pipelines built locally, with random weights, for tests and benchmarks.

No hub access is needed: every component is created from a small config with weights
drawn from a fixed seed, tokenizers are trained in code on a few sentences, and the whole
pipeline is written with ``save_pretrained``. ``Size`` scales the two large models (text
encoder and denoiser); the same code builds a 1 MB test fixture and a 6 GB benchmark one.

    from stageload.testing.diffusers import build, Size
    path = build("qwen-image-2.1", tmp_path / "qwen", size=Size.tiny())
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The Qwen fixtures save this processor; loading them back needs its module imported.
from ..diffusers.qwen_processor import Qwen3VLTextImageProcessor
from ._components import (
    Size,
    _clip_config,
    _kl_vae,
    _made,
    _mrope_section,
    _rope_axes,
    _t5_config,
)
from ._tokenizers import (
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIALS,
    clip_tokenizer,
    qwen_tokenizer,
    t5_tokenizer,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


# --- pipelines -----------------------------------------------------------------------------


def build(family: str, path: str | Path, *, size: Size | None = None, **kwargs: Any) -> Path:
    """Build the pipeline ``family`` (one of :data:`FAMILIES`) into ``path``; returns it."""
    try:
        builder = FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"unknown fixture family {family!r}; choose one of {', '.join(FAMILIES)}"
        ) from None
    return builder(Path(path), size=size or Size.tiny(), **kwargs)


def _save(pipe: Any, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path


def build_qwen_image_21(
    path: Path, *, size: Size, seed: int = 0, dtype: torch.dtype | None = None, vae_dim: int = 8
) -> Path:
    """A QwenImage21Pipeline: Qwen3-VL text encoder, QwenImage21 transformer and VAE."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import (
        Qwen2VLImageProcessorPil,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    dtype = dtype or torch.float32
    tokenizer = qwen_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    h = size.hidden
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": h,
        "intermediate_size": 3 * h,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.heads,
        "head_dim": size.head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": _mrope_section(size.head_dim),
            "mrope_interleaved": True,
        },
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": h,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_encoder = _made(lambda: Qwen3VLForConditionalGeneration(config), dtype, seed)

    z_dim = 8
    vae = _made(
        lambda: AutoencoderKLQwenImage21(
            base_dim=vae_dim,
            decoder_base_dim=vae_dim,
            z_dim=z_dim,
            dim_mult=[1, 1, 1, 1, 1],
            num_res_blocks=1,
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        ),
        dtype,
        seed + 1,
    )
    rope = _rope_axes(size.head_dim)
    transformer = _made(
        lambda: QwenImage21Transformer2DModel(
            in_channels=z_dim,
            out_channels=z_dim,
            num_layers=size.layers,
            attention_head_dim=size.head_dim,
            num_attention_heads=size.heads,
            context_in_dim=h,
            axes_dims_rope=rope,
        ),
        dtype,
        seed + 2,
    )
    processor = Qwen3VLTextImageProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            patch_size=16, merge_size=2, temporal_patch_size=2
        ),
        tokenizer=tokenizer,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae,
        text_encoder=text_encoder,
        processor=processor,
        transformer=transformer,
    )
    return _save(pipe, path)


def build_flux(path: Path, *, size: Size, seed: int = 0, dtype: torch.dtype | None = None) -> Path:
    """A FluxPipeline: CLIP and T5 text encoders, Flux transformer, AutoencoderKL."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    dtype = dtype or torch.float32
    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    clip_hidden = 16
    clip_config = _clip_config(size, clip_tok, hidden=clip_hidden)
    text_encoder = _made(lambda: CLIPTextModel(clip_config), dtype, seed)
    text_encoder_2 = _made(lambda: T5EncoderModel(_t5_config(size, t5_tok)), dtype, seed + 1)
    latent = 4
    transformer = _made(
        lambda: FluxTransformer2DModel(
            in_channels=4 * latent,
            num_layers=max(1, size.layers // 2),
            num_single_layers=max(1, size.layers - size.layers // 2),
            attention_head_dim=size.head_dim,
            num_attention_heads=size.heads,
            joint_attention_dim=size.hidden,
            pooled_projection_dim=clip_hidden,
            axes_dims_rope=_rope_axes(size.head_dim),
        ),
        dtype,
        seed + 2,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_kl_vae(latent, seed=seed + 3, dtype=dtype),
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )
    return _save(pipe, path)


def build_sd3(path: Path, *, size: Size, seed: int = 0, dtype: torch.dtype | None = None) -> Path:
    """A StableDiffusion3Pipeline: two CLIP encoders and T5, SD3 transformer, AutoencoderKL.

    Its classifier-free guidance encodes the negative prompt with the same encoders, a
    second pass through the encode stage."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    dtype = dtype or torch.float32
    clip_tok, clip_tok_2, t5_tok = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    clip_hidden = 16
    # SD3 pads the two CLIP embeddings (2 * clip_hidden wide) up to T5's width.
    t5_size = Size(
        hidden=max(size.hidden, 2 * clip_hidden),
        layers=size.layers,
        head_dim=size.head_dim,
        image=size.image,
    )
    text_encoder = _made(
        lambda: CLIPTextModelWithProjection(_clip_config(size, clip_tok, hidden=clip_hidden)),
        dtype,
        seed,
    )
    text_encoder_2 = _made(
        lambda: CLIPTextModelWithProjection(_clip_config(size, clip_tok_2, hidden=clip_hidden)),
        dtype,
        seed + 1,
    )
    text_encoder_3 = _made(lambda: T5EncoderModel(_t5_config(t5_size, t5_tok)), dtype, seed + 2)
    latent = 4
    transformer = _made(
        lambda: SD3Transformer2DModel(
            sample_size=size.image // 2,
            patch_size=2,
            in_channels=latent,
            out_channels=latent,
            num_layers=size.layers,
            attention_head_dim=size.head_dim,
            num_attention_heads=size.heads,
            joint_attention_dim=t5_size.hidden,
            caption_projection_dim=size.hidden,
            pooled_projection_dim=2 * clip_hidden,
            pos_embed_max_size=max(16, size.image // 2),
        ),
        dtype,
        seed + 3,
    )
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_kl_vae(latent, seed=seed + 4, dtype=dtype),
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tok_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tok,
        transformer=transformer,
    )
    return _save(pipe, path)


def build_pixart_sigma(
    path: Path, *, size: Size, seed: int = 0, dtype: torch.dtype | None = None
) -> Path:
    """A PixArtSigmaPipeline: T5 encoder, PixArt transformer, AutoencoderKL. Call it with
    ``use_resolution_binning=False``: its bins assume a real model's sample size."""
    import torch
    from diffusers import DDIMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
    from transformers import T5EncoderModel

    dtype = dtype or torch.float32
    tok = t5_tokenizer()
    text_encoder = _made(lambda: T5EncoderModel(_t5_config(size, tok)), dtype, seed)
    latent = 4
    transformer = _made(
        lambda: PixArtTransformer2DModel(
            sample_size=size.image // 8,
            num_layers=size.layers,
            patch_size=2,
            attention_head_dim=size.head_dim,
            num_attention_heads=size.heads,
            caption_channels=size.hidden,
            in_channels=latent,
            cross_attention_dim=size.heads * size.head_dim,
            out_channels=2 * latent,  # the learned variance, as PixArt's real checkpoints
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
        ),
        dtype,
        seed + 1,
    )
    pipe = PixArtSigmaPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        vae=_kl_vae(latent, seed=seed + 2, dtype=dtype),
        transformer=transformer,
        scheduler=DDIMScheduler(),
    )
    return _save(pipe, path)


def build_wan22(path: Path, *, size: Size, seed: int = 0, dtype: torch.dtype | None = None) -> Path:
    """A Wan 2.2 WanPipeline: UMT5 text encoder, two Wan transformers (``transformer`` for
    the high-noise steps, ``transformer_2`` after ``boundary_ratio``), AutoencoderKLWan."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5EncoderModel

    dtype = dtype or torch.float32
    tokenizer = t5_tokenizer()
    text_encoder = _made(
        lambda: UMT5EncoderModel(_t5_config(size, tokenizer, umt5=True)), dtype, seed
    )
    z_dim = 4

    def transformer() -> nn.Module:
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=size.heads,
            attention_head_dim=size.head_dim,
            in_channels=z_dim,
            out_channels=z_dim,
            text_dim=size.hidden,
            freq_dim=32,
            ffn_dim=3 * size.hidden,
            num_layers=size.layers,
            rope_max_seq_len=32,
        )

    vae = _made(
        lambda: AutoencoderKLWan(
            base_dim=8,
            z_dim=z_dim,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        ),
        dtype,
        seed + 1,
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=_made(transformer, dtype, seed + 2),
        transformer_2=_made(transformer, dtype, seed + 3),
        boundary_ratio=0.875,
    )
    return _save(pipe, path)


#: Fixture builders by family name: ``build(family, path, size=...)``.
FAMILIES: dict[str, Callable[..., Path]] = {
    "qwen-image-2.1": build_qwen_image_21,
    "flux": build_flux,
    "sd3": build_sd3,
    "wan2.2": build_wan22,
    "pixart-sigma": build_pixart_sigma,
}


def model_bytes(path: str | Path, names: Iterable[str] | None = None) -> dict[str, int]:
    """Bytes of weights on disk per component folder of a saved pipeline."""
    root = Path(path)
    index = json.loads((root / "model_index.json").read_text())
    out: dict[str, int] = {}
    for name in index:
        if name.startswith("_") or (names is not None and name not in names):
            continue
        folder = root / name
        files = list(folder.glob("*.safetensors")) + list(folder.glob("*.bin"))
        if files:
            out[name] = sum(f.stat().st_size for f in files)
    return out
