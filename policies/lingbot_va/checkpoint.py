"""LingBot-VA's checkpoint config, read key by key (torch-free).

``transformer/config.json`` of a released checkpoint is diffusers' ``register_to_config`` record of
upstream's ``WanTransformer3DModel.__init__`` arguments (``wan_va/modules/model.py``). Every key is
read here: the network's sizes go into :class:`TransformerConfig`; keys that do not change the
network (upstream accepts them and never uses them) are checked and named; anything else is refused
by name, so a checkpoint of another model or a newer format fails at start-up, not mid-episode.
The embodiment is not in a checkpoint: ``embodiments.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

TRANSFORMER_CLASS = "WanTransformer3DModel"

# diffusers' bookkeeping, written by save_pretrained: nothing in them shapes the network.
_DIFFUSERS_METADATA = frozenset({"_class_name", "_diffusers_version", "_name_or_path"})
# upstream's attention kernel choice (wan_va/modules/model.py: custom_sdpa or flash_attn_func; LeRobot's port adds
# flex): the same attention either way. Here attention is the engine's paged attention, so the value is checked and
# otherwise unused.
ATTN_MODES = frozenset({"torch", "flashattn", "flex"})


def read_config_json(path: Path) -> dict[str, Any]:
    """A transformer's ``config.json`` as a dict, or a one-line ValueError naming the file."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the transformer config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"transformer config {path}: expected a JSON object")
    return raw


def read_diffusers_header(raw: dict[str, Any], class_name: str, model: str, where: str) -> dict[str, Any]:
    """``config.json``'s keys less diffusers' own bookkeeping, once its ``_class_name`` is ``class_name`` (``model``'s)
    and its ``pos_embed_seq_len`` null: a copy, so the caller may pop what it reads."""
    raw = dict(raw)
    found = raw.pop("_class_name", class_name)
    if found != class_name:
        raise ValueError(f"{where}: _class_name {found!r} is not {model}'s {class_name!r}")
    for key in _DIFFUSERS_METADATA:
        raw.pop(key, None)
    # Passed by upstream to its time/text embedder, which ignores it: only the released value (null) is accepted,
    # so a checkpoint that relies on a learned position table is refused rather than served without it.
    if raw.pop("pos_embed_seq_len", None) is not None:
        raise ValueError(f"{where}: pos_embed_seq_len must be null (upstream has no position table)")
    return raw


@dataclass(frozen=True)
class TransformerConfig:
    """The network's sizes, with upstream's names and defaults (the released 5B's values)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    in_channels: int = 48
    out_channels: int = 48
    action_dim: int = 30
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 14336
    num_layers: int = 30
    cross_attn_norm: bool = True
    eps: float = 1e-6
    # Stored by upstream and never used (RoPE angles are computed from grid ids, unbounded); kept so that a
    # config round-trips, and checked to be a positive integer.
    rope_max_seq_len: int = 1024
    attn_mode: str = "torch"

    def __post_init__(self) -> None:
        if len(self.patch_size) != 3 or any(int(p) != p or p < 1 for p in self.patch_size):
            raise ValueError(f"transformer config: patch_size must be 3 positive integers, got {list(self.patch_size)}")
        for name in (
            "num_attention_heads",
            "attention_head_dim",
            "in_channels",
            "out_channels",
            "action_dim",
            "text_dim",
            "freq_dim",
            "ffn_dim",
            "num_layers",
            "rope_max_seq_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"transformer config: {name} must be a positive integer, got {value!r}")
        if self.freq_dim % 2:
            raise ValueError(f"transformer config: freq_dim must be even (sin and cos halves), got {self.freq_dim}")
        d = self.attention_head_dim
        if d % 2 or (d // 3) % 2:
            # RoPE splits the head into frame / height / width parts of d - 2 (d // 3), d // 3, d // 3 dimensions,
            # each rotated in pairs: upstream's complex view fails on an odd part.
            raise ValueError(
                f"transformer config: attention_head_dim {d} splits into RoPE parts {d - 2 * (d // 3)}/{d // 3}/{d // 3}; each must be even"
            )
        if self.attn_mode not in ATTN_MODES:
            raise ValueError(f"transformer config: attn_mode {self.attn_mode!r} is not one of {sorted(ATTN_MODES)}")
        if not isinstance(self.cross_attn_norm, bool):
            raise ValueError(f"transformer config: cross_attn_norm must be true or false, got {self.cross_attn_norm!r}")
        if not self.eps > 0:
            raise ValueError(f"transformer config: eps must be positive, got {self.eps!r}")

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TransformerConfig:
        raw = read_diffusers_header(raw, TRANSFORMER_CLASS, "LingBot-VA", "transformer config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"transformer config: unknown key(s) {unknown}; LingBot-VA's WanTransformer3DModel takes {sorted(known)}")
        if "patch_size" in raw:
            raw["patch_size"] = tuple(raw["patch_size"])
        return cls(**raw)

    @classmethod
    def from_file(cls, path: str | Path) -> TransformerConfig:
        path = Path(path)
        raw = read_config_json(path)
        try:
            return cls.from_dict(raw)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        except TypeError as exc:  # a key of the wrong shape (e.g. patch_size not a list)
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """``config.json`` as diffusers writes it for upstream's class."""
        out = {"_class_name": TRANSFORMER_CLASS, **asdict(self), "pos_embed_seq_len": None}
        out["patch_size"] = list(self.patch_size)
        return out
