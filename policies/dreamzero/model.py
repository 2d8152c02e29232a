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

from policies.dreamzero.checkpoint import CheckpointDir, CheckpointError, load_component
from policies.dreamzero.dit import CausalWanModel, DiTConfig
from policies.dreamzero.encoders import ImageEncoder, TextEncoder, VideoVAE
from policies.dreamzero.naming import (
    DIT_PREFIX,
    IMAGE_ENCODER_PREFIX,
    TEXT_ENCODER_PREFIX,
    VAE_PREFIX,
    identity_targets,
    image_encoder_targets,
    text_encoder_targets,
    vae_targets,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActionHeadConfig:
    """The action-head keys of ``config.json`` the policy needs."""

    num_frames: int  # pixel frames of the image conditioning (33 -> 9 latent frames)
    num_frame_per_block: int
    action_horizon: int
    max_action_dim: int
    max_state_dim: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ActionHeadConfig:
        try:
            return cls(
                num_frames=int(raw["num_frames"]),
                num_frame_per_block=int(raw["num_frame_per_block"]),
                action_horizon=int(raw["action_horizon"]),
                max_action_dim=int(raw.get("max_action_dim", raw.get("action_dim"))),
                max_state_dim=int(raw["max_state_dim"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json action_head_cfg.config is missing or has a bad {exc}") from None


@dataclass
class DreamZeroModel:
    dit: CausalWanModel
    text_encoder: TextEncoder
    image_encoder: ImageEncoder
    vae: VideoVAE
    tokenizer: Any
    action_head_config: ActionHeadConfig
    metadata: dict[str, Any]

    @classmethod
    def load(
        cls,
        checkpoint: str | Path,
        *,
        tokenizer: str | Path | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> DreamZeroModel:
        start = time.perf_counter()
        ckpt = CheckpointDir(checkpoint)
        head = ActionHeadConfig.from_dict(ckpt.action_head)
        dit_cfg = DiTConfig.from_dict(
            {
                **ckpt.diffusion_model_cfg,
                "action_dim": head.max_action_dim,
                "max_state_dim": head.max_state_dim,
                "num_frame_per_block": head.num_frame_per_block,
            }
        )
        with torch.device("meta"):
            dit = CausalWanModel(dit_cfg)
            text_encoder = TextEncoder.from_config(ckpt.component_config("text_encoder_cfg"))
            image_encoder = ImageEncoder.from_config(ckpt.component_config("image_encoder_cfg"))
            vae = VideoVAE.from_config(ckpt.component_config("vae_cfg"))
        vae_config = dict(vae.model.config)
        components = [
            (dit, DIT_PREFIX, identity_targets),
            (text_encoder, TEXT_ENCODER_PREFIX, text_encoder_targets),
            (image_encoder, IMAGE_ENCODER_PREFIX, image_encoder_targets),
            (vae, VAE_PREFIX, lambda key: vae_targets(key, vae_config)),
        ]
        for module, prefix, targets in components:
            load_component(module, ckpt.weights, prefix, targets, dtype=dtype, device=device)
            module.eval().requires_grad_(False)

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
        logger.info("loaded DreamZero checkpoint %s in %.1f s (%s, %s)", ckpt.path, time.perf_counter() - start, dtype, device)
        return cls(dit, text_encoder, image_encoder, vae, tok, head, ckpt.metadata)
