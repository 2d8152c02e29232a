"""Paged self-attention: write the current K/V into pages, attend over a block table.

Attention is non-causal over ``[visible window | current chunk | extra tokens]`` (the extra
tokens are DreamZero's action/state register). Two backends:

* ``sdpa``: gather the pages a sequence uses and call ``scaled_dot_product_attention``. Runs on
  CPU and GPU; every other backend is tested against it.
* ``flash``: vLLM's ``vllm_flash_attn.flash_attn_varlen_func`` reading the pages in place via
  ``block_table`` / ``seqused_k`` (no gather). Chosen automatically on CUDA when vLLM is
  installed and the page size suits the kernel (FA3 on Hopper takes any page size; FA2 needs
  a multiple of 256).

The write + attend step is one ``torch.library`` custom op, so a ``torch.compile``-d DiT
block stays a single graph. The layer's K and V pool tensors are explicit op arguments that
the op declares it mutates (``mutates_args``), so the compiler sees the write; every layer's
pool has the same shape, and slots, block ids and lengths are tensors, so a new layer, page or
window position changes values, never the graph. Nothing reaches the op through global state.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class PagedLayerInputs(NamedTuple):
    """One layer's inputs to :func:`paged_write_attend`, built once per forward by the cache."""

    key_cache: torch.Tensor  # (num_pages, page_size, heads, head_dim): this layer's K pool, written in place
    value_cache: torch.Tensor  # same for V
    video_slots: torch.Tensor  # (Lv,) int64 flat slots of the current video tokens
    extra_slots: torch.Tensor  # (Le,) int64 flat slots of the extra tokens (may be empty)
    block_table: torch.Tensor  # (1, width) int32, padded with the null page
    cu_seqlens_q: torch.Tensor  # (2,) int32
    seq_lens: torch.Tensor  # (1,) int32: real key length (video + extra)
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str  # "auto" | "sdpa" | "flash"


# --------------------------------------------------------------------------- backends


def sdpa_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference backend. ``query`` is (total_q, heads, head_dim); returns the same shape."""
    page_size = key_cache.shape[1]
    out = torch.empty_like(query)
    for b in range(seq_lens.shape[0]):
        q_start, q_end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        kv_len = int(seq_lens[b])
        num_pages = -(-kv_len // page_size)
        pages = block_table[b, :num_pages].to(device=key_cache.device, dtype=torch.long)
        k = key_cache.index_select(0, pages).flatten(0, 1)[:kv_len]
        v = value_cache.index_select(0, pages).flatten(0, 1)[:kv_len]
        # (L, H, D) -> (1, H, L, D): CPU SDPA only takes its flash kernel for 4-D inputs; with
        # 3-D it falls back to the math kernel and materializes H x Lq x Lk scores (1.8x slower).
        o = F.scaled_dot_product_attention(
            query[None, q_start:q_end].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), scale=scale
        )
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


@functools.cache
def flash_attention_version(device_index: int, page_size: int) -> int | None:
    """FA version usable for this device and page size, or None (then sdpa is used)."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # vLLM absent or built for another CUDA: sdpa it is
        return None
    major, _ = torch.cuda.get_device_capability(device_index)
    if major == 9:
        return 3
    if page_size % 256 == 0:
        return 2
    logger.warning("flash backend: page size %d needs FA3 (Hopper); falling back to sdpa", page_size)
    return None


def flash_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    fa_version: int,
) -> torch.Tensor:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    out = torch.empty_like(query)
    flash_attn_varlen_func(
        q=query,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        seqused_k=seq_lens,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=False,
        block_table=block_table,
        fa_version=fa_version,
    )
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Non-causal attention of ``query`` (total_q, H, D) over the pages in ``block_table``."""
    if backend not in ("auto", "sdpa", "flash"):
        raise ValueError(f"unknown attention backend {backend!r}; expected auto, sdpa or flash")
    if backend != "sdpa" and query.is_cuda:
        version = flash_attention_version(query.device.index or 0, key_cache.shape[1])
        if version is not None:
            return flash_paged_attention(
                query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                max_seqlen_q, max_seqlen_k, scale, version,
            )  # fmt: skip
        if backend == "flash":
            raise RuntimeError("attention backend 'flash' requested but vLLM flash-attention is unavailable here")
    elif backend == "flash":
        raise RuntimeError("attention backend 'flash' needs CUDA tensors")
    return sdpa_paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale)


# ------------------------------------------------------------- fused write + attend op


def _write_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    extra_key: torch.Tensor | None,
    extra_value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    video_slots: torch.Tensor,
    extra_slots: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    backend: str,
) -> torch.Tensor:
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k.index_copy_(0, video_slots, key.to(flat_k.dtype))
    flat_v.index_copy_(0, video_slots, value.to(flat_v.dtype))
    if extra_key is not None and extra_value is not None and extra_key.shape[0] > 0:
        flat_k.index_copy_(0, extra_slots, extra_key.to(flat_k.dtype))
        flat_v.index_copy_(0, extra_slots, extra_value.to(flat_v.dtype))
    return paged_attention(
        query.to(key_cache.dtype),
        key_cache,
        value_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        scale=scale,
        backend=backend,
    ).to(query.dtype)


# Registration is guarded so re-importing this module (tests pop it from sys.modules) is a no-op.
if not hasattr(torch.ops.ardiff, "paged_write_attend"):
    _op = torch.library.custom_op("ardiff::paged_write_attend", _write_attend, mutates_args=("key_cache", "value_cache"))

    @_op.register_fake
    def _(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.empty_like(query)


def paged_write_attend(
    inputs: PagedLayerInputs,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    extra_key: torch.Tensor | None,
    extra_value: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Write this layer's current K/V into its pages, then attend. Tensors are (L, H, D).

    ``query`` holds the video queries followed by the extra (action/state) queries.
    """
    return torch.ops.ardiff.paged_write_attend(
        query, key, value, extra_key, extra_value, inputs.key_cache, inputs.value_cache,
        inputs.video_slots, inputs.extra_slots, inputs.block_table, inputs.cu_seqlens_q, inputs.seq_lens,
        inputs.max_seqlen_q, inputs.max_seqlen_k, scale, inputs.backend,
    )  # fmt: skip
