"""Wan's text encoder: UMT5-XXL (``transformers.UMT5EncoderModel``), per-token embeddings with padding zeroed.

Both families condition on it: DreamZero builds it with eager attention (upstream's own T5 rounds the softmax
probabilities in bf16, :meth:`TextEncoder.from_config`); LingBot-VA loads a released ``text_encoder/`` with
transformers' default attention, as its upstream does. The prompt's cleaning is :mod:`ardiff_policies.wan.prompt`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from transformers import UMT5Config, UMT5EncoderModel

# Wan's `umt5-xxl` encoder (upstream `WanTextEncoder` defaults): per-layer relative position
# buckets (UMT5, not T5's shared table), gated tanh-GELU FFN, RMS norm eps 1e-6, no attention
# scaling. `feed_forward_proj="gated-gelu"` makes transformers pick `gelu_new`, the tanh
# approximation upstream's `GELU` computes. Dropout is off: the encoder is frozen.
UMT5_XXL_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.0,
}


class TextEncoder(nn.Module):
    """UMT5 encoder; returns per-token embeddings with padded positions zeroed."""

    def __init__(self, model: UMT5EncoderModel) -> None:
        super().__init__()
        self.model = model

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None) -> TextEncoder:
        """Builds the encoder from `UMT5Config` fields; `cfg` overrides the UMT5-XXL defaults."""
        # Eager attention: upstream's T5Attention takes the softmax in float32 and casts the probabilities back to
        # the model dtype before multiplying with V, which transformers' eager path reproduces; its default (SDPA)
        # never rounds the probabilities, so in bf16 it differs.
        config = UMT5Config(**{**UMT5_XXL_ENCODER_CONFIG, **(cfg or {})}, attn_implementation="eager")
        return cls(UMT5EncoderModel(config)).eval().requires_grad_(False)

    @property
    def dim(self) -> int:
        return self.model.config.d_model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, L) token ids and mask -> (B, L, d_model) embeddings in the model's dtype."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # Upstream `encode_prompt` zeroes every position at or past the attended-token count;
        # the DiT cross-attends over all L positions, so these zeros are part of the condition.
        seq_lens = attention_mask.gt(0).sum(dim=1)
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        padded = positions[None, :] >= seq_lens[:, None]
        return hidden.masked_fill(padded[..., None], 0.0)
