"""The DiT step cache: whether a denoising step runs the DiT or reuses the last velocity.

Upstream's dynamic rule (``dit_step_cache: dynamic``): after two real steps, skip 4 / 2 steps
while the last two video velocities stay closer than cosine 0.95 / 0.93. ``fixed`` follows a
per-step mask; ``off`` always runs. Decided per session from its own velocities, so a batched
session steps exactly as it would alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

THRESHOLDS = ((0.95, 4), (0.93, 2))  # (cosine similarity above which, steps skipped)


def should_run(mode: str, mask: Sequence[bool] | None, index: int, history: list[torch.Tensor], countdown: int) -> tuple[bool, int]:
    """(run the DiT at step ``index``?, the new skip countdown)."""
    if mode == "off":
        return True, 0
    if mode == "fixed":
        return mask[index], 0
    if len(history) < 2:
        return True, countdown
    if countdown > 1:
        return False, countdown - 1
    if countdown == 1:
        return True, 0
    similarity = F.cosine_similarity(history[-1].flatten(1).float(), history[-2].flatten(1).float(), dim=1).mean()
    for threshold, skips in THRESHOLDS:
        if similarity > threshold:
            return False, skips
    return True, 0
