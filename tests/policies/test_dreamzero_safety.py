"""The safety gate in the tiny DreamZero (policy.safety): off changes nothing, clamp limits and reports, frozen rows
are never altered, and a reject leaves the session as if the call never came (its KV pages too)."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_kv import PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.continuation import Continuation
from ardiff_policies.dreamzero.policy import DreamZeroConfig, DreamZeroPolicy
from ardiff_policies.errors import StartRefused
from ardiff_policies.observation import RobotObservation
from ardiff_policies.safety import SafetyRejected
from tests.helpers.dreamzero import TINY, make_policy, observations

FAST = {"num_inference_steps": 2, "dit_step_cache": "off"}
# Loose enough for the tiny model's chunks (its gripper actions are inside [0, 1]); a gripper state of 50 breaks it.
GRIPPER_FIRST = {"gripper_position": {"max_first_step": 2.0}}


def with_state(observation: RobotObservation, **states) -> RobotObservation:
    return RobotObservation(
        cameras=observation.cameras,
        states={**observation.states, **{k: np.asarray(v, np.float32) for k, v in states.items()}},
        prompt=observation.prompt,
        continuation=observation.continuation,
    )


def with_prompt(observation: RobotObservation, prompt: str) -> RobotObservation:
    return RobotObservation(cameras=observation.cameras, states=observation.states, prompt=prompt, continuation=observation.continuation)


def with_continuation(observation: RobotObservation, continuation: Continuation) -> RobotObservation:
    return RobotObservation(cameras=observation.cameras, states=observation.states, prompt=observation.prompt, continuation=continuation)


def open_session(policy, cache, session_id):
    return policy.start_session(session_id, cache.open_session(session_id))


def test_the_gate_off_by_default_changes_nothing_and_a_passing_gate_changes_no_action(tiny_model):
    obs = list(observations(3))
    plain, cache = make_policy(tiny_model, **FAST)
    gated, gated_cache = make_policy(tiny_model, **FAST, safety={"mode": "reject", "limits": GRIPPER_FIRST})
    assert plain.gate is None and plain.info.details["safety"] == {"mode": "off"}
    a, b = open_session(plain, cache, "a"), open_session(gated, gated_cache, "b")
    for o in obs:
        ours, theirs = plain.step(a, o), gated.step(b, o)
        assert "safety" not in ours.info
        assert theirs.info["safety"] == {"mode": "reject", "clamped": {}}
        np.testing.assert_array_equal(ours.actions, theirs.actions)
    assert gated.info.details["safety"]["limits"] == GRIPPER_FIRST


def test_clamp_limits_the_chunk_reports_it_and_the_session_continues_the_clamped_chunk(tiny_model):
    limits = {"joint_position": {"max_step": 0.001}, "gripper_position": {"max_first_step": 0.01}}
    policy, cache = make_policy(tiny_model, **FAST, safety={"mode": "clamp", "limits": limits})
    raw_policy, raw_cache = make_policy(tiny_model, **FAST)
    obs = next(observations(1))
    session = open_session(policy, cache, "s")
    result = policy.step(session, obs)
    raw = raw_policy.step(open_session(raw_policy, raw_cache, "r"), obs)
    assert not np.allclose(raw.actions, result.actions)  # the limits bite
    assert np.all(np.abs(np.diff(result.actions[:, :7], axis=0)) <= 0.001 + 1e-5)
    assert abs(result.actions[0, 7] - 0.3) <= 0.01 + 1e-6
    clamped = result.info["safety"]["clamped"]
    assert set(clamped) == {"step", "first"} and clamped["step"]["values"] > 0
    np.testing.assert_array_equal(session.last_chunk.actions, result.actions)  # what a continuation continues


def test_clamp_never_alters_a_continuations_frozen_rows(tiny_model):
    obs = list(observations(2))
    policy, cache = make_policy(tiny_model, **FAST)
    session = open_session(policy, cache, "s")
    first = policy.step(session, obs[0])
    # A gate that would clamp everything: the frozen rows still come back exactly as the last chunk's.
    gated, gated_cache = make_policy(
        tiny_model, **FAST, safety={"mode": "clamp", "limits": {"joint_position": {"max_first_step": 1e-4, "max_step": 1e-4}}}
    )
    g = open_session(gated, gated_cache, "g")
    gated_first = gated.step(g, obs[0])
    continued = gated.step(g, with_continuation(obs[1], Continuation(executed=2, delay=3)))
    assert continued.chunk.frozen == 3
    np.testing.assert_array_equal(continued.actions[:3], gated_first.actions[2:5])
    assert np.all(np.abs(np.diff(continued.actions[2:, :7], axis=0)) <= 1e-4 + 1e-5)  # the rest from the last frozen row on
    assert first.actions.shape == continued.actions.shape


@pytest.mark.parametrize("when", ["first_call", "steady", "prompt_change"])
def test_a_reject_leaves_the_session_as_if_the_call_never_came(tiny_model, when):
    obs, other = list(observations(3)), list(observations(2, seed=7))  # the rejected call brings frames of its own
    policy, cache = make_policy(tiny_model, **FAST, safety={"mode": "reject", "limits": GRIPPER_FIRST})
    rejected, clean = open_session(policy, cache, "rejected"), open_session(policy, cache, "clean")
    if when == "first_call":  # a fresh session: nothing of it may stay (its cross-attention K/V included)
        bad, after = with_state(other[0], gripper_position=[50.0]), obs[:2]
    else:
        policy.step(rejected, obs[0])
        policy.step(clean, obs[0])
        bad, after = with_state(other[1], gripper_position=[50.0]), obs[1:]
        if when == "prompt_change":  # the rejected call also started a window: it rewrote the cross-attention K/V
            bad = with_prompt(bad, "stack the blocks")
    pages_held, pages_free = rejected.kv.pages_held, cache.stats()["pages_free"]
    with pytest.raises(SafetyRejected, match=r"^safety gate: first: gripper_position\[0\]: the first action is .* from the observed state, limit 2"):
        policy.step(rejected, bad)
    assert rejected.kv.pages_held == pages_held and cache.stats()["pages_free"] == pages_free  # its pages went back
    assert not rejected.kv.has_snapshot
    assert (rejected.calls, rejected.chunks, rejected.current_start_frame) == (clean.calls, clean.chunks, clean.current_start_frame)
    for o in after:
        ours, theirs = policy.step(rejected, o), policy.step(clean, o)
        np.testing.assert_array_equal(ours.actions, theirs.actions)
        assert ours.chunk.chunk_id == theirs.chunk.chunk_id


def test_a_reject_in_a_batch_costs_only_its_own_call(tiny_model):
    obs = list(observations(2))
    policy = DreamZeroPolicy(
        DreamZeroConfig(**TINY, **FAST, safety={"mode": "reject", "limits": GRIPPER_FIRST}), RuntimeOptions(max_batch=2), model=tiny_model
    )
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=2 * len(policy.branches) * spec.pages_per_branch + 1, max_sessions=2, branches=policy.branches, max_batch=2)
    a, b = open_session(policy, cache, "a"), open_session(policy, cache, "b")
    policy.step_batch([(a, obs[0]), (b, obs[0])])
    results = policy.step_batch([(a, with_state(obs[1], gripper_position=[50.0])), (b, obs[1])])
    assert isinstance(results[0], SafetyRejected) and results[1].chunk.chunk_id == 2
    assert a.chunks == 1 and not a.kv.has_snapshot and not b.kv.has_snapshot


def test_a_gate_on_a_key_that_is_no_position_fails_at_start_up_naming_it(tiny_model):
    with pytest.raises(StartRefused, match=r"policy\.safety\.limits\.cartesian_position: embodiment oxe_droid has no action key"):
        make_policy(tiny_model, safety={"mode": "clamp", "limits": {"cartesian_position": {"max_step": 0.1}}})
