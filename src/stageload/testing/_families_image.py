"""Tiny image pipelines for :mod:`stageload.testing.families`: Stable Diffusion (one folder
for text-to-image, img2img, inpainting and LCM), ControlNet, SDXL, Kandinsky 2.2 (prior,
decoder and combined), Stable Cascade (prior and decoder) and PixArt-Σ.

Every model is a few hundred KB with seeded weights; tokenizers are trained in code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._components import _clip_config, _kl_vae, _made
from ._tokenizers import clip_tokenizer
from .diffusers import Size, _save
from .diffusers import build_pixart_sigma as scalable_pixart_sigma


def _f32() -> Any:
    import torch

    return torch.float32


def _ddim() -> Any:
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False, steps_offset=1
    )


def _clip_text(tok: Any, seed: int, *, hidden: int = 32, projection: bool = False) -> Any:
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    config = _clip_config(Size(), tok, hidden=hidden)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return _made(lambda: cls(config), _f32(), seed)


def _sd_unet(seed: int, **extra: Any) -> Any:
    from diffusers import UNet2DConditionModel

    config: dict[str, Any] = dict(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=4,
        attention_head_dim=4,
    )
    config.update(extra)
    return _made(lambda: UNet2DConditionModel(**config), _f32(), seed)


def build_sd(path: Path, *, seed: int = 0) -> Path:
    """StableDiffusionPipeline parts; the same folder loads as img2img, inpaint and LCM
    (its UNet takes LCM's guidance embedding, which SD then uses too)."""
    from diffusers import StableDiffusionPipeline

    tok = clip_tokenizer()
    pipe = StableDiffusionPipeline(
        vae=_kl_vae(4, seed=seed + 2, dtype=_f32()),
        text_encoder=_clip_text(tok, seed),
        tokenizer=tok,
        unet=_sd_unet(seed + 1, time_cond_proj_dim=32),
        scheduler=_ddim(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return _save(pipe, path)


def build_sd_controlnet(path: Path, *, seed: int = 0) -> Path:
    """StableDiffusionControlNetPipeline: SD plus a ControlNet that runs in every step."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    tok = clip_tokenizer()
    controlnet = _made(
        lambda: ControlNetModel(
            block_out_channels=(8, 16),
            layers_per_block=1,
            in_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            cross_attention_dim=32,
            conditioning_embedding_out_channels=(8, 16),
            norm_num_groups=4,
            attention_head_dim=4,
        ),
        _f32(),
        seed + 3,
    )
    pipe = StableDiffusionControlNetPipeline(
        vae=_kl_vae(4, seed=seed + 2, dtype=_f32()),
        text_encoder=_clip_text(tok, seed),
        tokenizer=tok,
        unet=_sd_unet(seed + 1),
        controlnet=controlnet,
        scheduler=_ddim(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return _save(pipe, path)


def build_sdxl(path: Path, *, seed: int = 0) -> Path:
    """StableDiffusionXLPipeline: two CLIP encoders (the second with a projection)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    tok, tok_2 = clip_tokenizer(), clip_tokenizer()
    unet = _sd_unet(
        seed + 2,
        cross_attention_dim=64,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,
        use_linear_projection=True,
    )
    pipe = StableDiffusionXLPipeline(
        vae=_kl_vae(4, seed=seed + 3, dtype=_f32()),
        text_encoder=_clip_text(tok, seed),
        text_encoder_2=_clip_text(tok_2, seed + 1, projection=True),
        tokenizer=tok,
        tokenizer_2=tok_2,
        unet=unet,
        scheduler=EulerDiscreteScheduler(
            beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
        ),
    )
    return _save(pipe, path)


def _kandinsky_prior_parts(seed: int) -> dict[str, Any]:
    from diffusers import PriorTransformer, UnCLIPScheduler
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModelWithProjection,
    )

    tok = clip_tokenizer()
    hidden = 32
    vision = CLIPVisionConfig(
        hidden_size=hidden,
        projection_dim=hidden,
        image_size=32,
        patch_size=8,
        intermediate_size=64,
        num_attention_heads=2,
        num_hidden_layers=1,
    )
    return {
        "prior": _made(
            lambda: PriorTransformer(
                num_attention_heads=2, attention_head_dim=16, embedding_dim=hidden, num_layers=2
            ),
            _f32(),
            seed,
        ),
        "image_encoder": _made(lambda: CLIPVisionModelWithProjection(vision), _f32(), seed + 1),
        "text_encoder": _clip_text(tok, seed + 2, hidden=hidden, projection=True),
        "tokenizer": tok,
        "scheduler": UnCLIPScheduler(
            variance_type="fixed_small_log",
            prediction_type="sample",
            clip_sample=True,
            clip_sample_range=10.0,
        ),
        "image_processor": CLIPImageProcessor(crop_size=32, size=32),
    }


def _kandinsky_decoder_parts(seed: int) -> dict[str, Any]:
    from diffusers import UNet2DConditionModel, VQModel

    unet = _made(
        lambda: UNet2DConditionModel(
            in_channels=4,
            out_channels=8,  # mean and variance
            addition_embed_type="image",
            down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
            up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
            mid_block_type="UNetMidBlock2DSimpleCrossAttn",
            block_out_channels=(32, 64),
            layers_per_block=1,
            encoder_hid_dim=32,
            encoder_hid_dim_type="image_proj",
            cross_attention_dim=32,
            attention_head_dim=4,
            resnet_time_scale_shift="scale_shift",
            class_embed_type=None,
        ),
        _f32(),
        seed,
    )
    movq = _made(
        lambda: VQModel(
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
            up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"),
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=8,
            norm_type="spatial",
            num_vq_embeddings=12,
            vq_embed_dim=4,
        ),
        _f32(),
        seed + 1,
    )
    return {"unet": unet, "scheduler": _ddim(), "movq": movq}


def build_kandinsky22(path: Path, *, seed: int = 0) -> Path:
    """Kandinsky 2.2 in three folders under ``path``: ``prior`` (KandinskyV22Prior),
    ``decoder`` (KandinskyV22) and ``combined`` (the two with ``prior_`` names)."""
    from diffusers import (
        KandinskyV22CombinedPipeline,
        KandinskyV22Pipeline,
        KandinskyV22PriorPipeline,
    )

    prior, decoder = _kandinsky_prior_parts(seed), _kandinsky_decoder_parts(seed + 3)
    _save(KandinskyV22PriorPipeline(**prior), path / "prior")
    _save(KandinskyV22Pipeline(**decoder), path / "decoder")
    combined = {**decoder, **{f"prior_{k}": v for k, v in prior.items()}}
    _save(KandinskyV22CombinedPipeline(**combined), path / "combined")
    return path


def build_stable_cascade(path: Path, *, seed: int = 0) -> Path:
    """Stable Cascade in two folders under ``path``: ``prior`` (StableCascadePrior) and
    ``decoder`` (StableCascadeDecoder: its denoiser is named ``decoder``, its VQ-GAN
    ``vqgan``)."""
    from diffusers import (
        DDPMWuerstchenScheduler,
        StableCascadeDecoderPipeline,
        StableCascadePriorPipeline,
        StableCascadeUNet,
    )
    from diffusers.pipelines.deprecated.wuerstchen import PaellaVQModel

    hidden = 32
    prior = _made(
        lambda: StableCascadeUNet(
            in_channels=16,
            out_channels=16,
            conditioning_dim=64,
            block_out_channels=(64, 64),
            num_attention_heads=(2, 2),
            down_num_layers_per_block=(1, 1),
            up_num_layers_per_block=(1, 1),
            switch_level=(False,),
            clip_image_in_channels=hidden,
            clip_text_in_channels=hidden,
            clip_text_pooled_in_channels=hidden,
            dropout=(0.0, 0.0),
        ),
        _f32(),
        seed,
    )
    tok = clip_tokenizer()
    text_encoder = _clip_text(tok, seed + 1, hidden=hidden, projection=True)
    _save(
        StableCascadePriorPipeline(
            tokenizer=tok,
            text_encoder=text_encoder,
            prior=prior,
            scheduler=DDPMWuerstchenScheduler(),
        ),
        path / "prior",
    )
    decoder = _made(
        lambda: StableCascadeUNet(
            in_channels=4,
            out_channels=4,
            conditioning_dim=64,
            block_out_channels=(16, 32, 64, 64),
            num_attention_heads=(-1, -1, 1, 2),
            down_num_layers_per_block=(1, 1, 1, 1),
            up_num_layers_per_block=(1, 1, 1, 1),
            down_blocks_repeat_mappers=(1, 1, 1, 1),
            up_blocks_repeat_mappers=(1, 1, 1, 1),
            block_types_per_layer=(
                ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
                ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
                ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
                ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
            ),
            switch_level=None,
            effnet_in_channels=16,
            clip_text_pooled_in_channels=hidden,
            dropout=(0.0, 0.0, 0.0, 0.0),
        ),
        _f32(),
        seed + 2,
    )
    vqgan = _made(
        lambda: PaellaVQModel(bottleneck_blocks=1, embed_dim=32, num_vq_embeddings=16),
        _f32(),
        seed + 3,
    )
    _save(
        StableCascadeDecoderPipeline(
            decoder=decoder,
            tokenizer=tok,
            text_encoder=text_encoder,
            scheduler=DDPMWuerstchenScheduler(),
            vqgan=vqgan,
            latent_dim_scale=4.0,
        ),
        path / "decoder",
    )
    # diffusers keeps PaellaVQModel in its deprecated Wuerstchen package, which
    # save_pretrained's "diffusers" does not reach; its module path does (once imported).
    index_file = path / "decoder" / "model_index.json"
    index = json.loads(index_file.read_text())
    index["vqgan"] = [PaellaVQModel.__module__, "PaellaVQModel"]
    index_file.write_text(json.dumps(index, indent=2))
    return path


def build_pixart_sigma(path: Path, *, seed: int = 0) -> Path:
    """PixArtSigmaPipeline: T5 encoder, PixArt transformer, AutoencoderKL (the scalable
    fixture at its tiny size, 128-pixel images)."""
    return scalable_pixart_sigma(path, size=Size(head_dim=8, image=128), seed=seed)
