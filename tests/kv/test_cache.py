"""Cache storage, sizing, scratch pages and session admission."""

from __future__ import annotations

import pytest
import torch

from ardiff_kv import Branch, CapacityError, KVSpec, PagedKVCache

SPEC = KVSpec(
    num_layers=2,
    num_heads=4,
    head_dim=16,
    page_size=8,
    window_pages=9,
    max_new_pages=2,
    max_extra_tokens=25,
    cross_text_tokens=12,
    cross_image_tokens=5,
)


def test_storage_views_share_memory_for_slot_writes_and_block_table_reads():
    cache = PagedKVCache(SPEC, num_pages=40, max_sessions=2)
    key_cache = cache.storage.key_cache(1)
    assert key_cache.shape[1:] == (8, 4, 16)
    flat = key_cache.view(-1, 4, 16)
    flat[3 * 8 + 5].fill_(7.0)  # slot = page * page_size + offset
    assert torch.equal(key_cache[3, 5], torch.full((4, 16), 7.0))
    assert cache.storage.value_cache(1)[3, 5].abs().sum() == 0  # K and V are separate


def test_budget_sizing_deducts_cross_and_scratch_first():
    budget = 300 * SPEC.page_bytes
    cache = PagedKVCache.from_budget(SPEC, budget, max_sessions=4)
    fixed = 4 * 2 * SPEC.cross_slot_bytes + 2 * SPEC.scratch_pages_per_branch * SPEC.page_bytes
    assert cache.pool.capacity == (budget - fixed) // SPEC.page_bytes
    assert cache.pool.capacity > 2 * SPEC.pages_per_branch  # so the deduction, not the floor, is tested


@pytest.mark.parametrize("branches", [(Branch.COND,), (Branch.UNCOND,), (Branch.COND, Branch.UNCOND)])
def test_pool_floor_is_what_one_session_needs_on_this_rank(branches):
    cache = PagedKVCache.from_budget(SPEC, 1, max_sessions=1, branches=branches)
    assert cache.pool.capacity == len(branches) * SPEC.pages_per_branch
    assert SPEC.pages_per_branch == 9 + 2  # window + in-flight chunk (chunks of one page)
    assert cache.session_capacity == 1


def test_scratch_regions_are_per_local_branch_and_outside_the_pool():
    both = PagedKVCache(SPEC, num_pages=30, max_sessions=1)
    cond, uncond = both.storage.scratch_pages(Branch.COND), both.storage.scratch_pages(Branch.UNCOND)
    assert len(cond) == len(uncond) == SPEC.scratch_pages_per_branch == 2 + 4  # 25 tokens -> 4 pages of 8
    assert not set(cond) & set(uncond)
    assert min(cond + uncond) >= both.pool.num_pages  # never handed out by the pool

    # A CFG-parallel rank runs one branch: it lands in the rank's single scratch region.
    rank1 = PagedKVCache(SPEC, num_pages=30, max_sessions=1, branches=(Branch.UNCOND,))
    assert rank1.storage.scratch_pages(Branch.UNCOND) == list(range(30, 30 + 6))
    with pytest.raises(RuntimeError, match="does not run on this rank"):
        rank1.storage.scratch_pages(Branch.COND)


def test_admission_reserves_the_worst_case_and_refuses_with_a_clear_error():
    cache = PagedKVCache(SPEC, num_pages=2 * 2 * SPEC.pages_per_branch + 1, max_sessions=8)
    assert cache.session_capacity == 2
    a, b = cache.open_session("a"), cache.open_session("b")
    with pytest.raises(CapacityError, match="at capacity"):
        cache.open_session("c")
    cache.end_session(a)
    cache.end_session(cache.open_session("c"))
    cache.end_session(b)
    assert cache.num_sessions == 0


def test_max_sessions_caps_admission():
    cache = PagedKVCache(SPEC, num_pages=500, max_sessions=1)
    cache.open_session("a")
    with pytest.raises(CapacityError):
        cache.open_session("b")


def test_duplicate_session_ids_are_a_bug():
    cache = PagedKVCache(SPEC, num_pages=50, max_sessions=2)
    cache.open_session("a")
    with pytest.raises(RuntimeError, match="already"):
        cache.open_session("a")


def test_block_table_width_and_pages_per_branch_follow_the_spec():
    assert SPEC.block_table_width == 9 + 4
    chunky = KVSpec(num_layers=1, num_heads=1, head_dim=8, page_size=4, window_pages=6, max_new_pages=2, chunk_pages=2)
    assert chunky.pages_per_branch == 6 + 1 + 2  # a partly visible chunk may linger one page


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_pages=10), "fit in the window"),
        (dict(window_pages=9, chunk_pages=2), "whole number of chunks"),
        (dict(page_size=0), "page_size must be positive"),
        (dict(sink_chunks=9), "sink"),
    ],
)
def test_spec_validation(kwargs, match):
    base = dict(num_layers=1, num_heads=1, head_dim=8, page_size=4, window_pages=9, max_new_pages=2)
    with pytest.raises(ValueError, match=match):
        KVSpec(**{**base, **kwargs})


def test_droid_page_size_880_works_on_cpu():
    spec = KVSpec(num_layers=1, num_heads=2, head_dim=8, page_size=880, window_pages=9, max_new_pages=2, max_extra_tokens=25)
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1)
    session = cache.open_session("droid")
    ctx = session.begin_forward(Branch.COND, num_video_tokens=2 * 880, commit=True, extra_tokens=25)
    inputs = ctx.prepare()[0]
    assert inputs.video_slots.shape == (1760,) and inputs.extra_slots.shape == (25,)
    assert int(inputs.seq_lens[0]) == 1760 + 25
    assert inputs.block_table.shape == (1, 10)
    session.complete(Branch.COND)
    cache.end_session(session)
    assert cache.pool.num_free == cache.pool.capacity
