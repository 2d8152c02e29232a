"""Randomized typed-entry accounting: pins, observations, predictions, drops, window restarts and undone calls in
any order, for a chunk window and an evict-to-fit one; the pool's count and every branch's layout after each step."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ardiff_kv import Branch, CapacityError, EntryKind, KVSpec, PagedKVCache

SPECS = {
    "chunks": KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=2, window_pages=4, max_new_pages=2, chunk_pages=2, max_pinned_pages=3),
    "evict_to_fit": KVSpec(
        num_layers=1, num_heads=1, head_dim=4, page_size=2, window_pages=4, max_new_pages=2, evict_to_fit=True, max_pinned_pages=3
    ),
}


def layout(session) -> dict:
    return {b: (list(session.branch(b).entries), session.branch(b).committed_tokens, session.branch(b).evicted_pages) for b in Branch}


def machine(spec: KVSpec) -> type[RuleBasedStateMachine]:
    class EntryLifecycle(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.cache = PagedKVCache(spec, num_pages=2 * 2 * spec.pages_per_branch + 1, max_sessions=2)
            self.sessions = {name: self.cache.open_session(name) for name in ("a", "b")}
            self.snapshots: dict[str, dict] = {}

        def pick(self, data):
            return self.sessions[data.draw(st.sampled_from(sorted(self.sessions)))]

        @rule(
            data=st.data(),
            branch=st.sampled_from(list(Branch)),
            pages=st.integers(1, 3),
            entry=st.sampled_from([None, *EntryKind]),  # None: a scratch (denoise) forward
            attend_pinned=st.booleans(),
            outcome=st.sampled_from(["complete", "abort"]),
        )
        def forward(self, data, branch, pages, entry, attend_pinned, outcome):
            s = self.pick(data)
            before = layout(s)
            try:
                ctx = s.begin_forward(
                    branch, num_video_tokens=2 * pages, commit=entry is not None, entry=entry or EntryKind.OBSERVATION, attend_pinned=attend_pinned
                )
            except ValueError:  # refused by name (not a prefix, over a limit): nothing changed
                assert layout(s) == before
                return
            try:
                ctx.prepare()
            except CapacityError:  # only a call that may be undone holds pages beyond its reservation (a real pool
                assert self.snapshots  # keeps headroom for them: PagedKVCache.undo_headroom; this one keeps none)
                s.abort(branch)
                return
            if outcome == "complete":
                s.complete(branch)
            else:
                s.abort(branch)

        @rule(data=st.data(), branch=st.sampled_from([None, *Branch]))
        def drop_predictions(self, data, branch):
            s = self.pick(data)
            kept = {b: [e for e in s.branch(b).entries if e.kind is not EntryKind.PREDICTION] for b in Branch}
            predicted = sum(len(s.branch(b).provisional) for b in ((branch,) if branch is not None else Branch))
            assert s.drop_predictions(branch) == predicted
            for b in Branch:
                if branch in (None, b):
                    assert s.branch(b).entries == kept[b]

        @rule(data=st.data(), keep_pinned=st.booleans())
        def restart(self, data, keep_pinned):
            s = self.pick(data)
            pinned = {b: list(s.branch(b).pinned) for b in Branch}
            s.restart_window(keep_pinned=keep_pinned)
            assert all(s.branch(b).pinned == (pinned[b] if keep_pinned else []) and not s.branch(b).resident for b in Branch)

        @rule(data=st.data())
        def snapshot(self, data):
            s = self.pick(data)
            if s.has_snapshot:
                return
            for b in Branch:
                s.abort(b)  # no forward in flight at a call's start
            s.snapshot()
            self.snapshots[s.session_id] = layout(s)

        @precondition(lambda self: self.snapshots)
        @rule(data=st.data(), undo=st.booleans())
        def finish_call(self, data, undo):
            sid = data.draw(st.sampled_from(sorted(self.snapshots)))
            s, before = self.sessions[sid], self.snapshots.pop(sid)
            if undo:
                s.rollback()
                assert layout(s) == before
            else:
                s.release()

        @rule(data=st.data())
        def end_and_reopen(self, data):
            s = self.pick(data)
            self.snapshots.pop(s.session_id, None)
            self.cache.end_session(s)
            self.sessions[s.session_id] = self.cache.open_session(s.session_id)

        @invariant()
        def pages_are_accounted_exactly(self):
            assert self.cache.pool.num_allocated == sum(s.pages_held for s in self.sessions.values())

        @invariant()
        def each_branch_is_three_runs_within_its_reservation(self):
            order = list(EntryKind)
            for s in self.sessions.values():
                for b in Branch:
                    state = s.branch(b)
                    kinds = [order.index(e.kind) for e in state.entries]
                    assert kinds == sorted(kinds)
                    pending = len(state.pending.new_pages) if state.pending else 0
                    pinning = state.pending is not None and state.pending.entry is EntryKind.IN_CONTEXT
                    assert len(state.pinned) + (pending if pinning else 0) <= spec.max_pinned_pages
                    assert len(state.resident) + len(state.provisional) + (0 if pinning else pending) <= spec.window_pages_per_branch

        def teardown(self):
            for s in self.sessions.values():
                self.cache.end_session(s)
            assert self.cache.pool.num_free == self.cache.pool.capacity

    return EntryLifecycle


@pytest.mark.parametrize("window", list(SPECS))
def test_typed_entries_stay_accounted(window):
    case = machine(SPECS[window]).TestCase
    case.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
    case("runTest").runTest()
