"""LingBot-VA through the paged KV cache against upstream's own cache, forward by forward.

The recorded episode (scripts/record_upstream_lingbot_va.py) drives upstream's ``WanTransformer3DModel`` cache the way
its server does: per chunk the video denoising steps (temporary writes) and the trailing t = 0 step that keeps the
predicted K/V, the same for the actions, then ``clear_pred_cache`` and the committed video and action writes; a window
of two chunks that slides twice, and one chunk predicted twice before its commit. Here the same forwards run through
``kv`` with provisional pages and the evict-to-fit window: every output within 1e-5 of upstream's.
"""

from __future__ import annotations

from math import gcd

import pytest
import torch

from ardiff_kv import Branch, KVSpec, PagedKVCache, prepare_batch
from ardiff_policies.lingbot_va.model import action_grid, load_transformer, video_grid
from ardiff_policies.lingbot_va.tiny import ensure_tiny_checkpoint
from tests.helpers.lingbot_va import ATOL, load_reference, randn, sha, text_embeddings

BRANCHES = (Branch.COND, Branch.UNCOND)  # the CFG batch's rows: prompt, negative prompt


@pytest.fixture(scope="module")
def reference():
    return load_reference()


@pytest.fixture(scope="module")
def model():
    return load_transformer(ensure_tiny_checkpoint() / "transformer")


def episode_spec(model, ep) -> KVSpec:
    video_tokens = ep["frames"] * (ep["height"] // 2) * (ep["width"] // 2)
    action_tokens = ep["frames"] * ep["actions_per_frame"]
    page = gcd(video_tokens, action_tokens)  # every write group is whole pages
    chunks = ep["attn_window"] // 2  # upstream: (attn_window // 2) x (video + action tokens per chunk)
    cfg = model.config
    return KVSpec(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_attention_heads,
        head_dim=cfg.attention_head_dim,
        page_size=page,
        window_pages=chunks * (video_tokens + action_tokens) // page,
        max_new_pages=max(video_tokens, action_tokens) // page,
        evict_to_fit=True,
    )


def test_an_episode_through_the_paged_cache_matches_upstreams_cache(reference, model):
    meta, tensors = reference
    ep = meta["episode"]
    spec = episode_spec(model, ep)
    assert (spec.page_size, spec.window_pages, spec.max_new_pages) == (4, 6, 2)
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1, attention_backend="sdpa")
    session = cache.open_session("robot")
    text = text_embeddings(meta, model.config.text_dim)
    text_kv = model.project_text(text)
    errors = {}
    evictions = 0
    for n, call in enumerate(ep["calls"]):
        if call.get("clear_pred"):
            session.drop_provisional()
            continue
        action = call["mode"] == "action"
        f = ep["frames"]
        if action:
            x = randn((1, model.config.action_dim, f, ep["actions_per_frame"], 1), call["seed"])
            grid = action_grid(f, ep["actions_per_frame"], call["start"])
        else:
            x = randn((1, model.config.in_channels, f, ep["height"], ep["width"]), call["seed"])
            grid = video_grid(f, ep["height"] // 2, ep["width"] // 2, call["start"])
        assert sha(x) == meta["input_sha256"][f"episode.{n}"]
        tokens = grid.shape[1]
        contexts = [session.begin_forward(b, num_video_tokens=tokens, commit=call["update"] > 0, provisional=call["update"] == 1) for b in BRANCHES]
        self_kv = prepare_batch(contexts)
        with torch.no_grad():
            out = model(
                x.repeat(2, 1, 1, 1, 1),
                torch.tensor([call["timesteps"]] * 2),
                grid[None].repeat(2, 1, 1),
                text_kv,
                action_mode=action,
                self_kv=self_kv,
            )
        for b in BRANCHES:
            session.complete(b)
        errors[n] = (out - tensors[f"episode.{n}"]).abs().max().item()
        evictions = session.branch(Branch.COND).evicted_pages
    worst = max(errors, key=errors.get)
    assert errors[worst] <= ATOL, f"forward {worst} ({ep['calls'][worst]}): max abs error {errors[worst]:.3g} vs upstream"
    # the episode did slide the window (chunk 0 evicted by the second prediction, chunk 1 by chunk 3) and it shows:
    assert evictions == 6
    cache.end_session(session)
    assert cache.pool.num_allocated == 0


def test_without_the_provisional_tail_the_action_steps_diverge(reference, model):
    """The anchor has teeth: dropping the predicted video before the action steps (what a cache without provisional
    entries would do) moves the first chunk's action velocity well past the tolerance."""
    meta, tensors = reference
    ep = meta["episode"]
    spec = episode_spec(model, ep)
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1, attention_backend="sdpa")
    session = cache.open_session("robot")
    text_kv = model.project_text(text_embeddings(meta, model.config.text_dim))
    first_action = next(n for n, c in enumerate(ep["calls"]) if c.get("mode") == "action")
    for call in ep["calls"][: first_action + 1]:
        action = call["mode"] == "action"
        if action:
            session.drop_provisional()
            x = randn((1, 30, ep["frames"], ep["actions_per_frame"], 1), call["seed"])
            grid = action_grid(ep["frames"], ep["actions_per_frame"], call["start"])
        else:
            x = randn((1, 48, ep["frames"], ep["height"], ep["width"]), call["seed"])
            grid = video_grid(ep["frames"], ep["height"] // 2, ep["width"] // 2, call["start"])
        contexts = [
            session.begin_forward(b, num_video_tokens=grid.shape[1], commit=call["update"] > 0, provisional=call["update"] == 1) for b in BRANCHES
        ]
        with torch.no_grad():
            out = model(
                x.repeat(2, 1, 1, 1, 1),
                torch.tensor([call["timesteps"]] * 2),
                grid[None].repeat(2, 1, 1),
                text_kv,
                action_mode=action,
                self_kv=prepare_batch(contexts),
            )
        for b in BRANCHES:
            session.complete(b)
    assert (out - tensors[f"episode.{first_action}"]).abs().max().item() > 100 * ATOL
