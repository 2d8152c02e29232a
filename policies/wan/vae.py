"""The Wan video VAE (diffusers' ``AutoencoderKLWan``), as both families run it.

- the configs and latent statistics of the Wan2.1 VAE (16 channels, 8x; DreamZero's 14B) and the Wan2.2 VAE
  (48 channels, 16x; upstream ``WanVideoVAE38``: DreamZero's 5B and LingBot-VA), which diffusers builds with
  ``is_residual=True, patch_size=2``;
- :class:`VideoVAE`: whole-video encode / decode returning normalized latents, with upstream DreamZero's RMS-norm
  rounding (:class:`UpstreamRMSNorm`). DreamZero encodes every window start this way;
- :class:`StreamingEncoder`: the encoder with its causal-conv feature cache carried across calls, one per session
  and camera stream (upstream LingBot-VA's ``WanVAEStreamingWrapper``), over diffusers' module as it is.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanRMS_norm, patchify
from torch import Tensor, nn

# Per-channel statistics of Wan2.1 VAE latents (upstream `WanVideoVAE.mean` / `.std`); kept unformatted (fmt: off):
# rows of numbers read and compare against upstream better aligned than one per line.
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

# Per-channel statistics of Wan2.2 VAE latents (upstream `WanVideoVAE38.mean` / `.std`); unformatted for the same reason:
# eight to a row, as upstream lists them, to read and compare against it.
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
        # diffusers' Wan VAE keeps its causal feature cache on the module (clear_cache, _enc_feat_map): one encode at a
        # time, whichever thread (the engine's encoder thread encodes window starts beside the batched re-encode).
        # Decodes (the recorder's thread) use a view of the same modules with a cache of its own (`_decoder`), one
        # decode at a time: they never wait for an encode.
        self._lock = threading.Lock()
        self._decode_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles get a lock of their own
        state = dict(self.__dict__)
        state.pop("_lock", None)
        state.pop("_decode_lock", None)
        state.pop("_decoding", None)  # made again on first use, over the copy's own modules
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()
        self._decode_lock = threading.Lock()

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
        with self._decode_lock:
            return self._decoder().decode(latents * std + mean).sample

    def _decoder(self) -> AutoencoderKLWan:
        """``model`` with a causal cache of its own: the same submodules and weights (a shallow copy shares them; not
        a registered submodule, so no second copy in the state dict), its own ``clear_cache`` state. A decode then
        never waits for an encode nor disturbs one."""
        source, view = self.__dict__.get("_decoding", (None, None))
        if source is not self.model:
            view = copy.copy(self.model)
            self.__dict__["_decoding"] = (self.model, view)
        view.training = self.model.training
        return view


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


@dataclass
class StreamingEncoder:
    """The VAE encoder with its causal-conv feature cache carried across calls (upstream ``WanVAEStreamingWrapper``)."""

    vae: AutoencoderKLWan
    feat_cache: list = field(default_factory=list)

    def clear(self) -> None:
        self.feat_cache = [None] * sum(isinstance(m, WanCausalConv3d) for m in self.vae.encoder.modules())

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        if not self.feat_cache:
            self.clear()
        if self.vae.config.patch_size is not None:
            video = patchify(video, self.vae.config.patch_size)
        return self.vae.quant_conv(self.vae.encoder(video, feat_cache=self.feat_cache, feat_idx=[0]))
