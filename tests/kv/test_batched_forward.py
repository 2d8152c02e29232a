"""Several sequences in one forward (ardiff_kv.prepare_batch): each attends only to its own pages and new tokens.

The reference is the dense attention of each sequence alone (its resident window + its new
tokens), computed without the cache; every backend that runs here (sdpa, flex) must agree with it
for a batch that mixes sessions, CFG branches, histories, commits and scratch slots.
"""

from __future__ import annotations

import pytest
import torch

from ardiff_kv import Branch, KVSpec, PagedKVCache, paged_write_attend, prepare_batch

PAGE, HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5


def make(backend: str, max_batch: int = 3) -> PagedKVCache:
    spec = KVSpec(num_layers=1, num_heads=HEADS, head_dim=DIM, page_size=PAGE, window_pages=5, max_new_pages=2, max_extra_tokens=3)
    return PagedKVCache(spec, num_pages=4 * 2 * spec.pages_per_branch + 1, max_sessions=4, attention_backend=backend, max_batch=max_batch)


def rand(n: int) -> torch.Tensor:
    return torch.randn(n, HEADS, DIM)


def dense(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=SCALE)[
        0
    ].transpose(0, 1)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("commit", [True, False])
def test_each_sequence_attends_to_its_own_window_and_new_tokens(backend, commit):
    torch.manual_seed(0)
    cache = make(backend)
    history: dict[tuple[str, Branch], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    sessions = {name: cache.open_session(name) for name in ("a", "b", "c")}
    # different histories per session and branch: 0, 1 or 3 committed frames
    for name, frames in (("a", 0), ("b", 1), ("c", 3)):
        for branch in Branch:
            for _ in range(frames):
                ctx = sessions[name].begin_forward(branch, num_video_tokens=PAGE, commit=True)
                k, v = rand(PAGE), rand(PAGE)
                paged_write_attend(ctx.prepare()[0], rand(PAGE), k, v, None, None, SCALE)
                sessions[name].complete(branch)
                history.setdefault((name, branch), []).append((k, v))
    # one forward: 3 sessions x 2 branches, 2 new frames + 3 extra tokens each, one scratch slot per session
    extra = 0 if commit else 3
    order = [(name, branch) for name in ("a", "b", "c") for branch in Branch]
    contexts = [
        sessions[name].begin_forward(branch, num_video_tokens=2 * PAGE, commit=commit, extra_tokens=extra, scratch_slot=slot // 2)
        for slot, (name, branch) in enumerate(order)
    ]
    inputs = prepare_batch(contexts)[0]
    assert inputs.block_table.shape[0] == 6 and inputs.cu_seqlens_q.tolist() == [i * (2 * PAGE + extra) for i in range(7)]
    q, k, v = rand(6 * (2 * PAGE + extra)), rand(6 * 2 * PAGE), rand(6 * 2 * PAGE)
    ke, ve = (rand(6 * extra), rand(6 * extra)) if extra else (None, None)
    out = paged_write_attend(inputs, q, k, v, ke, ve, SCALE)
    n, m = 2 * PAGE + extra, 2 * PAGE
    for i, key in enumerate(order):
        past = history.get(key, [])
        keys = torch.cat([p[0] for p in past] + [k[i * m : (i + 1) * m]] + ([ke[i * extra : (i + 1) * extra]] if extra else []))
        values = torch.cat([p[1] for p in past] + [v[i * m : (i + 1) * m]] + ([ve[i * extra : (i + 1) * extra]] if extra else []))
        torch.testing.assert_close(out[i * n : (i + 1) * n], dense(q[i * n : (i + 1) * n], keys, values), atol=1e-5, rtol=1e-5)
    for name, branch in order:
        sessions[name].complete(branch)
    if commit:  # committed: each session's branch holds its own two new pages
        for name, frames in (("a", 0), ("b", 1), ("c", 3)):
            assert all(len(sessions[name].branch(b).resident) == frames + 2 for b in Branch)
    for session in sessions.values():
        cache.end_session(session)
    assert cache.pool.num_free == cache.pool.capacity


def test_each_batch_slot_has_its_own_scratch_region():
    cache = make("sdpa", max_batch=3)
    regions = [cache.storage.scratch_pages(branch, slot) for slot in range(3) for branch in Branch]
    flat = [page for region in regions for page in region]
    assert len(flat) == len(set(flat)) and min(flat) >= cache.pool.num_pages  # disjoint, outside the pool
    with pytest.raises(ValueError, match="outside the batch of 3"):
        cache.storage.scratch_pages(Branch.COND, 3)


def test_a_batch_needs_one_cache_and_equal_query_lengths():
    cache, other = make("sdpa"), make("sdpa")
    a, b = cache.open_session("a"), cache.open_session("b")
    with pytest.raises(ValueError, match="equal query lengths"):
        prepare_batch(
            [
                a.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=False),
                b.begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=False, scratch_slot=1),
            ]
        )
    with pytest.raises(ValueError, match="one cache"):
        prepare_batch(
            [
                a.begin_forward(Branch.UNCOND, num_video_tokens=PAGE, commit=False),
                other.open_session("x").begin_forward(Branch.COND, num_video_tokens=PAGE, commit=False),
            ]
        )
    with pytest.raises(ValueError, match="at least one"):
        prepare_batch([])


def test_the_budget_pays_for_a_scratch_region_per_batch_slot():
    spec = make("sdpa").spec
    one = PagedKVCache.pages_for_budget(spec, 2**20, max_sessions=4, num_branches=2)
    four = PagedKVCache.pages_for_budget(spec, 2**20, max_sessions=4, num_branches=2, max_batch=4)
    assert one - four == 3 * 2 * spec.scratch_pages_per_branch


def test_a_batch_never_outgrows_the_sessions_its_pool_holds():
    """Scratch for a batch slot the pool cannot fill (a batch runs only if every member's pages fit)
    would be paid for and never used: the batch is capped at what the pool holds at once."""
    spec = make("sdpa").spec
    per_session = 2 * spec.pages_per_branch
    for sessions_held in (1, 2, 3):
        budget = (sessions_held * per_session + 4 * 2 * spec.scratch_pages_per_branch) * spec.page_bytes + 4 * 2 * spec.cross_slot_bytes
        batch = PagedKVCache.batch_for_budget(spec, budget, max_sessions=4, num_branches=2, max_batch=4)
        pages = PagedKVCache.pages_for_budget(spec, budget, max_sessions=4, num_branches=2, max_batch=batch)
        assert pages // per_session >= batch  # the pool holds the batch
        assert batch >= sessions_held  # and the cap is no lower than the plain pool holds
        cache = PagedKVCache.from_budget(spec, budget, max_sessions=4, max_batch=4)
        assert cache.storage.max_batch == batch
    roomy = 100 * per_session * spec.page_bytes
    assert PagedKVCache.batch_for_budget(spec, roomy, max_sessions=4, num_branches=2, max_batch=4) == 4
    assert PagedKVCache.batch_for_budget(spec, roomy, max_sessions=2, num_branches=2, max_batch=4) == 2  # engine.max_sessions
