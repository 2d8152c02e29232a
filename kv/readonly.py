"""Paged self-attention that reads the cache and writes nothing, differentiable in the current tokens.

RTC's guided continuation (``policy.continuation: guided``) needs a vector-Jacobian product through
a denoise forward: the gradient of the predicted actions with respect to the noisy actions. The
paged write + attend op (:func:`ardiff_kv.attention.paged_write_attend`) has no autograd formula: it writes
the current K/V into pages and attends over them in place. A denoise step commits nothing, so its
K/V need not be written at all: :class:`ReadOnlyPagedLayer` gathers the visible window's cached K/V
(constants for autograd) and concatenates the current tokens' live K/V after them, in the order the
block table lays a sequence out (``[cached window | current chunk | extra tokens]``,
:func:`ardiff_kv.window.visible_pages`), then calls ``scaled_dot_product_attention``, which has a
backward. The forward values equal the sdpa backend's (tests/kv/test_readonly.py).

It is the ``attend`` interface of :class:`ardiff_kv.dense.DenseLayerKV`, so the DiT takes it as a layer's
``self_kv`` unchanged. CPU-sized: one gather per sequence and layer, like the sdpa reference backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ardiff_kv.attention import PagedLayerInputs


class ReadOnlyPagedLayer:
    """One layer's paged inputs, read-only (see the module docstring)."""

    def __init__(self, inputs: PagedLayerInputs) -> None:
        self.inputs = inputs

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        extra_key: torch.Tensor | None,
        extra_value: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """(B, L, heads, head_dim) in and out, a block-table row per sequence; ``query`` covers video then extra tokens."""
        inputs = self.inputs
        current_k = key if extra_key is None else torch.cat([key, extra_key], dim=1)
        current_v = value if extra_value is None else torch.cat([value, extra_value], dim=1)
        page_size = inputs.key_cache.shape[1]
        own = current_k.shape[1]  # this call's tokens: they close each sequence's keys
        outputs = []
        for b, kv_len in enumerate(inputs.seq_lens.tolist()):
            cached = kv_len - own
            if cached < 0:
                raise ValueError(f"sequence {b}: {kv_len} keys cannot hold this call's {own} tokens")
            pages = inputs.block_table[b, : -(-cached // page_size)].to(device=inputs.key_cache.device, dtype=torch.long)
            k = inputs.key_cache.index_select(0, pages).flatten(0, 1)[:cached].to(current_k.dtype)
            v = inputs.value_cache.index_select(0, pages).flatten(0, 1)[:cached].to(current_v.dtype)
            k = torch.cat([k[None], current_k[b : b + 1]], dim=1)
            v = torch.cat([v[None], current_v[b : b + 1]], dim=1)
            out = F.scaled_dot_product_attention(query[b : b + 1].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
            outputs.append(out.transpose(1, 2))
        return torch.cat(outputs)
