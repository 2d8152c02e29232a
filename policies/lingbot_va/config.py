"""Settings of the LingBot-VA policy (torch-free: the front end validates them without loading a model).

Every key is read: ``checkpoint`` (a released checkpoint directory or Hugging Face id, ``builtin:tiny``, or
``synthetic:released`` / ``synthetic:tiny`` with ``,layers=N``: random weights made on the device, ``synthetic.py``), ``embodiment``
(upstream's config it was trained with: ``robotwin``, ``franka``, ``libero``, ``demo``; ``tiny_robotwin`` or
``tiny_libero`` for the tiny checkpoint), ``seed``
(each session's noise generator is seeded with it at reset: upstream never seeds), ``request_inference_steps`` /
``request_action_inference_steps`` (the bounds of a request's own video / action denoising steps,
``ardiff_policies.inference_steps``; default 1 to the embodiment's), ``safety`` (the safety gate,
``ardiff_policies.safety``: off only, refused otherwise with the reason). Unknown keys are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic

from ardiff_policies import hub
from ardiff_policies.inference_steps import bounds_setting
from ardiff_policies.safety import SafetyConfig

BUILTIN_TINY = "builtin:tiny"
SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_PRESETS = ("released", "tiny")  # synthetic.py
CHECKPOINT_EXAMPLE = "/path/to/lingbot-va-posttrain-robotwin"
# What the server reads of a released checkpoint (diffusers-style directories), and so all it fetches of a hub repo.
CHECKPOINT_FILES = ("transformer/*", "vae/*", "text_encoder/*", "tokenizer/*")
EMBODIMENTS = ("robotwin", "franka", "libero", "demo", "tiny_robotwin", "tiny_libero")
TINY_EMBODIMENTS = ("tiny_robotwin", "tiny_libero")  # the geometries the tiny checkpoints are served with


class LingBotVAConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: Literal["lingbot_va"] = "lingbot_va"  # LingBot-VA: video and actions from one transformer, chunk by chunk
    checkpoint: str = pydantic.Field(
        BUILTIN_TINY,
        description="checkpoint directory, Hugging Face id (robbyant/lingbot-va-posttrain-robotwin, robbyant/lingbot-va-base, "
        "robbyant/lingbot-va-posttrain-libero-long), builtin:tiny "
        "or synthetic:released / synthetic:tiny[,layers=N]",
    )
    embodiment: Literal["robotwin", "franka", "libero", "demo", "tiny_robotwin", "tiny_libero"] | None = pydantic.Field(
        None, description="upstream's embodiment config (default: tiny_robotwin for builtin:tiny, else robotwin)"
    )
    seed: int = pydantic.Field(0, ge=0, description="every session's noise generator is seeded with it at reset")
    request_inference_steps: tuple[pydantic.PositiveInt, pydantic.PositiveInt] | None = pydantic.Field(
        None,
        description="[min, max] video denoising steps a request's num_inference_steps may choose (default [1, the embodiment's "
        "num_inference_steps]: fewer than configured, never more; at most 1000)",
    )
    request_action_inference_steps: tuple[pydantic.PositiveInt, pydantic.PositiveInt] | None = pydantic.Field(
        None,
        description="[min, max] action denoising steps a request's action_num_inference_steps may choose (default [1, the "
        "embodiment's action_num_inference_steps]: fewer than configured, never more; at most 1000)",
    )
    safety: SafetyConfig = pydantic.Field(
        default_factory=SafetyConfig, description="the safety gate (ardiff_policies.safety): off only, LingBot-VA's actions cannot be gated"
    )

    @pydantic.field_validator("safety")
    @classmethod
    def _check_safety(cls, value: SafetyConfig) -> SafetyConfig:
        return safety_off("lingbot_va", value)

    @pydantic.model_validator(mode="after")
    def _check_request_steps(self) -> LingBotVAConfig:
        bounds_setting("request_inference_steps", self.request_inference_steps)
        bounds_setting("request_action_inference_steps", self.request_action_inference_steps)
        return self

    @pydantic.model_validator(mode="after")
    def _check_pair(self) -> LingBotVAConfig:
        tiny = check_checkpoint_name(self.checkpoint)
        if tiny and self.embodiment not in (None, *TINY_EMBODIMENTS):
            raise ValueError(
                f"policy.embodiment: {self.checkpoint} is served with the tiny geometries only ({', '.join(TINY_EMBODIMENTS)}), not {self.embodiment!r}"
            )
        if not tiny and self.embodiment in TINY_EMBODIMENTS:
            raise ValueError(f"policy.embodiment: {self.embodiment} is a geometry of builtin:tiny and synthetic:tiny only")
        return self

    @property
    def embodiment_name(self) -> str:
        tiny = self.checkpoint == BUILTIN_TINY or self.checkpoint.startswith(SYNTHETIC_PREFIX + "tiny")
        return self.embodiment or ("tiny_robotwin" if tiny else "robotwin")

    def preflight(self) -> LingBotVAConfig:
        """Before any worker is spawned: a Hugging Face id becomes a local snapshot directory; the directory is checked.
        Raises ValueError naming the problem and the fix."""
        if self.checkpoint == BUILTIN_TINY or self.checkpoint.startswith(SYNTHETIC_PREFIX):
            return self
        return self.model_copy(update={"checkpoint": str(self.local_checkpoint())})

    def local_checkpoint(self) -> Path:
        return released_checkpoint(self.checkpoint, CHECKPOINT_EXAMPLE, "LingBot-VA", "robbyant/lingbot-va-posttrain-robotwin")


def check_checkpoint_name(checkpoint: str) -> bool:
    """A ``builtin:`` or ``synthetic:`` checkpoint name is one the family knows (ValueError naming it); whether it is
    a tiny one."""
    if checkpoint.startswith(SYNTHETIC_PREFIX):
        preset = checkpoint.removeprefix(SYNTHETIC_PREFIX).split(",")[0]
        if preset not in SYNTHETIC_PRESETS:
            raise ValueError(f"policy.checkpoint: unknown synthetic preset {preset!r}; presets: {', '.join(SYNTHETIC_PRESETS)}")
    tiny = checkpoint == BUILTIN_TINY or checkpoint.startswith(SYNTHETIC_PREFIX + "tiny")
    if checkpoint.startswith("builtin:") and not tiny:
        raise ValueError(f"policy.checkpoint: unknown {checkpoint!r}; built in: {BUILTIN_TINY}")
    return tiny


def released_checkpoint(checkpoint: str, example: str, model: str, hub_id: str, extra_files: tuple[str, ...] = ()) -> Path:
    """The local directory of a released checkpoint of the family (a path, or a Hub id fetched with only what the
    server reads: ``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/`` and ``extra_files``), its parts checked."""
    root = hub.resolve(checkpoint, key="policy.checkpoint", example=example, allow_patterns=(*CHECKPOINT_FILES, *extra_files))
    missing = [part for part in ("transformer", "vae", "text_encoder", "tokenizer") if not (root / part).is_dir()]
    if missing:
        raise ValueError(
            f"policy.checkpoint: {root} lacks {', '.join(f'{m}/' for m in missing)}; point it at a released {model} "
            f"checkpoint (--set policy.checkpoint={hub_id} or a local copy)"
        )
    return root


def safety_off(policy: str, value: SafetyConfig) -> SafetyConfig:
    """The LingBot-VA family's safety gate: off only. Each arm's 7 channels are an end-effector position and quaternion
    (their statistics span [-1, 1] on 3-6), and no request carries a measured state of them: nothing to check a first
    action against, and a quaternion's step is no distance."""
    if value.mode != "off":
        raise ValueError(
            f"mode {value.mode}: the safety gate cannot apply to {policy} (its actions are end-effector poses with "
            "quaternions, and no request carries their state); leave policy.safety out"
        )
    return value
