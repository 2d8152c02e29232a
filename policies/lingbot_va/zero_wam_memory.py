"""Zero-WAM's memory plan on one GPU at full size (``scripts/memory_plan.py``): weights, each session's cache, activations.

Counted from what upstream's server keeps in its cache (``wan_va/wan_va_server.py``, ``icl_model.py``), token by
token, so the plan does not depend on how pages are cut:

* weights: the served transformer (:func:`~ardiff_policies.lingbot_va.zero_wam_model.parameter_count`: 9.41 B of
  the file's 10.79 B; the multi-chunk heads and the Conv3d copy are dropped on load), UMT5-XXL, the Wan2.2 VAE;
* per session: its in-context block (the demonstration, at most :attr:`ZeroWAMGeometry.max_demonstration_frames`
  latent frames, in the conditional half only), the observation window (``attn_window // 2`` chunks of video and
  actions; with CFG the video twice, once per half, the actions once: upstream writes the action history to the
  conditional half only), the predicted chunk's video (per half), and its prompt's cross-attention K/V (512 text
  positions per half);
* activations: the largest forward, the reset's (the demonstration's tokens over themselves) or a video step's
  (both halves' chunk over the whole cache), by ``policies/wan/memory.py``'s rule; UMT5 over 512 tokens; the VAE
  encode of a chunk's key frames;
* the CUDA reserve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ardiff_policies.lingbot_va.memory import LingBotVAPlan
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.wan.memory import CUDA_RESERVE_BYTES, encoder_bytes, itemsize, module_size, transformer_forward_bytes, vae_chunk_bytes
from ardiff_policies.wan.text import UMT5_XXL_ENCODER_CONFIG, TextEncoder
from ardiff_policies.wan.vae import WAN22_VAE_CONFIG

TEXT_LENGTH = 512


@dataclass(frozen=True)
class ZeroWAMGeometry:
    """What sizes a Zero-WAM session: upstream's RoboTwin serving defaults (docs/icl_inference.md §3: three 224x288
    cameras side by side, 2-frame chunks of 16 actions, ICL CFG on) and a bound on demonstrations."""

    name: str
    cameras: int = 3
    height: int = 224
    width: int = 288
    frame_chunk_size: int = 2
    action_per_frame: int = 16
    cfg: bool = True  # upstream's default icl_guidance_scale 5: both halves
    # Demonstrations: human video resized to 320x480 (latents 20x30), at most this many latent frames (4 video frames
    # each at 12 fps: 32 -> 125 frames, 10.4 s). A serving bound, not upstream's (upstream has none).
    demonstration_height: int = 320
    demonstration_width: int = 480
    max_demonstration_frames: int = 32

    @property
    def video_tokens_per_chunk(self) -> int:
        return self.frame_chunk_size * (self.height // 32) * (self.width // 32 * self.cameras)

    @property
    def action_tokens_per_chunk(self) -> int:
        return self.frame_chunk_size * self.action_per_frame

    @property
    def demonstration_tokens(self) -> int:
        return self.max_demonstration_frames * (self.demonstration_height // 32) * (self.demonstration_width // 32)

    def cached_tokens(self, attn_window: int) -> dict[str, int]:
        """Tokens a session's cache holds at most, by kind (upstream's cache types)."""
        halves = 2 if self.cfg else 1
        chunks = attn_window // 2  # video at frame id 2c, its actions at 2c + 1
        return {
            "in-context": self.demonstration_tokens,
            "observation": chunks * (halves * self.video_tokens_per_chunk + self.action_tokens_per_chunk),
            "prediction": halves * self.video_tokens_per_chunk,
        }


ROBOTWIN = ZeroWAMGeometry("RoboTwin (posttrain-robotwin)")
ROBOTWIN_NO_CFG = ZeroWAMGeometry("RoboTwin, icl_guidance_scale <= 1", cfg=False)


def weight_counts(cfg: ZeroWAMConfig) -> dict[str, int]:
    from diffusers import AutoencoderKLWan

    from ardiff_policies.lingbot_va.zero_wam_model import parameter_count

    with torch.device("meta"):
        encoders = {"text_encoder": TextEncoder.from_config(), "vae": AutoencoderKLWan(**WAN22_VAE_CONFIG)}
    return {"transformer": parameter_count(cfg)} | {name: module_size(module).floating for name, module in encoders.items()}


def plan(geometry: ZeroWAMGeometry, *, cfg: ZeroWAMConfig | None = None, dtype: torch.dtype = torch.bfloat16) -> LingBotVAPlan:
    cfg = cfg or ZeroWAMConfig()
    b = itemsize(dtype)
    base = cfg.base
    per_token = 2 * base.num_layers * base.dim * b  # K and V, every layer
    tokens = geometry.cached_tokens(cfg.attn_window)
    halves = 2 if geometry.cfg else 1
    cached = sum(tokens.values())
    step = transformer_forward_bytes(halves * geometry.video_tokens_per_chunk, base.dim, base.ffn_dim, cached, b)
    reset = transformer_forward_bytes(geometry.demonstration_tokens, base.dim, base.ffn_dim, geometry.demonstration_tokens, b)
    vae = WAN22_VAE_CONFIG
    frames = 4 * geometry.frame_chunk_size
    vae_bytes = geometry.cameras * vae_chunk_bytes(vae, geometry.height, geometry.width, vae["base_dim"]) + (
        geometry.cameras * 3 * frames * geometry.height * geometry.width * 4
    )
    text = UMT5_XXL_ENCODER_CONFIG
    text_bytes = 2 * encoder_bytes(TEXT_LENGTH, text["d_model"], text["d_ff"], text["num_heads"], b)
    return LingBotVAPlan(  # LingBot-VA's plan, read the same way; no pool pages are held apart from the sessions'
        geometry.name,
        {k: v * b for k, v in weight_counts(cfg).items()},
        kv_session=cached * per_token,
        text_session=halves * TEXT_LENGTH * per_token,
        kv_reserved=0,
        activations=max(step, reset, vae_bytes, text_bytes),
        reserve=CUDA_RESERVE_BYTES,
    )
