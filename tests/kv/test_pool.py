"""The page allocator."""

from __future__ import annotations

import pytest

from ardiff_kv.pool import CapacityError, PagePool


def test_null_page_is_never_handed_out():
    pool = PagePool(5)
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    assert PagePool.NULL_PAGE not in pages
    assert pool.num_free == 0


def test_fresh_pool_hands_out_contiguous_pages():
    assert PagePool(10).allocate(3) == [1, 2, 3]


def test_exhaustion_is_a_clear_error_and_changes_nothing():
    pool = PagePool(4)
    pool.allocate(2)
    with pytest.raises(CapacityError, match="need 2 pages, 1 of 3 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_free_returns_pages_and_counts_are_exact():
    pool = PagePool(8)
    a, b = pool.allocate(3), pool.allocate(2)
    assert pool.num_allocated == 5
    pool.free(a)
    assert pool.num_free == 5 and pool.num_allocated == 2
    pool.free(b)
    assert pool.num_free == pool.capacity == 7


@pytest.mark.parametrize("bad", [[0], [9], [1, 1]])
def test_double_or_foreign_free_raises(bad):
    pool = PagePool(9)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.free(bad)


def test_freeing_an_unallocated_page_raises():
    pool = PagePool(4)
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(pages)


def test_pool_needs_a_real_page():
    with pytest.raises(ValueError):
        PagePool(1)
