"""Paged KV cache for autoregressive video-diffusion models.

``spec``       what a model needs, in pages (``KVSpec``, ``Branch``, ``EntryKind``, ``CrossKV``)
``window``     the chunk-window eviction policy (pure)
``pool``       the page allocator: where a page is allocated and freed
``storage``    the page tensors, scratch region and cross-attention slots of one rank
``session``    one session's two CFG branches, typed entries (in-context pinned / observation / prediction), forward
               contexts, commit / abort / window restart, snapshot / rollback
``cache``      the rank's cache: storage + pool, admission, where a session's KV opens and ends
``attention``  paged attention backends and the fused write + attend custom op
``dense``      upstream concat-and-slice semantics, the reference for tests and benchmarks
``readonly``   paged attention that writes nothing and has a backward (RTC's guided continuation)
"""

from ardiff_kv.attention import PagedLayerInputs, paged_attention, paged_write_attend
from ardiff_kv.cache import PagedKVCache, kv_budget_bytes
from ardiff_kv.dense import DenseKVCache, DenseLayerKV
from ardiff_kv.pool import CapacityError, PagePool
from ardiff_kv.readonly import ReadOnlyPagedLayer
from ardiff_kv.session import Entry, ForwardContext, KVSnapshot, SessionKV, prepare_batch
from ardiff_kv.spec import Branch, CrossKV, EntryKind, KVSpec
from ardiff_kv.storage import CrossAttentionSlots, PagedStorage
from ardiff_kv.window import pages_to_evict, pages_to_fit, visible_pages

__all__ = [
    "Branch",
    "CapacityError",
    "CrossAttentionSlots",
    "CrossKV",
    "DenseKVCache",
    "DenseLayerKV",
    "Entry",
    "EntryKind",
    "ForwardContext",
    "KVSnapshot",
    "KVSpec",
    "PagePool",
    "PagedKVCache",
    "PagedLayerInputs",
    "PagedStorage",
    "ReadOnlyPagedLayer",
    "SessionKV",
    "kv_budget_bytes",
    "paged_attention",
    "paged_write_attend",
    "pages_to_evict",
    "pages_to_fit",
    "prepare_batch",
    "visible_pages",
]
