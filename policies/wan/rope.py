"""Wan's rotary position embedding: 3-D (frame, height, width) over the attention head, theta 10000.

Both families split the head the same way (:func:`rope_axis_dims`) and rotate interleaved pairs
(:func:`apply_rope`); where the positions come from is each model's own: DreamZero reads integer positions from
angle tables (:func:`rope_angles`; its action register has tables of its own), LingBot-VA computes angles for float
positions per call (its action tokens sit between frames).
"""

from __future__ import annotations

import torch


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """The head's frame / height / width parts: d - 4 (d // 6), 2 (d // 6), 2 (d // 6) (upstream Wan, diffusers'
    ``WanRotaryPosEmbed``). LingBot-VA's upstream writes d - 2 (d // 3), d // 3, d // 3: the same parts for every
    head whose parts are all even, which its config requires."""
    part = 2 * (head_dim // 6)
    return head_dim - 2 * part, part, part


def rope_frequencies(dim: int, theta: float = 10000.0, device: torch.device | None = None) -> torch.Tensor:
    """(dim // 2,) float64 inverse frequencies 1 / theta^(2k / dim) of one rotated part."""
    return 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)


def rope_angles(max_len: int, dim: int) -> torch.Tensor:
    """RoPE angles (max_len, dim // 2) of integer positions 0 .. max_len - 1, in float64, theta 10000."""
    return torch.outer(torch.arange(max_len, dtype=torch.float64), rope_frequencies(dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved (real, imag) pairs of x (B, L, H, D) by per-token angles (L, 1, D/2).

    Real-valued form of upstream's complex multiply (no complex tensors: compile-friendly);
    computed in float32, which is what upstream's float64 result is cast down to anyway.
    """
    x_pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = x_pairs[..., 0], x_pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
