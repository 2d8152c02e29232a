"""Random weights made on the device for a network built on the meta device: the released geometry without a
checkpoint, to measure the real model's speed and memory (both families' ``synthetic:`` checkpoints,
``scripts/gpu_check.py``).

:func:`materialize` allocates each distinct tensor directly on the target device in the target dtype and fills it
from a seeded device-side generator (no CPU copy, no float32 detour: a 14B DiT and the 5.7B UMT5 go straight to
~46 GB of bf16 on a GPU in a second or so). The fill keeps activations finite through every layer: weight matrices
~ N(0, 1/fan_in), residual-branch output projections (DreamZero's DiT, UMT5, CLIP; :func:`_residual_outputs`)
further scaled by 1/sqrt(2 x depth), norm gains 1, small biases, modulations ~ N(0, 1/dim) like the DiT's own init.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def _residual_outputs(name: str) -> bool:
    """Projections that write into a residual stream (scaled down with depth)."""
    return name.endswith(
        (
            "self_attn.o.weight",
            "cross_attn.o.weight",
            "ffn.2.weight",  # DreamZero's DiT (LingBot-VA's blocks are not listed: unscaled)
            "SelfAttention.o.weight",
            "DenseReluDense.wo.weight",  # UMT5
            "self_attn.out_proj.weight",
            "mlp.fc2.weight",  # CLIP
        )
    )


@torch.no_grad()
def _fill(name: str, owner: nn.Module, tensor: torch.Tensor, generator: torch.Generator, depth: int) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if not tensor.is_floating_point():
        tensor.zero_()
    elif "norm" in type(owner).__name__.lower():  # LayerNorm, RMSNorm, UMT5's and the VAE's norms
        tensor.fill_(0.0 if leaf == "bias" else 1.0)
    elif leaf == "logit_scale":
        tensor.fill_(math.log(1 / 0.07))
    elif leaf == "modulation":
        tensor.normal_(0.0, 1.0 / math.sqrt(tensor.shape[-1]), generator=generator)
    elif leaf in ("bias", "b") or tensor.ndim == 1:
        tensor.normal_(0.0, 0.02, generator=generator)
    elif isinstance(owner, nn.Embedding):
        # UMT5's token embeddings are unit scale (RMS-normed later); position / bucket tables small.
        vocab_table = "shared" in name or "embed_tokens" in name
        tensor.normal_(0.0, 1.0 if vocab_table else 0.02, generator=generator)
    else:
        fan_in = tensor.shape[-2] if leaf == "W" else math.prod(tensor.shape[1:])
        std = 1.0 / math.sqrt(max(fan_in, 1))
        if _residual_outputs(name):
            std /= math.sqrt(2 * max(depth, 1))
        tensor.normal_(0.0, std, generator=generator)


def materialize(module: nn.Module, *, device: torch.device, dtype: torch.dtype, generator: torch.Generator, depth: int) -> None:
    """Replace every meta tensor of ``module`` by a filled tensor on ``device`` (tied tensors stay tied)."""
    replaced: dict[int, torch.Tensor] = {}
    entries: Iterable[tuple[str, torch.Tensor, bool]] = [
        *((n, t, True) for n, t in module.named_parameters(remove_duplicate=False)),
        *((n, t, False) for n, t in module.named_buffers(remove_duplicate=False)),
    ]
    for name, tensor, is_param in entries:
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        new = replaced.get(id(tensor))
        if new is None:
            target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            new = torch.empty(tensor.shape, dtype=target_dtype, device=device)
            _fill(name, owner, new, generator, depth)
            if is_param:
                new = nn.Parameter(new, requires_grad=False)
            replaced[id(tensor)] = new
        (owner._parameters if is_param else owner._buffers)[leaf] = new
    rebuild = getattr(module, "rebuild_buffers", None)
    if rebuild is not None:
        rebuild(device)
    left_on_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left_on_meta:
        raise RuntimeError(f"synthetic model: tensors left on the meta device: {left_on_meta[:10]}")
    module.eval().requires_grad_(False)
