"""``KVSpec.window_of_history``: the window counts the pages a branch holds, not the forward's own, which makes the
paged window upstream Zero-WAM's frame-id window exactly (docs/zero-wam.md "The window in pages").

An episode of the conditional half runs every forward Zero-WAM's server runs (video steps, the kept prediction,
action steps, the observation's video and actions), and at each the pages attention reads are compared with what
upstream's predicate lets the same query see (tests/helpers/zero_wam_cache.py): the demonstration for video queries
only, the oldest chunk's video left out of the action queries' view once the window is full, one chunk evicted
after each action commit.
"""

from __future__ import annotations

from collections import Counter

import pytest

from ardiff_kv import Branch, EntryKind, KVSpec, PagedKVCache
from tests.helpers.zero_wam_cache import ACTION, ICL, OBSERVATION, PREDICTION, VIDEO, Entry, sees

PAGE, V, A, PIN = 4, 3, 1, 2  # pages: a chunk's video, its actions, the demonstration
WINDOW = 4  # frame ids: two chunks


def _spec(window_of_history: bool = True) -> KVSpec:
    return KVSpec(
        num_layers=1,
        num_heads=1,
        head_dim=4,
        page_size=PAGE,
        window_pages=(WINDOW // 2) * (V + A),
        max_new_pages=V,
        chunk_pages=V + A,
        max_pinned_pages=PIN,
        window_of_history=window_of_history,
    )


def test_the_spec_refuses_what_it_cannot_mean():
    with pytest.raises(ValueError, match="window_of_history is a sliding chunk window"):
        KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=4, window_pages=8, max_new_pages=2, evict_to_fit=True, window_of_history=True)
    assert _spec().block_table_width == PIN + 8 + V + 1  # the forward's own pages beside a full window


class Episode:
    def __init__(self, spec: KVSpec):
        self.cache = PagedKVCache(spec, num_pages=2 * 2 * spec.pages_per_branch + 1, max_sessions=1, attention_backend="sdpa")
        self.kv = self.cache.open_session("robot")
        self.label: dict[int, Entry] = {}  # page -> what it holds
        self.entries: list[Entry] = []  # upstream's cache, half 0

    def forward(self, pages, *, kind, frame, chunk, commit, entry=EntryKind.OBSERVATION, attend_pinned=True, cache_type=OBSERVATION):
        ctx = self.kv.begin_forward(Branch.COND, num_video_tokens=pages * PAGE, commit=commit, entry=entry, attend_pinned=attend_pinned)
        inputs = ctx.prepare()
        row = inputs[0].block_table[0, : int(inputs[0].seq_lens[0]) // PAGE].tolist()
        own = row[-pages:]
        assert all(p in self.label for p in row[:-pages]), "attention reads only pages the branch holds"
        seen = Counter(self.label[p] for p in row[:-pages])
        query = Entry(kind, cache_type, 0, frame, chunk)
        expected = Counter()
        for e in self.entries:
            if (e.cache_type != PREDICTION or e.chunk == chunk) and sees(kind, 0, frame, e, WINDOW):
                expected[e] += {ICL: PIN, OBSERVATION: V if e.kind == VIDEO else A, PREDICTION: V}[e.cache_type]
        assert seen == expected, f"{kind} query at frame {frame}: kv reads {dict(seen)}, upstream {dict(expected)}"
        self.kv.complete(Branch.COND)
        if commit:
            for p in own:
                self.label[p] = query
            self.entries.append(query)
        return row

    def trim(self, chunk):
        """After the action commit: upstream keeps observation frames within W of the next frame; kv evicts a chunk."""
        next_frame = 2 * chunk + 2
        self.entries = [e for e in self.entries if e.cache_type == ICL or (e.cache_type == OBSERVATION and abs(e.frame - next_frame) <= WINDOW)]
        held = set(self.kv.branch(Branch.COND).pinned) | set(self.kv.branch(Branch.COND).resident)
        self.label = {p: e for p, e in self.label.items() if p in held}
        assert Counter(self.label.values()) == Counter(
            {e: {ICL: PIN, OBSERVATION: V if e.kind == VIDEO else A}[e.cache_type] for e in self.entries}
        ), "kv holds what upstream keeps"


def _run(spec: KVSpec, chunks: int = 7) -> Episode:
    ep = Episode(spec)
    ep.forward(PIN, kind=VIDEO, frame=0, chunk=-1, commit=True, entry=EntryKind.IN_CONTEXT, cache_type=ICL)
    for chunk in range(chunks):
        video, action = 2 * chunk, 2 * chunk + 1
        ep.forward(V, kind=VIDEO, frame=video, chunk=chunk, commit=False, cache_type=PREDICTION)  # a denoising step
        ep.forward(V, kind=VIDEO, frame=video, chunk=chunk, commit=True, entry=EntryKind.PREDICTION, cache_type=PREDICTION)
        ep.forward(A, kind=ACTION, frame=action, chunk=chunk, commit=False, attend_pinned=False, cache_type=PREDICTION)
        ep.entries = [e for e in ep.entries if e.cache_type != PREDICTION]  # compute_kv_cache: the prediction goes
        ep.forward(V, kind=VIDEO, frame=video, chunk=chunk, commit=True)
        ep.forward(A, kind=ACTION, frame=action, chunk=chunk, commit=True, attend_pinned=False)
        ep.trim(chunk)
    return ep


def test_a_zero_wam_episode_reads_what_upstreams_predicate_allows():
    ep = _run(_spec())
    assert ep.kv.branch(Branch.COND).evicted_pages == (7 - WINDOW // 2) * (V + A)
    ep.cache.end_session(ep.kv)
    assert ep.cache.pool.num_allocated == 0


def test_a_window_that_counts_the_forwards_own_pages_is_not_upstreams():
    with pytest.raises(AssertionError, match="query at frame"):
        _run(_spec(window_of_history=False))
