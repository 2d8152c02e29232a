"""Randomized KV accounting: many sessions through random lifecycles, invariants after every step."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ardiff_kv import Branch, CapacityError, KVSpec, PagedKVCache

SPEC = KVSpec(
    num_layers=1,
    num_heads=1,
    head_dim=8,
    page_size=2,
    window_pages=4,
    max_new_pages=2,
    max_extra_tokens=3,
    chunk_pages=2,
    cross_text_tokens=2,
    cross_image_tokens=1,
)


class KVLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(SPEC, num_pages=3 * 2 * SPEC.pages_per_branch + 1, max_sessions=3)
        self.sessions = {}
        self.counter = 0

    @rule()
    def open(self):
        try:
            s = self.cache.open_session(f"s{self.counter}")
        except CapacityError:
            assert len(self.sessions) == self.cache.session_capacity
            return
        self.sessions[s.session_id] = s
        self.counter += 1

    @precondition(lambda self: self.sessions)
    @rule(
        data=st.data(),
        branch=st.sampled_from(list(Branch)),
        frames=st.integers(1, 2),
        commit=st.booleans(),
        outcome=st.sampled_from(["complete", "abort", "leave"]),
    )
    def forward(self, data, branch, frames, commit, outcome):
        s = self.sessions[data.draw(st.sampled_from(sorted(self.sessions)))]
        try:
            ctx = s.begin_forward(branch, num_video_tokens=frames * 2, commit=commit, extra_tokens=0 if commit else 3)
        except RuntimeError:  # guard: a prepared commit forward was left pending
            pending = s.branch(branch).pending
            assert pending is not None and pending.commit and pending.prepared
            return
        ctx.prepare()
        if outcome == "complete":
            s.complete(branch)
        elif outcome == "abort":  # the forward raised
            s.abort(branch)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), keep_text=st.booleans())
    def reset(self, data, keep_text):
        self.sessions[data.draw(st.sampled_from(sorted(self.sessions)))].restart_window(keep_cross_text=keep_text)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), branch=st.sampled_from(list(Branch)))
    def populate_cross(self, data, branch):
        import torch

        s = self.sessions[data.draw(st.sampled_from(sorted(self.sessions)))]
        kv = torch.ones(1, 2, 1, 8)
        s.write_cross(branch, 0, text=(kv, kv), image=(kv[:, :1], kv[:, :1]))
        s.mark_cross_ready(branch, text=True, image=True)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def end(self, data):
        sid = data.draw(st.sampled_from(sorted(self.sessions)))
        self.cache.end_session(self.sessions.pop(sid))

    @invariant()
    def pages_are_accounted_exactly(self):
        held = sum(s.pages_held for s in self.sessions.values())
        assert self.cache.pool.num_allocated == held
        assert self.cache.pool.num_free + held == self.cache.pool.capacity
        slots = sum(s.branch(b).cross_slot is not None for s in self.sessions.values() for b in Branch)
        assert self.cache.storage.cross.num_free + slots == self.cache.storage.cross.num_slots

    @invariant()
    def branches_stay_within_their_reservation(self):
        for s in self.sessions.values():
            for branch in Branch:
                state = s.branch(branch)
                pending = len(state.pending.new_pages) if state.pending else 0
                assert len(state.resident) <= SPEC.window_pages + SPEC.chunk_pages - 1
                assert len(state.resident) + pending <= SPEC.pages_per_branch

    def teardown(self):
        for s in self.sessions.values():
            self.cache.end_session(s)
        assert self.cache.pool.num_free == self.cache.pool.capacity
        assert self.cache.num_sessions == 0


TestKVLifecycle = KVLifecycle.TestCase
TestKVLifecycle.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
