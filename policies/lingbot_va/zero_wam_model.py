"""Zero-WAM's transformer: LingBot-VA's with an action expert, in one file.

Parameter names follow upstream's ``WanICLTransformer3DModel`` (jianwenli96/Zero-WAM
``wan_va/modules/icl_model.py``), so a released ``transformer/`` directory loads unchanged. What it
shares with LingBot-VA (:mod:`ardiff_policies.lingbot_va.model`) is used from there: the video
stream's modules and names (``patch_embedding_mlp``, ``condition_embedder``, each block's ``norm1`` /
``attn1`` / ``attn2`` / ``ffn`` / ``scale_shift_table``, ``proj_out``), RoPE, patching, the time/text
embedder and the attention. What Zero-WAM adds is the action expert: the action stream gets its own

* attention projections in every block (``attn1.action_to_{q,k,v,out}``, ``action_norm_{q,k}``;
  ``attn2.action_to_q`` / ``action_to_out`` / ``action_norm_q``: its cross-attention reads the text
  through the video's ``to_k`` / ``to_v``, which upstream also stores under ``action_*`` aliases);
* norms, feed-forward and modulation (``action_norm{1,2,3}``, ``action_ffn`` of width
  ``action_ffn_dim``, ``scale_shift_table_action``), and its own output norm and table
  (``action_norm_out``, ``scale_shift_table_action``) where LingBot-VA shares the video's.

Serving runs one stream per forward, as upstream's streaming path does, so a block applies either its
video or its action modules, never both. Who attends to what (video queries to the in-context block,
action queries not; the frame-id window) is the caller's choice of K/V (``self_kv``: the paged
cache's block tables), not a mask inside the model.

Read on load and dropped (upstream holds them, its streaming forward never runs them): the
``patch_embedding`` Conv3d (kept upstream for checkpoint compatibility; the MLP embeds), the
multi-chunk prediction heads (``mcp_*``, a training loss) and the action embedder's copy of the text
projection. Each is checked by name and shape; anything else is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
from diffusers.models.attention import FeedForward
from diffusers.models.normalization import FP32LayerNorm

from ardiff_kv import PagedLayerInputs, paged_write_attend
from ardiff_policies.lingbot_va.model import Attention, LayerKV, RotaryPositions, TextKV, TimeTextEmbedding, _sdpa, patchify, unpatchify
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.wan.rope import apply_rope

# The action embedder's never-read copy of the text projection (upstream deep-copies the video embedder).
UNUSED_TEXT_COPY = "condition_embedder_action.text_embedder."
# Aliases of attn2's text K/V projections under the action expert's names (the same modules upstream).
CROSS_ALIASES = {"action_to_k": "to_k", "action_to_v": "to_v", "action_norm_k": "norm_k"}


def expert_action_grid(frames: int, actions_per_frame: int, start_frame: int) -> torch.Tensor:
    """(3, frames * actions_per_frame) positions of a Zero-WAM action chunk: action j of frame f at (f, j, 0).

    Not LingBot-VA's :func:`~ardiff_policies.lingbot_va.model.action_grid` (f + (j + 1) / (N + 1), -1, -1):
    upstream's Zero-WAM server lays the actions out as a video-like grid (``get_mesh_id(..., action=False)``, one
    row per action), and its checkpoints were trained so."""
    f, j, w = torch.meshgrid(torch.arange(start_frame, start_frame + frames), torch.arange(actions_per_frame), torch.arange(1), indexing="ij")
    return torch.stack([f, j, w]).flatten(1).float()


class ExpertAttention(Attention):
    """LingBot-VA's attention (the video stream's ``to_q`` / ``to_k`` / ``to_v`` / ``to_out``) plus the action
    expert's projections. ``cross``: the action stream's queries meet the text through the video's K/V."""

    def __init__(self, dim: int, heads: int, eps: float, *, cross: bool) -> None:
        super().__init__(dim, heads, eps)
        self.action_to_q = nn.Linear(dim, dim)
        self.action_to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.action_norm_q = nn.RMSNorm(dim, eps=eps)
        if not cross:
            self.action_to_k = nn.Linear(dim, dim)
            self.action_to_v = nn.Linear(dim, dim)
            self.action_norm_k = nn.RMSNorm(dim, eps=eps)

    def stream_self_attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], self_kv: LayerKV, *, action_mode: bool) -> torch.Tensor:
        if not action_mode:
            return self.self_attention(x, rope, self_kv)
        q = apply_rope(self._heads(self.action_norm_q(self.action_to_q(x))), *rope)
        k = apply_rope(self._heads(self.action_norm_k(self.action_to_k(x))), *rope)
        v = self._heads(self.action_to_v(x))
        scale = self.head_dim**-0.5
        if isinstance(self_kv, PagedLayerInputs):
            out = paged_write_attend(self_kv, q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), None, None, scale).view(q.shape)
        else:
            out = _sdpa(q, k, v, scale)
        return self.action_to_out[0](out.flatten(2).type_as(x))

    def stream_cross_attention(self, x: torch.Tensor, text_kv: TextKV, *, action_mode: bool) -> torch.Tensor:
        if not action_mode:
            return self.cross_attention(x, text_kv)
        q = self._heads(self.action_norm_q(self.action_to_q(x)))
        out = _sdpa(q, *text_kv, self.head_dim**-0.5)
        return self.action_to_out[0](out.flatten(2).type_as(x))


class ZeroWAMBlock(nn.Module):
    def __init__(self, cfg: ZeroWAMConfig) -> None:
        super().__init__()
        base, dim = cfg.base, cfg.dim
        heads, eps = base.num_attention_heads, base.eps
        # the video stream: LingBot-VA's block, names and all
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = ExpertAttention(dim, heads, eps, cross=False)
        self.attn2 = ExpertAttention(dim, heads, eps, cross=True)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if base.cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, inner_dim=base.ffn_dim, activation_fn="gelu-approximate")
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        # the action expert
        self.action_norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.action_norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if base.cross_attn_norm else nn.Identity()
        self.action_ffn = FeedForward(dim, inner_dim=cfg.action_ffn_dim, activation_fn="gelu-approximate")
        self.action_norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table_action = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(
        self,
        x: torch.Tensor,
        modulation: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        text_kv: TextKV,
        self_kv: LayerKV,
        *,
        action_mode: bool,
    ) -> torch.Tensor:
        # LingBot-VA's block arithmetic (float32 sums, per-token modulation) over the stream's own modules
        if action_mode:
            table, norm1, norm2, ffn, norm3 = self.scale_shift_table_action, self.action_norm1, self.action_norm2, self.action_ffn, self.action_norm3
        else:
            table, norm1, norm2, ffn, norm3 = self.scale_shift_table, self.norm1, self.norm2, self.ffn, self.norm3
        shift, scale, gate, c_shift, c_scale, c_gate = (table[None] + modulation.float()).unbind(2)
        h = (norm1(x.float()) * (1.0 + scale) + shift).type_as(x)
        x = (x.float() + self.attn1.stream_self_attention(h, rope, self_kv, action_mode=action_mode) * gate).type_as(x)
        x = x + self.attn2.stream_cross_attention(norm2(x.float()).type_as(x), text_kv, action_mode=action_mode)
        h = (norm3(x.float()) * (1.0 + c_scale) + c_shift).type_as(x)
        return (x.float() + ffn(h).float() * c_gate).type_as(x)


class ZeroWAMTransformer(nn.Module):
    def __init__(self, cfg: ZeroWAMConfig) -> None:
        super().__init__()
        self.config = cfg
        base, dim = cfg.base, cfg.dim
        self.rope = RotaryPositions(base.attention_head_dim)
        self.patch_embedding_mlp = nn.Linear(base.in_channels * base.patch_volume, dim)
        self.action_embedder = nn.Linear(base.action_dim, dim, bias=cfg.action_embedder_bias)
        self.condition_embedder = TimeTextEmbedding(dim, base.freq_dim, base.text_dim)
        self.condition_embedder_action = TimeTextEmbedding(dim, base.freq_dim, base.text_dim, with_text=False)
        self.blocks = nn.ModuleList([ZeroWAMBlock(cfg) for _ in range(base.num_layers)])
        self.norm_out = FP32LayerNorm(dim, base.eps, elementwise_affine=False)
        self.action_norm_out = FP32LayerNorm(dim, base.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, base.out_channels * base.patch_volume)
        self.action_proj_out = nn.Linear(dim, base.action_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.scale_shift_table_action = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def project_text(self, text_embeddings: torch.Tensor) -> list[TextKV]:
        """Every layer's cross-attention K/V for UMT5 embeddings (B, 512, text_dim), shared by both streams."""
        text = self.condition_embedder.text_embedder(text_embeddings)
        return [block.attn2.project_text(text) for block in self.blocks]

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
        """One stream's forward, with LingBot-VA's arguments (:meth:`LingBotVATransformer.forward`): latents
        (B, C, F, H, W) or actions (B, action_dim, F, N, 1), per-frame ``timesteps`` (B, F), positions ``grid``
        (B, 3, L), text embeddings or :meth:`project_text`'s K/V, per-layer ``self_kv``. The velocity, in the
        input's layout."""
        base = self.config.base
        batch, _, frames, height, width = inputs.shape
        if action_mode:
            x = self.action_embedder(inputs.flatten(2).transpose(1, 2))
            tokens_per_frame = height * width
        else:
            x = self.patch_embedding_mlp(patchify(inputs, base.patch_size))
            tokens_per_frame = (height // base.patch_size[1]) * (width // base.patch_size[2])
        if isinstance(text, torch.Tensor):
            text = self.project_text(text)
        rope = self.rope(grid)
        embedder = self.condition_embedder_action if action_mode else self.condition_embedder
        temb, modulation = embedder(timesteps.repeat_interleave(tokens_per_frame, dim=1), dtype=x.dtype)
        for i, block in enumerate(self.blocks):
            x = block(x, modulation, rope, text[i], None if self_kv is None else self_kv[i], action_mode=action_mode)
        table, norm_out = (self.scale_shift_table_action, self.action_norm_out) if action_mode else (self.scale_shift_table, self.norm_out)
        shift, scale = (table[None] + temb[:, :, None]).unbind(2)
        x = (norm_out(x.float()) * (1.0 + scale) + shift).type_as(x)
        if action_mode:
            return self.action_proj_out(x).transpose(1, 2).reshape(batch, base.action_dim, frames, height, width)
        return unpatchify(self.proj_out(x), base.patch_size, base.out_channels, (frames, height, width))


# ----------------------------------------------------------------------------- the released state dict


def dropped_tensors(cfg: ZeroWAMConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of what a released state dict holds besides :class:`ZeroWAMTransformer`'s parameters: read,
    checked and dropped on load (module docstring). The MCP heads only when ``enable_mcp``; the cross-attention
    aliases (:func:`alias_tensors`) are optional and not listed."""
    base, dim = cfg.base, cfg.dim
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (dim, base.in_channels, *base.patch_size),
        "patch_embedding.bias": (dim,),
        f"{UNUSED_TEXT_COPY}linear_1.weight": (dim, base.text_dim),
        f"{UNUSED_TEXT_COPY}linear_1.bias": (dim,),
        f"{UNUSED_TEXT_COPY}linear_2.weight": (dim, dim),
        f"{UNUSED_TEXT_COPY}linear_2.bias": (dim,),
    }
    if cfg.enable_mcp:
        shapes |= {
            "mcp_mlp_hidden.0.weight": (dim, dim * len(cfg.mcp_hidden_collect_layers)),
            "mcp_mlp_hidden.0.bias": (dim,),
            "mcp_mlp_hidden.2.weight": (dim, dim),
            "mcp_mlp_hidden.2.bias": (dim,),
        }
        with torch.device("meta"):
            block = {name: tuple(p.shape) for name, p in ZeroWAMBlock(cfg).state_dict().items()}
        for i in range(cfg.num_mcp_modules):
            shapes |= {f"mcp_projections.{i}.weight": (dim, 2 * dim), f"mcp_projections.{i}.bias": (dim,)}
            for j in range(cfg.mcp_blocks_per_group):
                shapes |= {f"mcp_blocks.{i}.{j}.{name}": shape for name, shape in block.items()}
    return shapes


def alias_tensors(names: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The ``attn2.action_to_{k,v}`` / ``action_norm_k`` names upstream's state dict repeats ``attn2.to_k`` ... under."""
    out = {}
    for name, shape in names.items():
        head, _, tail = name.partition("attn2.")
        if not tail:
            continue
        for alias, source in CROSS_ALIASES.items():
            if tail.startswith(source + "."):
                out[f"{head}attn2.{alias}{tail[len(source) :]}"] = shape
    return out


def split_released_state(cfg: ZeroWAMConfig, model: nn.Module, state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The parameters of ``model`` from a released state dict, every other key accounted for or refused by name."""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    dropped = dropped_tensors(cfg)
    # present or not: a writer that deduplicates shared tensors keeps one name
    aliases = alias_tensors({k: v for k, v in (expected | dropped).items() if k.startswith(("blocks.", "mcp_blocks."))})
    missing = sorted(set(expected) - set(state)) + sorted(set(dropped) - set(state))
    unexpected = sorted(set(state) - set(expected) - set(aliases) - set(dropped))
    wrong = sorted(n for n, t in state.items() if n in (expected | aliases | dropped) and tuple(t.shape) != (expected | aliases | dropped)[n])
    if missing or unexpected or wrong:
        raise ValueError(
            f"{where}: the weights do not match Zero-WAM's {cfg.base.num_layers}-layer transformer "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]}, wrong shape {wrong[:4]})"
        )
    for alias in sorted(set(aliases) & set(state)):  # the same tensor upstream; a copy that differs is not
        head, _, tail = alias.partition("attn2.")
        name, _, leaf = tail.partition(".")
        source = f"{head}attn2.{CROSS_ALIASES[name]}.{leaf}"
        if not torch.equal(state[alias], state[source]):
            raise ValueError(f"{where}: {alias} differs from {source} (upstream's aliases of one module)")
    return {name: state[name] for name in expected}


def load_zero_wam_transformer(directory: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> ZeroWAMTransformer:
    """A released ``transformer/`` directory (config.json + diffusion_pytorch_model*.safetensors, sharded or not)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg = ZeroWAMConfig.from_file(directory / "config.json")
    shards = sorted(directory.glob("diffusion_pytorch_model*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory}: no diffusion_pytorch_model*.safetensors")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state |= load_file(shard)
    with torch.device("meta"):
        model = ZeroWAMTransformer(cfg)
    model.load_state_dict(split_released_state(cfg, model, state, str(directory)), strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def parameter_count(cfg: ZeroWAMConfig) -> int:
    """Parameters served (what :func:`load_zero_wam_transformer` keeps), for the memory plan."""
    with torch.device("meta"):
        return sum(math.prod(p.shape) for p in ZeroWAMTransformer(cfg).parameters())
