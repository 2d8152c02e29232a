"""``KVSpec.frame_window``: upstream Zero-WAM's window in frame ids, page for page (docs/zero-wam.md "The window in
pages").

An episode runs every forward Zero-WAM's server runs, in both CFG halves (the demonstration pinned in the conditional
half only; video steps in both halves, the kept prediction in both, action steps in the conditional half without the
pinned block; the observation's video in both halves, its actions in the conditional one; the trim), and at each the
pages attention reads are compared with what upstream's predicate lets the same query see (tests/helpers/zero_wam_cache.py,
the metadata oracle): the demonstration for conditional video queries only, the oldest chunk's video left out of the
action queries' view once the window is full, and the unconditional half, which holds video only, keeping as many
chunks as the conditional one (a window counted in pages would keep (v + a) / v times as many). A repeated infer sees
the first prediction of the chunk, as upstream's cache keeps it.
"""

from __future__ import annotations

from collections import Counter

import pytest

from ardiff_kv import Branch, EntryKind, KVSpec, PagedKVCache
from tests.helpers.zero_wam_cache import ACTION, ICL, OBSERVATION, PREDICTION, VIDEO, Entry, Episode

PAGE, V, A, PIN = 4, 3, 1, 2  # pages: a chunk's video, its actions, the demonstration
WINDOW = 4  # frame ids: two chunks
PAGES = {ICL: PIN, OBSERVATION: {VIDEO: V, ACTION: A}, PREDICTION: {VIDEO: V}}


def _spec() -> KVSpec:
    return KVSpec(
        num_layers=1,
        num_heads=1,
        head_dim=4,
        page_size=PAGE,
        window_pages=(WINDOW // 2) * (V + A),
        uncond_window_pages=(WINDOW // 2) * V,
        max_new_pages=V,
        chunk_pages=V + A,
        max_pinned_pages=PIN,
        pinned_branches=(Branch.COND,),
        frame_window=WINDOW,
    )


def _pages(entry: Entry) -> int:
    weight = PAGES[entry.cache_type]
    return weight if isinstance(weight, int) else weight[entry.kind]


def test_the_spec_refuses_what_it_cannot_mean_and_reserves_per_branch():
    with pytest.raises(ValueError, match="frame_window slides by frame ids"):
        KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=4, window_pages=8, max_new_pages=2, evict_to_fit=True, frame_window=4)
    with pytest.raises(ValueError, match="uncond_window_pages"):
        KVSpec(num_layers=1, num_heads=1, head_dim=4, page_size=4, window_pages=8, max_new_pages=2, uncond_window_pages=9)
    spec = _spec()
    # the conditional branch: the pinned block, its window, then a chunk's observation or a second prediction on top
    assert spec.pages_for(Branch.COND) == PIN + 2 * (V + A) + (V + A - 1) + V
    assert spec.pages_for(Branch.UNCOND) == 2 * V + (V + A - 1) + V  # no block, video only
    assert spec.reservation(2) == spec.pages_for(Branch.COND) + spec.pages_for(Branch.UNCOND)
    assert spec.block_table_width == PIN + spec.window_pages_per_branch + 1
    cache = PagedKVCache(spec, num_pages=spec.reservation(2) + 1, max_sessions=1)
    assert cache.reservation_per_session == spec.reservation(2)
    s = cache.open_session("s")
    with pytest.raises(ValueError, match="UNCOND branch pins nothing"):
        s.begin_forward(Branch.UNCOND, num_video_tokens=PIN * PAGE, commit=True, entry=EntryKind.IN_CONTEXT)
    with pytest.raises(ValueError, match="needs its frame id"):
        s.begin_forward(Branch.COND, num_video_tokens=V * PAGE, commit=False)


class PagedEpisode:
    """The paged cache driven as Zero-WAM's server drives its cache, each read checked against the oracle."""

    def __init__(self, halves: int = 2):
        spec = _spec()
        self.halves = tuple(Branch)[:halves]
        self.cache = PagedKVCache(spec, num_pages=spec.reservation(2) + 1, max_sessions=1, attention_backend="sdpa")
        self.kv = self.cache.open_session("robot")
        self.label: dict[int, Entry] = {}  # page -> what it holds
        self.oracle = Episode(window=WINDOW, cfg=halves == 2)

    def forward(self, branch, pages, *, kind, frame, commit, entry=EntryKind.OBSERVATION, cache_type=OBSERVATION):
        seq = int(branch)
        ctx = self.kv.begin_forward(branch, num_video_tokens=pages * PAGE, commit=commit, entry=entry, attend_pinned=kind == VIDEO, frame=frame)
        inputs = ctx.prepare()
        row = inputs[0].block_table[0, : int(inputs[0].seq_lens[0]) // PAGE].tolist()
        own, history = row[-pages:], row[:-pages]
        assert all(p in self.label for p in history), "attention reads only pages the branch holds"
        seen = Counter(self.label[p] for p in history)
        expected = Counter()
        for e in self.oracle.visible(kind, seq):
            expected[e] += _pages(e)
        assert seen == expected, f"{kind} query, half {seq}, frame {frame}: kv reads {dict(seen)}, upstream {dict(expected)}"
        self.kv.complete(branch)
        if commit:
            for p in own:
                self.label[p] = Entry(kind, cache_type, seq, frame if entry is not EntryKind.IN_CONTEXT else 0, self.oracle.chunk)

    def reset(self):
        self.oracle.reset(demonstration=False)  # the block's own forward sees only itself
        self.forward(Branch.COND, PIN, kind=VIDEO, frame=0, commit=True, entry=EntryKind.IN_CONTEXT, cache_type=ICL)
        self.oracle.reset(demonstration=True)
        self.label = {p: Entry(VIDEO, ICL, 0, 0, -1) for p in self.kv.branch(Branch.COND).pinned}

    def infer(self):
        c = self.oracle.chunk
        for branch in self.halves:  # a video denoising step
            self.forward(branch, V, kind=VIDEO, frame=2 * c, commit=False)
        for branch in self.halves:  # the trailing t = 0 step keeps the predicted video
            self.forward(branch, V, kind=VIDEO, frame=2 * c, commit=True, entry=EntryKind.PREDICTION, cache_type=PREDICTION)
        self.oracle.infer()
        self.forward(Branch.COND, A, kind=ACTION, frame=2 * c + 1, commit=False)  # an action step

    def compute_kv_cache(self):
        c = self.oracle.chunk
        before = list(self.oracle.entries)
        self.oracle.entries = [e for e in before if e.cache_type != PREDICTION]  # cleared before the writes
        for branch in self.halves:  # each write sees the ones before it
            self.forward(branch, V, kind=VIDEO, frame=2 * c, commit=True)
            self.oracle.entries.append(Entry(VIDEO, OBSERVATION, int(branch), 2 * c, c))
        self.forward(Branch.COND, A, kind=ACTION, frame=2 * c + 1, commit=True)
        self.oracle.entries = before
        self.oracle.compute_kv_cache()  # upstream's bookkeeping of the same writes, then its trim
        self.kv.trim_window(next_frame=2 * c + 2)
        held = {p for b in Branch for p in self.kv.branch(b).held}
        self.label = {p: e for p, e in self.label.items() if p in held}
        assert Counter(self.label.values()) == Counter({e: _pages(e) for e in self.oracle.entries}), "kv holds what upstream keeps"


def test_an_episode_in_both_halves_reads_what_upstreams_predicate_allows():
    ep = PagedEpisode()
    ep.reset()
    for chunk in range(7):
        ep.infer()
        if chunk == 3:  # a repeated infer (a client that asks again): it sees the chunk's first prediction, as upstream
            ep.infer()
            with pytest.raises(ValueError, match="exceeds the window's reservation"):
                ep.kv.begin_forward(Branch.COND, num_video_tokens=V * PAGE, commit=True, entry=EntryKind.PREDICTION, frame=2 * chunk)
        ep.compute_kv_cache()
    cond, uncond = ep.kv.branch(Branch.COND), ep.kv.branch(Branch.UNCOND)
    assert len(cond.resident) == (WINDOW // 2) * (V + A) and len(uncond.resident) == (WINDOW // 2) * V  # two chunks each
    assert len(cond.pinned) == PIN and not uncond.pinned
    assert cond.evicted_pages == (7 - WINDOW // 2) * (V + A) and uncond.evicted_pages == (7 - WINDOW // 2) * V
    ep.cache.end_session(ep.kv)
    assert ep.cache.pool.num_allocated == 0


def test_one_half_without_guidance():
    ep = PagedEpisode(halves=1)
    ep.reset()
    for _ in range(4):
        ep.infer()
        ep.compute_kv_cache()
    assert ep.kv.pages_held == PIN + (WINDOW // 2) * (V + A)


def test_a_rolled_back_trim_gets_its_pages_and_frames_back():
    ep = PagedEpisode()
    ep.reset()
    for _ in range(3):
        ep.infer()
        ep.compute_kv_cache()
    ep.infer()
    layout = {b: list(ep.kv.branch(b).entries) for b in Branch}
    frames = {b: dict(ep.kv.branch(b).frames) for b in Branch}
    free = ep.cache.pool.num_free
    ep.kv.snapshot()
    ep.kv.drop_predictions()
    for b in ep.halves:
        ctx = ep.kv.begin_forward(b, num_video_tokens=V * PAGE, commit=True, frame=6)
        ctx.prepare()
        ep.kv.complete(b)
    ep.kv.trim_window(next_frame=8)
    ep.kv.rollback()
    assert {b: list(ep.kv.branch(b).entries) for b in Branch} == layout
    assert {b: dict(ep.kv.branch(b).frames) for b in Branch} == frames
    assert ep.cache.pool.num_free == free
    ep.compute_kv_cache()  # and the episode goes on as if the undone call never ran
