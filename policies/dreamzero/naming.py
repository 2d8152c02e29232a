"""Checkpoint naming: where each DreamZero component lives in the checkpoint, and how upstream
tensor names map onto this project's modules.

The released checkpoint stores every component under its upstream module's names: the DiT
(``action_head.model.*``, kept unchanged by ``dit.py``), the Wan-T5 text encoder, the open-CLIP
visual tower and the original Wan VAE (Wan2.1 ``VideoVAE_`` or Wan2.2 ``VideoVAE38_``). `text_encoder_targets`, `image_encoder_targets` and
`vae_targets` map one upstream key (component prefix stripped) onto the library modules' own
`state_dict()` keys (transformers / diffusers naming, see ``encoders.py`` and ``policies/wan/``), each with the tensor
transform it needs. The maps are pure functions of names, so the same code streams real tensors
(``checkpoint.py``), checks shapes on the meta device, and lays out the tiny checkpoint
(``upstream_layout.py``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ardiff_policies.wan.vae import check_vae_config

DIT_PREFIX = "action_head.model."
TEXT_ENCODER_PREFIX = "action_head.text_encoder."
IMAGE_ENCODER_PREFIX = "action_head.image_encoder.model."
VAE_PREFIX = "action_head.vae.model."
COMPONENT_PREFIXES = (DIT_PREFIX, TEXT_ENCODER_PREFIX, IMAGE_ENCODER_PREFIX, VAE_PREFIX)


# ---------------------------------------------------------------------------------------------


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _flatten(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1)


def _drop_leading_dim(tensor: Tensor) -> Tensor:
    return tensor.reshape(tensor.shape[1:])


def _transpose(tensor: Tensor) -> Tensor:
    return tensor.t().contiguous()


def _chunk(tensor: Tensor, *, index: int, parts: int) -> Tensor:
    return tensor.chunk(parts, dim=0)[index]


@dataclass(frozen=True)
class Target:
    """Where one upstream tensor goes: a key of the wrapper's `state_dict()` and how to reshape it."""

    name: str
    transform: Callable[[Tensor], Tensor] = _identity


def convert_state_dict(source: Mapping[str, Tensor], targets_of: Callable[[str], list[Target]]) -> dict[str, Tensor]:
    """Maps a whole upstream-named state dict (prefix stripped) with one of the key maps."""
    converted: dict[str, Tensor] = {}
    for key, tensor in source.items():
        for target in targets_of(key):
            if target.name in converted:
                raise ValueError(f"{target.name!r} is produced twice (again by {key!r})")
            converted[target.name] = target.transform(tensor)
    return converted


def _unknown(component: str, key: str) -> KeyError:
    return KeyError(f"unknown {component} checkpoint key {key!r}")


# Wan-T5 block parameter -> UMT5 block parameter.
_T5_BLOCK_PARAMS = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    # Upstream FFN: fc2(fc1(x) * gelu(gate(x))); UMT5: wo(gelu(wi_0(x)) * wi_1(x)).
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")


def text_encoder_targets(key: str) -> list[Target]:
    """Upstream `WanTextEncoder` key (no prefix) -> `TextEncoder` state-dict targets."""
    if key == "token_embedding.weight":
        # UMT5EncoderModel ties `shared` and `encoder.embed_tokens`; both appear in state_dict().
        return [Target("model.shared.weight"), Target("model.encoder.embed_tokens.weight")]
    if key == "norm.weight":
        return [Target("model.encoder.final_layer_norm.weight")]
    match = _BLOCK_KEY.fullmatch(key)
    if match is not None and match[2] in _T5_BLOCK_PARAMS:
        return [Target(f"model.encoder.block.{match[1]}.{_T5_BLOCK_PARAMS[match[2]]}")]
    raise _unknown("text encoder", key)


_CLIP_TOP_LEVEL: dict[str, Target] = {
    "log_scale": Target("logit_scale"),
    # open-CLIP keeps the class and position embeddings with leading batch dims: (1, 1, D), (1, N, D).
    "visual.cls_embedding": Target("model.vision_model.embeddings.class_embedding", _flatten),
    "visual.pos_embedding": Target("model.vision_model.embeddings.position_embedding.weight", _drop_leading_dim),
    "visual.patch_embedding.weight": Target("model.vision_model.embeddings.patch_embedding.weight"),
    "visual.pre_norm.weight": Target("model.vision_model.pre_layrnorm.weight"),
    "visual.pre_norm.bias": Target("model.vision_model.pre_layrnorm.bias"),
    "visual.post_norm.weight": Target("model.vision_model.post_layernorm.weight"),
    "visual.post_norm.bias": Target("model.vision_model.post_layernorm.bias"),
    # open-CLIP projects with `x @ head`; nn.Linear computes `x @ weight.T`.
    "visual.head": Target("model.visual_projection.weight", _transpose),
}
_CLIP_BLOCK_PARAMS = {
    "norm1.weight": "layer_norm1.weight",
    "norm1.bias": "layer_norm1.bias",
    "attn.proj.weight": "self_attn.out_proj.weight",
    "attn.proj.bias": "self_attn.out_proj.bias",
    "norm2.weight": "layer_norm2.weight",
    "norm2.bias": "layer_norm2.bias",
    "mlp.0.weight": "mlp.fc1.weight",
    "mlp.0.bias": "mlp.fc1.bias",
    "mlp.2.weight": "mlp.fc2.weight",
    "mlp.2.bias": "mlp.fc2.bias",
}
_CLIP_BLOCK_KEY = re.compile(r"visual\.transformer\.(\d+)\.(.+)")


def image_encoder_targets(key: str) -> list[Target]:
    """Upstream `XLMRobertaCLIP` key (no prefix, e.g. `visual.head`) -> `ImageEncoder` targets."""
    if key in _CLIP_TOP_LEVEL:
        return [_CLIP_TOP_LEVEL[key]]
    match = _CLIP_BLOCK_KEY.fullmatch(key)
    if match is not None:
        layer, param = f"model.vision_model.encoder.layers.{match[1]}", match[2]
        if param in ("attn.to_qkv.weight", "attn.to_qkv.bias"):
            # Fused rows are [q; k; v] (upstream splits with `.chunk(3, dim=-1)` on the output).
            suffix = param.rsplit(".", 1)[1]
            return [
                Target(f"{layer}.self_attn.{proj}.{suffix}", functools.partial(_chunk, index=i, parts=3))
                for i, proj in enumerate(("q_proj", "k_proj", "v_proj"))
            ]
        if param in _CLIP_BLOCK_PARAMS:
            return [Target(f"{layer}.{_CLIP_BLOCK_PARAMS[param]}")]
    raise _unknown("image encoder", key)


# Parameters of the three Wan-VAE block kinds, upstream name -> diffusers name.
_VAE_RESNET_PARAMS = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight",
    "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight",
    "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight",
    "shortcut.bias": "conv_shortcut.bias",
}
_VAE_RESAMPLE_PARAMS = {p: p for p in ("resample.1.weight", "resample.1.bias", "time_conv.weight", "time_conv.bias")}
_VAE_ATTENTION_PARAMS = {p: p for p in ("norm.gamma", "to_qkv.weight", "to_qkv.bias", "proj.weight", "proj.bias")}
_VAE_BLOCK_PARAMS = {"resnet": _VAE_RESNET_PARAMS, "resample": _VAE_RESAMPLE_PARAMS, "attention": _VAE_ATTENTION_PARAMS}

# Upstream `middle` is [resnet, attention, resnet]; diffusers splits it by kind.
_VAE_MIDDLE = {
    "0": ("mid_block.resnets.0", "resnet"),
    "1": ("mid_block.attentions.0", "attention"),
    "2": ("mid_block.resnets.1", "resnet"),
}
_VAE_HEAD = {"head.0.gamma": "norm_out.gamma", "head.2.weight": "conv_out.weight", "head.2.bias": "conv_out.bias"}
_VAE_TOP_LEVEL = {
    "conv1.weight": "quant_conv.weight",
    "conv1.bias": "quant_conv.bias",
    "conv2.weight": "post_quant_conv.weight",
    "conv2.bias": "post_quant_conv.bias",
}
_VAE_STAGE_KEY = re.compile(r"(encoder|decoder)\.(.+)")
_VAE_SEQUENCE_KEY = re.compile(r"(downsamples|upsamples|middle)\.(\d+)\.(.+)")


@functools.lru_cache(maxsize=8)
def _vae_sequences(num_levels: int, num_res_blocks: int) -> dict[str, tuple[tuple[str, str], ...]]:
    """Upstream's flat `downsamples` / `upsamples` lists as (diffusers block path, kind) per index."""
    last = num_levels - 1
    encoder_kinds: list[str] = []
    decoder: list[tuple[str, str]] = []
    for level in range(num_levels):
        encoder_kinds += ["resnet"] * num_res_blocks + (["resample"] if level < last else [])
        # The decoder has num_res_blocks + 1 resnets per level, then an upsampler except at the last.
        decoder += [(f"up_blocks.{level}.resnets.{j}", "resnet") for j in range(num_res_blocks + 1)]
        if level < last:
            decoder.append((f"up_blocks.{level}.upsamplers.0", "resample"))
    # diffusers keeps the encoder's flat list (`down_blocks.N`) but groups the decoder's by level.
    encoder = tuple((f"down_blocks.{n}", kind) for n, kind in enumerate(encoder_kinds))
    return {"downsamples": encoder, "upsamples": tuple(decoder)}


_VAE22_NESTED_KEY = re.compile(r"(downsamples|upsamples)\.(\d+)\.(downsamples|upsamples)\.(\d+)\.(.+)")


def vae_targets(key: str, vae_config: Mapping[str, Any]) -> list[Target]:
    """Upstream `VideoVAE_` / `VideoVAE38_` key (no prefix) -> `VideoVAE` targets, for the VAE built from `vae_config`."""
    check_vae_config(vae_config)
    if key in _VAE_TOP_LEVEL:
        return [Target(f"model.{_VAE_TOP_LEVEL[key]}")]
    stage_match = _VAE_STAGE_KEY.fullmatch(key)
    if stage_match is None:
        raise _unknown("VAE", key)
    stage, rest = stage_match[1], stage_match[2]
    if rest in ("conv1.weight", "conv1.bias"):
        return [Target(f"model.{stage}.conv_in.{rest.split('.')[1]}")]
    if rest in _VAE_HEAD:
        return [Target(f"model.{stage}.{_VAE_HEAD[rest]}")]
    if vae_config.get("is_residual"):
        block = _vae22_block(stage, rest, vae_config)
    else:
        block = _vae21_block(stage, rest, vae_config)
    if block is None or block[2] not in _VAE_BLOCK_PARAMS[block[1]]:
        raise _unknown("VAE", key)
    path, kind, param = block
    return [Target(f"model.{stage}.{path}.{_VAE_BLOCK_PARAMS[kind][param]}")]


def _vae21_block(stage: str, rest: str, vae_config: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """Wan2.1: flat `downsamples` / `upsamples` lists and `middle` -> (diffusers block path, kind, param)."""
    match = _VAE_SEQUENCE_KEY.fullmatch(rest)
    if match is None:
        return None
    sequence, index, param = match[1], match[2], match[3]
    if sequence == "middle":
        block = _VAE_MIDDLE.get(index)
    elif (sequence == "downsamples") == (stage == "encoder"):
        blocks = _vae_sequences(len(vae_config["dim_mult"]), vae_config["num_res_blocks"])[sequence]
        block = blocks[int(index)] if int(index) < len(blocks) else None
    else:
        block = None  # `encoder.upsamples` / `decoder.downsamples`
    return None if block is None else (*block, param)


def _vae22_block(stage: str, rest: str, vae_config: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """Wan2.2: one residual block per level, each a `downsamples` / `upsamples` list of resnets and a final
    resampler (its shortcut has no parameters); diffusers names them `down_blocks.N.{resnets.M,downsampler}` and
    `up_blocks.N.{resnets.M,upsampler}`. `middle` as in Wan2.1."""
    middle = _VAE_SEQUENCE_KEY.fullmatch(rest)
    if middle is not None and middle[1] == "middle":
        block = _VAE_MIDDLE.get(middle[2])
        return None if block is None else (*block, middle[3])
    match = _VAE22_NESTED_KEY.fullmatch(rest)
    sequence = "downsamples" if stage == "encoder" else "upsamples"
    if match is None or match[1] != sequence or match[3] != sequence:
        return None
    level, index, param = int(match[2]), int(match[4]), match[5]
    levels = len(vae_config["dim_mult"])
    resnets = vae_config["num_res_blocks"] + (0 if stage == "encoder" else 1)
    if level >= levels:
        return None
    blocks = "down_blocks" if stage == "encoder" else "up_blocks"
    if index < resnets:
        return f"{blocks}.{level}.resnets.{index}", "resnet", param
    if index == resnets and level < levels - 1:  # the last level does not resample
        return f"{blocks}.{level}.{'downsampler' if stage == 'encoder' else 'upsampler'}", "resample", param
    return None


def identity_targets(key: str) -> list[Target]:
    """Checkpoint names equal module names (the DiT keeps upstream's names)."""
    return [Target(key)]
