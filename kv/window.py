"""Chunk-window eviction: which pages a branch keeps and which pages attention sees.

Pure functions over page counts, so the policy is unit-testable without any tensors.

* Visibility is page-exact, like upstream DreamZero's ``cat(cache, new)[-window:]``: the sink
  pages plus the most recent ``window - sink`` pages of (history + current chunk).
* Eviction frees whole chunks only (chunk boundaries are absolute positions, multiples of
  ``chunk_pages``): a chunk that is still partly visible stays resident until it is fully out.
* ``reset_at_boundary``: once the window is full after a commit, every non-sink page is
  freed and the next chunk starts a fresh window.
* ``evict_to_fit`` (LingBot-VA, :func:`pages_to_fit`): no eviction after a commit; before any
  forward the oldest pages are freed until what the branch holds plus the forward's new pages
  fit in the window. Committed pages are older than provisional ones (a commit discards the
  provisional tail first), so the committed go first.
* A branch's pinned (in-context) pages are outside all of this: they precede the window, are never
  counted in it, never evicted (``SessionKV`` puts them before what :func:`visible_pages` returns).
"""

from __future__ import annotations

from collections.abc import Sequence


def pages_to_evict(
    resident_pages: int,
    *,
    window_pages: int,
    chunk_pages: int,
    sink_chunks: int = 0,
    reset_at_boundary: bool = False,
) -> int:
    """How many of the oldest non-sink resident pages to free after a commit (whole chunks)."""
    if resident_pages < 0:
        raise ValueError(f"resident_pages must be >= 0, got {resident_pages}")
    sink = sink_chunks * chunk_pages
    movable = max(0, resident_pages - sink)
    budget = window_pages - sink
    if reset_at_boundary:
        return movable if movable >= budget else 0
    overflow = max(0, movable - budget)
    return (overflow // chunk_pages) * chunk_pages


def visible_pages(
    resident: Sequence[int],
    current: Sequence[int],
    *,
    window_pages: int,
    sink_pages: int = 0,
) -> list[int]:
    """Page ids attention reads, in position order: sink + the newest ``window - sink`` pages."""
    sink = list(resident[:sink_pages])
    rest = list(resident[sink_pages:]) + list(current)
    keep = window_pages - len(sink)
    return sink + rest[-keep:] if keep > 0 else sink


def pages_to_fit(resident_pages: int, provisional_pages: int, new_pages: int, *, window_pages: int) -> tuple[int, int]:
    """(committed, provisional) oldest pages to free before a forward of ``new_pages`` so that everything fits in
    the window: upstream LingBot-VA's slot allocator (``WanAttention.allocate_slots``), which frees the oldest
    entries, by write order, for any write that does not fit, a temporary one included."""
    if min(resident_pages, provisional_pages, new_pages) < 0:
        raise ValueError(f"page counts must be >= 0, got {resident_pages}, {provisional_pages}, {new_pages}")
    if new_pages > window_pages:
        raise ValueError(f"a forward of {new_pages} pages cannot fit in a window of {window_pages}")
    over = max(0, resident_pages + provisional_pages + new_pages - window_pages)
    from_resident = min(over, resident_pages)
    return from_resident, over - from_resident
