"""Pinned pages: a session's in-context block (upstream Zero-WAM's demonstration) before its window.

Never evicted by the window in any of its modes, seen by the forwards that ask for it, counted in what a session
reserves (admission, the memory plan's sizing), and returned on every path that ends a session or undoes a call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ardiff_kv import Branch, CapacityError, DenseKVCache, EntryKind, KVSpec, PagedKVCache, paged_write_attend, prepare_batch
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.core import SessionEngine
from tests.helpers.fake_policy import FakeConfig, FakePolicy

PAGE, HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5
PIN = EntryKind.IN_CONTEXT

WINDOWS = {
    "evict_to_fit": dict(window_pages=6, max_new_pages=2, evict_to_fit=True),
    "sink": dict(window_pages=4, max_new_pages=2, chunk_pages=2, sink_chunks=1),
    "reset_at_boundary": dict(window_pages=4, max_new_pages=2, chunk_pages=2, reset_at_boundary=True),
}


def spec_of(window: str = "evict_to_fit", pinned: int = 3, **extra) -> KVSpec:
    return KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=PAGE, max_pinned_pages=pinned, **{**WINDOWS[window], **extra})


def make(spec: KVSpec, sessions: int = 2, **kwargs) -> PagedKVCache:
    return PagedKVCache(spec, num_pages=sessions * 2 * spec.pages_per_branch + 1, max_sessions=sessions, attention_backend="sdpa", **kwargs)


def write(session, pages, *, entry=EntryKind.OBSERVATION, commit=True, branch=Branch.COND, **kwargs):
    ctx = session.begin_forward(branch, num_video_tokens=pages * PAGE, commit=commit, entry=entry, **kwargs)
    inputs = ctx.prepare()
    session.complete(branch)
    return ctx, inputs


def visible(inputs, row=0) -> list[int]:
    return inputs[0].block_table[row, : int(inputs[0].seq_lens[row]) // PAGE].tolist()


@pytest.mark.parametrize("window", list(WINDOWS))
def test_the_window_never_evicts_the_pinned_block(window):
    cache = make(spec_of(window))
    s = cache.open_session("s")
    state = s.branch(Branch.COND)
    write(s, 2, entry=PIN)
    write(s, 1, entry=PIN)
    pinned = list(state.pinned)
    assert len(pinned) == 3
    for _ in range(12):  # many windows' worth of observations, with predictions and denoise steps between
        write(s, 2, entry=EntryKind.PREDICTION)
        _, seen = write(s, 2, commit=False)
        assert visible(seen)[:3] == pinned  # every forward sees the block first
        _, seen = write(s, 2)
        assert state.pinned == pinned and visible(seen)[:3] == pinned
        assert len(visible(seen)) - 3 <= s.storage.spec.window_pages  # the window's own budget is untouched by the block
    assert state.evicted_pages > 0  # the window did slide
    s.restart_window(keep_pinned=True)  # a window reset inside the episode keeps the block
    assert state.pinned == pinned and state.resident == [] and s.pages_held == 3
    s.restart_window()  # an episode reset frees it
    assert s.pages_held == 0 and cache.pool.num_allocated == 0


def test_a_forward_may_leave_the_pinned_block_out():
    """Zero-WAM's action queries do not attend to the demonstration; its video queries do."""
    cache = make(spec_of())
    s = cache.open_session("s")
    write(s, 2, entry=PIN)
    write(s, 2)
    _, with_block = write(s, 1, commit=False)
    _, without = write(s, 1, commit=False, attend_pinned=False)
    assert visible(with_block)[:2] == s.branch(Branch.COND).pinned
    assert visible(without) == visible(with_block)[2:]


def test_the_block_is_a_prefix_within_its_limit_and_a_refused_pin_changes_nothing():
    cache = make(spec_of())
    s = cache.open_session("s")
    write(s, 3, entry=PIN)
    with pytest.raises(ValueError, match="max_pinned_pages=3"):
        s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True, entry=PIN)
    write(s, 2, entry=PIN, branch=Branch.UNCOND)
    write(s, 1, branch=Branch.UNCOND)
    before = (list(s.branch(Branch.UNCOND).entries), cache.pool.num_free)
    with pytest.raises(ValueError, match="prefix"):
        s.begin_forward(Branch.UNCOND, num_video_tokens=PAGE, commit=True, entry=PIN)
    assert (list(s.branch(Branch.UNCOND).entries), cache.pool.num_free) == before
    with pytest.raises(ValueError, match="needs commit=True"):
        s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=False, entry=PIN)
    unpinned = make(spec_of(pinned=0)).open_session("u")
    with pytest.raises(ValueError, match="pins nothing"):
        unpinned.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True, entry=PIN)
    # a block larger than one forward's max_new_pages is fine: it is written once per episode, outside the window
    assert s.storage.spec.max_new_pages == 2 and len(s.branch(Branch.COND).pinned) == 3


def test_admission_counts_the_pinned_block():
    spec = spec_of(pinned=5)
    assert spec.pages_per_branch == 5 + spec.window_pages and spec.block_table_width == 5 + spec.window_pages + 1
    cache = PagedKVCache(spec, num_pages=2 * 2 * spec.pages_per_branch + 1, max_sessions=8)
    assert cache.reservation_per_session == 2 * (5 + 6) and cache.session_capacity == 2
    cache.open_session("a")
    cache.open_session("b")
    with pytest.raises(CapacityError, match="5 per branch for its pinned in-context block"):
        cache.open_session("c")
    # a pool that holds the window but not the block as well holds no session at all
    with pytest.raises(ValueError, match="pinned in-context block"):
        PagedKVCache(spec, num_pages=2 * spec.window_pages_per_branch + 1, max_sessions=1)
    # the budget arithmetic (the engine's pool sizing, the memory plans) pays for a full block per session and branch
    plain = spec_of(pinned=0)
    extra = PagedKVCache.bytes_for_sessions(spec, max_sessions=3, num_branches=2) - PagedKVCache.bytes_for_sessions(
        plain, max_sessions=3, num_branches=2
    )
    assert extra == 3 * 2 * 5 * spec.page_bytes
    budget = PagedKVCache.bytes_for_sessions(spec, max_sessions=3, num_branches=2)
    assert PagedKVCache.sessions_for_budget(spec, budget, max_sessions=8, num_branches=2) == 3
    assert PagedKVCache.sessions_for_budget(spec, budget - 1, max_sessions=8, num_branches=2) == 2
    assert PagedKVCache.from_budget(spec, budget, max_sessions=3).session_capacity == 3


def test_every_session_at_its_worst_still_has_its_whole_block():
    """The reservation is the worst case: every admitted session with a full block, a window holding a partly
    visible chunk and a chunk in flight in both branches at once uses the pool to its last page, never past it."""
    spec = spec_of("sink", pinned=3)
    cache = PagedKVCache(spec, num_pages=2 * 2 * spec.pages_per_branch + 1, max_sessions=2)
    sessions = [cache.open_session(n) for n in "ab"]
    for s in sessions:
        for b in Branch:
            write(s, 3, entry=PIN, branch=b)
            for _ in range(7):  # single pages: the window ends with 5 (a half-evicted chunk lingers)
                write(s, 1, branch=b)
            assert len(s.branch(b).resident) == spec.window_pages_per_branch - spec.max_new_pages
    for s in sessions:
        prepare_batch([s.begin_forward(b, num_video_tokens=2 * PAGE, commit=True) for b in Branch])
    assert cache.pool.num_free == 0 and all(s.pages_held == cache.reservation_per_session for s in sessions)
    for s in sessions:
        cache.end_session(s)
    assert cache.pool.num_free == cache.pool.capacity


def test_the_pinned_block_goes_back_when_a_session_ends_or_a_write_fails():
    cache = make(spec_of())
    s = cache.open_session("s")
    write(s, 2, entry=PIN)
    s.begin_forward(Branch.UNCOND, num_video_tokens=3 * PAGE, commit=True, entry=PIN).prepare()
    s.abort(Branch.UNCOND)  # the in-context forward failed: its pages back, nothing pinned
    assert s.branch(Branch.UNCOND).pinned == [] and cache.pool.num_allocated == 2
    s.begin_forward(Branch.UNCOND, num_video_tokens=3 * PAGE, commit=True, entry=PIN).prepare()  # in flight at the end
    write(s, 2)
    cache.end_session(s)
    assert cache.pool.num_allocated == 0 and cache.num_sessions == 0


def test_a_pin_inside_a_call_that_is_undone_is_undone_too():
    cache = make(spec_of(), sessions=3)
    s = cache.open_session("s")
    write(s, 2, entry=PIN)
    write(s, 2)
    old = list(s.branch(Branch.COND).pinned)
    s.storage.key_cache(0)[old] = 7.0
    entries, free = {b: s.branch(b).entries for b in Branch}, cache.pool.num_free
    s.snapshot()
    s.restart_window()  # an episode reset inside the call: the old block is set aside, not handed out
    write(s, 3, entry=PIN)  # the new demonstration
    write(s, 2, entry=PIN, branch=Branch.UNCOND)
    write(s, 2)
    s.rollback()
    assert {b: s.branch(b).entries for b in Branch} == entries and cache.pool.num_free == free
    assert torch.equal(s.storage.key_cache(0)[old], torch.full_like(s.storage.key_cache(0)[old], 7.0))
    s.snapshot()
    write(s, 2, entry=PIN, branch=Branch.UNCOND)
    s.release()  # kept
    assert len(s.branch(Branch.UNCOND).pinned) == 2
    s.snapshot()
    s.restart_window()
    cache.end_session(s)  # ending with a snapshot held returns the set-aside block too
    assert cache.pool.num_allocated == 0


# -- the engine's ending paths -------------------------------------------------------------------


class PinningPolicy(FakePolicy):
    """The fake policy with a two-page in-context block written on each session's first call."""

    def kv_spec(self) -> KVSpec:
        return KVSpec(num_layers=1, num_heads=1, head_dim=8, page_size=4, window_pages=self.config.window_pages, max_new_pages=1, max_pinned_pages=2)

    def step_batch(self, items):
        for session, _ in items:
            if not session.kv.branch(Branch.COND).pinned:
                session.kv.begin_forward(Branch.COND, num_video_tokens=8, commit=True, entry=PIN).prepare()
                session.kv.complete(Branch.COND)
        return super().step_batch(items)


def engine_of(sessions_in_pool: int, max_sessions: int = 16) -> SessionEngine:
    policy = PinningPolicy(FakeConfig(window_pages=2), RuntimeOptions())
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=sessions_in_pool * spec.pages_per_branch + 1, max_sessions=max_sessions, branches=policy.branches)
    return SessionEngine(policy, cache, max_sessions=max_sessions)


def obs(prompt: str = "") -> RobotObservation:
    return RobotObservation(prompt=prompt, joint_position=np.zeros(7, np.float32))


def test_every_ending_path_of_the_engine_returns_the_pinned_block():
    engine = engine_of(sessions_in_pool=2)
    pool = engine.cache.pool
    for _ in range(4):  # the window (2 pages) slides; the block stays
        engine.infer("a", obs())
    assert len(engine.sessions["a"].kv.branch(Branch.COND).pinned) == 2 and engine.sessions["a"].kv.pages_held == 4
    engine.infer("b", obs())
    engine.detach("a", "switched")
    engine.detach("b", "switched")
    engine.infer("c", obs())  # admission evicts the least recently used idle session (a), block and all
    assert set(engine.sessions) == {"b", "c"} and engine.endings == {"pressure": 1}
    assert pool.num_allocated == engine.sessions["b"].kv.pages_held + engine.sessions["c"].kv.pages_held == 2 * 3
    assert engine.end("b", "ttl")  # the TTL ends it the same way
    with pytest.raises(RuntimeError, match="exploded"):
        engine.infer("c", obs("explode"))  # a failed call ends the session: its block goes back with the rest
    assert engine.sessions == {} and pool.num_allocated == 0
    engine.infer("d", obs())
    engine.close()  # shutdown
    assert pool.num_free == pool.capacity


# -- batched attention with pinned prefixes against the dense reference ---------------------------


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_batched_attention_over_sessions_with_pinned_prefixes_equals_each_alone_against_the_dense_reference(backend):
    torch.manual_seed(0)
    spec = KVSpec(
        num_layers=1, num_heads=HEADS, head_dim=DIM, page_size=PAGE, window_pages=3, max_new_pages=2, max_extra_tokens=3, max_pinned_pages=3
    )
    cache = PagedKVCache(spec, num_pages=3 * 2 * spec.pages_per_branch + 1, max_sessions=3, attention_backend=backend, max_batch=3)
    names = ("a", "b", "c")
    sessions = {name: cache.open_session(name) for name in names}
    dense = {(n, b): DenseKVCache(1, spec.window_pages * PAGE) for n in names for b in Branch}

    def run(items, *, commit, entry=EntryKind.OBSERVATION, pages=1, extra=0, attend_pinned=True):
        """One paged forward over ``items`` (session, branch) and each alone through its dense cache."""
        contexts = [
            sessions[n].begin_forward(
                b, num_video_tokens=pages * PAGE, commit=commit, entry=entry, extra_tokens=extra, scratch_slot=i // 2, attend_pinned=attend_pinned
            )
            for i, (n, b) in enumerate(items)
        ]
        inputs = prepare_batch(contexts)[0]
        m, q_len = pages * PAGE, pages * PAGE + extra
        q, k, v = torch.randn(len(items) * q_len, HEADS, DIM), torch.randn(len(items) * m, HEADS, DIM), torch.randn(len(items) * m, HEADS, DIM)
        ke, ve = (torch.randn(len(items) * extra, HEADS, DIM), torch.randn(len(items) * extra, HEADS, DIM)) if extra else (None, None)
        out = paged_write_attend(inputs, q, k, v, ke, ve, SCALE)
        for i, (n, b) in enumerate(items):
            layer = dense[n, b].layers(update=commit, pin=entry is PIN, attend_pinned=attend_pinned)[0]
            rows = slice(i * q_len, (i + 1) * q_len)
            kv_rows, extra_rows = slice(i * m, (i + 1) * m), slice(i * extra, (i + 1) * extra)
            expected = layer.attend(
                q[rows][None],
                k[kv_rows][None],
                v[kv_rows][None],
                ke[extra_rows][None] if extra else None,
                ve[extra_rows][None] if extra else None,
                SCALE,
            )[0]
            torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
            sessions[n].complete(b)
        return out

    # pinned blocks of 0, 1 and 3 pages (the longest in two forwards), different per branch
    for name, blocks in (("b", [1]), ("c", [2, 1])):
        for pages in blocks:
            run([(name, Branch.COND)], commit=True, entry=PIN, pages=pages)
    run([("c", Branch.UNCOND)], commit=True, entry=PIN, pages=2)
    # histories of 0, 2 and 5 observed frames: c's window has slid past its oldest frames
    for name, frames in (("a", 0), ("b", 2), ("c", 5)):
        for _ in range(frames):
            run([(name, b) for b in Branch], commit=True)
    everyone = [(n, b) for n in names for b in Branch]
    run(everyone, commit=False, pages=2, extra=3)  # a denoise step: pinned prefix + window + new + extra tokens
    run(everyone, commit=False, pages=2, extra=3, attend_pinned=False)  # one that leaves the blocks out
    run(everyone, commit=True, pages=2)  # the observation, committed by everyone at once
    run(everyone, commit=False, pages=1, extra=3)  # and the next step sees it
    assert [len(sessions[n].branch(Branch.COND).pinned) for n in names] == [0, 1, 3]
    for session in sessions.values():
        cache.end_session(session)
    assert cache.pool.num_free == cache.pool.capacity
