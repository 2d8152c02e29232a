"""Zero-WAM's guidance, decided once per episode at reset (upstream ``VA_Server._reset_icl`` / ``_pack_icl_cfg``).

Upstream's reset takes ``use_icl``, ``video_guidance_scale`` and ``icl_guidance_scale`` and fixes for the episode
which of two CFG modes the video runs (actions never have CFG):

* **in-context** (``use_icl`` and ``icl_guidance_scale > 1``): both halves get the target text, only the
  conditional half sees the demonstration; ``v = v_u + icl_guidance_scale (v_c - v_u)``;
* **text** (otherwise, ``video_guidance_scale > 1``): the unconditional half gets the empty text;
* **none**: one half.

The target text is the prompt, or the empty text when ``video_guidance_scale < 0`` (upstream's default -1: the
target branch conditions on the demonstration, not on words). :func:`plan_guidance` returns that decision, which
the episode turns into branches (conditional: pinned demonstration and the action history; unconditional: video
only) and texts.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ardiff_policies.lingbot_va.episode_io import MAX_GUIDANCE, EpisodeError


class GuidanceMode(enum.Enum):
    IN_CONTEXT = "in-context"
    TEXT = "text"
    NONE = "none"


@dataclass(frozen=True)
class GuidancePlan:
    mode: GuidanceMode
    scale: float  # the video's; 1.0 without guidance
    demonstration: bool  # the episode pins one (use_icl)
    target_text_empty: bool  # the conditional half's text: the empty one (video_guidance_scale < 0) or the prompt
    # the unconditional half's text: the target text (in-context guidance) or the empty one (text guidance)
    uncond_text_empty: bool | None

    @property
    def halves(self) -> int:
        return 1 if self.mode is GuidanceMode.NONE else 2


def plan_guidance(*, use_icl: object, video_guidance_scale: object, icl_guidance_scale: object) -> GuidancePlan:
    """Upstream's decision for a reset's three keys; a key of the wrong type or out of range is an EpisodeError."""
    if not isinstance(use_icl, bool):
        raise EpisodeError(f"use_icl: expected true or false, got {use_icl!r}")
    video = _scale("video_guidance_scale", video_guidance_scale, allow_negative=True)
    icl = _scale("icl_guidance_scale", icl_guidance_scale, allow_negative=False)
    target_empty = video < 0
    if use_icl and icl > 1:
        return GuidancePlan(GuidanceMode.IN_CONTEXT, icl, True, target_empty, uncond_text_empty=target_empty)
    if video > 1:
        return GuidancePlan(GuidanceMode.TEXT, video, use_icl, target_empty, uncond_text_empty=True)
    return GuidancePlan(GuidanceMode.NONE, 1.0, use_icl, target_empty, uncond_text_empty=None)


def _scale(key: str, value: object, *, allow_negative: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EpisodeError(f"{key}: expected a number, got {value!r}")
    low = -MAX_GUIDANCE if allow_negative else 0.0
    if not low <= value <= MAX_GUIDANCE:
        raise EpisodeError(f"{key}: {value} outside [{low:g}, {MAX_GUIDANCE:g}]")
    return float(value)
