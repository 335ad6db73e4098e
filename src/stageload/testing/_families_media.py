"""Tiny video and audio pipelines for :mod:`stageload.testing.families`: Stable Video
Diffusion, LTX-Video (text- and image-to-video from one folder) and AudioLDM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._components import _made, _t5_config
from ._families_image import _f32
from ._tokenizers import _train_bpe, t5_tokenizer
from .diffusers import Size, _save


def build_svd(path: Path, *, seed: int = 0) -> Path:
    """StableVideoDiffusionPipeline: CLIP image encoder, spatio-temporal UNet, temporal VAE.
    It encodes the input image twice before denoising: CLIP, then ``vae.encode``."""
    from diffusers import (
        AutoencoderKLTemporalDecoder,
        EulerDiscreteScheduler,
        StableVideoDiffusionPipeline,
        UNetSpatioTemporalConditionModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    unet = _made(
        lambda: UNetSpatioTemporalConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            sample_size=16,
            in_channels=8,
            out_channels=4,
            down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
            up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
            cross_attention_dim=32,
            num_attention_heads=(2, 4),
            projection_class_embeddings_input_dim=3 * 16,
            addition_time_embed_dim=16,
        ),
        _f32(),
        seed,
    )
    vae = _made(
        lambda: AutoencoderKLTemporalDecoder(
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            layers_per_block=1,
            latent_channels=4,
        ),
        _f32(),
        seed + 1,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        intermediate_size=64,
        patch_size=4,
    )
    pipe = StableVideoDiffusionPipeline(
        vae=vae,
        image_encoder=_made(lambda: CLIPVisionModelWithProjection(vision), _f32(), seed + 2),
        unet=unet,
        scheduler=EulerDiscreteScheduler(
            beta_schedule="scaled_linear",
            interpolation_type="linear",
            prediction_type="v_prediction",
            sigma_max=700.0,
            sigma_min=0.002,
            steps_offset=1,
            timestep_spacing="leading",
            timestep_type="continuous",
            use_karras_sigmas=True,
        ),
        feature_extractor=CLIPImageProcessor(crop_size=32, size=32),
    )
    return _save(pipe, path)


def build_ltx(path: Path, *, seed: int = 0) -> Path:
    """LTXPipeline parts (T5, LTX transformer, LTX VAE); the folder also loads as
    LTXImageToVideoPipeline. The VAE's ``latents_mean``/``latents_std`` are buffers that
    the pipeline reads before it decodes."""
    import torch
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from transformers import T5EncoderModel

    tok = t5_tokenizer()
    transformer = _made(
        lambda: LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=4,
            attention_head_dim=8,
            cross_attention_dim=32,
            num_layers=2,
            caption_channels=32,
        ),
        _f32(),
        seed,
    )
    vae = _made(
        lambda: AutoencoderKLLTXVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=8,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False, False, False, False, False),
            upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1),
            timestep_conditioning=False,
            patch_size=1,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        ),
        _f32(),
        seed + 1,
    )
    # Checkpoint statistics, not the zeros and ones of a fresh VAE: a placeholder that
    # answered the read from its empty build would give a different video.
    gen = torch.Generator().manual_seed(seed + 2)
    vae.latents_mean.copy_(torch.randn(vae.latents_mean.shape, generator=gen) * 0.1)
    vae.latents_std.copy_(1.0 + torch.rand(vae.latents_std.shape, generator=gen))
    text_encoder = _made(lambda: T5EncoderModel(_t5_config(Size(), tok)), _f32(), seed + 3)
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )
    return _save(pipe, path)


def _roberta_tokenizer() -> Any:
    from transformers import RobertaTokenizer

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    vocab, merges = _train_bpe(specials)
    return RobertaTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def build_audioldm2(path: Path, *, seed: int = 0) -> Path:
    """AudioLDM2Pipeline: CLAP (``get_text_features``), T5, a projection, GPT-2 (run token
    by token), the AudioLDM2 UNet, a VAE and a HiFi-GAN vocoder."""
    from diffusers import AudioLDM2Pipeline, AudioLDM2UNet2DConditionModel, AutoencoderKL
    from diffusers.pipelines.audioldm2 import AudioLDM2ProjectionModel
    from transformers import (
        ClapConfig,
        ClapFeatureExtractor,
        ClapModel,
        GPT2Config,
        GPT2LMHeadModel,
        SpeechT5HifiGan,
        SpeechT5HifiGanConfig,
        T5EncoderModel,
    )

    tok, tok_2 = _roberta_tokenizer(), t5_tokenizer(max_length=77)
    clap = ClapConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "max_position_embeddings": 80,
            "projection_dim": 16,
            "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
        },
        audio_config={
            "spec_size": 8,
            "window_size": 4,
            "num_mel_bins": 8,
            "intermediate_size": 37,
            "depths": [1, 1],
            "num_attention_heads": [1, 1],
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "patch_embeds_hidden_size": 16,
            "projection_dim": 16,
            "patch_size": 2,
            "patch_stride": 2,
            "patch_embed_input_channels": 4,
        },
        projection_dim=16,
    )
    gpt2 = GPT2Config(n_embd=16, n_head=1, n_layer=2, vocab_size=64, n_ctx=99, n_positions=99)
    language_model = _made(lambda: GPT2LMHeadModel(gpt2), _f32(), seed + 2)
    language_model.config.max_new_tokens = 4
    vocoder = SpeechT5HifiGanConfig(
        model_in_dim=8,
        sampling_rate=16000,
        upsample_initial_channel=16,
        upsample_rates=[2, 2],
        upsample_kernel_sizes=[4, 4],
        resblock_kernel_sizes=[3, 7],
        resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
        normalize_before=False,
    )
    pipe = AudioLDM2Pipeline(
        vae=_made(
            lambda: AutoencoderKL(
                block_out_channels=(8, 16),
                in_channels=1,
                out_channels=1,
                norm_num_groups=8,
                down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2,
                latent_channels=4,
            ),
            _f32(),
            seed,
        ),
        text_encoder=_made(lambda: ClapModel(clap), _f32(), seed + 1),
        text_encoder_2=_made(lambda: T5EncoderModel(_t5_config(Size(), tok_2)), _f32(), seed + 3),
        projection_model=_made(
            lambda: AudioLDM2ProjectionModel(
                text_encoder_dim=16, text_encoder_1_dim=32, langauge_model_dim=16
            ),
            _f32(),
            seed + 4,
        ),
        language_model=language_model,
        tokenizer=tok,
        tokenizer_2=tok_2,
        feature_extractor=ClapFeatureExtractor(),
        unet=_made(
            lambda: AudioLDM2UNet2DConditionModel(
                block_out_channels=(8, 16),
                layers_per_block=1,
                norm_num_groups=8,
                sample_size=32,
                in_channels=4,
                out_channels=4,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                cross_attention_dim=(8, 16),
            ),
            _f32(),
            seed + 5,
        ),
        scheduler=_ddim_audio(),
        vocoder=_made(lambda: SpeechT5HifiGan(vocoder), _f32(), seed + 6),
    )
    return _save(pipe, path)


def _ddim_audio() -> Any:
    from diffusers import DDIMScheduler

    return DDIMScheduler(beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False)
