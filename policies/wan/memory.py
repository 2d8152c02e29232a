"""The memory-plan arithmetic both families use: parameter counts of meta-device modules, the activations of a Wan
transformer forward, a causal-conv VAE chunk and a UMT5 / CLIP encode, and the CUDA reserve.

Each family's ``memory.py`` adds up its own plan from these (DreamZero: per device, with the KV pool as the engine
sizes it and the fixes to suggest; LingBot-VA: weights, each session's pages and prompt K/V, sessions per card).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

GiB = 2**30
# What CUDA needs beyond the tensors PyTorch accounts: cuBLAS / cuDNN workspaces (the VAE's 3-D
# convolutions), NCCL buffers under CFG-parallel, caching-allocator fragmentation. A prior, to be
# calibrated against scripts/gpu_check.py's measured peak on a real GPU.
CUDA_RESERVE_BYTES = 1 * GiB
# A causal-conv VAE chunk: 4 new frames plus the 2 cached ones its convolutions concatenate.
VAE_CHUNK_FRAMES = 6
# Tensors of (first-level channels x 6 frames x H x W) x 4 bytes alive at a VAE encode's peak: the
# exact peak of live tensor bytes of a 9-frame float32 encode on a CPU over that unit, rounded up
# (scripts/memory_plan.py --measure-vae): Wan2.1 VAE 6.88 / 6.82 / 6.79 at 88x160 / 176x320 /
# 352x640; Wan2.2 VAE (is_residual: its first level at half resolution after the 2x2 patchify, plus
# the residual down-sampling's shortcut copies) 8.37 at 160x320.
VAE_LIVE_TENSORS = 7
RESIDUAL_VAE_LIVE_TENSORS = 9


@dataclass(frozen=True)
class ComponentSize:
    floating: int  # floating-point parameters and persistent buffers: stored in the engine dtype
    other_bytes: int = 0  # integer buffers (CLIP's position ids)

    def bytes(self, dtype: torch.dtype) -> int:
        return self.floating * itemsize(dtype) + self.other_bytes


def module_size(module: nn.Module) -> ComponentSize:
    floating = other = 0
    seen: set[int] = set()
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if tensor.is_floating_point():
            floating += tensor.numel()
        else:
            other += tensor.numel() * tensor.element_size()
    return ComponentSize(floating, other)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def transformer_forward_bytes(tokens: int, dim: int, ffn_dim: int, window_tokens: int, element_size: int) -> int:
    """One Wan transformer forward of ``tokens`` tokens (one sequence): across layers x, e (L x dim) and the per-token
    modulation (6 L x dim); inside a block its modulation (6 L x dim) plus the larger of self-attention (norms, q, k,
    v, output: 8 L x dim; RoPE in float32: 3 L x dim x 4 bytes; the visible window's K/V gathered by the sdpa backend:
    2 x window tokens x dim) and the FFN (2 L x ffn_dim + 2 L x dim)."""
    b = element_size
    attention = 8 * tokens * dim * b + 3 * tokens * dim * 4 + 2 * window_tokens * dim * b
    feed_forward = (2 * tokens * ffn_dim + 2 * tokens * dim) * b
    return (8 + 6) * tokens * dim * b + max(attention, feed_forward)


def vae_chunk_bytes(vae: Mapping[str, Any], height: int, width: int, channels: int) -> int:
    """One causal chunk of the Wan VAE at its first (full-resolution) level, ``channels`` wide: 7 tensors (9 for the
    Wan2.2 VAE) of channels x 6 frames x H x W in float32, measured (an upper bound in bf16)."""
    patch = vae.get("patch_size") or 1
    live = RESIDUAL_VAE_LIVE_TENSORS if vae.get("is_residual") else VAE_LIVE_TENSORS
    return live * channels * VAE_CHUNK_FRAMES * (height // patch) * (width // patch) * 4


def encoder_bytes(tokens: int, width: int, ffn_dim: int, heads: int, element_size: int) -> int:
    """``tokens`` through a transformer encoder (UMT5, CLIP): 6 width + 3 ffn_dim per token, and its eager attention's
    float32 scores and probabilities (2 x heads x tokens^2)."""
    return tokens * (6 * width + 3 * ffn_dim) * element_size + 2 * heads * tokens * tokens * 4
