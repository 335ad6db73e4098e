"""Weights and small component configs shared by the diffusers fixture builders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class Size:
    """How big the large models are: ``hidden`` width and ``layers`` of the text encoder
    and the denoiser. Attention heads are ``hidden // head_dim``."""

    hidden: int = 32
    layers: int = 2
    head_dim: int = 16
    image: int = 64  # default image side the fixture is meant to run at, pixels

    @classmethod
    def tiny(cls) -> Size:
        """About a megabyte per model: for unit tests."""
        return cls()

    @classmethod
    def for_bytes(cls, model_bytes: int, *, bytes_per_param: int = 2, head_dim: int = 128) -> Size:
        """A size whose text encoder and denoiser each hold about ``model_bytes``.

        Both are stacks of ~13 hidden**2 parameters per layer (attention plus a 3x MLP),
        so the hidden width is chosen for a layer count near 16-28.
        """
        params = model_bytes / bytes_per_param
        for hidden in (256, 512, 768, 1024, 1536, 2048, 3072, 4096):
            layers = round(params / (13 * hidden * hidden))
            if layers <= 28:
                return cls(hidden=hidden, layers=max(1, layers), head_dim=min(head_dim, hidden))
        return cls(
            hidden=4096, layers=max(1, round(params / (13 * 4096 * 4096))), head_dim=head_dim
        )

    @property
    def heads(self) -> int:
        return max(1, self.hidden // self.head_dim)


# --- weights -------------------------------------------------------------------------------


def fill_random(module: nn.Module, seed: int, *, std: float = 0.02) -> nn.Module:
    """Overwrite every parameter with seeded values: weights ~ N(0, std), biases 0, and
    1-D norm scales 1, so activations stay finite in any depth (random init of real
    models is slow and some leave parameters unset). Buffers keep their computed values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                param.zero_()
            elif param.ndim == 1 and "norm" in name:
                # Zero-centred norms (weight + 1) take 0; ordinary ones take 1.
                param.fill_(0.0 if "ZeroCenter" in _owner_class(module, name) else 1.0)
            else:
                # Draw in float32 chunk by chunk: one draw per parameter would need a float32
                # copy of the largest matrix, and the result must not depend on the dtype.
                flat = param.view(-1)
                step = 1 << 24
                for start in range(0, flat.numel(), step):
                    chunk = torch.randn(min(step, flat.numel() - start), generator=gen) * std
                    flat[start : start + chunk.numel()] = chunk.to(param.dtype)
    return module


def _owner_class(module: nn.Module, param_name: str) -> str:
    owner = module.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else module
    return type(owner).__name__


def _empty(factory: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    """Build a model without running its (slow, RNG-consuming) initialisation, allocating
    its parameters in ``dtype`` directly (a 3 GB bf16 model never exists in float32)."""
    import torch

    with torch.device("meta"):
        model = factory()
    twins: dict[int, torch.nn.Parameter] = {}  # tied parameters stay one parameter
    for sub in model.modules():
        for key, param in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            if not param.is_floating_point():
                continue
            if id(param) not in twins:
                meta = torch.empty_like(param, dtype=dtype)
                twins[id(param)] = torch.nn.Parameter(meta, requires_grad=param.requires_grad)
            setattr(sub, key, twins[id(param)])
    return model.to_empty(device="cpu")


def _made(factory: Callable[[], nn.Module], dtype: torch.dtype, seed: int) -> nn.Module:
    model = _empty(factory, dtype)
    if hasattr(model, "tie_weights"):  # re-tie what the config ties, whatever to_empty() did
        model.tie_weights()
    # Buffers computed in __init__ (rotary frequencies) were lost on meta: recompute them.
    fresh_buffers = _cpu_buffers(factory)
    for name, buf in model.named_buffers():
        if name in fresh_buffers:
            buf.copy_(fresh_buffers[name].to(buf.dtype))
    return fill_random(model, seed).eval()


def _cpu_buffers(factory: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    """Buffers of a freshly built model, built with parameters on meta (cheap)."""
    from accelerate import init_empty_weights

    from ..external import BUILD_LOCK

    with BUILD_LOCK, init_empty_weights(include_buffers=False):
        model = factory()
    return dict(model.named_buffers())


# --- component configs ---------------------------------------------------------------------


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Split ``head_dim`` over (frame, height, width) rotary axes, each even."""
    frame = max(2, (head_dim // 8) // 2 * 2)
    rest = head_dim - frame
    height = rest // 2 // 2 * 2
    return (frame, height, rest - height)


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's multimodal rotary split of head_dim // 2 over (t, h, w)."""
    half = head_dim // 2
    t = half - 2 * (3 * half // 8)
    return [t, 3 * half // 8, 3 * half // 8]


def _clip_config(size: Size, tokenizer: Any, *, hidden: int, projection: int | None = None) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=max(1, size.layers // 2),
        num_attention_heads=max(1, hidden // size.head_dim),
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection or hidden,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|startoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )


def _t5_config(size: Size, tokenizer: Any, *, umt5: bool = False) -> Any:
    from transformers import T5Config, UMT5Config

    config_cls = UMT5Config if umt5 else T5Config
    h = size.hidden
    return config_cls(
        vocab_size=len(tokenizer),
        d_model=h,
        d_kv=size.head_dim,
        d_ff=3 * h,
        num_layers=size.layers,
        num_heads=size.heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def _kl_vae(latent_channels: int, *, seed: int, dtype: torch.dtype, levels: int = 2) -> nn.Module:
    from diffusers import AutoencoderKL

    return _made(
        lambda: AutoencoderKL(
            block_out_channels=(8,) * levels,
            down_block_types=("DownEncoderBlock2D",) * levels,
            up_block_types=("UpDecoderBlock2D",) * levels,
            latent_channels=latent_channels,
            norm_num_groups=4,
            layers_per_block=1,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        ),
        dtype,
        seed,
    )
