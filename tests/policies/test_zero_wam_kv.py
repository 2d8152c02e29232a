"""Zero-WAM's transformer over the paged cache's pinned pages (ardiff_kv ``EntryKind.IN_CONTEXT``): the pieces its
episode logic will use, held to upstream's visibility rules (docs/zero-wam.md "The cache").

The demonstration's forward attends over its own block only (bidirectional: it equals an uncached forward of it);
video queries read the pinned block, action queries (``attend_pinned=False``) are exactly as if it were not there; the
window slides under the block without touching it, and it is still read; ending the session returns every page.
"""

from __future__ import annotations

from math import gcd

import pytest
import torch

from ardiff_kv import Branch, EntryKind, KVSpec, PagedKVCache, prepare_batch
from ardiff_policies.lingbot_va.model import video_grid
from ardiff_policies.lingbot_va.zero_wam_model import expert_action_grid, load_zero_wam_transformer
from ardiff_policies.lingbot_va.zero_wam_tiny import ensure_tiny_zero_wam_checkpoint

F, H, W, N = 2, 4, 6, 4  # a chunk: 2 latent frames of 4x6 (12 video tokens), 4 actions a frame (8 tokens)
VIDEO_TOKENS, ACTION_TOKENS = F * (H // 2) * (W // 2), F * N
DEMO_FRAMES = 2
ICL_ROPE_H = 24  # upstream's row offset of the demonstration's positions


@pytest.fixture(scope="module")
def model():
    return load_zero_wam_transformer(ensure_tiny_zero_wam_checkpoint() / "transformer")


def _spec(model) -> KVSpec:
    page = gcd(VIDEO_TOKENS, ACTION_TOKENS)
    base = model.config.base
    return KVSpec(
        num_layers=base.num_layers,
        num_heads=base.num_attention_heads,
        head_dim=base.attention_head_dim,
        page_size=page,
        window_pages=2 * (VIDEO_TOKENS + ACTION_TOKENS) // page,  # two chunks
        max_new_pages=VIDEO_TOKENS // page,
        evict_to_fit=True,
        max_pinned_pages=DEMO_FRAMES * (H // 2) * (W // 2) // page,
    )


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _demo_grid() -> torch.Tensor:
    grid = video_grid(DEMO_FRAMES, H // 2, W // 2, start_frame=0)
    grid[1] += ICL_ROPE_H
    return grid


class Robot:
    """One session of one half (the conditional one): forwards over its pages."""

    def __init__(self, model, cache, name):
        self.model, self.cache = model, cache
        self.kv = cache.open_session(name)
        self.text = model.project_text(_randn((1, 5, model.config.base.text_dim), 1))

    def forward(self, x, t, grid, *, action_mode, commit=False, entry=EntryKind.OBSERVATION, attend_pinned=True):
        ctx = self.kv.begin_forward(Branch.COND, num_video_tokens=grid.shape[1], commit=commit, entry=entry, attend_pinned=attend_pinned)
        with torch.no_grad():
            out = self.model(x, torch.full((1, x.shape[2]), float(t)), grid[None], self.text, action_mode=action_mode, self_kv=prepare_batch([ctx]))
        self.kv.complete(Branch.COND)
        return out

    def pin(self, demo):
        return self.forward(demo, 0.0, _demo_grid(), action_mode=False, commit=True, entry=EntryKind.IN_CONTEXT)

    def observe(self, chunk):
        """A chunk's committed video and actions (upstream's compute_kv_cache, t = 0)."""
        video = _randn((1, 48, F, H, W), 100 + chunk)
        actions = _randn((1, 30, F, N, 1), 200 + chunk)
        self.forward(video, 0.0, video_grid(F, H // 2, W // 2, F * chunk), action_mode=False, commit=True)
        self.forward(actions, 0.0, expert_action_grid(F, N, F * chunk), action_mode=True, commit=True, attend_pinned=False)

    def denoise(self, chunk, *, action_mode, attend_pinned=True):
        if action_mode:
            x, grid = _randn((1, 30, F, N, 1), 300 + chunk), expert_action_grid(F, N, F * chunk)
        else:
            x, grid = _randn((1, 48, F, H, W), 400 + chunk), video_grid(F, H // 2, W // 2, F * chunk)
        return self.forward(x, 500.0, grid, action_mode=action_mode, attend_pinned=attend_pinned)


@pytest.fixture()
def cache(model):
    spec = _spec(model)
    cache = PagedKVCache(spec, num_pages=4 * spec.pages_per_branch + 2, max_sessions=2, attention_backend="sdpa")
    yield cache
    assert cache.pool.num_allocated == 0, "every ending path returns its pages"


def test_the_demonstrations_forward_is_bidirectional_over_its_own_block(model, cache):
    demo = _randn((1, 48, DEMO_FRAMES, H, W), 7)
    robot = Robot(model, cache, "a")
    paged = robot.pin(demo)
    with torch.no_grad():
        alone = model(demo, torch.zeros(1, DEMO_FRAMES), _demo_grid()[None], robot.text, action_mode=False)
    torch.testing.assert_close(paged, alone, rtol=0, atol=1e-5)
    assert len(robot.kv.branch(Branch.COND).pinned) == _spec(model).max_pinned_pages
    cache.end_session(robot.kv)


def test_video_queries_see_the_demonstration_and_action_queries_never_do(model, cache):
    robot = Robot(model, cache, "demo")
    robot.pin(_randn((1, 48, DEMO_FRAMES, H, W), 7))
    x, grid = _randn((1, 30, F, N, 1), 3), expert_action_grid(F, N, 0)
    t = torch.full((1, F), 500.0)
    with torch.no_grad():  # with nothing but the pinned block cached, a blind query sees only its own chunk
        alone_actions = model(x, t, grid[None], robot.text, action_mode=True)
        alone_video = model(_randn((1, 48, F, H, W), 4), t, video_grid(F, H // 2, W // 2, 0)[None], robot.text, action_mode=False)
    actions = robot.forward(x, 500.0, grid, action_mode=True, attend_pinned=False)
    torch.testing.assert_close(actions, alone_actions, rtol=0, atol=1e-5)
    video = robot.forward(_randn((1, 48, F, H, W), 4), 500.0, video_grid(F, H // 2, W // 2, 0), action_mode=False)
    assert (video - alone_video).abs().max() > 1e-3  # the video queries read the demonstration
    blind = robot.forward(_randn((1, 48, F, H, W), 4), 500.0, video_grid(F, H // 2, W // 2, 0), action_mode=False, attend_pinned=False)
    torch.testing.assert_close(blind, alone_video, rtol=0, atol=1e-5)
    cache.end_session(robot.kv)


def test_the_window_slides_under_the_pinned_block(model, cache):
    robot = Robot(model, cache, "long")
    robot.pin(_randn((1, 48, DEMO_FRAMES, H, W), 7))
    pinned = list(robot.kv.branch(Branch.COND).pinned)
    for chunk in range(5):  # a window of two chunks: chunks 0-2 are evicted
        robot.observe(chunk)
    branch = robot.kv.branch(Branch.COND)
    assert branch.pinned == pinned and branch.evicted_pages == 3 * (VIDEO_TOKENS + ACTION_TOKENS) // _spec(model).page_size
    seeing, blind = robot.denoise(5, action_mode=False), robot.denoise(5, action_mode=False, attend_pinned=False)
    assert (seeing - blind).abs().max() > 1e-3  # still read after the window slid
    cache.end_session(robot.kv)
