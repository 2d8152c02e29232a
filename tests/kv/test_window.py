"""The chunk-window eviction policy, as pure functions."""

from __future__ import annotations

import pytest

from ardiff_kv.window import pages_to_evict, visible_pages


def evict(resident, *, window=4, chunk=2, sink=0, reset=False):
    return pages_to_evict(resident, window_pages=window, chunk_pages=chunk, sink_chunks=sink, reset_at_boundary=reset)


def test_sliding_keeps_the_window():
    assert evict(4) == 0  # exactly full
    assert evict(6) == 2  # one chunk fell out
    assert evict(8) == 4


def test_sliding_never_evicts_half_a_chunk():
    # 5 resident pages, window 4: one page over, but that page's chunk is still partly visible.
    assert evict(5) == 0
    assert evict(7) == 2
    assert all(evict(n) % 2 == 0 for n in range(20))


def test_sink_chunks_are_never_evicted():
    # sink = 1 chunk (2 pages); the other 2 window pages slide.
    assert evict(4, sink=1) == 0
    assert evict(6, sink=1) == 2
    assert evict(2, sink=1) == 0
    assert evict(10, window=6, sink=1) == 4


def test_reset_at_boundary_drops_everything_past_the_sink_once_full():
    assert evict(3, reset=True) == 0  # not full yet: nothing dropped
    assert evict(4, reset=True) == 4  # full: the window restarts
    assert evict(3, sink=1, reset=True) == 0  # sink 2 pages + 1 movable: budget 2 not reached
    assert evict(4, sink=1, reset=True) == 2  # 2 movable fill the budget: dropped, sink kept
    assert evict(5, sink=1, reset=True) == 3


def test_frame_granular_dreamzero_window():
    # DreamZero pages one latent frame per page and attends over 9 frames.
    for resident in range(0, 10):
        assert pages_to_evict(resident, window_pages=9, chunk_pages=1) == 0
    assert pages_to_evict(11, window_pages=9, chunk_pages=1) == 2


def test_visible_pages_is_the_upstream_slice():
    history, current = [11, 12, 13, 14], [21, 22]
    # upstream: cat(cache, new)[-window:]
    assert visible_pages(history, current, window_pages=4) == (history + current)[-4:]
    assert visible_pages(history, current, window_pages=9) == history + current
    assert visible_pages([], current, window_pages=3) == current


def test_visible_pages_keeps_the_sink():
    assert visible_pages([1, 2, 3, 4, 5], [6, 7], window_pages=5, sink_pages=2) == [1, 2, 5, 6, 7]


def test_negative_resident_is_rejected():
    with pytest.raises(ValueError):
        evict(-1)
