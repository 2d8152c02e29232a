"""Zero-WAM's transformer config, read key by key (torch-free).

Zero-WAM (``jianwenli96/Zero-WAM``, weights ``robbyant-research/zero-wam-*``) is LingBot-VA's transformer with
its own action expert: the action stream keeps LingBot-VA's shapes but gets its own attention projections, norms,
feed-forward and output modulation (upstream ``WanICLTransformer3DModel``, ``wan_va/modules/icl_model.py``). Its
``transformer/config.json`` is diffusers' record of that class's ``__init__`` arguments. Every key is read here:
the shared sizes go into LingBot-VA's :class:`~ardiff_policies.lingbot_va.checkpoint.TransformerConfig` (one
definition of what the two share), the action expert's and the window's into :class:`ZeroWAMConfig`; the keys
upstream itself refuses at other values (``attn_moe``, ``fully_share``) are refused here by name, and so is
anything unknown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ardiff_policies.lingbot_va.checkpoint import TransformerConfig, read_config_json, read_diffusers_header

ZERO_WAM_CLASS = "WanICLTransformer3DModel"
# LingBot-VA's keys Zero-WAM's class also takes (everything but ``attn_mode``: Zero-WAM has one attention path).
_SHARED_KEYS = tuple(f.name for f in fields(TransformerConfig) if f.name != "attn_mode")


@dataclass(frozen=True)
class ZeroWAMConfig:
    """Upstream's ``WanICLTransformer3DModel`` arguments (defaults: the released checkpoints' values)."""

    base: TransformerConfig = field(default_factory=TransformerConfig)
    # The action expert's width. Upstream builds the action stream's time embedder as a copy of the video one
    # (width heads x head_dim) and adds it to a table of this width, so any other value fails in its forward:
    # refused here at start-up instead.
    action_inner_dim: int = 3072
    action_ffn_dim: int = 14336
    action_embedder_bias: bool = True
    # The attention window in frame ids (video chunk c at 2c, its actions at 2c + 1; the in-context block at 0
    # and outside the window). The model's value, not the serving config's: upstream's server reads the
    # transformer's (docs/icl_inference.md §3).
    attn_window: int = 64
    # Multi-chunk prediction heads: a training-time auxiliary loss, never run while serving (upstream's streaming
    # forward skips them). Read so that their weights are accounted for and dropped on load.
    enable_mcp: bool = True
    num_mcp_modules: int = 4
    mcp_blocks_per_group: int = 1
    mcp_hidden_collect_layers: tuple[int, ...] = (3, 11, 19, 29)

    def __post_init__(self) -> None:
        if self.action_inner_dim != self.base.dim:
            raise ValueError(
                f"zero-wam transformer config: action_inner_dim {self.action_inner_dim} must equal "
                f"num_attention_heads x attention_head_dim = {self.base.dim} (upstream's action time embedder has that width)"
            )
        for name in ("action_ffn_dim", "num_mcp_modules", "mcp_blocks_per_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"zero-wam transformer config: {name} must be a positive integer, got {value!r}")
        if isinstance(self.attn_window, bool) or not isinstance(self.attn_window, int) or not (self.attn_window == -1 or self.attn_window > 0):
            raise ValueError(f"zero-wam transformer config: attn_window must be -1 (unbounded) or positive, got {self.attn_window!r}")
        for name in ("action_embedder_bias", "enable_mcp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"zero-wam transformer config: {name} must be true or false, got {getattr(self, name)!r}")
        layers = self.mcp_hidden_collect_layers
        if self.enable_mcp and not all(isinstance(i, int) and 0 <= i < self.base.num_layers for i in layers):
            raise ValueError(f"zero-wam transformer config: mcp_hidden_collect_layers {list(layers)} must be layer indices < {self.base.num_layers}")

    @property
    def dim(self) -> int:
        return self.base.dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ZeroWAMConfig:
        raw = read_diffusers_header(raw, ZERO_WAM_CLASS, "Zero-WAM", "zero-wam transformer config")
        # Upstream raises on any other value ("The released ICL checkpoints require ..."): so does this.
        if raw.pop("attn_moe", True) is not True:
            raise ValueError("zero-wam transformer config: attn_moe must be true (the action expert's own attention projections)")
        if raw.pop("fully_share", False) is not False:
            raise ValueError("zero-wam transformer config: fully_share must be false (the action expert's own blocks)")
        own = {f.name for f in fields(cls)} - {"base"}
        unknown = sorted(set(raw) - own - set(_SHARED_KEYS))
        if unknown:
            raise ValueError(f"zero-wam transformer config: unknown key(s) {unknown}; {ZERO_WAM_CLASS} takes {sorted(own | set(_SHARED_KEYS))}")
        shared = {k: raw.pop(k) for k in _SHARED_KEYS if k in raw}
        if "patch_size" in shared:
            shared["patch_size"] = tuple(shared["patch_size"])
        if "mcp_hidden_collect_layers" in raw:
            raw["mcp_hidden_collect_layers"] = tuple(raw["mcp_hidden_collect_layers"])
        return cls(base=TransformerConfig(**shared), **raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ZeroWAMConfig:
        path = Path(path)
        raw = read_config_json(path)
        try:
            return cls.from_dict(raw)
        except (ValueError, TypeError) as exc:  # TypeError: a key of the wrong shape
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """``config.json`` as diffusers writes it for upstream's class."""
        shared = {k: v for k, v in asdict(self.base).items() if k in _SHARED_KEYS}
        shared["patch_size"] = list(self.base.patch_size)
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "base"}
        own["mcp_hidden_collect_layers"] = list(self.mcp_hidden_collect_layers)
        return {"_class_name": ZERO_WAM_CLASS, **shared, **own, "pos_embed_seq_len": None, "attn_moe": True, "fully_share": False}
