"""The DiT step cache: whether a denoising step runs the DiT or reuses the last velocity.

Upstream's dynamic rule (``dit_step_cache: dynamic``): after two real steps, skip 4 / 2 steps
while the last two video velocities stay closer than cosine 0.95 / 0.93. ``fixed`` follows a
per-step mask; ``off`` always runs. Decided per session from its own velocities, so a batched
session steps exactly as it would alone.

A session may denoise with another number of steps than the configured one (a request's
``num_inference_steps``): :meth:`StepCache.for_steps` carries the configured rule over as the same
share of the schedule. At the configured count it is the configured rule itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

THRESHOLDS = ((0.95, 4), (0.93, 2))  # (cosine similarity above which, steps skipped)


def resample_mask(mask: Sequence[bool], steps: int) -> tuple[bool, ...]:
    """The fixed mask for a call of ``steps`` denoising steps. Step i of ``steps`` covers the configured steps
    ``[i N / steps, (i + 1) N / steps)`` of the schedule (N = ``len(mask)``; at least the one it starts in) and runs
    the DiT if the mask runs one of them: upstream's 8 of 16 become 4 of 4, 6 of 8 or 16 of 32. The first step
    always runs (the configured mask's first entry does)."""
    n = len(mask)
    out = []
    for i in range(steps):
        start = i * n // steps
        out.append(any(mask[start : max((i + 1) * n // steps, start + 1)]))
    return tuple(out)


def scale_thresholds(configured_steps: int, steps: int) -> tuple[tuple[float, int], ...]:
    """The dynamic rule's skips as the same share of a call's steps (``skips * steps // configured_steps``); a
    rule left skipping nothing is dropped (at 4 of 16 steps: skip 1 above cosine 0.95, never at 0.93)."""
    scaled = ((threshold, skips * steps // configured_steps) for threshold, skips in THRESHOLDS)
    return tuple((threshold, skips) for threshold, skips in scaled if skips > 0)


@dataclass(frozen=True, slots=True)
class StepCache:
    """One call's step cache at its number of denoising steps."""

    mode: str  # off, fixed, dynamic
    mask: tuple[bool, ...] | None = None  # fixed: one entry per step
    thresholds: tuple[tuple[float, int], ...] = THRESHOLDS  # dynamic

    @classmethod
    def for_steps(cls, mode: str, mask: Sequence[bool] | None, configured_steps: int, steps: int) -> StepCache:
        """The configured step cache (``mode``, its ``mask`` of ``configured_steps`` entries) for ``steps`` steps."""
        if mode == "fixed":
            return cls(mode, tuple(mask) if steps == configured_steps else resample_mask(mask, steps))
        if mode == "dynamic" and steps != configured_steps:
            return cls(mode, thresholds=scale_thresholds(configured_steps, steps))
        return cls(mode)

    def should_run(self, index: int, history: list[torch.Tensor], countdown: int) -> tuple[bool, int]:
        """(run the DiT at step ``index``?, the new skip countdown)."""
        if self.mode == "off":
            return True, 0
        if self.mode == "fixed":
            return self.mask[index], 0
        if len(history) < 2:
            return True, countdown
        if countdown > 1:
            return False, countdown - 1
        if countdown == 1:
            return True, 0
        similarity = F.cosine_similarity(history[-1].flatten(1).float(), history[-2].flatten(1).float(), dim=1).mean()
        for threshold, skips in self.thresholds:
            if similarity > threshold:
                return False, skips
        return True, 0
