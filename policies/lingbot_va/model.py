"""LingBot-VA's shared-backbone video/action transformer, in one file.

Structure and parameter names follow upstream's ``WanTransformer3DModel``
(Robbyant/lingbot-va ``wan_va/modules/model.py``), so a released ``transformer/`` directory loads
unchanged. A Wan2.2-TI2V-5B DiT whose blocks serve two streams, one forward each:

* video (``action_mode=False``): 48-channel latents cut into 1x2x2 patches, ``patch_embedding_mlp``
  (a Linear), the blocks, ``proj_out``; time embedded by ``condition_embedder``;
* action (``action_mode=True``): one token per action of 30 channels, ``action_embedder``, the
  same blocks, ``action_proj_out``; time embedded by ``condition_embedder_action``.

Both read the prompt through ``condition_embedder.text_embedder`` into a cross-attention over all
512 text positions. Timesteps are per latent frame and become per-token modulation. RoPE is 3-D
over float positions (``grid_id``): video tokens at (frame, row, column), action j of frame f at
(f + (j + 1) / (N + 1), -1, -1).

Inference only. Self-attention K/V come from the caller per layer (``self_kv``):

* :class:`ardiff_kv.PagedLayerInputs`: the paged cache (serving path); the layer writes this forward's
  K/V into its pages and attends over the session's block table in one custom op. Which pages
  those are (committed, provisional, scratch) is the session's business (``kv/``);
* ``None``: attention over this call's tokens only (no cache).

The diffusers building blocks upstream uses (``Timesteps``, ``TimestepEmbedding``,
``PixArtAlphaTextProjection``, ``FeedForward``, ``FP32LayerNorm``) are used as they are, so their
arithmetic is upstream's; attention, RoPE and the blocks are written out here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import PixArtAlphaTextProjection, TimestepEmbedding, Timesteps
from diffusers.models.normalization import FP32LayerNorm

from ardiff_kv import PagedLayerInputs, paged_write_attend
from ardiff_policies.lingbot_va.checkpoint import TransformerConfig
from ardiff_policies.wan.rope import apply_rope, rope_axis_dims, rope_frequencies

LayerKV = PagedLayerInputs | None
# Cross-attention K/V of one layer, projected once per prompt: (B, text tokens, heads, head_dim) each.
TextKV = tuple[torch.Tensor, torch.Tensor]

# In the released state dict (``deepcopy`` of the video embedder) but never read: text always goes through
# ``condition_embedder.text_embedder``. Dropped on load instead of holding ~25 M unused parameters.
UNUSED_PREFIXES = ("condition_embedder_action.text_embedder.",)


# ----------------------------------------------------------------------------- positions


def video_grid(frames: int, height: int, width: int, start_frame: int) -> torch.Tensor:
    """(3, frames * height * width) token positions of a patched latent chunk: frame, row, column."""
    f, h, w = torch.meshgrid(torch.arange(start_frame, start_frame + frames), torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([f, h, w]).flatten(1).float()


def action_grid(frames: int, actions_per_frame: int, start_frame: int) -> torch.Tensor:
    """(3, frames * actions_per_frame) positions of an action chunk: action j of frame f sits at frame position
    f + (j + 1) / (N + 1) (float32, as upstream adds it), row and column -1."""
    offsets = torch.ones(actions_per_frame).cumsum(0) / (actions_per_frame + 1)
    f = torch.arange(start_frame, start_frame + frames)[:, None] + offsets[None]
    minus_one = torch.full_like(f, -1.0)
    return torch.stack([f, minus_one, minus_one]).flatten(1)


def patchify(latents: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, tokens, C * patch volume): b c (f p1) (h p2) (w p3) -> b (f h w) (c p1 p2 p3)."""
    _, _, frames, height, width = latents.shape
    pt, ph, pw = patch_size
    patches = latents.unflatten(4, (width // pw, pw)).unflatten(3, (height // ph, ph)).unflatten(2, (frames // pt, pt))
    return patches.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4).flatten(1, 3)


def unpatchify(tokens: torch.Tensor, patch_size: tuple[int, int, int], channels: int, size: tuple[int, int, int]) -> torch.Tensor:
    """:func:`patchify`'s inverse for the output projection's (B, tokens, patch volume * C) -> (B, C, F, H, W)."""
    frames, height, width = size
    pt, ph, pw = patch_size
    out = tokens.view(tokens.shape[0], frames // pt, height // ph, width // pw, pt, ph, pw, channels)
    return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(tokens.shape[0], channels, frames, height, width)


class RotaryPositions(nn.Module):
    """3-D RoPE angles for float positions. The head dimension splits into frame / height / width parts
    (:func:`rope_axis_dims`: upstream's d - 2 (d // 3), d // 3 and d // 3); frequencies 1 / 10000^(2k / part) per
    part, angles in float64 then float32 (upstream's ``WanRotaryPosEmbed``). The frequencies are made per call (a
    few dozen numbers) rather than held as buffers, which ``model.to(bfloat16)`` would round."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.parts = rope_axis_dims(head_dim)
        self.theta = theta

    def forward(self, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grid`` (B, 3, L) -> cos, sin (B, L, 1, head_dim / 2) for :func:`apply_rope`."""
        angles = []
        for axis, part in enumerate(self.parts):
            angles.append(grid[:, axis, :, None].double() * rope_frequencies(part, self.theta, grid.device))
        angles = torch.cat(angles, dim=-1).float()
        return torch.cos(angles)[:, :, None], torch.sin(angles)[:, :, None]


# ----------------------------------------------------------------------------- modules


class TimeTextEmbedding(nn.Module):
    """Sinusoidal timestep -> MLP -> 6-way modulation; the text projection (upstream ``WanTimeTextImageEmbedding``)."""

    def __init__(self, dim: int, freq_dim: int, text_dim: int, with_text: bool = True) -> None:
        super().__init__()
        self.timesteps_proj = Timesteps(num_channels=freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedder = TimestepEmbedding(in_channels=freq_dim, time_embed_dim=dim)
        self.act_fn = nn.SiLU()
        self.time_proj = nn.Linear(dim, 6 * dim)
        if with_text:
            self.text_embedder = PixArtAlphaTextProjection(text_dim, dim, act_fn="gelu_tanh")

    def forward(self, timesteps: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``timesteps`` (B, L) -> temb (B, L, dim), modulation (B, L, 6, dim)."""
        batch, length = timesteps.shape
        t = self.timesteps_proj(timesteps.reshape(-1))
        t = t.to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(t).to(dtype)
        modulation = self.time_proj(self.act_fn(temb))
        return temb.reshape(batch, length, -1), modulation.reshape(batch, length, 6, -1)


class Attention(nn.Module):
    """q/k/v/out projections with RMSNorm over the full width on q and k (upstream ``WanAttention``)."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])  # upstream's [Linear, Dropout(0)]: same names
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def project_text(self, text: torch.Tensor) -> TextKV:
        """Cross-attention K/V of projected text tokens (B, T, dim): computed once per prompt."""
        return self._heads(self.norm_k(self.to_k(text))), self._heads(self.to_v(text))

    # The projections a stream reads. LingBot-VA's two streams share one set; Zero-WAM's action expert
    # (``zero_wam_model.ExpertAttention``) answers with its own for ``action_mode``.
    def query_out(self, action_mode: bool) -> tuple[nn.Module, nn.Module, nn.Module]:
        """The stream's query projection, query norm and output projection."""
        return self.to_q, self.norm_q, self.to_out[0]

    def key_value(self, action_mode: bool) -> tuple[nn.Module, nn.Module, nn.Module]:
        """The stream's key projection, key norm and value projection (self-attention)."""
        return self.to_k, self.norm_k, self.to_v

    def self_attention(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], self_kv: LayerKV, *, action_mode: bool = False
    ) -> torch.Tensor:
        to_q, norm_q, to_out = self.query_out(action_mode)
        to_k, norm_k, to_v = self.key_value(action_mode)
        q = apply_rope(self._heads(norm_q(to_q(x))), *rope)
        k = apply_rope(self._heads(norm_k(to_k(x))), *rope)
        v = self._heads(to_v(x))
        scale = self.head_dim**-0.5
        if isinstance(self_kv, PagedLayerInputs):  # B sequences, each over its own pages
            out = paged_write_attend(self_kv, q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), None, None, scale)
            out = out.view(q.shape)
        else:
            out = _sdpa(q, k, v, scale)
        return to_out(out.flatten(2).type_as(x))

    def cross_attention(self, x: torch.Tensor, text_kv: TextKV, *, action_mode: bool = False) -> torch.Tensor:
        to_q, norm_q, to_out = self.query_out(action_mode)
        q = self._heads(norm_q(to_q(x)))
        out = _sdpa(q, *text_kv, self.head_dim**-0.5)
        return to_out(out.flatten(2).type_as(x))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, L, H, D) in and out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale).transpose(1, 2)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        dim = cfg.dim
        self.norm1 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.attn1 = self.attention(cfg, cross=False)
        self.attn2 = self.attention(cfg, cross=True)
        self.norm2 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, inner_dim=cfg.ffn_dim, activation_fn="gelu-approximate")
        self.norm3 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def attention(self, cfg: TransformerConfig, *, cross: bool) -> Attention:
        """``attn1`` (self) or ``attn2`` (cross); Zero-WAM's block adds the action expert's projections."""
        return Attention(cfg.dim, cfg.num_attention_heads, cfg.eps)

    def stream_modules(self, action_mode: bool) -> tuple[torch.Tensor, nn.Module, nn.Module, nn.Module, nn.Module]:
        """The stream's modulation table, norm1, norm2, feed-forward and norm3: one set for both streams here."""
        return self.scale_shift_table, self.norm1, self.norm2, self.ffn, self.norm3

    def forward(
        self,
        x: torch.Tensor,
        modulation: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        text_kv: TextKV,
        self_kv: LayerKV,
        *,
        action_mode: bool = False,
    ) -> torch.Tensor:
        table, norm1, norm2, ffn, norm3 = self.stream_modules(action_mode)
        # modulation (B, L, 6, dim), per token; the sums are float32 like upstream's
        shift, scale, gate, c_shift, c_scale, c_gate = (table[None] + modulation.float()).unbind(2)
        h = (norm1(x.float()) * (1.0 + scale) + shift).type_as(x)
        x = (x.float() + self.attn1.self_attention(h, rope, self_kv, action_mode=action_mode) * gate).type_as(x)
        x = x + self.attn2.cross_attention(norm2(x.float()).type_as(x), text_kv, action_mode=action_mode)
        h = (norm3(x.float()) * (1.0 + c_scale) + c_shift).type_as(x)
        return (x.float() + ffn(h).float() * c_gate).type_as(x)


class LingBotVATransformer(nn.Module):
    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        block: Callable[[], TransformerBlock] | None = None,
        action_embedder_bias: bool = True,
    ) -> None:
        """``block`` and ``action_embedder_bias``: what Zero-WAM's transformer (a subclass) builds differently."""
        super().__init__()
        self.config = cfg
        dim = cfg.dim
        self.rope = RotaryPositions(cfg.attention_head_dim)
        self.patch_embedding_mlp = nn.Linear(cfg.in_channels * cfg.patch_volume, dim)
        self.action_embedder = nn.Linear(cfg.action_dim, dim, bias=action_embedder_bias)
        self.condition_embedder = TimeTextEmbedding(dim, cfg.freq_dim, cfg.text_dim)
        self.condition_embedder_action = TimeTextEmbedding(dim, cfg.freq_dim, cfg.text_dim, with_text=False)
        self.blocks = nn.ModuleList([TransformerBlock(cfg) if block is None else block() for _ in range(cfg.num_layers)])
        self.norm_out = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * cfg.patch_volume)
        self.action_proj_out = nn.Linear(dim, cfg.action_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    @property
    def stream_config(self) -> TransformerConfig:
        """The sizes both streams are built and run with (Zero-WAM's ``config`` holds them as ``base``)."""
        return self.config

    def output_modules(self, action_mode: bool) -> tuple[torch.Tensor, nn.Module]:
        """The stream's output modulation table and norm: the video's for both streams here."""
        return self.scale_shift_table, self.norm_out

    # -- text ----------------------------------------------------------------------------

    def project_text(self, text_embeddings: torch.Tensor) -> list[TextKV]:
        """Every layer's cross-attention K/V for UMT5 embeddings (B, 512, text_dim): once per prompt."""
        text = self.condition_embedder.text_embedder(text_embeddings)
        return [block.attn2.project_text(text) for block in self.blocks]

    # -- forward ---------------------------------------------------------------------------

    def forward(
        self,
        inputs: torch.Tensor,
        timesteps: torch.Tensor,
        grid: torch.Tensor,
        text: torch.Tensor | Sequence[TextKV],
        *,
        action_mode: bool,
        self_kv: Sequence[LayerKV] | None = None,
    ) -> torch.Tensor:
        """One stream's forward.

        ``inputs``: latents (B, C, F, H, W) (video) or actions (B, action_dim, F, N, 1) (action);
        ``timesteps``: (B, F) per latent frame; ``grid``: (B, 3, L) token positions (:func:`video_grid`,
        :func:`action_grid`); ``text``: UMT5 embeddings (B, T, text_dim) or :meth:`project_text`'s K/V;
        ``self_kv``: per layer, or None for attention over this call's tokens only.
        Returns the velocity in the input's layout.
        """
        cfg = self.stream_config
        batch, _, frames, height, width = inputs.shape
        if action_mode:
            x = self.action_embedder(inputs.flatten(2).transpose(1, 2))  # one token per (frame, action)
            tokens_per_frame = height * width
        else:
            x = self.patch_embedding_mlp(patchify(inputs, cfg.patch_size))
            tokens_per_frame = (height // cfg.patch_size[1]) * (width // cfg.patch_size[2])
        if isinstance(text, torch.Tensor):
            text = self.project_text(text)
        rope = self.rope(grid)
        embedder = self.condition_embedder_action if action_mode else self.condition_embedder
        temb, modulation = embedder(timesteps.repeat_interleave(tokens_per_frame, dim=1), dtype=x.dtype)
        for i, block in enumerate(self.blocks):
            x = block(x, modulation, rope, text[i], None if self_kv is None else self_kv[i], action_mode=action_mode)
        table, norm_out = self.output_modules(action_mode)
        shift, scale = (table[None] + temb[:, :, None]).unbind(2)
        x = (norm_out(x.float()) * (1.0 + scale) + shift).type_as(x)
        if action_mode:
            # b (f n) c -> b c f n 1
            return self.action_proj_out(x).transpose(1, 2).reshape(batch, cfg.action_dim, frames, height, width)
        return unpatchify(self.proj_out(x), cfg.patch_size, cfg.out_channels, (frames, height, width))


# ----------------------------------------------------------------------------- loading


def load_transformer(directory: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LingBotVATransformer:
    """A released ``transformer/`` directory (config.json + diffusion_pytorch_model*.safetensors, sharded or not):
    every tensor name and shape must be upstream's (strict), except :data:`UNUSED_PREFIXES`."""
    directory = Path(directory)
    cfg = TransformerConfig.from_file(directory / "config.json")
    state = {k: v for k, v in read_released_state(directory).items() if not k.startswith(UNUSED_PREFIXES)}
    with torch.device("meta"):
        model = LingBotVATransformer(cfg)
    missing, unexpected = _check_names(model, state)
    if missing or unexpected:
        raise ValueError(
            f"{directory}: the weights do not match LingBot-VA's transformer (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}{' ...' if len(missing) + len(unexpected) > 10 else ''})"
        )
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def read_released_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a released ``transformer/`` directory's diffusion_pytorch_model*.safetensors, sharded or not."""
    from safetensors.torch import load_file

    shards = sorted(directory.glob("diffusion_pytorch_model*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory}: no diffusion_pytorch_model*.safetensors")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state |= load_file(shard)
    return state


def _check_names(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    unexpected += sorted(n for n in set(expected) & set(state) if tuple(state[n].shape) != expected[n])
    return missing, unexpected
