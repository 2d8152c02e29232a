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
from pathlib import Path

import torch
import torch.nn as nn
from diffusers.models.attention import FeedForward
from diffusers.models.normalization import FP32LayerNorm

from ardiff_policies.lingbot_va.checkpoint import TransformerConfig
from ardiff_policies.lingbot_va.model import Attention, LingBotVATransformer, TransformerBlock, read_released_state
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig

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

    def query_out(self, action_mode: bool) -> tuple[nn.Module, nn.Module, nn.Module]:
        if not action_mode:
            return super().query_out(action_mode)
        return self.action_to_q, self.action_norm_q, self.action_to_out[0]

    def key_value(self, action_mode: bool) -> tuple[nn.Module, nn.Module, nn.Module]:
        if not action_mode:
            return super().key_value(action_mode)
        return self.action_to_k, self.action_norm_k, self.action_to_v


class ZeroWAMBlock(TransformerBlock):
    """LingBot-VA's block (the video stream, names and all; its arithmetic for both streams) plus the action expert."""

    def __init__(self, cfg: ZeroWAMConfig) -> None:
        base, dim = cfg.base, cfg.dim
        super().__init__(base)
        self.action_norm1 = FP32LayerNorm(dim, base.eps, elementwise_affine=False)
        self.action_norm2 = FP32LayerNorm(dim, base.eps, elementwise_affine=True) if base.cross_attn_norm else nn.Identity()
        self.action_ffn = FeedForward(dim, inner_dim=cfg.action_ffn_dim, activation_fn="gelu-approximate")
        self.action_norm3 = FP32LayerNorm(dim, base.eps, elementwise_affine=False)
        self.scale_shift_table_action = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def attention(self, cfg: TransformerConfig, *, cross: bool) -> Attention:
        return ExpertAttention(cfg.dim, cfg.num_attention_heads, cfg.eps, cross=cross)

    def stream_modules(self, action_mode: bool) -> tuple[torch.Tensor, nn.Module, nn.Module, nn.Module, nn.Module]:
        if not action_mode:
            return super().stream_modules(action_mode)
        return self.scale_shift_table_action, self.action_norm1, self.action_norm2, self.action_ffn, self.action_norm3


class ZeroWAMTransformer(LingBotVATransformer):
    """LingBot-VA's transformer, its forward included, with :class:`ZeroWAMBlock` blocks and the action stream's own
    output norm and table. ``config`` is the :class:`ZeroWAMConfig`; the shared sizes are its ``base``."""

    def __init__(self, cfg: ZeroWAMConfig) -> None:
        super().__init__(cfg.base, block=lambda: ZeroWAMBlock(cfg), action_embedder_bias=cfg.action_embedder_bias)
        self.config = cfg
        dim = cfg.dim
        self.action_norm_out = FP32LayerNorm(dim, cfg.base.eps, elementwise_affine=False)
        self.scale_shift_table_action = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    @property
    def stream_config(self) -> TransformerConfig:
        return self.config.base

    def output_modules(self, action_mode: bool) -> tuple[torch.Tensor, nn.Module]:
        if not action_mode:
            return super().output_modules(action_mode)
        return self.scale_shift_table_action, self.action_norm_out


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
    directory = Path(directory)
    cfg = ZeroWAMConfig.from_file(directory / "config.json")
    state = read_released_state(directory)
    with torch.device("meta"):
        model = ZeroWAMTransformer(cfg)
    model.load_state_dict(split_released_state(cfg, model, state, str(directory)), strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def parameter_count(cfg: ZeroWAMConfig) -> int:
    """Parameters served (what :func:`load_zero_wam_transformer` keeps), for the memory plan."""
    with torch.device("meta"):
        return sum(math.prod(p.shape) for p in ZeroWAMTransformer(cfg).parameters())
