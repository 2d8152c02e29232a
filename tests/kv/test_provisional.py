"""Provisional entries (predicted K/V as a per-session tail a commit discards) and the evict-to-fit window.

The model-level parity of these semantics against upstream LingBot-VA's own cache is in
tests/policies/test_lingbot_va_kv.py; here the page bookkeeping itself.
"""

from __future__ import annotations

import pytest
import torch

from ardiff_kv import Branch, KVSpec, PagedKVCache, pages_to_fit, prepare_batch

PAGE = 4
# LingBot-VA-like: a chunk is 2 video pages + 1 action page; the window holds two chunks
SPEC = KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=PAGE, window_pages=6, max_new_pages=2, evict_to_fit=True)


def make(spec=SPEC, sessions=2):
    cache = PagedKVCache(spec, num_pages=sessions * 2 * spec.pages_per_branch + 1, max_sessions=sessions, attention_backend="sdpa")
    return cache, cache.open_session("s")


def forward(session, pages, *, update, branch=Branch.COND):
    """upstream's update_cache: 0 temporary (scratch), 1 predicted (provisional), 2 real (committed)."""
    ctx = session.begin_forward(branch, num_video_tokens=pages * PAGE, commit=update > 0, provisional=update == 1)
    inputs = ctx.prepare()
    session.complete(branch)
    return ctx, inputs


def visible(inputs, row=0):
    seq_len = int(inputs[0].seq_lens[row])
    return inputs[0].block_table[row, : seq_len // PAGE].tolist()


def test_a_prediction_is_a_tail_later_forwards_see_and_a_commit_discards():
    cache, s = make()
    state = s.branch(Branch.COND)
    forward(s, 2, update=2)
    committed = list(state.resident)
    _, _ = forward(s, 2, update=1)  # the predicted video chunk
    predicted = list(state.provisional)
    assert len(predicted) == 2 and state.resident == committed
    assert s.pages_held == 4
    _, seen = forward(s, 1, update=0)  # an action denoising step sees the committed and predicted pages
    assert visible(seen)[:4] == committed + predicted
    forward(s, 1, update=1)
    assert len(state.provisional) == 3
    free_before = cache.pool.num_free
    _, seen = forward(s, 2, update=2)  # the observation: the prediction is discarded before it is written
    assert state.provisional == []
    assert state.resident[:2] == committed  # committed pages neither copied nor moved
    assert visible(seen) == committed + state.resident[2:]  # the prediction is not attended (its pages may be reused)
    assert cache.pool.num_free == free_before + 3 - 2
    assert state.committed_tokens == 4 * PAGE


def test_the_window_frees_the_oldest_committed_pages_first_even_for_a_temporary_write():
    _, s = make()
    state = s.branch(Branch.COND)
    for pages in (2, 1, 2):  # chunk 0 video, chunk 0 actions, chunk 1 video
        forward(s, pages, update=2)
    oldest = state.resident[:2]
    forward(s, 1, update=2)  # chunk 1 actions: the window (6 pages) is full
    assert len(state.resident) == 6 and state.evicted_pages == 0
    _, seen = forward(s, 2, update=0)  # a denoising step's scratch write needs 2 pages: chunk 0's video goes, for good
    assert state.evicted_pages == 2 and not set(oldest) & set(state.resident)
    assert len(visible(seen)) == 6  # 4 committed + the 2 scratch pages
    forward(s, 2, update=0)  # now it fits: nothing more is freed
    assert state.evicted_pages == 2


def test_predicted_pages_outlive_committed_ones_and_go_last():
    _, s = make()
    state = s.branch(Branch.COND)
    forward(s, 2, update=2)
    forward(s, 1, update=2)
    committed_actions = state.resident[2:]
    forward(s, 2, update=1)
    forward(s, 1, update=1)  # full: 3 committed + 3 predicted
    first_prediction = list(state.provisional)
    forward(s, 2, update=1)  # the same chunk predicted again (infer twice): the two oldest committed pages go
    assert state.resident == committed_actions
    assert state.provisional[:3] == first_prediction and len(state.provisional) == 5
    forward(s, 1, update=1)
    assert state.resident == [] and state.provisional[:3] == first_prediction
    forward(s, 2, update=1)  # nothing committed is left: the oldest predictions go
    assert state.provisional[:1] == first_prediction[2:] and len(state.provisional) == 6
    assert state.evicted_pages == 5


def test_ending_or_restarting_a_session_returns_its_predicted_pages():
    cache, s = make()
    forward(s, 2, update=2)
    forward(s, 2, update=1)
    forward(s, 2, update=1, branch=Branch.UNCOND)
    assert cache.pool.num_allocated == 6
    s.restart_window()
    assert cache.pool.num_allocated == 0
    forward(s, 2, update=1)
    cache.end_session(s)
    assert cache.pool.num_allocated == 0


def test_dropping_one_branchs_prediction_leaves_the_other():
    _, s = make()
    forward(s, 1, update=1)
    forward(s, 1, update=1, branch=Branch.UNCOND)
    assert s.drop_provisional(Branch.COND) == 1
    assert s.branch(Branch.UNCOND).provisional and not s.branch(Branch.COND).provisional
    assert s.drop_provisional() == 1


def test_a_batched_forward_evicts_each_sequence_for_itself():
    _, s = make()
    for pages in (2, 1, 2, 1):
        forward(s, pages, update=2)
    cond = s.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=False)
    uncond = s.begin_forward(Branch.UNCOND, num_video_tokens=2 * PAGE, commit=False)
    inputs = prepare_batch([cond, uncond])
    assert s.branch(Branch.COND).evicted_pages == 2 and s.branch(Branch.UNCOND).evicted_pages == 0
    assert inputs[0].seq_lens.tolist() == [6 * PAGE, 2 * PAGE]


def test_a_provisional_forward_must_keep_its_pages():
    _, s = make()
    with pytest.raises(ValueError, match="commit=True"):
        s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=False, provisional=True)


def test_the_window_is_the_whole_reservation_with_evict_to_fit():
    assert SPEC.pages_per_branch == SPEC.window_pages
    with pytest.raises(ValueError, match="evict_to_fit"):
        KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=PAGE, window_pages=6, max_new_pages=2, evict_to_fit=True, sink_chunks=1)


@pytest.mark.parametrize(
    ("held", "new", "expected"),
    [((3, 0), 2, (0, 0)), ((6, 0), 2, (2, 0)), ((3, 3), 1, (1, 0)), ((1, 5), 2, (1, 1)), ((0, 6), 2, (0, 2)), ((0, 0), 6, (0, 0))],
)
def test_pages_to_fit(held, new, expected):
    assert pages_to_fit(*held, new, window_pages=6) == expected


def test_pages_to_fit_refuses_a_forward_larger_than_the_window():
    with pytest.raises(ValueError, match="cannot fit"):
        pages_to_fit(0, 0, 7, window_pages=6)


def test_attention_reads_the_predicted_pages_values():
    """Not only the block table: the K/V a provisional forward wrote are what a later forward attends to."""
    cache, s = make()
    ctx = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True, provisional=True)
    inputs = ctx.prepare()
    k = torch.randn(PAGE, 1, 4)
    v = torch.randn(PAGE, 1, 4)
    torch.ops.ardiff.paged_write_attend(k, k, v, None, None, 1.0, *inputs[0]._replace(backend="sdpa"))
    s.complete(Branch.COND)
    page = s.branch(Branch.COND).provisional[0]
    assert torch.equal(cache.storage.key_cache(0)[page], k) and torch.equal(cache.storage.value_cache(0)[page], v)
