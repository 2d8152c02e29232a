"""DreamZero's CLIP image encoder: the open-CLIP XLM-RoBERTa ViT-H/14 visual tower of Wan2.1-I2V.

`ImageEncoder` wraps `transformers.CLIPVisionModelWithProjection`, read after its second-to-last block. DreamZero's
other two frozen encoders are Wan's, shared with LingBot-VA: UMT5 (`ardiff_policies.wan.text.TextEncoder`) and the
video VAE (`ardiff_policies.wan.vae.VideoVAE`). The key maps from upstream DreamZero's checkpoint names onto the
three live in `naming.py`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

# open-CLIP `xlm-roberta-large-vit-huge-14` visual tower: pre-norm ViT, exact (erf) GELU,
# LayerNorm eps 1e-5, class token, no patch-embedding bias, (1280 -> 1024) projection `head`.
CLIP_VIT_H_14_CONFIG: dict[str, Any] = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 14,
    "projection_dim": 1024,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "attention_dropout": 0.0,
}

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# transformers < 5 passes a required `causal_attention_mask` and returns a tuple; 5.x takes
# `(hidden_states, attention_mask)` and returns the hidden states.
_CLIP_LAYER_TAKES_CAUSAL_MASK = "causal_attention_mask" in inspect.signature(CLIPEncoderLayer.forward).parameters


def _run_clip_layer(layer: nn.Module, hidden: Tensor) -> Tensor:
    out = layer(hidden, None, None) if _CLIP_LAYER_TAKES_CAUSAL_MASK else layer(hidden, None)
    return out[0] if isinstance(out, tuple) else out


class ImageEncoder(nn.Module):
    """CLIP ViT visual tower; returns the tokens after all but its last block (upstream `use_31_block`)."""

    def __init__(self, model: CLIPVisionModelWithProjection) -> None:
        super().__init__()
        self.model = model
        # open-CLIP's contrastive temperature (upstream `log_scale`). Conditioning never reads it;
        # it is kept so that every checkpoint tensor has a home.
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None) -> ImageEncoder:
        """Builds the tower from `CLIPVisionConfig` fields; `cfg` overrides the ViT-H/14 defaults."""
        config = CLIPVisionConfig(**{**CLIP_VIT_H_14_CONFIG, **(cfg or {})})
        return cls(CLIPVisionModelWithProjection(config)).eval().requires_grad_(False)

    @property
    def image_size(self) -> int:
        return self.model.config.image_size

    @property
    def num_tokens(self) -> int:
        return 1 + (self.image_size // self.model.config.patch_size) ** 2

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @property
    def num_used_layers(self) -> int:
        """Blocks that run: all but the last. The last block, post-norm and projection are unused."""
        return self.model.config.num_hidden_layers - 1

    def rebuild_buffers(self, device: torch.device) -> None:
        """Recreate the non-persistent `position_ids` buffer after a meta-device load (it is not in
        any checkpoint; transformers derives it from the config)."""
        embeddings = self.model.vision_model.embeddings
        embeddings.position_ids = torch.arange(embeddings.num_positions, device=device).expand((1, -1))

    def forward(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) images in [-1, 1] -> (B, 1 + (image_size / patch)^2, hidden) tokens."""
        size = (self.image_size, self.image_size)
        pixels = F.interpolate(images, size=size, mode="bicubic", align_corners=False)
        # Upstream maps [-1, 1] to [0, 1], then applies torchvision's Normalize, whose mean/std
        # take the input's dtype.
        pixels = pixels * 0.5 + 0.5
        mean = torch.tensor(CLIP_MEAN, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        pixels = (pixels - mean) / std

        vision = self.model.vision_model
        hidden = vision.pre_layrnorm(vision.embeddings(pixels))
        for layer in vision.encoder.layers[: self.num_used_layers]:
            hidden = _run_clip_layer(layer, hidden)
        return hidden
