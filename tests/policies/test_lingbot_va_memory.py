"""LingBot-VA's memory plan (``policies/lingbot_va/memory.py``) against the arithmetic of docs/lingbot-va.md."""

from __future__ import annotations

import torch

from ardiff_policies.lingbot_va import memory
from ardiff_policies.lingbot_va.embodiments import FRANKA, ROBOTWIN

GiB = 2**30


def test_a_sessions_kv_is_upstreams_window_in_both_branches():
    for embodiment, chunks, tokens in ((ROBOTWIN, 36, 240 + 32), (FRANKA, 15, 840 + 80)):
        plan = memory.plan("x", embodiment)
        # window tokens x (K, V) x 30 layers x 24 heads x 128 x 2 CFG branches x 2 bytes (bf16)
        assert plan.kv_session == chunks * tokens * 2 * 30 * 24 * 128 * 2 * 2
        assert plan.text_session == 30 * 2 * 2 * 512 * 3072 * 2  # every layer's [prompt, negative] K/V
    assert round(memory.plan("x", ROBOTWIN).kv_session / GiB, 1) == 6.7 and round(memory.plan("x", FRANKA).kv_session / GiB, 1) == 9.5


def test_weights_are_the_released_5b_umt5_xxl_and_wan22_vae():
    counts = memory.weight_counts()
    assert 4.9e9 < counts["transformer"] < 5.3e9  # Wan2.2-TI2V-5B blocks + the action stream
    assert 5.6e9 < counts["text_encoder"] < 5.8e9  # UMT5-XXL's encoder
    plan = memory.plan("x", ROBOTWIN)
    assert plan.weights["transformer"] == counts["transformer"] * 2  # bf16
    assert memory.plan("x", ROBOTWIN, dtype=torch.float32).weights["vae"] == 2 * plan.weights["vae"]
    assert plan.sessions_on(80 * GiB) == (80 * GiB - plan.fixed) // plan.per_session > 0
    assert plan.sessions_on(24 * GiB) == 0  # the weights alone need more than 21 GiB


def test_the_pools_reserved_pages_are_what_the_engine_keeps_free():
    """Scratch per batch slot and branch, and for batches of more than one the undo headroom: a budget of the plan's
    reserved bytes plus n sessions holds exactly n sessions in the engine's sizing (``PagedKVCache.sessions_for_budget``)."""
    from ardiff_kv import PagedKVCache
    from ardiff_policies.lingbot_va.episode import kv_spec

    spec = kv_spec(ROBOTWIN, memory.RELEASED, torch.bfloat16)
    alone, batched = memory.plan("x", ROBOTWIN), memory.plan("x", ROBOTWIN, max_batch=4)
    assert alone.kv_reserved == 2 * spec.scratch_pages_per_branch * spec.page_bytes  # no retry for a batch of one
    assert batched.kv_reserved == 4 * 2 * (spec.scratch_pages_per_branch + spec.undo_pages) * spec.page_bytes
    assert batched.fixed - alone.fixed > batched.kv_reserved - alone.kv_reserved  # the activations grow with the batch too
    per_session = 2 * (spec.pages_per_branch * spec.page_bytes + spec.cross_slot_bytes)
    for plan, batch in ((alone, 1), (batched, 4)):
        budget = plan.kv_reserved + 3 * per_session
        assert PagedKVCache.sessions_for_budget(spec, budget, max_sessions=8, num_branches=2, max_batch=batch) == 3
        assert PagedKVCache.sessions_for_budget(spec, budget - 1, max_sessions=8, num_branches=2, max_batch=batch) == 2


def test_start_up_logs_the_plan_of_the_model_as_loaded(caplog):
    """The worker's log has LingBot-VA's plan as DreamZero's has its own: weights as loaded, a session's KV and prompt K/V."""
    from ardiff_policies.base import RuntimeOptions
    from ardiff_policies.lingbot_va.config import LingBotVAConfig
    from ardiff_policies.lingbot_va.policy import build_lingbot_va
    from ardiff_policies.wan.memory import module_size

    with caplog.at_level("INFO", logger="ardiff_policies.lingbot_va.policy"):
        served = build_lingbot_va(LingBotVAConfig(checkpoint="builtin:tiny", embodiment="tiny_robotwin"), RuntimeOptions(max_sessions=3))
    text = caplog.text
    assert "memory plan: lingbot_va on cpu (float32), 2 CFG branch(es)" in text
    transformer_mib = module_size(served.episodes.transformer).floating * 4 / 2**20
    assert "transformer weights" in text and f"{transformer_mib:.1f} MiB" in text
    spec = served.episodes.kv_spec()
    assert f"(KV {spec.pages_per_branch} pages x 2 branch(es)" in text and "engine.max_sessions 3:" in text
