"""All DreamZero networks, loaded from one checkpoint directory.

Every module is built on the meta device and filled tensor by tensor from the shards (see
``checkpoint.py``), so nothing is initialized randomly and nothing exists twice in memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ardiff_policies.dreamzero.checkpoint import CheckpointDir, CheckpointError, load_component
from ardiff_policies.dreamzero.dit import CausalWanModel, DiTConfig
from ardiff_policies.dreamzero.embodiments import read_experiment_config
from ardiff_policies.dreamzero.encoders import ImageEncoder
from ardiff_policies.dreamzero.naming import (
    DIT_PREFIX,
    IMAGE_ENCODER_PREFIX,
    TEXT_ENCODER_PREFIX,
    VAE_PREFIX,
    identity_targets,
    image_encoder_targets,
    text_encoder_targets,
    vae_targets,
)
from ardiff_policies.dreamzero.upstream_layout import UPSTREAM_TARGETS, UPSTREAM_VAE38_TARGET
from ardiff_policies.wan.text import TextEncoder
from ardiff_policies.wan.vae import WAN21_VAE_CONFIG, WAN22_VAE_CONFIG, VideoVAE

logger = logging.getLogger(__name__)


# Upstream ``CausalWanModel.__init__`` defaults (groot/vla/model/dreamzero/modules/wan_video_dit_action_casual_chunk.py):
# a key missing from ``diffusion_model_cfg`` gets these upstream, so it gets them here too. (DiTConfig's own
# defaults are the released model's values; they agree with these on every key the released file leaves out.)
UPSTREAM_DIT_DEFAULTS: dict[str, Any] = {
    "model_type": "t2v",
    "patch_size": (1, 2, 2),
    "frame_seqlen": 220,
    "text_len": 512,
    "in_dim": 16,
    "dim": 2048,
    "ffn_dim": 8192,
    "freq_dim": 256,
    "text_dim": 4096,
    "out_dim": 16,
    "num_heads": 16,
    "num_layers": 32,
    "max_chunk_size": -1,
    "qk_norm": True,
    "cross_attn_norm": True,
    "eps": 1e-6,
    "num_frame_per_block": 1,
    "action_dim": 32,
    "max_state_dim": 64,
    "hidden_size": 1024,
    "num_action_per_block": 32,
    "num_state_per_block": 1,
    "concat_first_frame_latent": True,
}

# action_head_cfg.config keys whose value changes inference and that run at one value only:
# key -> (the supported value, upstream's value when the key is absent: WANPolicyHeadConfig's field default).
FIXED_ACTION_HEAD_KEYS: dict[str, tuple[Any, Any]] = {
    "tiled": (False, True),  # tiled VAE re-encode of the observed frames (WANPolicyHead.lazy_joint_video_action)
    "train_architecture": ("full", "lora"),  # "lora": un-merged LoRA tensors that upstream merges after loading
}
# action_head_cfg.config keys this project reads (besides FIXED_ACTION_HEAD_KEYS and the sub-sections).
READ_ACTION_HEAD_KEYS = frozenset(
    {
        "num_frames",
        "num_frame_per_block",
        "action_horizon",
        "action_dim",
        "max_state_dim",
        "decouple_inference_noise",
        "video_inference_final_noise",
        "target_video_height",
        "target_video_width",  # the video is resized to this before the VAE (the 5B's 160x320)
    }
)
SECTIONS = ("diffusion_model_cfg", "text_encoder_cfg", "image_encoder_cfg", "vae_cfg")
# action_head_cfg.config keys (released ones and other WANPolicyHeadConfig fields) that do not change inference:
IGNORED_ACTION_HEAD_KEYS = frozenset(
    {
        # hydra bookkeeping
        "_target_",
        "_recursive_",
        "_convert_",
        # only used when tiled=True / train_architecture="lora" (both refused)
        "tile_size_height",
        "tile_size_width",
        "tile_stride_height",
        "tile_stride_width",
        "lora_rank",
        "lora_alpha",
        "lora_target_modules",
        "init_lora_weights",
        "defer_lora_injection",
        # upstream's action head hard-codes 16 steps (the server setting num_inference_steps applies); training dtype
        "num_inference_timesteps",
        "model_dtype",
        # pads training actions; the head's hidden_size is not the DiT's (diffusion_model_cfg.hidden_size)
        "max_action_dim",
        "hidden_size",
        # training: loss, noise sampling, trainable parts, checkpointing, weight loading
        "action_loss_embodiment_ids",
        "noise_beta_alpha",
        "noise_beta_beta",
        "noise_s",
        "num_timestep_buckets",
        "decouple_video_action_noise",
        "video_noise_beta_alpha",
        "video_noise_beta_beta",
        "use_high_noise_emphasis",
        "high_noise_beta_alpha",
        "tune_projector",
        "tune_diffusion_model",
        "use_gradient_checkpointing",
        "skip_component_loading",
        "load_pretrained_det_decode_layer_path",
        "freeze_decode_layer",
        "detection_coeff",
        "repa_layer",
        "repa_coeff",
        "expand_batch",
        # GR00T N1.5 leftovers that build nothing in WANPolicyHead
        "add_pos_embed",
        "input_embedding_dim",
        "backbone_embedding_dim",
        "use_vlln",
        "vl_self_attention_cfg",
        "backbone_features_projector_cfg",
        "qformer_cfg",
        "max_seq_len",
        "max_num_embodiments",
    }
)
# Keys of the encoder sections: upstream's (class, weight path) and this project's ``architecture`` overrides.
ENCODER_SECTION_KEYS = frozenset({"_target_", "_convert_", "architecture"})
# Constructor arguments upstream's VAE classes take from vae_cfg: WanVideoVAE(z_dim) and WanVideoVAE38(z_dim, dim).
VAE_SECTION_ARGUMENTS = {"z_dim": "z_dim", "dim": "base_dim"}  # upstream name -> AutoencoderKLWan name
_KNOWN_ACTION_HEAD_KEYS = frozenset(FIXED_ACTION_HEAD_KEYS) | READ_ACTION_HEAD_KEYS | IGNORED_ACTION_HEAD_KEYS | set(SECTIONS)


def _key_error(key: str, value: Any, supported: Any, absent: bool = False) -> CheckpointError:
    shown = f"is absent (upstream then uses {value!r})" if absent else f"= {value!r}"
    return CheckpointError(f"config.json {key} {shown}, which this server does not implement (supported: {supported!r})")


@dataclass(frozen=True)
class ActionHeadConfig:
    """What the policy reads from ``action_head_cfg.config`` (validated against the DiT's section)."""

    num_frames: int  # pixel frames of the image conditioning (33 -> 9 latent frames)
    num_frame_per_block: int
    action_horizon: int
    max_action_dim: int  # action width the DiT predicts (diffusion_model_cfg.action_dim)
    max_state_dim: int  # state width the DiT's state encoder takes (diffusion_model_cfg.max_state_dim)
    # Upstream's decoupled inference: the video schedule ends at this noise level instead of 0 (actions unchanged).
    decouple_inference_noise: bool = False
    video_inference_final_noise: float = 0.8
    # (height, width) the stitched video is resized to before the VAE and CLIP (bilinear), or None: no resize.
    target_video_size: tuple[int, int] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dit: DiTConfig) -> ActionHeadConfig:
        """Reads and checks ``action_head_cfg.config`` (unknown keys are the caller's to report)."""
        prefix = "action_head_cfg.config."
        for key, (supported, default) in FIXED_ACTION_HEAD_KEYS.items():
            value = raw.get(key, default)
            if value != supported or type(value) is not type(supported):
                raise _key_error(prefix + key, value, supported, absent=key not in raw)
        try:
            head = cls(
                num_frames=int(raw["num_frames"]),
                num_frame_per_block=int(raw.get("num_frame_per_block", 1)),
                action_horizon=int(raw["action_horizon"]),
                max_action_dim=dit.action_dim,
                max_state_dim=dit.max_state_dim,
                decouple_inference_noise=raw.get("decouple_inference_noise", False),
                video_inference_final_noise=float(raw.get("video_inference_final_noise", 0.8)),
                target_video_size=_target_video_size(raw, dit),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json {prefix[:-1]} is missing or has a bad {exc}") from None
        if not isinstance(head.decouple_inference_noise, bool):
            raise CheckpointError(f"config.json {prefix}decouple_inference_noise must be true or false")
        if not 0.0 <= head.video_inference_final_noise <= 1.0:
            raise CheckpointError(f"config.json {prefix}video_inference_final_noise must be in [0, 1]")
        # What upstream requires to agree (it fails, or builds mismatched shapes, otherwise):
        pairs = [
            ("num_frame_per_block", head.num_frame_per_block, dit.num_frame_per_block),  # noise vs the DiT's blocks
            ("action_horizon", head.action_horizon, dit.num_action_per_block),  # one action block per chunk
            # VLA.validate_data checks the predicted width against it
            ("action_dim", raw.get("action_dim", dit.action_dim), dit.action_dim),
            # the transform pads the state to it; the DiT's state encoder takes the DiT's
            ("max_state_dim", raw.get("max_state_dim", dit.max_state_dim), dit.max_state_dim),
        ]
        for key, value, dit_value in pairs:
            if value != dit_value:
                dit_key = "num_action_per_block" if key == "action_horizon" else key
                raise CheckpointError(
                    f"config.json {prefix}{key} = {value!r} disagrees with {prefix}diffusion_model_cfg.{dit_key} = "
                    f"{dit_value!r}; upstream cannot run that combination"
                )
        return head


def _target_video_size(raw: dict[str, Any], dit: DiTConfig) -> tuple[int, int] | None:
    """Upstream's rule (``WANPolicyHead.lazy_joint_video_action``): both keys set -> that size; otherwise a DiT with
    ``frame_seqlen`` 50 or 55 (a 5B trained before the keys existed) -> 176x320; otherwise no resize."""
    height, width = raw.get("target_video_height"), raw.get("target_video_width")
    if height is None or width is None:
        if (height is None) != (width is None):
            logger.warning("config.json sets only one of target_video_height / target_video_width; upstream then ignores it, and so does this server")
        return (176, 320) if dit.frame_seqlen in (50, 55) else None
    if type(height) is not int or type(width) is not int or height < 1 or width < 1:
        raise CheckpointError(f"config.json target_video_height / target_video_width must be positive integers, got {height!r} x {width!r}")
    return height, width


def _vae_section(head_raw: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(Wan2.2?, ``AutoencoderKLWan`` fields from upstream's constructor arguments) of ``vae_cfg``: ``WanVideoVAE38``
    is the Wan2.2 VAE, anything else upstream builds (``WanVideoVAE``) the Wan2.1 one."""
    section = head_raw.get("vae_cfg") or {}
    wan22 = str(section.get("_target_", "")).rsplit(".", 1)[-1] == UPSTREAM_VAE38_TARGET.rsplit(".", 1)[-1]
    arguments = {ours: section[theirs] for theirs, ours in VAE_SECTION_ARGUMENTS.items() if theirs in section}
    if "base_dim" in arguments and not wan22:
        raise CheckpointError("config.json action_head_cfg.config.vae_cfg.dim is an argument of WanVideoVAE38 only (WanVideoVAE has none)")
    return wan22, arguments


def read_vae_config(ckpt: CheckpointDir) -> dict[str, Any]:
    """``AutoencoderKLWan`` fields of the checkpoint's VAE: the family's (``vae_cfg._target_``), upstream's constructor
    arguments in ``vae_cfg`` (``z_dim``, ``dim``), then this project's ``architecture`` overrides."""
    wan22, arguments = _vae_section(ckpt.action_head)
    config = {**(WAN22_VAE_CONFIG if wan22 else WAN21_VAE_CONFIG), **arguments, **(ckpt.component_config("vae_cfg") or {})}
    if len(config["latents_mean"]) != config["z_dim"]:
        # upstream normalizes with fixed statistics: 16 channels (WanVideoVAE), 48 (WanVideoVAE38)
        raise CheckpointError(
            f"config.json vae_cfg: z_dim {config['z_dim']} does not fit the {len(config['latents_mean'])} latent statistics of its VAE"
        )
    return config


def read_config(ckpt: CheckpointDir) -> tuple[ActionHeadConfig, DiTConfig]:
    """The action-head and DiT configs of a checkpoint, each key read from the section upstream reads it from.

    Keys that change inference are implemented or refused (CheckpointError naming the key); keys that do not are
    listed in ``IGNORED_ACTION_HEAD_KEYS``; anything else is reported in one warning line.
    """
    head_raw, dit_raw = ckpt.action_head, ckpt.diffusion_model_cfg
    _check_targets(ckpt)
    unknown = [f"action_head_cfg.config.{k}" for k in sorted(head_raw) if k not in _KNOWN_ACTION_HEAD_KEYS]
    for section in SECTIONS[1:]:
        raw = head_raw.get(section) or {}
        known = ENCODER_SECTION_KEYS | {f"{section.removesuffix('_cfg')}_pretrained_path"}
        if section == "vae_cfg":
            known |= set(VAE_SECTION_ARGUMENTS)
        unknown += [f"action_head_cfg.config.{section}.{k}" for k in sorted(raw) if k not in known]
    if unknown:
        logger.warning("config.json: ignoring keys this server does not know: %s", ", ".join(unknown))
    try:
        # Upstream instantiates CausalWanModel(**diffusion_model_cfg): an unknown key fails there too.
        dit = DiTConfig.from_dict({**UPSTREAM_DIT_DEFAULTS, **dit_raw})
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json action_head_cfg.config.diffusion_model_cfg: {exc}") from None
    head = ActionHeadConfig.from_dict(head_raw, dit)
    _vae_section(head_raw)
    # VLA.validate_data (base_vla.py) checks every prediction against the root's action_horizon / action_dim.
    for key, value in (("action_horizon", head.action_horizon), ("action_dim", dit.action_dim)):
        if ckpt.root_config.get(key, value) != value:
            raise CheckpointError(f"config.json {key} = {ckpt.root_config[key]!r} disagrees with the model's {value!r}")
    return head, dit


def _check_targets(ckpt: CheckpointDir) -> None:
    """Each section's ``_target_`` (when present) names the upstream class this project implements."""
    sections = {
        "action_head_cfg": ckpt.root_config.get("action_head_cfg"),
        "action_head_cfg.config": ckpt.action_head,
        **{s: ckpt.action_head.get(s) for s in SECTIONS},
    }
    for name, section in sections.items():
        target = section.get("_target_") if isinstance(section, dict) else None
        expected = [UPSTREAM_TARGETS[name]] + ([UPSTREAM_VAE38_TARGET] if name == "vae_cfg" else [])
        if target is not None and str(target).rsplit(".", 1)[-1] not in [e.rsplit(".", 1)[-1] for e in expected]:
            key = name if name.startswith("action_head_cfg") else f"action_head_cfg.config.{name}"
            raise _key_error(f"{key}._target_", target, expected[0] if len(expected) == 1 else expected)


def check_dit_fits_vae(dit: DiTConfig, vae: VideoVAE) -> None:
    """The DiT predicts the VAE's latents and takes them (+ the 4 mask and z image channels when it concatenates ys)."""
    z = vae.latent_channels
    expected_in = dit.out_dim + (4 + z if dit.concat_first_frame_latent else 0)  # upstream concatenates whenever asked
    if dit.out_dim != z or dit.in_dim != expected_in:
        raise CheckpointError(
            f"config.json diffusion_model_cfg in_dim={dit.in_dim}, out_dim={dit.out_dim} (model_type={dit.model_type!r}, "
            f"concat_first_frame_latent={dit.concat_first_frame_latent}) does not fit a VAE of {z} latent channels "
            f"(expected in_dim={expected_in}, out_dim={z})"
        )


def meta_modules(ckpt: CheckpointDir) -> tuple[ActionHeadConfig, DiTConfig, tuple[CausalWanModel, TextEncoder, ImageEncoder, VideoVAE]]:
    """A checkpoint's configs and its four networks built on the meta device (no memory): the
    loader fills them, the memory plan counts them."""
    head, dit_cfg = read_config(ckpt)
    with torch.device("meta"):
        dit = CausalWanModel(dit_cfg)
        text_encoder = TextEncoder.from_config(ckpt.component_config("text_encoder_cfg"))
        image_encoder = ImageEncoder.from_config(ckpt.component_config("image_encoder_cfg"))
        vae = VideoVAE.from_config(read_vae_config(ckpt))
    return head, dit_cfg, (dit, text_encoder, image_encoder, vae)


@dataclass
class DreamZeroModel:
    dit: CausalWanModel
    text_encoder: TextEncoder
    image_encoder: ImageEncoder
    vae: VideoVAE
    tokenizer: Any
    action_head_config: ActionHeadConfig
    metadata: dict[str, Any]
    experiment_config: dict[str, Any] | None = None  # experiment_cfg/conf.yaml: the training run's config, if shipped

    @classmethod
    def load(
        cls,
        checkpoint: str | Path,
        *,
        tokenizer: str | Path | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        text_encoder_device: torch.device | str | None = None,
        image_encoder_device: torch.device | str | None = None,
    ) -> DreamZeroModel:
        """The model on ``device``; the text / image encoders on their own devices if given (they
        run once per prompt / window; the policy moves their outputs to ``device``)."""
        start = time.perf_counter()
        ckpt = CheckpointDir(checkpoint)
        head, dit_cfg, (dit, text_encoder, image_encoder, vae) = meta_modules(ckpt)
        vae_config = dict(vae.model.config)
        components = [
            (dit, DIT_PREFIX, identity_targets, device),
            (text_encoder, TEXT_ENCODER_PREFIX, text_encoder_targets, text_encoder_device or device),
            (image_encoder, IMAGE_ENCODER_PREFIX, image_encoder_targets, image_encoder_device or device),
            (vae, VAE_PREFIX, lambda key: vae_targets(key, vae_config), device),
        ]
        for module, prefix, targets, module_device in components:
            load_component(module, ckpt.weights, prefix, targets, dtype=dtype, device=module_device)
            module.eval().requires_grad_(False)
        ckpt.weights.progress.finish()

        tokenizer_path = Path(tokenizer).expanduser() if tokenizer else ckpt.path / "tokenizer"
        if not tokenizer_path.exists():
            raise CheckpointError(f"tokenizer not found at {tokenizer_path} (set policy.tokenizer to a local umt5-xxl tokenizer)")
        tok = AutoTokenizer.from_pretrained(str(tokenizer_path), local_files_only=True)
        if image_encoder.dim != dit_cfg.clip_dim or image_encoder.num_tokens != dit_cfg.num_image_tokens:
            raise CheckpointError(
                f"image encoder gives {image_encoder.num_tokens} tokens of width {image_encoder.dim}, the DiT expects "
                f"{dit_cfg.num_image_tokens} of width {dit_cfg.clip_dim}"
            )
        if text_encoder.dim != dit_cfg.text_dim:
            raise CheckpointError(f"text encoder width {text_encoder.dim} != DiT text_dim {dit_cfg.text_dim}")
        check_dit_fits_vae(dit_cfg, vae)
        logger.info("loaded DreamZero checkpoint %s in %.1f s (%s, %s)", ckpt.path, time.perf_counter() - start, dtype, device)
        return cls(dit, text_encoder, image_encoder, vae, tok, head, ckpt.metadata, read_experiment_config(ckpt.path))
