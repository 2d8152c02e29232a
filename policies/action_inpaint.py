"""Inpainting a flow-matching action sample towards a continuation's target (both families' ``inpaint`` mode).

At noise level sigma the sample is ``x = (1 - sigma) x0 + sigma eps``. Before each denoising step the continued
rows become ``x + w (x_target - x)`` with ``x_target = (1 - sigma) a' + sigma eps``: the old chunk's actions ``a'``
noised with the call's own initial noise ``eps``, weighted by RTC's soft mask ``w``
(:func:`ardiff_policies.continuation.soft_mask`: 1 on the frozen rows). At sigma 0 it is ``x + w (a' - x)``; the
frozen rows are then set to ``a'`` exactly (:func:`pin`). DreamZero's samples are (1, H, dim), LingBot-VA's
(1, channels, frames, per frame, 1): the tensors only need to broadcast.
"""

from __future__ import annotations

import torch


def toward(actions: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """The sample with its continued rows moved towards the target noised to ``sigma``."""
    noisy_target = (1.0 - sigma) * target + sigma * noise
    return actions + weights * (noisy_target - actions)


def pin(actions: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:
    """The final sample: soft-masked rows moved to the target at noise level 0, ``frozen`` (a bool mask) rows exactly it."""
    return torch.where(frozen, target, actions + weights * (target - actions))
