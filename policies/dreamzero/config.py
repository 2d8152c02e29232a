"""Settings of the DreamZero policy (torch-free: the front end validates them without loading a model)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic

# Upstream's default (NUM_DIT_STEPS=8): which of the 16 denoise steps run the DiT.
UPSTREAM_STEP_MASK = [True, True, True, False, False, False, True, False, False, False, True, False, False, True, True, True]

DEFAULT_NEGATIVE_PROMPT = (
    "Vibrant colors, overexposed, static, blurry details, text, subtitles, style, artwork, painting, "
    "image, still, grayscale, dull, worst quality, low quality, JPEG artifacts, ugly, mutilated, extra "
    "fingers, bad hands, bad face, deformed, disfigured, mutated limbs, fused fingers, stagnant image, "
    "cluttered background, three legs, many people in the background, walking backwards."
)


BUILTIN_TINY = "builtin:tiny"
BUILTIN_TINY_5B = "builtin:tiny_5b"  # the same, on the Wan2.2-5B architecture (tiny.py)
SYNTHETIC_PREFIX = "synthetic:"  # random weights in a released geometry, made on the device (synthetic.py)


class DreamZeroConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: Literal["dreamzero"] = "dreamzero"
    checkpoint: str = pydantic.Field(BUILTIN_TINY, description="checkpoint directory, builtin:tiny or builtin:tiny_5b")
    tokenizer: str | None = pydantic.Field(None, description="tokenizer directory (default: <checkpoint>/tokenizer)")
    view_size: tuple[int, int] | None = pydantic.Field(
        None, description="per-view (height, width) fed to the model (default: the checkpoint family's, 14B 176x320, 5B 160x320)"
    )
    image_resolution: tuple[int, int] | None = pydantic.Field(
        None, description="camera size advertised to clients (default: 14B 180x320; 5B its metadata.json's, else 160x320)"
    )
    num_inference_steps: int = pydantic.Field(16, ge=1, le=1000)
    sigma_shift: float = pydantic.Field(5.0, gt=0)
    cfg_scale: float = pydantic.Field(5.0, ge=1.0)
    seed: int = 1140
    dit_step_cache: Literal["off", "fixed", "dynamic"] = "fixed"
    dit_step_mask: list[bool] = pydantic.Field(default_factory=lambda: list(UPSTREAM_STEP_MASK))
    embodiment: str = "oxe_droid"
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT
    relative_action_dims: int = pydantic.Field(7, ge=0)

    @pydantic.model_validator(mode="after")
    def _check_mask(self) -> DreamZeroConfig:
        if self.dit_step_cache == "fixed":
            if len(self.dit_step_mask) != self.num_inference_steps:
                raise ValueError(
                    f"dit_step_mask has {len(self.dit_step_mask)} entries for {self.num_inference_steps} inference steps"
                )
            if not self.dit_step_mask[0]:
                raise ValueError("dit_step_mask must run the DiT on the first step")
        return self

    def preflight(self) -> None:
        """Cheap checks before any worker is spawned: the checkpoint and tokenizer directories exist.
        Raises ValueError with one line naming the problem and the fix."""
        if self.checkpoint in (BUILTIN_TINY, BUILTIN_TINY_5B) or self.checkpoint.startswith(SYNTHETIC_PREFIX):
            return
        checkpoint = Path(self.checkpoint).expanduser()
        if not (checkpoint / "config.json").is_file():
            what = "has no config.json" if checkpoint.is_dir() else "does not exist"
            raise ValueError(
                f"policy.checkpoint: {checkpoint} {what}; point it at a local GEAR-Dreams/DreamZero-DROID "
                "directory (--set policy.checkpoint=/path/to/DreamZero-DROID)"
            )
        tokenizer = Path(self.tokenizer).expanduser() if self.tokenizer else checkpoint / "tokenizer"
        if not tokenizer.is_dir():
            raise ValueError(
                f"policy.tokenizer: {tokenizer} does not exist; point it at a local google/umt5-xxl tokenizer "
                "directory (--set policy.tokenizer=/path/to/umt5-xxl)"
            )
