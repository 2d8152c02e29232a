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

from ardiff_policies.dreamzero.dit import CausalWanModel, DiTConfig
from ardiff_policies.dreamzero.encoders import CLIP_VIT_H_14_CONFIG
from ardiff_policies.dreamzero.naming import DIT_PREFIX, IMAGE_ENCODER_PREFIX, TEXT_ENCODER_PREFIX, VAE_PREFIX
from ardiff_policies.wan.text import UMT5_XXL_ENCODER_CONFIG
from ardiff_policies.wan.vae import WAN21_VAE_CONFIG, WAN22_VAE_CONFIG

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
    if (overrides or {}).get("is_residual"):
        return vae22_layout(overrides)
    cfg = {**WAN21_VAE_CONFIG, **(overrides or {})}
    dim, z_dim, dim_mult = cfg["base_dim"], cfg["z_dim"], list(cfg["dim_mult"])
    num_res_blocks, temporal = cfg["num_res_blocks"], list(cfg["temperal_downsample"])
    shapes: Shapes = {}
    conv, resnet, middle = _vae_writers(shapes)

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


def vae22_layout(overrides: Mapping[str, Any] | None = None) -> Shapes:
    """Upstream ``VideoVAE38_`` (Wan2.2): per level a ``Down_ResidualBlock`` / ``Up_ResidualBlock`` holding a
    ``downsamples`` / ``upsamples`` list (resnets, then a resampler that keeps the width) and a shortcut without
    parameters; 12-channel (2x2-patchified) input and output; the decoder at its own width (``dec_dim``)."""
    cfg = {**WAN22_VAE_CONFIG, **(overrides or {})}
    z_dim, dim_mult = cfg["z_dim"], list(cfg["dim_mult"])
    num_res_blocks, temporal = cfg["num_res_blocks"], list(cfg["temperal_downsample"])
    channels = cfg["in_channels"]
    shapes: Shapes = {}
    conv, resnet, middle = _vae_writers(shapes)

    last = len(dim_mult) - 1
    dims = [cfg["base_dim"] * m for m in [1, *dim_mult]]
    conv("encoder.conv1", dims[0], channels, (3, 3, 3))
    for level, (c_in, c_out) in enumerate(itertools.pairwise(dims)):
        block = f"encoder.downsamples.{level}.downsamples"
        for j in range(num_res_blocks):
            resnet(f"{block}.{j}", c_in, c_out)
            c_in = c_out
        if level < last:
            conv(f"{block}.{num_res_blocks}.resample.1", c_out, c_out, (3, 3))
            if temporal[level]:
                conv(f"{block}.{num_res_blocks}.time_conv", c_out, c_out, (3, 1, 1))
    middle("encoder.middle", dims[-1])
    shapes["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("encoder.head.2", 2 * z_dim, dims[-1], (3, 3, 3))
    conv("conv1", 2 * z_dim, 2 * z_dim, (1, 1, 1))
    conv("conv2", z_dim, z_dim, (1, 1, 1))

    decoder_dim = cfg.get("decoder_base_dim") or cfg["base_dim"]
    dims = [decoder_dim * m for m in [dim_mult[-1], *dim_mult[::-1]]]
    temporal_up = temporal[::-1]
    conv("decoder.conv1", dims[0], z_dim, (3, 3, 3))
    middle("decoder.middle", dims[0])
    for level, (c_in, c_out) in enumerate(itertools.pairwise(dims)):
        block = f"decoder.upsamples.{level}.upsamples"
        for j in range(num_res_blocks + 1):
            resnet(f"{block}.{j}", c_in, c_out)
            c_in = c_out
        if level < last:
            conv(f"{block}.{num_res_blocks + 1}.resample.1", c_out, c_out, (3, 3))
            if temporal_up[level]:
                conv(f"{block}.{num_res_blocks + 1}.time_conv", 2 * c_out, c_out, (3, 1, 1))
    shapes["decoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv("decoder.head.2", cfg["out_channels"], dims[-1], (3, 3, 3))
    return shapes


def _vae_writers(shapes: Shapes):
    """Writers of the Wan VAE's three parameterized pieces (conv, resnet, middle) into ``shapes``."""

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

    return conv, resnet, middle


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


# ------------------------------------------------------------------------------------------- config.json

# Upstream class paths (``_target_``) of the released config's sections.
UPSTREAM_TARGETS: dict[str, str] = {
    "action_head_cfg": "groot.vla.model.dreamzero.action_head.wan_flow_matching_action_tf.WANPolicyHead",
    "action_head_cfg.config": "groot.vla.model.dreamzero.action_head.wan_flow_matching_action_tf.WANPolicyHeadConfig",
    "diffusion_model_cfg": "groot.vla.model.dreamzero.modules.wan_video_dit_action_casual_chunk.CausalWanModel",
    "text_encoder_cfg": "groot.vla.model.dreamzero.modules.wan_video_text_encoder.WanTextEncoder",
    "image_encoder_cfg": "groot.vla.model.dreamzero.modules.wan_video_image_encoder.WanImageEncoder",
    "vae_cfg": "groot.vla.model.dreamzero.modules.wan_video_vae.WanVideoVAE",
}
# The Wan2.2 VAE's class (vae_cfg of upstream's wan_flow_matching_action_tf_wan22.yaml, the 5B).
UPSTREAM_VAE38_TARGET = "groot.vla.model.dreamzero.modules.wan_video_vae.WanVideoVAE38"

# The keys of the released GEAR-Dreams/DreamZero-DROID config.json, section by section. The file is upstream's
# ``VLAConfig`` (groot/vla/model/dreamzero/base_vla.py) written by ``save_pretrained``: the kwargs of
# groot/vla/configs/model/dreamzero/vla.yaml, whose ``action_head_cfg`` is the hydra node of
# groot/vla/configs/model/dreamzero/action_head/wan_flow_matching_action_tf.yaml (plus backbone/identity.yaml's
# ``backbone_features_projector_cfg``), resolved with scripts/train/droid_training_full_finetune_wan21.sh's
# overrides. ``decouple_inference_noise`` / ``video_inference_final_noise`` are no longer in that yaml, but the
# released file has them: vLLM-Omni's DreamZero pipeline (vllm_omni/diffusion/models/dreamzero/pipeline_dreamzero.py)
# reads both as required keys of it. transformers' own bookkeeping (``transformers_version``) is left out.
RELEASED_ROOT_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "model_dtype",
        "hidden_size",
        "action_horizon",
        "action_dim",
        "backbone_cfg",
        "action_head_cfg",
    }
)
RELEASED_HEAD_WRAPPER_KEYS = frozenset({"_target_", "_convert_", "config"})  # action_head_cfg
RELEASED_ACTION_HEAD_KEYS = frozenset(
    {  # action_head_cfg.config
        "_target_",
        "_recursive_",
        "tiled",
        "tile_size_height",
        "tile_size_width",
        "tile_stride_height",
        "tile_stride_width",
        "lora_rank",
        "lora_alpha",
        "num_frames",
        "num_frame_per_block",
        "lora_target_modules",
        "init_lora_weights",
        "train_architecture",
        "use_gradient_checkpointing",
        "add_pos_embed",
        "model_dtype",
        "max_state_dim",
        "max_action_dim",
        "action_loss_embodiment_ids",
        "hidden_size",
        "input_embedding_dim",
        "backbone_embedding_dim",
        "repa_layer",
        "repa_coeff",
        "load_pretrained_det_decode_layer_path",
        "freeze_decode_layer",
        "expand_batch",
        "use_vlln",
        "vl_self_attention_cfg",
        "diffusion_model_cfg",
        "text_encoder_cfg",
        "image_encoder_cfg",
        "vae_cfg",
        "action_dim",
        "action_horizon",
        "num_inference_timesteps",
        "noise_beta_alpha",
        "noise_beta_beta",
        "noise_s",
        "num_timestep_buckets",
        "decouple_video_action_noise",
        "video_noise_beta_alpha",
        "video_noise_beta_beta",
        "tune_projector",
        "tune_diffusion_model",
        "backbone_features_projector_cfg",
        "decouple_inference_noise",
        "video_inference_final_noise",
    }
)
RELEASED_DIT_KEYS = frozenset(
    {  # action_head_cfg.config.diffusion_model_cfg
        "_target_",
        "_convert_",
        "diffusion_model_pretrained_path",
        "model_type",
        "frame_seqlen",
        "dim",
        "in_dim",
        "ffn_dim",
        "out_dim",
        "freq_dim",
        "eps",
        "num_heads",
        "num_layers",
        "max_chunk_size",
        "num_frame_per_block",
        "num_action_per_block",
        "num_state_per_block",
    }
)
RELEASED_ENCODER_KEYS: dict[str, frozenset[str]] = {
    section: frozenset({"_target_", "_convert_", f"{section.removesuffix('_cfg')}_pretrained_path"})
    for section in ("text_encoder_cfg", "image_encoder_cfg", "vae_cfg")
}


def checkpoint_config(
    dit: DiTConfig,
    text_encoder: Mapping[str, Any] | None = None,
    image_encoder: Mapping[str, Any] | None = None,
    vae: Mapping[str, Any] | None = None,
    *,
    num_frames: int = 33,
    target_video_size: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """A ``config.json`` with every key of the released one, in its sections, for a model of this geometry.

    Keys that do not change inference carry the released (DROID run's) values. The DiT section holds the whole
    ``DiTConfig`` (a superset of the released keys); encoder geometry that differs from the released model's goes
    under ``architecture`` (this project's extension: upstream builds its encoders at fixed sizes).

    A ``vae`` with ``is_residual`` is the Wan2.2 VAE (the 5B): its section is upstream's ``wan_flow_matching_action_tf_wan22``
    one (``WanVideoVAE38`` with ``z_dim`` and ``dim``), only what differs from that VAE under ``architecture``; the
    5B's ``target_video_height`` / ``target_video_width`` come from ``target_video_size``.
    """
    encoders = {}
    for section, arch in (("text_encoder_cfg", text_encoder), ("image_encoder_cfg", image_encoder), ("vae_cfg", vae)):
        path_key = f"{section.removesuffix('_cfg')}_pretrained_path"
        encoders[section] = {"_target_": UPSTREAM_TARGETS[section], "_convert_": "object", path_key: None}
        if section == "vae_cfg" and arch is not None and arch.get("is_residual"):
            wan22 = {**WAN22_VAE_CONFIG, **arch}
            encoders[section] |= {"_target_": UPSTREAM_VAE38_TARGET, "z_dim": wan22["z_dim"], "dim": wan22["base_dim"]}
            rest = {k: v for k, v in arch.items() if k not in ("is_residual", "z_dim", "base_dim") and WAN22_VAE_CONFIG.get(k) != v}
            if rest:
                encoders[section]["architecture"] = rest
        elif arch is not None:
            encoders[section]["architecture"] = dict(arch)
    head = {
        "_target_": UPSTREAM_TARGETS["action_head_cfg.config"],
        "_recursive_": False,
        # what the action head computes with
        "num_frames": num_frames,
        "num_frame_per_block": dit.num_frame_per_block,
        "action_horizon": dit.num_action_per_block,
        "action_dim": dit.action_dim,
        "max_action_dim": dit.action_dim,
        "max_state_dim": dit.max_state_dim,
        "tiled": False,
        "train_architecture": "full",
        "decouple_inference_noise": False,
        "video_inference_final_noise": 0.8,
        "num_inference_timesteps": 4,  # the released value; upstream's action head runs 16 steps regardless
        "tile_size_height": 34,
        "tile_size_width": 34,
        "tile_stride_height": 18,
        "tile_stride_width": 16,
        # training only (released values)
        "lora_rank": 4,
        "lora_alpha": 4,
        "lora_target_modules": "q,k,v,o,ffn.0,ffn.2",
        "init_lora_weights": "kaiming",
        "use_gradient_checkpointing": True,
        "add_pos_embed": True,
        "model_dtype": "float32",
        "action_loss_embodiment_ids": [26, 17, 32],
        "hidden_size": 64,
        "input_embedding_dim": 1536,
        "backbone_embedding_dim": 0,
        "repa_layer": 8,
        "repa_coeff": 1.0,
        "load_pretrained_det_decode_layer_path": None,
        "freeze_decode_layer": False,
        "expand_batch": None,
        "use_vlln": True,
        "backbone_features_projector_cfg": None,
        "vl_self_attention_cfg": {
            "_target_": "groot.vla.model.n1_5.modules.cross_attention_dit.SelfAttentionTransformer",
            "positional_embeddings": None,
            "num_layers": 4,
            "num_attention_heads": 24,
            "attention_head_dim": 64,
            "dropout": 0.2,
            "final_dropout": True,
        },
        "noise_beta_alpha": 1.5,
        "noise_beta_beta": 1.0,
        "noise_s": 0.999,
        "num_timestep_buckets": 1000,
        "decouple_video_action_noise": False,
        "video_noise_beta_alpha": 3.0,
        "video_noise_beta_beta": 1.0,
        "tune_projector": True,
        "tune_diffusion_model": True,
        # sections
        "diffusion_model_cfg": {
            "_target_": UPSTREAM_TARGETS["diffusion_model_cfg"],
            "_convert_": "object",
            "diffusion_model_pretrained_path": None,
            **dit.to_dict(),
        },
        **encoders,
    }
    if target_video_size is not None:
        head["target_video_height"], head["target_video_width"] = target_video_size
    return {
        "architectures": ["VLA"],
        "model_type": "vla",
        "model_dtype": "float32",
        "hidden_size": 0,
        "action_horizon": head["action_horizon"],
        "action_dim": head["action_dim"],
        "backbone_cfg": {"_target_": "groot.vla.model.dreamzero.backbone.identity.IdentityBackbone"},
        "action_head_cfg": {"_target_": UPSTREAM_TARGETS["action_head_cfg"], "_convert_": "object", "config": head},
    }
