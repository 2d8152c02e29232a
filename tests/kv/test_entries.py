"""Typed cache entries: in-context, observation, prediction (``EntryKind`` on every page a branch holds).

Upstream Zero-WAM (``wan_va/modules/icl_model.py``, ``wan_va/wan_va_server.py``) types its cache entries ICL /
observation / prediction: the demonstration at reset, the predicted video chunk written by the last (t = 0) video
step of an infer, and at ``compute_kv_cache`` first ``clear_prediction_cache`` (the prediction goes, the rest
stays), then the real video and action history as observations. Here that order through the paged cache, what is
kept and dropped at each point, and that a call which is undone leaves every entry as it was.
"""

from __future__ import annotations

import pytest
import torch

from ardiff_kv import Branch, Entry, EntryKind, KVSpec, PagedKVCache

PAGE = 4
IN_CONTEXT, OBSERVATION, PREDICTION = EntryKind.IN_CONTEXT, EntryKind.OBSERVATION, EntryKind.PREDICTION
# a Zero-WAM-like window: 2 video pages + 1 action page a chunk, two chunks, a demonstration of up to 4 pages
SPEC = KVSpec(
    num_layers=1, num_heads=1, head_dim=4, page_size=PAGE, window_pages=6, max_new_pages=2, evict_to_fit=True, max_pinned_pages=4, undo_pages=3
)


def make(sessions=2):
    spare = PagedKVCache.undo_headroom(SPEC, 2, 2)
    cache = PagedKVCache(SPEC, num_pages=sessions * 2 * SPEC.pages_per_branch + spare + 1, max_sessions=sessions, attention_backend="sdpa")
    return cache, cache.open_session("robot")


def forward(session, pages, *, entry=OBSERVATION, commit=True, branch=Branch.COND, fill=None, **kwargs):
    ctx = session.begin_forward(branch, num_video_tokens=pages * PAGE, commit=commit, entry=entry, **kwargs)
    inputs = ctx.prepare()
    if fill is not None and ctx.new_pages:
        session.storage.key_cache(0)[ctx.new_pages] = fill
    session.complete(branch)
    return inputs


def visible(inputs) -> list[int]:
    return inputs[0].block_table[0, : int(inputs[0].seq_lens[0]) // PAGE].tolist()


def kinds(session, branch=Branch.COND) -> list[EntryKind]:
    return [e.kind for e in session.branch(branch).entries]


def test_every_page_carries_its_kind_in_position_order():
    _, s = make()
    forward(s, 3, entry=IN_CONTEXT)
    forward(s, 2)
    forward(s, 2, entry=PREDICTION)
    state = s.branch(Branch.COND)
    assert kinds(s) == [IN_CONTEXT] * 3 + [OBSERVATION] * 2 + [PREDICTION] * 2
    assert [e.page for e in state.entries] == state.pinned + state.resident + state.provisional
    assert state.pages(PREDICTION) is state.provisional and state.entries[0] == Entry(state.pinned[0], IN_CONTEXT)
    ctx = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True, provisional=True)  # LingBot-VA's spelling
    assert ctx.entry is PREDICTION and ctx.provisional
    with pytest.raises(ValueError, match="not in-context"):
        s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True, provisional=True, entry=IN_CONTEXT)


def test_upstream_zero_wams_order_drops_the_prediction_exactly_when_asked():
    cache, s = make()
    state = s.branch(Branch.COND)
    forward(s, 4, entry=IN_CONTEXT)  # reset: the demonstration
    demo = list(state.pinned)
    for _ in range(4):
        # infer: video denoising steps (scratch), then the t = 0 step keeps the predicted chunk's K/V
        forward(s, 2, commit=False)
        forward(s, 2, entry=PREDICTION)
        predicted = list(state.provisional)
        # the action steps see the prediction (and not the demonstration: attend_pinned=False), and keep it
        for _ in range(3):
            seen = visible(forward(s, 1, commit=False, attend_pinned=False))
            assert seen[-3:-1] == predicted and not set(seen) & set(demo)
        assert state.provisional == predicted
        # compute_kv_cache: clear_prediction_cache first: only the prediction goes
        observed, free = list(state.resident), cache.pool.num_free
        assert s.drop_predictions() == 2
        assert state.provisional == [] and state.resident == observed and state.pinned == demo
        assert cache.pool.num_free == free + 2
        # the real video, then the action history, as observations
        seen = visible(forward(s, 2))
        assert seen == demo + state.resident  # the prediction's pages are not attended (the new frames may reuse them)
        forward(s, 1)
        assert kinds(s) == [IN_CONTEXT] * 4 + [OBSERVATION] * len(state.resident)
        assert s.drop_predictions() == 0  # the second clear (clean_window_cache) finds nothing: nothing else goes
    assert state.pinned == demo and state.evicted_pages > 0  # the window slid under the demonstration
    # an observation forward while a prediction is still held replaces it (LingBot-VA's compute_kv_cache relies on it)
    forward(s, 2, entry=PREDICTION)
    forward(s, 2)
    assert state.provisional == [] and state.pinned == demo


def test_dropping_is_per_branch_and_never_touches_the_other_kinds():
    _, s = make()
    for b in Branch:
        forward(s, 1, entry=IN_CONTEXT, branch=b)
        forward(s, 1, branch=b)
        forward(s, 2, entry=PREDICTION, branch=b)
    assert s.drop_predictions(Branch.UNCOND) == 2
    assert kinds(s, Branch.UNCOND) == [IN_CONTEXT, OBSERVATION] and kinds(s) == [IN_CONTEXT, OBSERVATION, PREDICTION, PREDICTION]
    assert s.drop_provisional() == 2  # LingBot-VA's name for the same drop
    assert kinds(s) == [IN_CONTEXT, OBSERVATION]


def test_an_undone_call_leaves_every_entry_and_its_kv_as_it_was():
    """A failed compute_kv_cache inside a batch: the prediction was dropped and observations written (evicting the
    oldest), then the call is rolled back: every entry of every kind is back, its K/V untouched."""
    cache, s = make()
    forward(s, 2, entry=IN_CONTEXT, fill=5.0)
    for value in (1.0, 2.0):
        forward(s, 2, fill=value)
    forward(s, 2, entry=PREDICTION, fill=9.0)
    before = {b: list(s.branch(b).entries) for b in Branch}
    tokens, free = s.branch(Branch.COND).committed_tokens, cache.pool.num_free
    contents = {e.page: s.storage.key_cache(0)[e.page].clone() for e in s.branch(Branch.COND).entries}
    s.snapshot()
    s.drop_predictions()
    forward(s, 2, fill=-1.0)
    forward(s, 1, fill=-2.0)  # evicts the oldest observation to fit
    s.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=True, entry=PREDICTION).prepare()  # in flight when it failed
    s.rollback()
    assert {b: list(s.branch(b).entries) for b in Branch} == before
    assert s.branch(Branch.COND).committed_tokens == tokens and cache.pool.num_free == free
    for page, value in contents.items():
        torch.testing.assert_close(s.storage.key_cache(0)[page], value, atol=0, rtol=0)
    # kept instead: the dropped prediction and the evicted observation go back to the pool at release
    s.snapshot()
    s.drop_predictions()
    forward(s, 2)
    s.release()
    assert kinds(s) == [IN_CONTEXT] * 2 + [OBSERVATION] * 6 and s.pages_held == cache.pool.num_allocated == 8


def test_a_refused_forward_leaves_the_entries_as_they_were():
    cache, s = make()
    forward(s, 2, entry=IN_CONTEXT)
    forward(s, 2, entry=PREDICTION)
    before, free = list(s.branch(Branch.COND).entries), cache.pool.num_free
    for bad in (
        dict(num_video_tokens=PAGE, commit=True, entry=IN_CONTEXT),  # not a prefix any more
        dict(num_video_tokens=3 * PAGE, commit=True, entry=PREDICTION),  # more than max_new_pages
        dict(num_video_tokens=PAGE + 1, commit=True),  # not whole pages
        dict(num_video_tokens=PAGE, commit=False, entry=PREDICTION),  # a prediction must be kept
    ):
        with pytest.raises(ValueError):
            s.begin_forward(Branch.COND, **bad)
        assert s.branch(Branch.COND).entries == before and cache.pool.num_free == free


def test_a_chunk_window_refuses_predictions_stacked_past_its_reservation():
    """A chunk window evicts after an observation only: a second prediction before one would hold more than the
    session reserved, so it is refused by name (an evict-to-fit window makes room instead, as above)."""
    spec = KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=PAGE, window_pages=4, max_new_pages=2, chunk_pages=2)
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1)
    s = cache.open_session("s")
    for _ in range(3):
        forward(s, 2)
    forward(s, 2, entry=PREDICTION)
    before = list(s.branch(Branch.COND).entries)
    with pytest.raises(ValueError, match=r"drop_predictions\(\) first"):
        s.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=True, entry=PREDICTION)
    assert s.branch(Branch.COND).entries == before
    s.drop_predictions()
    forward(s, 2, entry=PREDICTION)
    assert kinds(s) == [OBSERVATION] * 4 + [PREDICTION] * 2
