"""DreamZero's causal Wan DiT with the action register, in one file.

Structure and parameter names follow upstream ``CausalWanModel``
(dreamzero0/dreamzero ``groot/vla/model/dreamzero/modules/wan_video_dit_action_casual_chunk.py``)
so the released checkpoint's ``action_head.model.*`` tensors load unchanged:

* Wan2.1 I2V backbone (14B): 3-D patch embedding of ``[noisy latents | image conditioning]``,
  sinusoidal time embedding with 6-way modulation per block, self-attention with q/k RMSNorm
  and 3-D RoPE, cross-attention over text (+ 257 CLIP image tokens for I2V), tanh-GELU FFN,
  modulated head, unpatchify.
* Wan2.2 TI2V backbone (5B, ``model_type="ti2v"``, ``concat_first_frame_latent=False``): the same
  network on the noisy latents alone (48 channels in and out); the first frame conditions it
  only through the CLIP image tokens in the cross-attention context, as in upstream.
* Action register: 24 action tokens and 1 state token appended after the video tokens, with
  their own RoPE tables (advanced by one block per chunk) and their own timesteps. Encoders and
  decoder are category-specific MLPs with one embodiment slot (category 0 always).

Inference only. Self-attention K/V come from the caller per layer (``self_kv``):

* :class:`ardiff_kv.PagedLayerInputs` — the paged cache (serving path): the layer writes its current
  K/V into pages and attends over the block table in one custom op;
* :class:`ardiff_kv.DenseLayerKV` — upstream's concat-and-slice cache, the reference for parity;
* ``None`` — full attention over the tokens of this call (no cache).

Cross-attention K/V are projected once per session/window by :meth:`CausalWanModel.project_cross_kv`
and passed back as ``cross_kv`` on every step; without them they are computed from
``context`` / ``clip_feature`` as upstream does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ardiff_kv import CrossKV, DenseLayerKV, PagedLayerInputs, paged_write_attend
from ardiff_policies.wan.rope import apply_rope, rope_angles, rope_axis_dims

LayerKV = PagedLayerInputs | DenseLayerKV | None


@dataclass(frozen=True)
class DiTConfig:
    """``action_head_cfg.config.diffusion_model_cfg`` plus the action-head keys the DiT uses."""

    model_type: str = "i2v"
    patch_size: tuple[int, int, int] = (1, 2, 2)
    frame_seqlen: int = 880
    text_len: int = 512
    in_dim: int = 36
    dim: int = 5120
    ffn_dim: int = 13824
    freq_dim: int = 256
    text_dim: int = 4096
    out_dim: int = 16
    num_heads: int = 40
    num_layers: int = 40
    max_chunk_size: int = 4
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    num_frame_per_block: int = 2
    action_dim: int = 32
    max_state_dim: int = 64
    hidden_size: int = 1024  # width of the state encoder / action decoder MLPs
    num_action_per_block: int = 24
    num_state_per_block: int = 1
    clip_dim: int = 1280  # CLIP token width (upstream hard-codes 1280; the tiny model shrinks it)
    num_image_tokens: int = 257  # CLIP tokens prepended to the text context (I2V, TI2V)
    # Upstream: concatenate the image conditioning ``y`` to the latents before the patch embedding (14B I2V);
    # False (the 5B TI2V) feeds the latents alone and ignores ``y``.
    concat_first_frame_latent: bool = True

    # Training-time keys of the upstream config that do not change the inference network.
    _IGNORED = frozenset(
        {
            "_target_",
            "_convert_",
            "diffusion_model_pretrained_path",
            "num_registers",
            "max_num_embodiments",
            "sink_size",
        }
    )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DiTConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known - cls._IGNORED
        if unknown:
            raise ValueError(f"unknown DiT config keys: {sorted(unknown)}")
        values = {k: v for k, v in raw.items() if k in known}
        if "patch_size" in values:
            values["patch_size"] = tuple(values["patch_size"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["patch_size"] = list(self.patch_size)
        return out

    @property
    def has_image_context(self) -> bool:
        """CLIP image tokens in the cross-attention context (upstream: ``model_type in ('i2v', 'ti2v')``)."""
        return self.model_type in ("i2v", "ti2v")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def local_attn_size(self) -> int:
        """Latent frames attention sees (upstream: ``max_chunk_size * num_frame_per_block + 1``)."""
        return self.max_chunk_size * self.num_frame_per_block + 1 if self.max_chunk_size != -1 else 21

    @property
    def action_register_length(self) -> int:
        return self.num_action_per_block + self.num_state_per_block


# ----------------------------------------------------------------------------- helpers


def sinusoidal_embedding_1d(dim: int, position: torch.Tensor) -> torch.Tensor:
    """Wan's timestep embedding: [cos, sin] of position / 10000^(i / half), in float64."""
    half = dim // 2
    position = position.to(torch.float64)
    angles = torch.outer(position, torch.pow(10000, -torch.arange(half, dtype=torch.float64, device=position.device) / half))
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


class WanRMSNorm(nn.Module):
    """RMSNorm over the full width (across heads), normalizing in float32 like upstream."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f = x.float()
        return (x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """(B, L, H, D) layout in and out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale).transpose(1, 2)


# ------------------------------------------------------------------- action register


class CategorySpecificLinear(nn.Module):
    """A linear layer per embodiment category; DreamZero checkpoints hold one category."""

    def __init__(self, num_categories: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(num_categories, in_dim, out_dim))
        self.b = nn.Parameter(torch.zeros(num_categories, out_dim))

    def forward(self, x: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.W[category]) + self.b[category].unsqueeze(1)


class CategorySpecificMLP(nn.Module):
    def __init__(self, num_categories: int, in_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, in_dim, hidden_dim)
        self.layer2 = CategorySpecificLinear(num_categories, hidden_dim, out_dim)

    def forward(self, x: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, category)), category)


def action_timestep_encoding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """Pi0-style [sin, cos] encoding of per-token action timesteps (B, T) -> (B, T, dim)."""
    half = dim // 2
    exponent = -torch.arange(half, dtype=torch.float32, device=timesteps.device) * (math.log(10000.0) / half)
    angles = timesteps.float().unsqueeze(-1) * exponent.exp()
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class MultiEmbodimentActionEncoder(nn.Module):
    """W1 (action -> dim), concat the timestep encoding, W2 (2 dim -> dim) + swish, W3."""

    def __init__(self, action_dim: int, dim: int, num_categories: int = 1) -> None:
        super().__init__()
        self.dim = dim
        self.W1 = CategorySpecificLinear(num_categories, action_dim, dim)
        self.W2 = CategorySpecificLinear(num_categories, 2 * dim, dim)
        self.W3 = CategorySpecificLinear(num_categories, dim, dim)

    def forward(self, actions: torch.Tensor, timesteps: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        a = self.W1(actions, category)
        tau = action_timestep_encoding(timesteps, self.dim).to(a.dtype)
        x = self.W2(torch.cat([a, tau], dim=-1), category)
        # Upstream's swish is x * sigmoid(x): two roundings in bf16, where F.silu rounds once.
        return self.W3(x * torch.sigmoid(x), category)


# ----------------------------------------------------------------------------- blocks


class WanAttentionProjections(nn.Module):
    """q/k/v/o projections with q/k RMSNorm, shared by self- and cross-attention (upstream names)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()


class CausalWanSelfAttention(WanAttentionProjections):
    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], num_extra: int, self_kv: LayerKV) -> torch.Tensor:
        shape = (*x.shape[:2], self.num_heads, self.head_dim)
        q = apply_rope(self.norm_q(self.q(x)).view(shape), *rope)
        k = apply_rope(self.norm_k(self.k(x)).view(shape), *rope)
        v = self.v(x).view(shape)
        n_video = x.shape[1] - num_extra
        k_video, v_video = k[:, :n_video], v[:, :n_video]
        k_extra, v_extra = (k[:, n_video:], v[:, n_video:]) if num_extra else (None, None)
        scale = self.head_dim**-0.5
        if isinstance(self_kv, PagedLayerInputs):  # B sequences, each over its own pages (block-table rows)
            out = paged_write_attend(
                self_kv,
                q.flatten(0, 1),
                k_video.flatten(0, 1),
                v_video.flatten(0, 1),
                None if k_extra is None else k_extra.flatten(0, 1),
                None if v_extra is None else v_extra.flatten(0, 1),
                scale,
            ).view(shape)
        elif self_kv is None:  # full attention over this call's tokens
            out = _attention(q, k, v, scale)
        else:
            out = self_kv.attend(q, k_video, v_video, k_extra, v_extra, scale)
        return self.o(out.flatten(2))


class WanCrossAttention(WanAttentionProjections):
    """Cross-attention over the text tokens, plus (I2V) a parallel attention over image tokens."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float, image: bool, num_image_tokens: int) -> None:
        super().__init__(dim, num_heads, qk_norm, eps)
        self.num_image_tokens = num_image_tokens if image else 0
        if image:
            self.k_img = nn.Linear(dim, dim)
            self.v_img = nn.Linear(dim, dim)
            self.norm_k_img = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.num_heads, self.head_dim))

    def project_text(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._heads(self.norm_k(self.k(text))), self._heads(self.v(text))

    def project_image(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._heads(self.norm_k_img(self.k_img(image))), self._heads(self.v_img(image))

    def forward(self, x: torch.Tensor, context: torch.Tensor | CrossKV | tuple[CrossKV, ...]) -> torch.Tensor:
        q = self._heads(self.norm_q(self.q(x)))
        if isinstance(context, tuple) and not isinstance(context, CrossKV):
            # a batched forward: each sequence reads its own cached slot, in place (no gather copy)
            out = torch.cat([self._attend(q[b : b + 1], kv) for b, kv in enumerate(context)])
        else:
            out = self._attend(q, context)
        return self.o(out.flatten(2))

    def _attend(self, q: torch.Tensor, context: torch.Tensor | CrossKV) -> torch.Tensor:
        if isinstance(context, CrossKV):
            text_kv = (context.text_key, context.text_value)
            image_kv = (context.image_key, context.image_value) if self.num_image_tokens else None
        else:  # upstream path: project the (image tokens | text tokens) context every call
            text_kv = self.project_text(context[:, self.num_image_tokens :])
            image_kv = self.project_image(context[:, : self.num_image_tokens]) if self.num_image_tokens else None
        out = _attention(q, *text_kv)
        if image_kv is not None:
            out = out + _attention(q, *image_kv)
        return out


class CausalWanAttentionBlock(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        dim = cfg.dim
        self.norm1 = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=False)
        self.self_attn = CausalWanSelfAttention(dim, cfg.num_heads, cfg.qk_norm, cfg.eps)
        self.norm3 = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.cross_attn = WanCrossAttention(
            dim, cfg.num_heads, cfg.qk_norm, cfg.eps, image=cfg.has_image_context, num_image_tokens=cfg.num_image_tokens
        )
        self.norm2 = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(
        self,
        x: torch.Tensor,
        e: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        num_extra: int,
        self_kv: LayerKV,
        context: torch.Tensor | CrossKV | tuple[CrossKV, ...],
    ) -> torch.Tensor:
        # e: (B, L, 6, dim) per-token modulation: shift/scale/gate for attention, then for the FFN
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = (self.modulation.unsqueeze(1) + e).unbind(2)
        y = self.self_attn(self.norm1(x) * (1 + scale_a) + shift_a, rope, num_extra, self_kv)
        x = x + y * gate_a
        x = x + self.cross_attn(self.norm3(x), context)
        y = self.ffn(self.norm2(x) * (1 + scale_f) + shift_f)
        return x + y * gate_f


class CausalHead(nn.Module):
    def __init__(self, dim: int, out_dim: int, patch_size: tuple[int, int, int], eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.head = nn.Linear(dim, math.prod(patch_size) * out_dim)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation.unsqueeze(1) + e.unsqueeze(2)).unbind(2)
        return self.head(self.norm(x) * (1 + scale) + shift)


class MLPProj(nn.Module):
    """Projects CLIP image tokens to the DiT width (I2V)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim), nn.GELU(), nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim))

    def forward(self, image_tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(image_tokens)


# ------------------------------------------------------------------------------ model


class CausalWanModel(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        if cfg.model_type not in ("t2v", "i2v", "ti2v"):
            raise ValueError(f"model_type must be 't2v', 'i2v' or 'ti2v', got {cfg.model_type!r}")
        if cfg.dim % cfg.num_heads or cfg.head_dim % 2:
            raise ValueError(f"dim {cfg.dim} must split into {cfg.num_heads} heads of even width")
        self.config = cfg
        dim = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_dim, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList([CausalWanAttentionBlock(cfg) for _ in range(cfg.num_layers)])
        self.head = CausalHead(dim, cfg.out_dim, cfg.patch_size, cfg.eps)
        if cfg.has_image_context:
            self.img_emb = MLPProj(cfg.clip_dim, dim)
        self.state_encoder = CategorySpecificMLP(1, cfg.max_state_dim, cfg.hidden_size, dim)
        self.action_encoder = MultiEmbodimentActionEncoder(cfg.action_dim, dim)
        self.action_decoder = CategorySpecificMLP(1, dim, cfg.hidden_size, cfg.action_dim)
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    # -- RoPE ---------------------------------------------------------------------------

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Angle tables: frame, height, width axes (1024 positions) and action (10240) / state (1024)."""
        if device not in self._rope_tables:
            d = self.config.head_dim
            tables = [rope_angles(1024, a) for a in rope_axis_dims(d)] + [rope_angles(1024 * 10, d), rope_angles(1024, d)]
            self._rope_tables[device] = tuple(t.to(device) for t in tables)
        return self._rope_tables[device]

    def rope(
        self, grid: tuple[int, int, int], start_frames: Sequence[int], action_blocks: Sequence[int] | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, L, 1, head_dim/2) for the video tokens of this call, then the action register.

        Sequence b's video frames are numbered from ``start_frames[b]`` (their position in its
        window); its action/state tokens (chunk ``action_blocks[b]``) use rows of their own tables.
        """
        t_frame, t_h, t_w, t_action, t_state = self._tables(device)
        f, h, w = grid
        spatial = torch.cat([t_h[:h].view(1, h, 1, -1).expand(f, h, w, -1), t_w[:w].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1)
        rows = []
        for b, start in enumerate(start_frames):
            frames = t_frame[start : start + f].view(f, 1, 1, -1).expand(f, h, w, -1)
            parts = [torch.cat([frames, spatial], dim=-1).reshape(f * h * w, -1)]
            if action_blocks is not None:
                n_a, n_s, block = self.config.num_action_per_block, self.config.num_state_per_block, action_blocks[b]
                parts += [t_action[block * n_a : (block + 1) * n_a], t_state[block * n_s : (block + 1) * n_s]]
            rows.append(torch.cat(parts))
        angles = torch.stack(rows).unsqueeze(2)
        return torch.cos(angles).float(), torch.sin(angles).float()

    # -- conditioning ---------------------------------------------------------------------

    def embed_context(self, context: torch.Tensor | None, clip_feature: torch.Tensor | None) -> torch.Tensor:
        """The cross-attention context upstream builds: (image tokens | projected text)."""
        text = self.text_embedding(context)
        if self.config.has_image_context:
            return torch.cat([self.img_emb(clip_feature), text], dim=1)
        return text

    @torch.no_grad()
    def project_cross_kv(
        self, context: torch.Tensor | None = None, clip_feature: torch.Tensor | None = None
    ) -> list[tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor] | None]]:
        """Per layer (text K/V, image K/V) to cache: the text half once per session, the image half
        once per window. Pass only what needs (re)projecting; the other half comes back None."""
        text = self.text_embedding(context) if context is not None else None
        image = self.img_emb(clip_feature) if clip_feature is not None and self.config.has_image_context else None
        out = []
        for block in self.blocks:
            ca = block.cross_attn
            out.append((ca.project_text(text) if text is not None else None, ca.project_image(image) if image is not None else None))
        return out

    # -- forward --------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        *,
        current_start_frame: int | Sequence[int],
        self_kv: Sequence[LayerKV] | None,
        y: torch.Tensor | None = None,
        cross_kv: Sequence[CrossKV | tuple[CrossKV, ...]] | None = None,
        context: torch.Tensor | None = None,
        clip_feature: torch.Tensor | None = None,
        action: torch.Tensor | None = None,
        timestep_action: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One DiT call over B sequences.

        x: (B, out_dim, F, H, W) latents; timestep: (B, F); y: (B, in_dim - out_dim, F, H, W)
        I2V conditioning, concatenated to x only when ``concat_first_frame_latent`` (the 5B ignores
        it, like upstream). Actions: (B, num_action_per_block, action_dim) with timestep_action
        (B, num_action_per_block) and state (B, num_state_per_block, max_state_dim).
        ``current_start_frame``: each sequence's window position (one int: all the same).
        ``self_kv``: per layer; paged inputs hold a block-table row per sequence. ``cross_kv``:
        per layer one cached slot (B = 1) or a tuple of B (each sequence its own session branch).
        Returns (video prediction like x, action prediction or None).
        """
        cfg = self.config
        if cfg.concat_first_frame_latent and y is not None:
            x = torch.cat([x, y.to(x.dtype)], dim=1)
        elif cfg.concat_first_frame_latent and cfg.model_type == "i2v":
            raise ValueError("an i2v DiT needs the image conditioning y")
        x = self.patch_embedding(x)
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)
        batch, num_video = x.shape[:2]
        starts = [current_start_frame] * batch if isinstance(current_start_frame, int) else list(current_start_frame)
        if len(starts) != batch:
            raise ValueError(f"{len(starts)} start frames for a batch of {batch}")
        if self_kv is not None and len(self_kv) != cfg.num_layers:
            raise ValueError(f"self_kv has {len(self_kv)} layers, the DiT {cfg.num_layers}")

        # Per-token timesteps: each latent frame's timestep repeated over its tokens.
        token_t = timestep.repeat_interleave(num_video // timestep.shape[1], dim=1)
        num_extra = 0
        action_blocks = None
        category = torch.zeros(batch, dtype=torch.long, device=x.device)  # one embodiment slot
        if action is not None:
            if timestep_action is None or state is None:
                raise ValueError("action needs timestep_action and state")
            register = torch.cat([self.action_encoder(action, timestep_action, category), self.state_encoder(state, category)], dim=1)
            num_extra = register.shape[1]
            if num_extra != cfg.action_register_length:
                raise ValueError(f"action register of {num_extra} tokens, expected {cfg.action_register_length}")
            x = torch.cat([x, register], dim=1)
            state_t = timestep_action[:, :: timestep_action.shape[1] // state.shape[1]]
            token_t = torch.cat([token_t, timestep_action, state_t], dim=1)
            # Each AR chunk advances the register's RoPE rows by one block.
            action_blocks = [(start - 1) // cfg.num_frame_per_block for start in starts]

        e = self.time_embedding(sinusoidal_embedding_1d(cfg.freq_dim, token_t.flatten()).to(x.dtype)).unflatten(0, (batch, -1))
        e_blocks = self.time_projection(e).unflatten(2, (6, cfg.dim))
        rope = self.rope(grid, starts, action_blocks, x.device)

        if cross_kv is not None:
            contexts: Sequence[torch.Tensor | CrossKV | tuple[CrossKV, ...]] = cross_kv
        else:
            if context is None:
                raise ValueError("pass either cross_kv (cached) or context (+ clip_feature for i2v / ti2v)")
            full_context = self.embed_context(context, clip_feature)
            contexts = [full_context] * cfg.num_layers

        for i, block in enumerate(self.blocks):
            x = block(x, e_blocks, rope, num_extra, None if self_kv is None else self_kv[i], contexts[i])

        action_pred = None
        if action is not None:
            action_pred = self.action_decoder(x[:, num_video : num_video + cfg.num_action_per_block], category)
        video = self.head(x[:, :num_video], e[:, :num_video])
        return self.unpatchify(video, grid), action_pred

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        c, (pf, ph, pw) = self.config.out_dim, self.config.patch_size
        f, h, w = grid
        x = x.view(x.shape[0], f, h, w, pf, ph, pw, c)
        x = torch.einsum("bfhwpqrc->bcfphqwr", x)
        return x.reshape(x.shape[0], c, f * pf, h * ph, w * pw)
