"""DreamZero's frozen conditioning encoders and the key maps from its checkpoint onto them.

DreamZero (Wan2.1-I2V) conditions its DiT on three frozen encoders. Each is a thin wrapper around
the library module that already implements it:

- `TextEncoder`: the UMT5-XXL encoder (`transformers.UMT5EncoderModel`).
- `ImageEncoder`: the open-CLIP XLM-RoBERTa ViT-H/14 visual tower
  (`transformers.CLIPVisionModelWithProjection`), read after its second-to-last block.
- `VideoVAE`: the Wan video VAE (`diffusers.AutoencoderKLWan`), returning normalized latents: the
  Wan2.1 VAE (16 channels, 8x) of the 14B, or the Wan2.2 VAE (48 channels, 16x; upstream
  `WanVideoVAE38`) of the 5B, which diffusers builds with `is_residual=True, patch_size=2`.

The released checkpoint stores these modules in upstream DreamZero naming; the key maps from those
names onto these wrappers live in `naming.py`.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm
from torch import Tensor, nn
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection, UMT5Config, UMT5EncoderModel
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

# Wan's `umt5-xxl` encoder (upstream `WanTextEncoder` defaults): per-layer relative position
# buckets (UMT5, not T5's shared table), gated tanh-GELU FFN, RMS norm eps 1e-6, no attention
# scaling. `feed_forward_proj="gated-gelu"` makes transformers pick `gelu_new`, the tanh
# approximation upstream's `GELU` computes. Dropout is off: the encoder is frozen.
UMT5_XXL_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.0,
}

# open-CLIP `xlm-roberta-large-vit-huge-14` visual tower: pre-norm ViT, exact (erf) GELU,
# LayerNorm eps 1e-5, class token, no patch-embedding bias, (1280 -> 1024) projection `head`.
CLIP_VIT_H_14_CONFIG: dict[str, Any] = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 14,
    "projection_dim": 1024,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "attention_dropout": 0.0,
}

# Per-channel statistics of Wan2.1 VAE latents (upstream `WanVideoVAE.mean` / `.std`).
# fmt: off
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)
# fmt: on

# Wan2.1 VAE (upstream `VideoVAE_` defaults and `WanVideoVAE` latent statistics).
WAN21_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": list(WAN21_LATENTS_MEAN),
    "latents_std": list(WAN21_LATENTS_STD),
}

# Per-channel statistics of Wan2.2 VAE latents (upstream `WanVideoVAE38.mean` / `.std`).
# fmt: off
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)
# fmt: on

# Wan2.2 VAE (upstream `VideoVAE38_` as `WanVideoVAE38(z_dim=48, dim=160)` builds it): residual down/up blocks with
# parameter-free shortcuts, a 2x2 pixel (un)shuffle around the networks (12 channels), a wider decoder (256).
WAN22_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "patch_size": 2,
    "in_channels": 12,
    "out_channels": 12,
    "scale_factor_spatial": 16,
    "latents_mean": list(WAN22_LATENTS_MEAN),
    "latents_std": list(WAN22_LATENTS_STD),
}

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ---------------------------------------------------------------------------------------------
# Encoders
# ---------------------------------------------------------------------------------------------


class TextEncoder(nn.Module):
    """UMT5 encoder; returns per-token embeddings with padded positions zeroed."""

    def __init__(self, model: UMT5EncoderModel) -> None:
        super().__init__()
        self.model = model

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None) -> TextEncoder:
        """Builds the encoder from `UMT5Config` fields; `cfg` overrides the UMT5-XXL defaults."""
        # Eager attention: upstream's T5Attention takes the softmax in float32 and casts the probabilities back to
        # the model dtype before multiplying with V, which transformers' eager path reproduces; its default (SDPA)
        # never rounds the probabilities, so in bf16 it differs.
        config = UMT5Config(**{**UMT5_XXL_ENCODER_CONFIG, **(cfg or {})}, attn_implementation="eager")
        return cls(UMT5EncoderModel(config)).eval().requires_grad_(False)

    @property
    def dim(self) -> int:
        return self.model.config.d_model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, L) token ids and mask -> (B, L, d_model) embeddings in the model's dtype."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # Upstream `encode_prompt` zeroes every position at or past the attended-token count;
        # the DiT cross-attends over all L positions, so these zeros are part of the condition.
        seq_lens = attention_mask.gt(0).sum(dim=1)
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        padded = positions[None, :] >= seq_lens[:, None]
        return hidden.masked_fill(padded[..., None], 0.0)


# transformers < 5 passes a required `causal_attention_mask` and returns a tuple; 5.x takes
# `(hidden_states, attention_mask)` and returns the hidden states.
_CLIP_LAYER_TAKES_CAUSAL_MASK = "causal_attention_mask" in inspect.signature(CLIPEncoderLayer.forward).parameters


def _run_clip_layer(layer: nn.Module, hidden: Tensor) -> Tensor:
    out = layer(hidden, None, None) if _CLIP_LAYER_TAKES_CAUSAL_MASK else layer(hidden, None)
    return out[0] if isinstance(out, tuple) else out


class ImageEncoder(nn.Module):
    """CLIP ViT visual tower; returns the tokens after all but its last block (upstream `use_31_block`)."""

    def __init__(self, model: CLIPVisionModelWithProjection) -> None:
        super().__init__()
        self.model = model
        # open-CLIP's contrastive temperature (upstream `log_scale`). Conditioning never reads it;
        # it is kept so that every checkpoint tensor has a home.
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None) -> ImageEncoder:
        """Builds the tower from `CLIPVisionConfig` fields; `cfg` overrides the ViT-H/14 defaults."""
        config = CLIPVisionConfig(**{**CLIP_VIT_H_14_CONFIG, **(cfg or {})})
        return cls(CLIPVisionModelWithProjection(config)).eval().requires_grad_(False)

    @property
    def image_size(self) -> int:
        return self.model.config.image_size

    @property
    def num_tokens(self) -> int:
        return 1 + (self.image_size // self.model.config.patch_size) ** 2

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @property
    def num_used_layers(self) -> int:
        """Blocks that run: all but the last. The last block, post-norm and projection are unused."""
        return self.model.config.num_hidden_layers - 1

    def rebuild_buffers(self, device: torch.device) -> None:
        """Recreate the non-persistent `position_ids` buffer after a meta-device load (it is not in
        any checkpoint; transformers derives it from the config)."""
        embeddings = self.model.vision_model.embeddings
        embeddings.position_ids = torch.arange(embeddings.num_positions, device=device).expand((1, -1))

    def forward(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) images in [-1, 1] -> (B, 1 + (image_size / patch)^2, hidden) tokens."""
        size = (self.image_size, self.image_size)
        pixels = F.interpolate(images, size=size, mode="bicubic", align_corners=False)
        # Upstream maps [-1, 1] to [0, 1], then applies torchvision's Normalize, whose mean/std
        # take the input's dtype.
        pixels = pixels * 0.5 + 0.5
        mean = torch.tensor(CLIP_MEAN, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        pixels = (pixels - mean) / std

        vision = self.model.vision_model
        hidden = vision.pre_layrnorm(vision.embeddings(pixels))
        for layer in vision.encoder.layers[: self.num_used_layers]:
            hidden = _run_clip_layer(layer, hidden)
        return hidden


class UpstreamRMSNorm(WanRMS_norm):
    """diffusers' `WanRMS_norm` computing upstream's `RMS_norm` formula (groot/vla/model/dreamzero/modules/
    wan_video_vae.py): `F.normalize(x) * scale * gamma + bias` in the input's dtype. diffusers normalizes a bf16 input
    in float32 and rounds it back; upstream's bf16 re-encode rounds at every step, and under CUDA autocast (its
    window-start encode) `F.normalize` returns float32, so the whole norm and the SiLU after it stay float32 until
    the next convolution. In float32 both formulas are the same operations: results are bit-identical."""

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1 if self.channel_first else -1) * self.scale * self.gamma + self.bias


class VideoVAE(nn.Module):
    """Wan2.1 or Wan2.2 video VAE; `encode` returns normalized posterior means like upstream's non-tiled encode."""

    def __init__(self, model: AutoencoderKLWan) -> None:
        super().__init__()
        check_vae_config(model.config)
        # Same parameters, upstream's rounding: the norms become `UpstreamRMSNorm` in place (no state is added).
        for module in model.modules():
            if type(module) is WanRMS_norm:
                module.__class__ = UpstreamRMSNorm
        self.model = model
        # diffusers' Wan VAE keeps its causal feature cache on the module (clear_cache, _enc_feat_map): one call at a
        # time, whichever thread (the engine's encoder thread encodes window starts beside the batched re-encode).
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles get a lock of their own
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None, base: Mapping[str, Any] = WAN21_VAE_CONFIG) -> VideoVAE:
        """Builds the VAE from `AutoencoderKLWan` config fields (e.g. a diffusers `vae/config.json`);
        `cfg` overrides `base` (the Wan2.1 VAE; `WAN22_VAE_CONFIG` for the Wan2.2 one)."""
        model = AutoencoderKLWan.from_config({**base, **(cfg or {})})
        return cls(model).eval().requires_grad_(False)

    @property
    def is_wan22(self) -> bool:
        return bool(self.model.config.is_residual)

    @property
    def latent_channels(self) -> int:
        return self.model.config.z_dim

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(bool(t) for t in self.model.config.temperal_downsample)

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent along H and W: 8 (Wan2.1), 16 (Wan2.2: the 2x2 patchify, then 8)."""
        return 2 ** (len(self.model.config.dim_mult) - 1) * (self.model.config.patch_size or 1)

    def encode(self, video: Tensor) -> Tensor:
        """(B, 3, 1 + 4k, H, W) video in [-1, 1] -> (B, z_dim, 1 + k, H/s, W/s) normalized latents
        (s = :attr:`spatial_compression`)."""
        if video.ndim != 5 or (video.shape[2] - 1) % 4 != 0:
            # The causal encoder consumes the first frame, then chunks of 4; a remainder would be
            # silently dropped.
            raise ValueError(f"expected video (B, C, 1 + 4k, H, W), got {tuple(video.shape)}")
        with self._lock:
            mu = self.model.encode(video).latent_dist.mean
        # Upstream keeps the statistics in fp32, inverts std there, and casts both to mu's dtype.
        config = self.model.config
        mean = torch.tensor(config.latents_mean, dtype=torch.float32, device=mu.device)
        inv_std = 1.0 / torch.tensor(config.latents_std, dtype=torch.float32, device=mu.device)
        shape = (1, -1, 1, 1, 1)
        return (mu - mean.to(mu.dtype).view(shape)) * inv_std.to(mu.dtype).view(shape)

    def decode(self, latents: Tensor) -> Tensor:
        """(B, z_dim, k, h, w) normalized latents -> (B, 3, 1 + 4 (k - 1), s h, s w) video in [-1, 1]
        (the inverse of :meth:`encode`'s normalization, then diffusers' causal decoder)."""
        config = self.model.config
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        with self._lock:
            return self.model.decode(latents * std + mean).sample


def check_vae_config(vae_config: Mapping[str, Any]) -> None:
    """The two layouts upstream builds: Wan2.1 (`VideoVAE_`) and Wan2.2 (`VideoVAE38_`)."""
    residual, patch = bool(vae_config.get("is_residual")), vae_config.get("patch_size")
    wan21 = not residual and patch is None
    wan22 = residual and patch == 2 and vae_config.get("in_channels") == vae_config.get("out_channels") == 12
    if not (wan21 or wan22):
        raise ValueError(
            f"VAE is_residual={residual}, patch_size={patch}, in_channels={vae_config.get('in_channels')}, "
            f"out_channels={vae_config.get('out_channels')} is neither the Wan2.1 layout (is_residual=False, patch_size=None) "
            "nor the Wan2.2 one (is_residual=True, patch_size=2, in/out_channels=12)"
        )
    if vae_config.get("attn_scales"):
        # diffusers' Wan decoder has no per-level attention blocks, so upstream's would have no home.
        raise ValueError("Wan VAE attn_scales must be empty")
