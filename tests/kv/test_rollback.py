"""Snapshot / rollback of a session's pages (a batched call retried member by member undoes what it wrote)."""

from __future__ import annotations

import pytest
import torch

from ardiff_kv import Branch, KVSpec, PagedKVCache

PAGE = 4
SPEC = KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=PAGE, window_pages=6, max_new_pages=2, evict_to_fit=True)


def make(sessions=2, spare=6):
    cache = PagedKVCache(SPEC, num_pages=sessions * 2 * SPEC.pages_per_branch + spare + 1, max_sessions=sessions, attention_backend="sdpa")
    return cache, cache.open_session("s")


def forward(session, pages, *, update, branch=Branch.COND, fill=None):
    """upstream's update_cache 0 / 1 / 2; ``fill``: write this value into the forward's new pages."""
    ctx = session.begin_forward(branch, num_video_tokens=pages * PAGE, commit=update > 0, provisional=update == 1)
    ctx.prepare()
    if fill is not None and ctx.new_pages:
        session.storage.key_cache(0)[ctx.new_pages] = fill
    session.complete(branch)
    return ctx


def bookkeeping(session):
    return {b: (list(s.resident), list(s.provisional), s.committed_tokens, s.evicted_pages) for b in Branch for s in [session.branch(b)]}


@pytest.mark.parametrize("branch", list(Branch))
def test_a_rollback_restores_pages_lengths_and_contents_after_evictions_drops_and_commits(branch):
    cache, s = make()
    for value in (1.0, 2.0, 3.0):  # a full window of committed chunks, then a prediction
        forward(s, 2, update=2, branch=branch, fill=value)
    forward(s, 2, update=1, branch=branch, fill=9.0)  # evicts the oldest committed chunk to fit
    before, free_before = bookkeeping(s), cache.pool.num_free
    contents = {p: s.storage.key_cache(0)[p].clone() for p in s.branch(branch).resident + s.branch(branch).provisional}
    s.snapshot()
    # what a failed compute_kv_cache does: drop the prediction, evict, commit new chunks that reuse freed pages
    forward(s, 2, update=2, branch=branch, fill=-1.0)
    forward(s, 2, update=2, branch=branch, fill=-2.0)
    forward(s, 1, update=0, branch=branch)  # a scratch forward evicts to fit as well
    s.begin_forward(branch, num_video_tokens=2 * PAGE, commit=True).prepare()  # in flight when it failed
    s.rollback()
    assert bookkeeping(s) == before and cache.pool.num_free == free_before
    for page, value in contents.items():  # set aside, never handed out again: their K/V untouched
        torch.testing.assert_close(s.storage.key_cache(0)[page], value, atol=0, rtol=0)
    assert s.pages_held == sum(len(r) + len(p) for r, p, _, _ in before.values())


def test_release_keeps_the_call_and_returns_what_it_evicted():
    cache, s = make()
    for value in (1.0, 2.0, 3.0):
        forward(s, 2, update=2, fill=value)
    forward(s, 2, update=1)
    s.snapshot()
    forward(s, 2, update=2)  # drops the 2 predicted pages (set aside) and writes 2
    forward(s, 2, update=2)  # evicts the 2 oldest committed (set aside) and writes 2
    assert s.pages_held == 6 + 4  # the window plus what the call set aside
    s.release()
    after = bookkeeping(s)
    assert s.pages_held == 6 and cache.pool.num_free == cache.pool.capacity - 6
    s.snapshot()
    s.release()  # a snapshot of nothing changed costs nothing
    assert bookkeeping(s) == after


def test_ending_a_session_with_a_snapshot_returns_every_page():
    cache, s = make()
    forward(s, 2, update=2)
    forward(s, 2, update=1)
    s.snapshot()
    forward(s, 2, update=2)
    cache.end_session(s)
    assert cache.pool.num_free == cache.pool.capacity


def test_snapshot_misuse_is_refused():
    _, s = make()
    with pytest.raises(RuntimeError, match="no snapshot"):
        s.rollback()
    s.snapshot()
    with pytest.raises(RuntimeError, match="already held"):
        s.snapshot()
    s.release()
    s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True).prepare()
    with pytest.raises(RuntimeError, match="during a forward"):
        s.snapshot()


def test_a_budgeted_pool_keeps_the_undo_headroom_free_of_sessions():
    """KVSpec.undo_pages: a pool sized from a budget holds its sessions' pages plus, per batch slot and branch,
    the pages a call writes while it may be undone; no session is admitted into that headroom."""
    from ardiff_kv import KVSpec, PagedKVCache

    spec = KVSpec(num_layers=1, num_heads=2, head_dim=8, page_size=4, window_pages=6, max_new_pages=2, evict_to_fit=True, undo_pages=3)
    for max_batch in (1, 2, 3):
        budget = PagedKVCache.bytes_for_sessions(spec, max_sessions=4, num_branches=2, max_batch=max_batch)
        cache = PagedKVCache.from_budget(spec, budget, max_sessions=4, max_batch=max_batch)
        headroom = PagedKVCache.undo_headroom(spec, 2, max_batch)
        assert headroom == (0 if max_batch == 1 else max_batch * 2 * 3)
        assert cache.session_capacity == 4 and cache.storage.max_batch == max_batch
        assert cache.pool.capacity == 4 * cache.reservation_per_session + headroom
        # a budget short of the headroom holds a session fewer, never eats the headroom
        short = PagedKVCache.from_budget(spec, budget - spec.page_bytes, max_sessions=4, max_batch=max_batch)
        if max_batch > 1:
            assert short.session_capacity == 3 and short.pool.capacity - 3 * short.reservation_per_session >= headroom


def test_invalidate_cross_asks_every_branch_for_its_cross_attention_kv_again():
    _, session = make()
    for branch in Branch:
        session.mark_cross_ready(branch, text=True, image=True)
    session.invalidate_cross()  # a rolled-back call rewrote the slot: the flags must not vouch for it
    assert all(session.cross_ready(branch) == (False, False) for branch in Branch)
