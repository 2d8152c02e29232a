"""Zero-WAM's full-size memory plan (ardiff_policies.lingbot_va.zero_wam_memory): what the server reserves (the KV spec
it serves with: a pinned demonstration in the conditional branch only, the video-only unconditional window), upstream's
own cache beside it, the weights as loaded, and the rows scripts/memory_plan.py prints for 80 and 141 GiB cards."""

from __future__ import annotations

import torch

from ardiff_kv import Branch, PagedKVCache
from ardiff_policies.lingbot_va import zero_wam_memory
from ardiff_policies.lingbot_va.embodiments import ZERO_WAM_ROBOTWIN
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.lingbot_va.zero_wam_demonstration import DemonstrationGeometry
from ardiff_policies.lingbot_va.zero_wam_episode import kv_spec
from ardiff_policies.lingbot_va.zero_wam_model import parameter_count
from ardiff_policies.wan.memory import GiB

TOKEN = 2 * 30 * 3072 * 2  # K and V, 30 layers, width 3072, bf16


def test_upstreams_cache_by_kind():
    # three 224x288 cameras side by side: a 14x54 latent frame, 7x27 tokens; 2-frame chunks of 16 actions
    g = zero_wam_memory.ROBOTWIN
    assert (g.video_tokens_per_chunk, g.action_tokens_per_chunk, g.demonstration_tokens) == (378, 32, 32 * 10 * 15)
    # window 64 frame ids = 32 chunks; with CFG the video in both halves, the actions in the conditional one only
    assert g.cached_tokens(64) == {"in-context": 4800, "observation": 32 * (2 * 378 + 32), "prediction": 2 * 378}
    assert g.cached_tokens(64, cfg=False) == {"in-context": 4800, "observation": 32 * (378 + 32), "prediction": 378}


def test_a_session_reserves_the_served_spec_and_upstreams_cache_fits_in_it():
    spec = kv_spec(ZERO_WAM_ROBOTWIN, ZeroWAMConfig(), DemonstrationGeometry(), torch.bfloat16)
    v, a = 189, 16  # pages of gcd(378, 32) = 2 tokens
    assert (spec.page_size, spec.window_pages, spec.uncond_window_pages, spec.max_pinned_pages) == (2, 32 * (v + a), 32 * v, 2400)
    assert spec.pages_for(Branch.COND) == 2400 + 32 * (v + a) + (v + a - 1) + v  # the block, the window, a chunk on top
    assert spec.pages_for(Branch.UNCOND) == 32 * v + (v + a - 1) + v  # no block, video only
    p = zero_wam_memory.plan(zero_wam_memory.ROBOTWIN)
    assert p.kv_session == spec.reservation(2) * spec.page_bytes == 31588 * TOKEN
    upstream = sum(zero_wam_memory.ROBOTWIN.cached_tokens(64).values())
    # upstream's most (a window, a prediction per half) and, per branch, room for a chunk's observation or a second prediction
    assert spec.reservation(2) * spec.page_size == upstream + 2 * (v + a - 1) * spec.page_size
    # the pool's own: a forward's scratch per branch; batches of 4 add their slots and the undo headroom a retry keeps
    assert p.kv_reserved == PagedKVCache.reserved_pages(spec, 2, 1) * spec.page_bytes == 2 * v * spec.page_bytes
    assert zero_wam_memory.plan(zero_wam_memory.ROBOTWIN, max_batch=4).kv_reserved == 4 * 2 * (v + spec.undo_pages) * spec.page_bytes


def test_weights_are_the_served_parameters_in_bf16():
    p = zero_wam_memory.plan(zero_wam_memory.ROBOTWIN)
    assert p.weights["transformer"] == 2 * parameter_count(ZeroWAMConfig())
    assert 17.0 < p.weights["transformer"] / GiB < 17.7  # 9.41 B: the MCP heads are not loaded


def test_sessions_on_80_and_141_gib():
    p = zero_wam_memory.plan(zero_wam_memory.ROBOTWIN)
    assert round(p.kv_session / GiB, 2) == 10.84  # 31,588 tokens
    assert (p.sessions_on(int(79.5 * GiB)), p.sessions_on(int(140.5 * GiB))) == (4, 9)
    assert p.total(4) <= 79.5 * GiB < p.total(5)
    short = zero_wam_memory.plan(zero_wam_memory.ROBOTWIN_SHORT)
    assert p.kv_session - short.kv_session == 16 * 150 * TOKEN  # the bound, not each demonstration, is what a session costs
    assert short.sessions_on(int(140.5 * GiB)) == 10
