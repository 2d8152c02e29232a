"""Paged self-attention: write the current K/V into pages, attend over a block table.

Attention is non-causal over ``[visible window | current chunk | extra tokens]`` (the extra
tokens are DreamZero's action/state register). Two backends:

* ``sdpa``: gather the pages a sequence uses and call ``scaled_dot_product_attention``. Runs on
  CPU and GPU; every other backend is tested against it.
* ``flash``: vLLM's ``vllm_flash_attn.flash_attn_varlen_func`` reading the pages in place via
  ``block_table`` / ``seqused_k`` (no gather). Chosen automatically on CUDA when vLLM is
  installed and the page size suits the kernel (FA3 on Hopper takes any page size; FA2 needs
  a multiple of 256).
* ``flex``: PyTorch's FlexAttention reading the pages in place, without vLLM (see
  :func:`flex_paged_attention`). Runs wherever torch does (compiled Triton kernel on CUDA, the
  unfused reference on CPU), and, having no host synchronization, can be captured in a CUDA graph.

The write + attend step is one ``torch.library`` custom op, so a ``torch.compile``-d DiT
block stays a single graph. The layer's K and V pool tensors are explicit op arguments that
the op declares it mutates (``mutates_args``), so the compiler sees the write; every layer's
pool has the same shape, and slots, block ids and lengths are tensors, so a new layer, page or
window position changes values, never the graph. Nothing reaches the op through global state.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class PagedLayerInputs(NamedTuple):
    """One layer's inputs to :func:`paged_write_attend` and the paged attention functions, built once per forward by the cache."""

    key_cache: torch.Tensor  # (num_pages, page_size, heads, head_dim): this layer's K pool, written in place
    value_cache: torch.Tensor  # same for V
    video_slots: torch.Tensor  # (Lv,) int64 flat slots of the current video tokens, sequence after sequence
    extra_slots: torch.Tensor  # (Le,) int64 flat slots of the extra tokens, same order (may be empty)
    block_table: torch.Tensor  # (B, width) int32, a row per sequence, padded with the null page
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32: where each sequence's queries start
    seq_lens: torch.Tensor  # (B,) int32: each sequence's real key length (video + extra)
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str  # "auto" | "sdpa" | "flash" | "flex"


# --------------------------------------------------------------------------- backends


def sdpa_paged_attention(query: torch.Tensor, inputs: PagedLayerInputs, scale: float) -> torch.Tensor:
    """Reference backend. ``query`` is (total_q, heads, head_dim); returns the same shape."""
    key_cache, value_cache, block_table = inputs.key_cache, inputs.value_cache, inputs.block_table
    page_size = key_cache.shape[1]
    out = torch.empty_like(query)
    # Read the lengths on the host once per call (one device sync each), not per sequence.
    q_bounds, kv_lens = inputs.cu_seqlens_q.tolist(), inputs.seq_lens.tolist()
    for b, kv_len in enumerate(kv_lens):
        q_start, q_end = q_bounds[b], q_bounds[b + 1]
        num_pages = -(-kv_len // page_size)
        pages = block_table[b, :num_pages].to(device=key_cache.device, dtype=torch.long)
        k = key_cache.index_select(0, pages).flatten(0, 1)[:kv_len]
        v = value_cache.index_select(0, pages).flatten(0, 1)[:kv_len]
        # (L, H, D) -> (1, H, L, D): CPU SDPA only takes its flash kernel for 4-D inputs; with
        # 3-D it falls back to the math kernel and materializes H x Lq x Lk scores (1.8x slower).
        o = F.scaled_dot_product_attention(query[None, q_start:q_end].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), scale=scale)
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


def flash_paged_attention(query: torch.Tensor, inputs: PagedLayerInputs, scale: float, fa_version: int) -> torch.Tensor:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    out = torch.empty_like(query)
    flash_attn_varlen_func(
        q=query,
        k=inputs.key_cache,
        v=inputs.value_cache,
        out=out,
        cu_seqlens_q=inputs.cu_seqlens_q,
        max_seqlen_q=inputs.max_seqlen_q,
        seqused_k=inputs.seq_lens,
        max_seqlen_k=inputs.max_seqlen_k,
        softmax_scale=scale,
        causal=False,
        block_table=inputs.block_table,
        fa_version=fa_version,
    )
    return out


# ------------------------------------------------------------------------ flex backend
#
# FlexAttention over the page pool in place. The layer's pool (num_pages, page_size, H, D) is
# viewed as ONE key sequence of num_pages * page_size tokens (a free view: no copy, no gather)
# and a BlockMask restricts each query to the tokens of the pages in its block table:
#
# * page_len[p] = how many leading tokens of page p are visible (page_size for a window page,
#   the action/state count for the extra page, 0 for every other page of the pool);
# * the mask is cut into FLEX_BLOCK x FLEX_BLOCK tiles (flex's tile: 128). A key tile whose 128
#   tokens are all visible is a "full" block (no per-element mask); a tile that is partly
#   visible (a page boundary next to an invisible page, the extra page's tail) is a "partial"
#   block whose elements go through ``mask_mod``; invisible tiles are skipped entirely.
#
# Page size 880 is not a multiple of 128: a page boundary falls inside a tile, so a page whose
# neighbour in the pool is not visible costs up to 127 masked keys on each side. The pool layout
# is unchanged (no padding of pages to 896 tokens, no extra memory, the same pool serves every
# backend); the cost is compute on masked keys, bounded by 2 x 127 / 880 < 29 % of the keys in
# the worst case (every page isolated) and near zero when the allocator hands out runs of
# consecutive pages (it does: a fresh pool allocates 1, 2, 3, ...). Attention is non-causal, so
# the pages' order in the pool does not matter (RoPE was applied before the keys were written).
#
# Everything is built from the block table and sequence length with tensor ops on the device:
# no host synchronization, so the op can be replayed by a CUDA graph. Order of keys differs
# from the sdpa gather, so results equal sdpa up to floating-point summation order.

FLEX_BLOCK = 128


def _flex_block_mask(block_table: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, page_size: int, q_len: int):
    """The BlockMask of B sequences (a row of the block table each) over a pool of ``num_pages`` pages."""
    from torch.nn.attention.flex_attention import BlockMask

    device = block_table.device
    batch = block_table.shape[0]
    total = num_pages * page_size
    kv_blocks = -(-total // FLEX_BLOCK)
    q_blocks = -(-q_len // FLEX_BLOCK)
    table = block_table.long()
    positions = torch.arange(table.shape[1], device=device)
    lens = (seq_lens[:, None].long() - positions[None] * page_size).clamp(0, page_size)  # tokens used at each table slot
    # Padding slots point at the null page with length 0; "amax" keeps any duplicate harmless.
    page_len = torch.zeros(batch, num_pages, dtype=torch.long, device=device).scatter_reduce(1, table, lens, "amax")
    tokens = torch.arange(kv_blocks * FLEX_BLOCK, device=device)
    visible = (page_len[:, (tokens // page_size).clamp(max=num_pages - 1)] > tokens % page_size) & (tokens < total)
    count = visible.view(batch, kv_blocks, FLEX_BLOCK).sum(2)
    full = count == FLEX_BLOCK
    partial = (count > 0) & ~full

    def indices(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Per sequence: the flagged blocks first (stable: ascending pool order), the count says how many are read.
        order = torch.argsort((~flags).to(torch.int8), dim=1, stable=True).to(torch.int32)
        num = flags.sum(1).to(torch.int32)
        return (
            num.view(batch, 1, 1).expand(batch, 1, q_blocks).contiguous(),
            order.view(batch, 1, 1, -1).expand(batch, 1, q_blocks, kv_blocks).contiguous(),
        )

    def mask_mod(b, h, q_idx, kv_idx):
        return page_len[b, kv_idx // page_size] > kv_idx % page_size

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    kwargs = {"compute_q_blocks": False} if _FROM_KV_BLOCKS_HAS_Q_FLAG else {}  # q-side tables serve backward only
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(q_len, total),
        **kwargs,
    )


def _from_kv_blocks_has_q_flag() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask

        return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    except Exception:  # no flex attention in this torch: the backend raises when used
        return False


_FROM_KV_BLOCKS_HAS_Q_FLAG = _from_kv_blocks_has_q_flag()

# All layers of a forward share one block table tensor: the mask is built once per forward and
# reused by the other layers (keyed by the table and length tensors' identity and version, so an
# in-place update, e.g. a CUDA graph's static buffers being refilled, rebuilds it). Under CUDA
# graph capture the first layer's build is recorded in the graph and the others read its output.
_mask_cache: list = [None]


def _cached_block_mask(block_table: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, page_size: int, q_len: int):
    try:
        versions = (block_table._version, seq_lens._version)
    except RuntimeError:  # inference-mode tensors keep no version counter: build every time
        return _flex_block_mask(block_table, seq_lens, num_pages, page_size, q_len)
    # A mask built outside a CUDA graph capture must not be reused inside one (the capture has to
    # record the build, or replays would read the warm-up's mask), nor the other way round.
    capturing = block_table.is_cuda and torch.cuda.is_current_stream_capturing()
    key = (*versions, num_pages, page_size, q_len, block_table.device, capturing)
    hit = _mask_cache[0]
    if hit is not None and hit[0]() is block_table and hit[1]() is seq_lens and hit[2] == key:
        return hit[3]
    mask = _flex_block_mask(block_table, seq_lens, num_pages, page_size, q_len)
    _mask_cache[0] = (weakref.ref(block_table), weakref.ref(seq_lens), key, mask)
    return mask


# Query lengths a DreamZero-style rollout compiles for: a 1-frame prefill, a later prefill and a denoise step.
QUERY_KINDS = 3


def allow_batch_shapes(max_batch: int, branches: int) -> None:
    """Let ``torch.compile`` (``dynamic=False``) keep a graph per batch shape: every number of
    sequences in a forward (1 .. max_batch x branches, the step cache may run a subset) times each
    query length. Dynamo's default (8 per code object) would fail a ``fullgraph`` compile at the
    9th shape, i.e. at the first batch of 3 sessions; raising it only ever adds cache entries."""
    config = torch._dynamo.config
    needed = QUERY_KINDS * max_batch * branches + 8
    if getattr(config, "recompile_limit", needed) < needed:
        config.recompile_limit = needed
    if getattr(config, "accumulated_recompile_limit", needed) < needed:
        config.accumulated_recompile_limit = needed


@functools.cache
def _flex_kernel(compiled: bool):
    """flex_attention itself: compiled (the fused Triton kernel on CUDA, inductor's C++ template on
    CPU), or eager: an unfused reference that materializes query x pool scores and applies
    ``mask_mod`` to every element (it reads no block indices), for small CPU cases only."""
    from torch.nn.attention.flex_attention import flex_attention

    if compiled:
        return torch.compile(flex_attention, dynamic=False, fullgraph=True)

    def eager(*args, **kwargs):
        with warnings.catch_warnings():  # the unfused path is chosen on purpose here
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return eager


def flex_paged_attention(query: torch.Tensor, inputs: PagedLayerInputs, scale: float, compiled: bool | None = None) -> torch.Tensor:
    """Paged attention with FlexAttention, reading the pages in place.

    ``query`` is (total_q, heads, head_dim): B sequences (a block-table row each) of equal query
    length, stacked. The pool is one key sequence shared by all B query sequences (broadcast over
    the batch); each sequence's block mask lets it see its own pages only. ``compiled`` defaults
    to True on CUDA (the eager path materializes query x pool scores) and False on CPU.
    """
    key_cache, value_cache, block_table = inputs.key_cache, inputs.value_cache, inputs.block_table
    batch = block_table.shape[0]
    if query.shape[0] % batch:
        raise ValueError(f"the flex backend needs equal query lengths: {query.shape[0]} queries for {batch} sequences")
    q_len = query.shape[0] // batch
    num_pages, page_size, heads, dim = key_cache.shape
    mask = _cached_block_mask(block_table, inputs.seq_lens, num_pages, page_size, q_len)
    # (P, S, H, D) -> (1, H, P * S, D): a strided view of the pool, nothing is copied.
    key = key_cache.view(1, num_pages * page_size, heads, dim).transpose(1, 2)
    value = value_cache.view(1, num_pages * page_size, heads, dim).transpose(1, 2)
    kernel = _flex_kernel(query.is_cuda if compiled is None else compiled)
    # Always below the autograd/view-tracking keys (inference only): the custom op is entered
    # with ADInplaceOrView excluded on some paths (the first run of an enclosing compiled graph)
    # and not on others, and the compiled kernel's guards would recompile for each state.
    with torch._C._AutoDispatchBelowADInplaceOrView():
        out = kernel(query.view(batch, q_len, heads, dim).transpose(1, 2), key, value, block_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(batch * q_len, heads, dim)


def paged_attention(query: torch.Tensor, inputs: PagedLayerInputs, scale: float) -> torch.Tensor:
    """Non-causal attention of ``query`` (total_q, H, D) over the pages in ``inputs.block_table``, with
    ``inputs.backend`` (the slots are not read: nothing is written)."""
    backend = inputs.backend
    if backend not in ("auto", "sdpa", "flash", "flex"):
        raise ValueError(f"unknown attention backend {backend!r}; expected auto, sdpa, flash or flex")
    if backend == "flex":
        return flex_paged_attention(query, inputs, scale)
    if backend != "sdpa" and query.is_cuda:
        version = flash_attention_version(query.device.index or 0, inputs.key_cache.shape[1])
        if version is not None:
            return flash_paged_attention(query, inputs, scale, version)
        if backend == "flash":
            raise RuntimeError("attention backend 'flash' requested but vLLM flash-attention is unavailable here")
    elif backend == "flash":
        raise RuntimeError("attention backend 'flash' needs CUDA tensors")
    return sdpa_paged_attention(query, inputs, scale)


# ------------------------------------------------------------- fused write + attend op


def write_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    extra_key: torch.Tensor | None,
    extra_value: torch.Tensor | None,
    scale: float,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    video_slots: torch.Tensor,
    extra_slots: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    backend: str,
) -> torch.Tensor:
    # A custom op takes tensors and scalars, not a NamedTuple: the layer's inputs arrive spread out, last and in
    # PagedLayerInputs' field order, so a caller passes ``*inputs``.
    inputs = PagedLayerInputs(
        key_cache, value_cache, video_slots, extra_slots, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k, backend
    )
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k.index_copy_(0, video_slots, key.to(flat_k.dtype))
    flat_v.index_copy_(0, video_slots, value.to(flat_v.dtype))
    if extra_key is not None and extra_value is not None and extra_key.shape[0] > 0:
        flat_k.index_copy_(0, extra_slots, extra_key.to(flat_k.dtype))
        flat_v.index_copy_(0, extra_slots, extra_value.to(flat_v.dtype))
    return paged_attention(query.to(key_cache.dtype), inputs, scale).to(query.dtype)


# Registration is guarded so re-importing this module (tests pop it from sys.modules) is a no-op.
if not hasattr(torch.ops.ardiff, "paged_write_attend"):
    _op = torch.library.custom_op("ardiff::paged_write_attend", write_attend, mutates_args=("key_cache", "value_cache"))

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
    return torch.ops.ardiff.paged_write_attend(query, key, value, extra_key, extra_value, scale, *inputs)
