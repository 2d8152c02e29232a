"""Zero-WAM's full-size memory plan (ardiff_policies.lingbot_va.zero_wam_memory): the cache counted as upstream keeps
it, the weights as loaded, and the rows scripts/memory_plan.py prints for 80 and 141 GiB cards."""

from __future__ import annotations

import dataclasses

from ardiff_policies.lingbot_va import zero_wam_memory
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.lingbot_va.zero_wam_model import parameter_count
from ardiff_policies.wan.memory import GiB


def test_the_cache_is_upstreams_by_kind():
    # three 224x288 cameras side by side: a 14x54 latent frame, 7x27 tokens; 2-frame chunks of 16 actions
    g = zero_wam_memory.ROBOTWIN
    assert (g.video_tokens_per_chunk, g.action_tokens_per_chunk, g.demonstration_tokens) == (378, 32, 32 * 10 * 15)
    # window 64 frame ids = 32 chunks; with CFG the video in both halves, the actions in the conditional one only
    assert g.cached_tokens(64) == {"in-context": 4800, "observation": 32 * (2 * 378 + 32), "prediction": 2 * 378}
    assert zero_wam_memory.ROBOTWIN_NO_CFG.cached_tokens(64) == {"in-context": 4800, "observation": 32 * (378 + 32), "prediction": 378}


def test_weights_are_the_served_parameters_in_bf16():
    p = zero_wam_memory.plan(zero_wam_memory.ROBOTWIN)
    assert p.weights["transformer"] == 2 * parameter_count(ZeroWAMConfig())
    assert 17.0 < p.weights["transformer"] / GiB < 17.7  # 9.41 B: the MCP heads are not loaded


def test_sessions_on_80_and_141_gib():
    p = zero_wam_memory.plan(zero_wam_memory.ROBOTWIN)
    assert round(p.kv_session / GiB, 2) == 10.56  # 30,776 tokens x 30 layers x K,V x 3072 x 2 bytes
    assert (p.sessions_on(int(79.5 * GiB)), p.sessions_on(int(140.5 * GiB))) == (4, 9)
    assert p.total(4) <= 79.5 * GiB < p.total(5)
    longer = zero_wam_memory.plan(dataclasses.replace(zero_wam_memory.ROBOTWIN, max_demonstration_frames=64))
    assert longer.kv_session - p.kv_session == 32 * 150 * 2 * 30 * 3072 * 2  # a longer bound costs every session
