"""Zero-WAM's memory plan on one GPU at full size (``scripts/memory_plan.py``): weights, each session's cache, activations.

What the server reserves, from the KV spec it serves with (:func:`~ardiff_policies.lingbot_va.zero_wam_episode.kv_spec`):

* weights: the served transformer (:func:`~ardiff_policies.lingbot_va.zero_wam_model.parameter_count`: 9.41 B of
  the file's 10.79 B; the multi-chunk heads and the Conv3d copy are dropped on load), UMT5-XXL, the Wan2.2 VAE;
* per session (``KVSpec.reservation``): the conditional branch's pinned block (a demonstration of at most
  ``max_demonstration_frames`` latent frames) and its window (``attn_window // 2`` chunks of video and actions), the
  unconditional branch's window (video only: upstream writes the action history to the conditional half only), each
  with a chunk's observation or a second prediction on top; both branches always (guidance is decided per episode);
  and the prompt's cross-attention K/V (512 text positions per half);
* the pool's reserved pages: the forward's scratch per batch slot and branch and, for batches, the undo headroom;
* activations: the largest forward, the reset's (the demonstration's tokens over themselves) or a video step's
  (both halves' chunk over the whole cache), by ``policies/wan/memory.py``'s rule; UMT5 over 512 tokens; the VAE
  encode of a chunk's key frames;
* the CUDA reserve.

:meth:`ZeroWAMGeometry.cached_tokens` counts what upstream's own cache holds at most, token by token, beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ardiff_kv import PagedKVCache
from ardiff_policies.lingbot_va.embodiments import ZERO_WAM_ROBOTWIN, Embodiment
from ardiff_policies.lingbot_va.episode_io import TEXT_LENGTH
from ardiff_policies.lingbot_va.memory import LingBotVAPlan
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.lingbot_va.zero_wam_demonstration import DemonstrationGeometry
from ardiff_policies.wan.memory import CUDA_RESERVE_BYTES, encoder_bytes, itemsize, module_size, transformer_forward_bytes, vae_chunk_bytes
from ardiff_policies.wan.text import UMT5_XXL_ENCODER_CONFIG, TextEncoder
from ardiff_policies.wan.vae import WAN22_VAE_CONFIG


@dataclass(frozen=True)
class ZeroWAMGeometry:
    """What sizes a Zero-WAM session: the embodiment (RoboTwin: three 224x288 cameras side by side, 2-frame chunks of
    16 actions) and the demonstrations' bound (``policy.max_demonstration_frames``)."""

    name: str
    embodiment: Embodiment = ZERO_WAM_ROBOTWIN
    demonstrations: DemonstrationGeometry = field(default_factory=DemonstrationGeometry)

    @property
    def video_tokens_per_chunk(self) -> int:
        return self.embodiment.video_tokens_per_chunk

    @property
    def action_tokens_per_chunk(self) -> int:
        return self.embodiment.action_tokens_per_chunk

    @property
    def demonstration_tokens(self) -> int:
        return self.demonstrations.max_tokens

    def cached_tokens(self, attn_window: int, *, cfg: bool = True) -> dict[str, int]:
        """Tokens upstream's cache holds at most, by kind (its cache types), with ICL CFG (both halves) or one half."""
        halves = 2 if cfg else 1
        chunks = attn_window // 2  # video at frame id 2c, its actions at 2c + 1
        return {
            "in-context": self.demonstration_tokens,
            "observation": chunks * (halves * self.video_tokens_per_chunk + self.action_tokens_per_chunk),
            "prediction": halves * self.video_tokens_per_chunk,
        }


ROBOTWIN = ZeroWAMGeometry("RoboTwin (posttrain-robotwin)")
ROBOTWIN_SHORT = ZeroWAMGeometry("RoboTwin, max_demonstration_frames 16", demonstrations=DemonstrationGeometry(max_frames=16))


def weight_counts(cfg: ZeroWAMConfig) -> dict[str, int]:
    from diffusers import AutoencoderKLWan

    from ardiff_policies.lingbot_va.zero_wam_model import parameter_count

    with torch.device("meta"):
        encoders = {"text_encoder": TextEncoder.from_config(), "vae": AutoencoderKLWan(**WAN22_VAE_CONFIG)}
    return {"transformer": parameter_count(cfg)} | {name: module_size(module).floating for name, module in encoders.items()}


def plan(
    geometry: ZeroWAMGeometry = ROBOTWIN, *, cfg: ZeroWAMConfig | None = None, dtype: torch.dtype = torch.bfloat16, max_batch: int = 1
) -> LingBotVAPlan:
    from ardiff_policies.lingbot_va.zero_wam_episode import kv_spec

    cfg = cfg or ZeroWAMConfig()
    b = itemsize(dtype)
    base = cfg.base
    spec = kv_spec(geometry.embodiment, cfg, geometry.demonstrations, dtype)
    per_token = spec.token_bytes
    cached = spec.reservation(2) * spec.page_size
    step = max_batch * transformer_forward_bytes(2 * geometry.video_tokens_per_chunk, base.dim, base.ffn_dim, cached, b)
    reset = transformer_forward_bytes(geometry.demonstration_tokens, base.dim, base.ffn_dim, geometry.demonstration_tokens, b)
    e, vae = geometry.embodiment, WAN22_VAE_CONFIG
    frames = 4 * e.frame_chunk_size
    cameras = len(e.cameras)
    vae_bytes = max_batch * (cameras * vae_chunk_bytes(vae, e.height, e.width, vae["base_dim"]) + cameras * 3 * frames * e.height * e.width * 4)
    text = UMT5_XXL_ENCODER_CONFIG
    text_bytes = encoder_bytes(TEXT_LENGTH, text["d_model"], text["d_ff"], text["num_heads"], b)
    return LingBotVAPlan(  # LingBot-VA's plan, read the same way
        geometry.name,
        {k: v * b for k, v in weight_counts(cfg).items()},
        spec.reservation(2) * spec.page_bytes,
        2 * TEXT_LENGTH * per_token,
        PagedKVCache.reserved_pages(spec, 2, max_batch) * spec.page_bytes,
        max(step, reset, vae_bytes, text_bytes),
        CUDA_RESERVE_BYTES,
    )


def describe_loaded(episodes, max_sessions: int) -> str:
    """The start-up log's plan for the model as loaded (its real parameter counts, any size): weights per component,
    one session's reserved pages (its pinned block counted) and prompt K/V, and what ``max_sessions`` of them take."""
    from ardiff_kv import Branch
    from ardiff_policies.lingbot_va.memory import describe_session_plan

    spec = episodes.kv_spec()
    detail = f"{spec.pages_for(Branch.COND)} + {spec.pages_for(Branch.UNCOND)} pages, {spec.max_pinned_pages} of them the pinned demonstration,"
    text_session = 2 * TEXT_LENGTH * spec.token_bytes
    return describe_session_plan(episodes, "zero_wam", "both CFG branches", spec.reservation(2), detail, text_session, max_sessions)
