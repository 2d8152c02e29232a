"""Tensor names and shapes of a DreamZero checkpoint in upstream naming, for any geometry.

The released checkpoint stores each component under its upstream module's names (Wan-T5,
open-CLIP, the original Wan VAE, the causal DiT). These functions produce that name -> shape
layout from the same configs the modules are built from. Two uses: the tiny checkpoint writer
(``tiny.py``) writes exactly this layout, and the tests check that the released model's
geometry reproduces ``reference/dreamzero_droid_tensors.json`` name for name, shape for shape.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

from policies.dreamzero.dit import CausalWanModel, DiTConfig
from policies.dreamzero.encoders import CLIP_VIT_H_14_CONFIG, UMT5_XXL_ENCODER_CONFIG, WAN21_VAE_CONFIG
from policies.dreamzero.naming import DIT_PREFIX, IMAGE_ENCODER_PREFIX, TEXT_ENCODER_PREFIX, VAE_PREFIX

Shapes = dict[str, tuple[int, ...]]


def text_encoder_layout(overrides: Mapping[str, Any] | None = None) -> Shapes:
    """Upstream ``WanTextEncoder`` (umt5 with per-block relative position tables)."""
    cfg = {**UMT5_XXL_ENCODER_CONFIG, **(overrides or {})}
    dim, inner, ffn = cfg["d_model"], cfg["num_heads"] * cfg["d_kv"], cfg["d_ff"]
    shapes: Shapes = {"token_embedding.weight": (cfg["vocab_size"], dim), "norm.weight": (dim,)}
    for i in range(cfg["num_layers"]):
        block = f"blocks.{i}"
        shapes |= {f"{block}.attn.{p}.weight": (inner, dim) for p in "qkv"}
        shapes |= {
            f"{block}.attn.o.weight": (dim, inner),
            f"{block}.norm1.weight": (dim,),
            f"{block}.norm2.weight": (dim,),
            f"{block}.ffn.gate.0.weight": (ffn, dim),
            f"{block}.ffn.fc1.weight": (ffn, dim),
            f"{block}.ffn.fc2.weight": (dim, ffn),
            f"{block}.pos_embedding.embedding.weight": (cfg["relative_attention_num_buckets"], cfg["num_heads"]),
        }
    return shapes


def image_encoder_layout(overrides: Mapping[str, Any] | None = None) -> Shapes:
    """Upstream open-CLIP visual tower (``XLMRobertaCLIP.visual``) plus its ``log_scale``."""
    cfg = {**CLIP_VIT_H_14_CONFIG, **(overrides or {})}
    dim, mlp, patch = cfg["hidden_size"], cfg["intermediate_size"], cfg["patch_size"]
    tokens = 1 + (cfg["image_size"] // patch) ** 2
    shapes: Shapes = {
        "log_scale": (),
        "visual.cls_embedding": (1, 1, dim),
        "visual.pos_embedding": (1, tokens, dim),
        "visual.patch_embedding.weight": (dim, cfg["num_channels"], patch, patch),
        "visual.head": (dim, cfg["projection_dim"]),
    }
    for norm in ("visual.pre_norm", "visual.post_norm"):
        shapes |= {f"{norm}.weight": (dim,), f"{norm}.bias": (dim,)}
    for i in range(cfg["num_hidden_layers"]):
        block = f"visual.transformer.{i}"
        shapes |= {f"{block}.{norm}.{p}": (dim,) for norm in ("norm1", "norm2") for p in ("weight", "bias")}
        shapes |= {
            f"{block}.attn.to_qkv.weight": (3 * dim, dim),
            f"{block}.attn.to_qkv.bias": (3 * dim,),
            f"{block}.attn.proj.weight": (dim, dim),
            f"{block}.attn.proj.bias": (dim,),
            f"{block}.mlp.0.weight": (mlp, dim),
            f"{block}.mlp.0.bias": (mlp,),
            f"{block}.mlp.2.weight": (dim, mlp),
            f"{block}.mlp.2.bias": (dim,),
        }
    return shapes


def vae_layout(overrides: Mapping[str, Any] | None = None) -> Shapes:
    """Upstream ``VideoVAE_``: flat ``downsamples`` / ``upsamples`` lists, ``middle`` [res, attn, res]."""
    cfg = {**WAN21_VAE_CONFIG, **(overrides or {})}
    dim, z_dim, dim_mult = cfg["base_dim"], cfg["z_dim"], list(cfg["dim_mult"])
    num_res_blocks, temporal = cfg["num_res_blocks"], list(cfg["temperal_downsample"])
    shapes: Shapes = {}

    def conv(name: str, c_out: int, c_in: int, kernel: tuple[int, ...]) -> None:
        shapes[f"{name}.weight"] = (c_out, c_in, *kernel)
        shapes[f"{name}.bias"] = (c_out,)

    def resnet(name: str, c_in: int, c_out: int) -> None:
        shapes[f"{name}.residual.0.gamma"] = (c_in, 1, 1, 1)
        conv(f"{name}.residual.2", c_out, c_in, (3, 3, 3))
        shapes[f"{name}.residual.3.gamma"] = (c_out, 1, 1, 1)
        conv(f"{name}.residual.6", c_out, c_out, (3, 3, 3))
        if c_in != c_out:
            conv(f"{name}.shortcut", c_out, c_in, (1, 1, 1))

    def middle(name: str, c: int) -> None:
        resnet(f"{name}.0", c, c)
        shapes[f"{name}.1.norm.gamma"] = (c, 1, 1)
        conv(f"{name}.1.to_qkv", 3 * c, c, (1, 1))
        conv(f"{name}.1.proj", c, c, (1, 1))
        resnet(f"{name}.2", c, c)

    last = len(dim_mult) - 1
    dims = [dim * m for m in [1, *dim_mult]]
    conv("encoder.conv1", dims[0], 3, (3, 3, 3))
    index = 0
    for level, (c_in, c_out) in enumerate(itertools.pairwise(dims)):
        for _ in range(num_res_blocks):
            resnet(f"encoder.downsamples.{index}", c_in, c_out)
            c_in, index = c_out, index + 1
        if level < last:
            conv(f"encoder.downsamples.{index}.resample.1", c_out, c_out, (3, 3))
            if temporal[level]:
                conv(f"encoder.downsamples.{index}.time_conv", c_out, c_out, (3, 1, 1))
            index += 1
    middle("encoder.middle", dims[-1])
    shapes["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("encoder.head.2", 2 * z_dim, dims[-1], (3, 3, 3))
    conv("conv1", 2 * z_dim, 2 * z_dim, (1, 1, 1))
    conv("conv2", z_dim, z_dim, (1, 1, 1))

    dims = [dim * m for m in [dim_mult[-1], *dim_mult[::-1]]]
    temporal_up = temporal[::-1]
    conv("decoder.conv1", dims[0], z_dim, (3, 3, 3))
    middle("decoder.middle", dims[0])
    index = 0
    for level, (c_in, c_out) in enumerate(itertools.pairwise(dims)):
        c_in = c_in // 2 if level > 0 else c_in  # each upsampler halves the channels
        for _ in range(num_res_blocks + 1):
            resnet(f"decoder.upsamples.{index}", c_in, c_out)
            c_in, index = c_out, index + 1
        if level < last:
            conv(f"decoder.upsamples.{index}.resample.1", c_out // 2, c_out, (3, 3))
            if temporal_up[level]:
                conv(f"decoder.upsamples.{index}.time_conv", 2 * c_out, c_out, (3, 1, 1))
            index += 1
    shapes["decoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("decoder.head.2", 3, dims[-1], (3, 3, 3))
    return shapes


def dit_layout(cfg: DiTConfig) -> Shapes:
    """The DiT keeps upstream's names: its own state dict is the layout."""
    with torch.device("meta"):
        model = CausalWanModel(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def checkpoint_layout(
    dit: DiTConfig,
    text_encoder: Mapping[str, Any] | None = None,
    image_encoder: Mapping[str, Any] | None = None,
    vae: Mapping[str, Any] | None = None,
) -> Shapes:
    """Every tensor of a DreamZero checkpoint with its full ``action_head.*`` name."""
    layout: Shapes = {}
    for prefix, shapes in (
        (DIT_PREFIX, dit_layout(dit)),
        (TEXT_ENCODER_PREFIX, text_encoder_layout(text_encoder)),
        (IMAGE_ENCODER_PREFIX, image_encoder_layout(image_encoder)),
        (VAE_PREFIX, vae_layout(vae)),
    ):
        layout |= {prefix + name: shape for name, shape in shapes.items()}
    return layout
