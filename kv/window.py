"""Chunk-window eviction: which pages a branch keeps and which pages attention sees.

Pure functions over page counts, so the policy is unit-testable without any tensors.

* Visibility is page-exact, like upstream DreamZero's ``cat(cache, new)[-window:]``: the sink
  pages plus the most recent ``window - sink`` pages of (history + current chunk).
* Eviction frees whole chunks only (chunk boundaries are absolute positions, multiples of
  ``chunk_pages``): a chunk that is still partly visible stays resident until it is fully out.
* ``reset_at_boundary``: once the window is full after a commit, every non-sink page is
  freed and the next chunk starts a fresh window.
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
