"""LingBot-VA's memory plan on one GPU: weights, each session's KV and prompt K/V, activations (``scripts/memory_plan.py``).

* weights: the transformer (upstream's ``WanTransformer3DModel``, the released 5B geometry), UMT5-XXL and the Wan2.2
  VAE, built on the meta device (exact parameter counts), in the engine dtype;
* per session: its KV window in both CFG branches (``policy.kv_spec``: upstream's ``attn_window // 2`` chunks of video +
  action tokens) and its prompt's cross-attention K/V (every layer, [prompt, negative] x 512 positions), which the
  session keeps beside its pages;
* the pool's reserved pages: the forward's scratch (the chunk's own K/V beside the window, per batch slot and branch)
  and, for batches of more than one, the undo headroom a member-by-member retry needs (``PagedKVCache.reserved_pages``);
* activations: the largest forward (a video chunk of both CFG rows over the full window), by the rule of
  ``policies/wan/memory.py`` (its per-token tensor counts and the measured VAE constant), for ``max_batch``
  sessions per forward; the streaming VAE encode of a chunk's key frames; UMT5 over 512 tokens;
* the CUDA reserve (workspaces, fragmentation), as DreamZero's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ardiff_kv import PagedKVCache
from ardiff_policies.lingbot_va.checkpoint import TransformerConfig
from ardiff_policies.lingbot_va.embodiments import Embodiment
from ardiff_policies.lingbot_va.episode import LingBotVAEpisodes, kv_spec
from ardiff_policies.lingbot_va.episode_io import TEXT_LENGTH
from ardiff_policies.wan.memory import CUDA_RESERVE_BYTES, encoder_bytes, itemsize, module_size, transformer_forward_bytes, vae_chunk_bytes
from ardiff_policies.wan.text import UMT5_XXL_ENCODER_CONFIG, TextEncoder
from ardiff_policies.wan.vae import WAN22_VAE_CONFIG

RELEASED = TransformerConfig()  # the released 5B's sizes (the class defaults)


@dataclass(frozen=True)
class LingBotVAPlan:
    name: str
    weights: dict[str, int]  # component -> bytes
    kv_session: int  # one session's pages, both branches
    text_session: int  # one session's prompt K/V
    kv_reserved: int  # pool pages no session holds: scratch and undo headroom
    activations: int
    reserve: int

    @property
    def per_session(self) -> int:
        return self.kv_session + self.text_session

    @property
    def fixed(self) -> int:
        return sum(self.weights.values()) + self.kv_reserved + self.activations + self.reserve

    def total(self, sessions: int = 1) -> int:
        return self.fixed + sessions * self.per_session

    def sessions_on(self, card_bytes: int) -> int:
        return max(0, (card_bytes - self.fixed) // self.per_session)


def weight_counts(cfg: TransformerConfig = RELEASED) -> dict[str, int]:
    """Floating-point parameters and buffers per component (meta device)."""
    from diffusers import AutoencoderKLWan

    from ardiff_policies.lingbot_va.model import LingBotVATransformer

    with torch.device("meta"):
        modules = {"transformer": LingBotVATransformer(cfg), "text_encoder": TextEncoder.from_config(), "vae": AutoencoderKLWan(**WAN22_VAE_CONFIG)}
    counts = {name: module_size(module).floating for name, module in modules.items()}
    # upstream's checkpoint also holds the action embedder's unused copy of the text projection (loaded, never run)
    counts["transformer"] += 2 * cfg.text_dim * cfg.dim + cfg.dim * cfg.dim + 2 * cfg.dim
    return counts


def plan(
    name: str, embodiment: Embodiment, *, dtype: torch.dtype = torch.bfloat16, max_batch: int = 1, cfg: TransformerConfig = RELEASED
) -> LingBotVAPlan:
    b = itemsize(dtype)
    branches = 2 if (embodiment.guidance_scale > 1 or embodiment.action_guidance_scale > 1) else 1
    spec = kv_spec(embodiment, cfg, dtype)
    kv_session = branches * spec.pages_per_branch * spec.page_bytes
    text_session = cfg.num_layers * 2 * branches * TEXT_LENGTH * cfg.dim * b

    rows = 2 * max_batch  # CFG rows per forward
    window = spec.block_table_width * spec.page_size
    transformer = rows * transformer_forward_bytes(embodiment.video_tokens_per_chunk, cfg.dim, cfg.ffn_dim, window, b)

    vae = WAN22_VAE_CONFIG
    frames = 4 * embodiment.frame_chunk_size  # a later chunk's key frames, per camera
    h, w = embodiment.height, embodiment.width
    cameras = 1 if embodiment.layout == "robotwin_tshape" else len(embodiment.cameras)  # Franka: one batch of three
    vae_bytes = max_batch * (cameras * vae_chunk_bytes(vae, h, w, vae["base_dim"]) + len(embodiment.cameras) * 3 * frames * h * w * 4)

    text = UMT5_XXL_ENCODER_CONFIG  # the prompt and the negative ""
    text_bytes = 2 * encoder_bytes(TEXT_LENGTH, text["d_model"], text["d_ff"], text["num_heads"], b)

    counts = weight_counts(cfg)
    return LingBotVAPlan(
        name,
        {k: v * b for k, v in counts.items()},
        kv_session,
        text_session,
        PagedKVCache.reserved_pages(spec, branches, max_batch) * spec.page_bytes,
        max(transformer, vae_bytes, text_bytes),
        CUDA_RESERVE_BYTES,
    )


def describe_loaded(episodes: LingBotVAEpisodes, max_sessions: int) -> str:
    """The start-up log's plan for the model as loaded (its real parameter counts, any size): weights per component,
    one session's KV pages and prompt K/V, and what ``max_sessions`` of them take. The engine's pool line follows it."""
    branches = len(episodes.branches)
    spec = episodes.kv_spec()
    cfg = episodes.transformer.config
    kv_pages = f"{spec.pages_per_branch} pages x {branches} branch(es)"
    text_session = cfg.num_layers * 2 * branches * TEXT_LENGTH * cfg.dim * itemsize(episodes.dtype)
    return describe_session_plan(
        episodes, "lingbot_va", f"{branches} CFG branch(es)", spec.reservation(branches), kv_pages, text_session, max_sessions
    )


def describe_session_plan(episodes, policy: str, branches: str, kv_pages: int, kv_detail: str, text_session: int, max_sessions: int) -> str:
    """The start-up log's plan of a LingBot-VA family policy as loaded: weights per component, then one session's
    ``kv_pages`` reserved (said as ``kv_detail``) and prompt K/V ``text_session``, and ``max_sessions`` of them."""
    b = itemsize(episodes.dtype)
    modules = {"transformer": episodes.transformer, "text encoder": episodes.text_encoder, "VAE": episodes.vae}
    weights = {name: module_size(module).floating * b for name, module in modules.items()}
    kv_session = kv_pages * episodes.kv_spec().page_bytes
    lines = [f"memory plan: {policy} on {episodes.device} ({str(episodes.dtype).removeprefix('torch.')}), {branches}"]
    lines += [f"    {name + ' weights':<24}{_size(size):>11}" for name, size in weights.items()]
    lines.append(
        f"    {'a session':<24}{_size(kv_session + text_session):>11}  (KV {kv_detail} of {_size(episodes.kv_spec().page_bytes)} "
        f"+ prompt K/V {_size(text_session)}); engine.max_sessions {max_sessions}: {_size(max_sessions * (kv_session + text_session))}"
    )
    return "\n".join(lines)


def _size(value: int) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 0.1 * 2**30 else f"{value / 2**20:.1f} MiB"
