"""Per-session KV lifecycle: lazy allocation, commit after success, eviction, window restart, end."""

from __future__ import annotations

import pytest
import torch

from ardiff_kv import Branch, KVSpec, PagedKVCache

PAGE = 4
SPEC = KVSpec(
    num_layers=2,
    num_heads=2,
    head_dim=8,
    page_size=PAGE,
    window_pages=4,
    max_new_pages=2,
    max_extra_tokens=3,
    cross_text_tokens=6,
    cross_image_tokens=2,
)


def make(branches=(Branch.COND, Branch.UNCOND), spec=SPEC, sessions=4):
    cache = PagedKVCache(spec, num_pages=sessions * len(branches) * spec.pages_per_branch + 1, max_sessions=sessions, branches=branches)
    return cache, cache.open_session("s")


def prefill(session, branch=Branch.COND, frames=1):
    ctx = session.begin_forward(branch, num_video_tokens=frames * PAGE, commit=True)
    ctx.prepare()
    session.complete(branch)


def test_contexts_allocate_lazily_and_commit_only_after_success():
    cache, s = make()
    ctx = s.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=True)
    assert cache.pool.num_allocated == 0  # nothing before prepare
    ctx.prepare()
    assert cache.pool.num_allocated == 2
    assert s.branch(Branch.COND).resident == [] and s.branch(Branch.COND).committed_tokens == 0
    s.complete(Branch.COND)
    assert len(s.branch(Branch.COND).resident) == 2
    assert s.branch(Branch.COND).committed_tokens == 2 * PAGE


def test_preparing_one_branch_allocates_nothing_for_the_other():
    cache, s = make()
    cond = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True)
    s.begin_forward(Branch.UNCOND, num_video_tokens=PAGE, commit=True)
    cond.prepare()
    assert cache.pool.num_allocated == 1
    assert s.pages_held == 1 and s.branch(Branch.UNCOND).pending.new_pages == []


def test_denoise_forwards_use_scratch_and_commit_nothing():
    cache, s = make()
    prefill(s)
    committed = s.branch(Branch.COND).committed_tokens
    for _ in range(3):  # denoise steps of one chunk reuse the same scratch pages
        ctx = s.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=False, extra_tokens=3)
        inputs = ctx.prepare()[0]
        scratch = cache.storage.scratch_pages(Branch.COND)
        assert set((inputs.video_slots // PAGE).tolist()) == set(scratch[:2])
        assert set((inputs.extra_slots // PAGE).tolist()) == {scratch[2]}
        s.complete(Branch.COND)
    assert s.branch(Branch.COND).committed_tokens == committed
    assert cache.pool.num_allocated == 1


def test_block_table_has_a_fixed_width_and_real_lengths_in_seq_lens():
    _cache, s = make()
    shapes, lengths = set(), []
    for _ in range(4):
        ctx = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True, extra_tokens=3)
        inputs = ctx.prepare()[0]
        shapes.add((tuple(inputs.block_table.shape), inputs.max_seqlen_k))
        lengths.append(int(inputs.seq_lens[0]))
        s.complete(Branch.COND)
    assert shapes == {((1, SPEC.block_table_width), SPEC.block_table_width * PAGE)}
    assert lengths == [1 * PAGE + 3, 2 * PAGE + 3, 3 * PAGE + 3, 4 * PAGE + 3]


def test_prepare_is_idempotent_and_layers_share_metadata():
    _, s = make()
    ctx = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True)
    first = ctx.prepare()
    assert ctx.prepare() is first
    assert first[0].block_table is first[1].block_table and first[0].video_slots is first[1].video_slots
    # each layer gets its own pool views (same shape: one compiled graph serves every layer)
    assert first[1].key_cache.data_ptr() == s.storage.key_cache(1).data_ptr()
    assert first[0].key_cache.shape == first[1].key_cache.shape and first[0].key_cache.data_ptr() != first[1].key_cache.data_ptr()


def test_eviction_bounds_the_resident_window_and_memory_plateaus():
    cache, s = make()
    free_after = []
    for _ in range(12):
        prefill(s, frames=2)
        assert len(s.branch(Branch.COND).resident) <= SPEC.window_pages
        free_after.append(cache.pool.num_free)
    assert free_after[1:] == [free_after[1]] * 11  # full after 2 chunks, then flat
    assert s.branch(Branch.COND).evicted_pages == 24 - 4


def test_visible_window_is_the_latest_pages():
    cache, s = make()
    prefill(s, frames=2)
    prefill(s, frames=2)
    resident = list(s.branch(Branch.COND).resident)
    ctx = s.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=False)
    table = ctx.prepare()[0].block_table[0].tolist()
    visible = (resident + cache.storage.scratch_pages(Branch.COND)[:2])[-4:]
    assert table[:4] == visible and table[4:] == [0] * (len(table) - 4)


def test_branches_are_independent():
    _, s = make()
    prefill(s, Branch.COND, frames=2)
    assert len(s.branch(Branch.COND).resident) == 2 and s.branch(Branch.UNCOND).resident == []


def test_replacing_an_uncommitted_managed_forward_is_refused():
    _, s = make()
    s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True).prepare()
    with pytest.raises(RuntimeError, match="never committed"):
        s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True)
    # an unprepared or scratch context may be replaced freely
    s.abort(Branch.COND)
    s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True)
    s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=False).prepare()
    s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True)


def test_a_forward_that_raised_frees_its_pages_via_abort():
    cache, s = make()
    prefill(s)
    before = cache.pool.num_free
    ctx = s.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=True)
    ctx.prepare()
    assert cache.pool.num_free == before - 2
    s.abort(Branch.COND)
    assert cache.pool.num_free == before
    assert len(s.branch(Branch.COND).resident) == 1


def test_frames_must_be_page_aligned_and_bounded():
    _, s = make()
    with pytest.raises(ValueError, match="whole frames"):
        s.begin_forward(Branch.COND, num_video_tokens=PAGE + 1, commit=True)
    with pytest.raises(ValueError, match="max_new_pages"):
        s.begin_forward(Branch.COND, num_video_tokens=3 * PAGE, commit=True)
    with pytest.raises(ValueError, match="extra_tokens"):
        s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=False, extra_tokens=4)


def _write_cross(s, branch, value, *, text=True, image=True):
    for layer in range(SPEC.num_layers):
        t = torch.full((1, 6, 2, 8), value + layer)
        i = torch.full((1, 2, 2, 8), -value - layer)
        s.write_cross(branch, layer, text=(t, t) if text else None, image=(i, i) if image else None)
    s.mark_cross_ready(branch, text=text, image=image)


def test_cross_attention_is_a_loud_error_before_population_and_round_trips():
    cache, s = make()
    with pytest.raises(RuntimeError, match="before it was populated"):
        s.cross_kv(Branch.COND)
    _write_cross(s, Branch.COND, 1.0, image=False)
    with pytest.raises(RuntimeError, match="image=False"):  # I2V needs the image half too
        s.cross_kv(Branch.COND)
    _write_cross(s, Branch.COND, 1.0, text=False)
    layers = s.cross_kv(Branch.COND)
    assert torch.all(layers[1].text_key == 2.0) and torch.all(layers[1].image_value == -2.0)
    assert layers[0].text_key.shape == (1, 6, 2, 8) and layers[0].image_key.shape == (1, 2, 2, 8)
    assert cache.storage.cross.num_free == cache.storage.cross.num_slots - 1  # one slot, for the COND branch


def test_sessions_do_not_share_cross_attention_storage():
    cache, a = make()
    b = cache.open_session("b")
    _write_cross(a, Branch.COND, 1.0)
    _write_cross(b, Branch.COND, 5.0)
    assert torch.all(a.cross_kv(Branch.COND)[0].text_key == 1.0)
    assert torch.all(b.cross_kv(Branch.COND)[0].text_key == 5.0)


def test_window_reset_keeps_text_cross_and_frees_pages():
    cache, s = make()
    _write_cross(s, Branch.COND, 1.0)
    prefill(s, frames=2)
    prefill(s, Branch.UNCOND)
    s.restart_window(keep_cross_text=True)
    assert cache.pool.num_allocated == 0
    assert s.cross_ready(Branch.COND) == (True, False)
    assert s.branch(Branch.COND).committed_tokens == 0
    s.restart_window()
    assert s.cross_ready(Branch.COND) == (False, False)
    prefill(s)  # usable after a reset
    assert len(s.branch(Branch.COND).resident) == 1


@pytest.mark.parametrize("ending", ["end", "restart_then_end", "abort_then_end", "end_mid_forward"])
def test_every_ending_returns_every_page(ending):
    cache, s = make()
    start_free, start_slots = cache.pool.num_free, cache.storage.cross.num_free
    _write_cross(s, Branch.COND, 1.0)
    _write_cross(s, Branch.UNCOND, 1.0)
    for branch in Branch:
        prefill(s, branch, frames=2)
        prefill(s, branch, frames=2)
    if ending == "restart_then_end":
        s.restart_window()
    ctx = s.begin_forward(Branch.UNCOND, num_video_tokens=2 * PAGE, commit=True)
    ctx.prepare()
    if ending == "abort_then_end":
        s.abort(Branch.UNCOND)
    cache.end_session(s)
    assert cache.pool.num_free == start_free and cache.storage.cross.num_free == start_slots
    assert cache.num_sessions == 0
    cache.end_session(s)  # idempotent
    with pytest.raises(RuntimeError, match="ended"):
        s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True)


def test_slot_mapping_is_page_times_page_size_plus_offset():
    from ardiff_kv.session import _slots

    assert _slots([5, 2, 9], 10, page_size=4).tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 36, 37]
    assert _slots([7], 0, page_size=4).shape == (0,)


def test_committed_chunk_slots_land_in_the_pages_the_branch_now_owns():
    _cache, s = make()
    prefill(s, frames=2)
    ctx = s.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=True)
    slots = ctx.prepare()[0].video_slots
    pages = set((slots // PAGE).tolist())
    assert len(slots) == 2 * PAGE and pages == set(ctx.new_pages) and 0 not in pages
    s.complete(Branch.COND)
    assert s.branch(Branch.COND).resident[-2:] == ctx.new_pages
