"""Settings of the Zero-WAM policy (torch-free: the front end validates them without loading a model).

Zero-WAM (jianwenli96/Zero-WAM, weights ``robbyant-research/zero-wam-posttrain-robotwin`` and the pretrain
``robbyant-research/zero-wam-pretrain``) is served as its own policy, ``zero_wam``, built from LingBot-VA's package:
its checkpoint holds another transformer class, its episodes begin with a demonstration and per-episode guidance, and
its options are not LingBot-VA's. Every key is read: ``checkpoint`` (a released checkpoint directory or Hugging Face
id, ``builtin:tiny``, ``synthetic:released`` / ``synthetic:tiny`` with ``,layers=N``), ``embodiment`` (``robotwin``;
``tiny_robotwin`` for the tiny checkpoint), ``demonstration_root`` (where ``icl_demo_id`` names ``<id>.pth``; or
``builtin:tiny``), ``max_demonstration_frames`` (the most latent frames a session pins: what each session reserves),
``video_guidance_scale`` / ``icl_guidance_scale`` (a reset's defaults), ``empty_text_embedding`` (upstream's
``empty_text_emb_path``), ``seed``, ``safety`` (off only). Unknown keys are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic

from ardiff_policies.lingbot_va.config import BUILTIN_TINY, SYNTHETIC_PREFIX, check_checkpoint_name, released_checkpoint, safety_off
from ardiff_policies.safety import SafetyConfig

CHECKPOINT_EXAMPLE = "/path/to/zero-wam-posttrain-robotwin"
HUB_IDS = ("robbyant-research/zero-wam-posttrain-robotwin", "robbyant-research/zero-wam-pretrain")
BUILTIN_DEMONSTRATIONS = "builtin:tiny"  # the tiny checkpoint's demonstrations (zero_wam_tiny.py)
EMBODIMENTS = ("robotwin", "tiny_robotwin")
# The most latent frames a session pins by default, per embodiment: RoboTwin's 32 (10.4 s of human video at 12 fps,
# 4,800 tokens), the tiny twin's 4.
DEFAULT_DEMONSTRATION_FRAMES = {"robotwin": 32, "tiny_robotwin": 4}
MAX_GUIDANCE = 20.0  # the reset's scales: video in [-20, 20] (below 0: the empty target text), in-context in [0, 20]


class ZeroWAMPolicyConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: Literal["zero_wam"] = "zero_wam"  # Zero-WAM: LingBot-VA with an action expert and a demonstration in context
    checkpoint: str = pydantic.Field(
        BUILTIN_TINY,
        description="checkpoint directory, Hugging Face id (robbyant-research/zero-wam-posttrain-robotwin, "
        "robbyant-research/zero-wam-pretrain), builtin:tiny or synthetic:released / synthetic:tiny[,layers=N]",
    )
    embodiment: Literal["robotwin", "tiny_robotwin"] | None = pydantic.Field(
        None, description="upstream's embodiment config (default: tiny_robotwin for builtin:tiny, else robotwin)"
    )
    demonstration_root: str | None = pydantic.Field(
        None,
        description="directory of pre-encoded demonstrations: icl_demo_id names <root>/<id>.pth (upstream's ICL_LATENT_ROOT); "
        "builtin:tiny for the tiny checkpoint's; null: no demonstrations (a reset with use_icl is refused)",
    )
    max_demonstration_frames: int | None = pydantic.Field(
        None, ge=1, le=256, description="the most latent frames a demonstration may have (each session reserves them); default 32, tiny 4"
    )
    video_guidance_scale: float = pydantic.Field(
        -1.0,
        ge=-MAX_GUIDANCE,
        le=MAX_GUIDANCE,
        description="a reset's default: > 1 text guidance (without in-context guidance), < 0 the empty target text (upstream's -1)",
    )
    icl_guidance_scale: float = pydantic.Field(
        5.0, ge=0.0, le=MAX_GUIDANCE, description="a reset's default: > 1 with a demonstration, in-context guidance (upstream's 5)"
    )
    empty_text_embedding: str | None = pydantic.Field(
        None,
        description="a torch file holding the (512, text_dim) empty-text embedding to use instead of UMT5's for '' "
        "(upstream's empty_text_emb_path); a relative path is under the checkpoint",
    )
    seed: int = pydantic.Field(0, ge=0, description="every session's noise generator is seeded with it at reset")
    safety: SafetyConfig = pydantic.Field(default_factory=SafetyConfig, description="the safety gate: off only, as lingbot_va's")

    @pydantic.field_validator("safety")
    @classmethod
    def _check_safety(cls, value: SafetyConfig) -> SafetyConfig:
        return safety_off("zero_wam", value)

    @pydantic.model_validator(mode="after")
    def _check_pair(self) -> ZeroWAMPolicyConfig:
        check_checkpoint_name(self.checkpoint)
        if self.tiny != (self.embodiment_name == "tiny_robotwin"):
            raise ValueError(
                f"policy.embodiment: {self.checkpoint} is served with {'tiny_robotwin' if self.tiny else 'robotwin'}, not {self.embodiment!r}"
            )
        if self.demonstration_root == BUILTIN_DEMONSTRATIONS and not self.tiny:
            raise ValueError("policy.demonstration_root: builtin:tiny holds the tiny checkpoint's demonstrations; name a directory")
        return self

    @property
    def tiny(self) -> bool:
        return self.checkpoint == BUILTIN_TINY or self.checkpoint.startswith(SYNTHETIC_PREFIX + "tiny")

    @property
    def embodiment_name(self) -> str:
        return self.embodiment or ("tiny_robotwin" if self.tiny else "robotwin")

    @property
    def demonstration_frames(self) -> int:
        return self.max_demonstration_frames or DEFAULT_DEMONSTRATION_FRAMES[self.embodiment_name]

    def preflight(self) -> ZeroWAMPolicyConfig:
        """Before any worker is spawned: a Hugging Face id becomes a local snapshot directory; the checkpoint, the
        demonstration root and the empty-text embedding are checked. Raises ValueError naming the key and the fix."""
        update = {}
        if not (self.checkpoint == BUILTIN_TINY or self.checkpoint.startswith(SYNTHETIC_PREFIX)):
            update["checkpoint"] = str(self.local_checkpoint())
        root = self.demonstration_root
        if root is not None and root != BUILTIN_DEMONSTRATIONS and not Path(root).is_dir():
            raise ValueError(f"policy.demonstration_root: {root} is not a directory; point it at the pre-encoded demonstrations (<id>.pth)")
        config = self.model_copy(update=update)
        if config.empty_text_embedding is not None and not config.empty_text_path().is_file():
            raise ValueError(f"policy.empty_text_embedding: {config.empty_text_path()} is not a file")
        return config

    def empty_text_path(self) -> Path:
        path = Path(self.empty_text_embedding)
        if path.is_absolute() or self.checkpoint.startswith(("builtin:", SYNTHETIC_PREFIX)):
            return path
        return Path(self.checkpoint) / path

    def local_checkpoint(self) -> Path:
        # a relative empty-text embedding lives in the checkpoint: fetched with it
        extra = () if self.empty_text_embedding is None or Path(self.empty_text_embedding).is_absolute() else (self.empty_text_embedding,)
        return released_checkpoint(self.checkpoint, CHECKPOINT_EXAMPLE, "Zero-WAM", HUB_IDS[0], extra)
