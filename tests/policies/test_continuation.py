"""Chunks that continue the one being executed: frozen prefix, re-anchoring, fresh-chunk reasons, batching.

The reference for the frozen prefix is the previous reply itself (what the robot executes); for the
soft mask, RTC's formula written out here; for batching, each session alone (fp32, <= 1e-5).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from ardiff_policies.continuation import (
    APPLIED,
    NO_PREVIOUS_CHUNK,
    PROMPT_CHANGE,
    UNKNOWN_CHUNK_ID,
    Continuation,
    soft_mask,
)
from ardiff_policies.dreamzero import continuation
from ardiff_policies.dreamzero.config import DreamZeroConfig
from ardiff_policies.dreamzero.model import DreamZeroModel
from ardiff_policies.dreamzero.tiny import ensure_tiny_checkpoint
from ardiff_policies.dreamzero.transforms import NormStats, denormalize_actions
from ardiff_policies.observation import RobotObservation
from tests.helpers.dreamzero import batched, each_alone, make_policy, observations

ATOL = 1e-5


def continued(observation: RobotObservation, executed: int, delay: int, chunk_id: int | None = None) -> RobotObservation:
    return RobotObservation(
        cameras=observation.cameras,
        states=observation.states,
        prompt=observation.prompt,
        continuation=Continuation(executed, delay, chunk_id),
    )


# ----------------------------------------------------------------------------- torch-free parts


def test_soft_mask_is_rtcs_exponential_prefix_weights():
    horizon, d, end = 24, 4, 18
    w = soft_mask(horizon, d, end)
    assert (w[:d] == 1).all() and (w[end:] == 0).all()
    for i in range(d, end):  # Black et al. 2025, eq. 5: c_i (e^c_i - 1) / (e - 1), c_i = (H - s - i) / (H - s - d + 1)
        c = (end - i) / (end - d + 1)
        assert w[i] == pytest.approx(c * (math.exp(c) - 1) / (math.e - 1), abs=1e-15)
    assert (np.diff(w[d - 1 : end + 1]) < 0).all()  # strictly decaying from 1 to 0
    assert (soft_mask(8, 3, 2) == np.array([1, 1, 1, 0, 0, 0, 0, 0])).all()  # end before d: only the frozen ones


def test_inpaint_ends_on_the_replacement_at_noise_level_zero():
    """The last sampler step moves every free row by the model's velocity alone: inpaint's final actions are the
    soft-masked replacement at sigma 0 (frozen rows exactly the target, the overlap pulled by its weight, the rest
    the model's); clean_prefix and guided only pin the frozen rows."""
    horizon, d = 8, 2
    weights = torch.from_numpy(soft_mask(horizon, d, 6)).reshape(1, horizon, 1).float()
    target, denoised = torch.randn(1, horizon, 3), torch.randn(1, horizon, 3)
    for mode in ("inpaint", "clean_prefix", "guided"):
        plan = continuation.ContinuationPlan(frozen=d, mode=mode, target=target, weights=weights, executed_actions=np.zeros((d, 3)))
        out = continuation.after_denoising(plan, denoised)
        assert torch.equal(out[:, :d], target[:, :d])
        expected = denoised + weights * (target - denoised) if mode == "inpaint" else denoised
        torch.testing.assert_close(out[:, d:], expected[:, d:], rtol=0, atol=1e-7)
    assert not torch.equal(continuation.after_denoising(plan, denoised)[:, d:4], (denoised + weights * (target - denoised))[:, d:4])


@pytest.mark.parametrize(
    "continuation, message",
    [
        (Continuation(-1, 2), "continuation.executed: expected an integer >= 0"),
        (Continuation(1, -2), "continuation.delay: expected an integer >= 0"),
        (Continuation(1.5, 2), "continuation.executed: expected an integer >= 0"),  # type: ignore[arg-type]
        (Continuation(20, 5), "continuation.executed + continuation.delay = 20 + 5 is past the 24-action chunk"),
    ],
)
def test_bad_continuations_name_the_field(continuation, message):
    with pytest.raises(ValueError, match="^" + message.replace("+", r"\+")):
        continuation.check(24)
    Continuation(20, 4).check(24)


def test_reanchoring_keeps_absolute_targets_for_relative_keys_and_values_for_absolute_ones():
    """DROID: joints (columns 0-6) relative to the joint state, the gripper (7) absolute; the DiT predicts 32 columns."""
    rng = np.random.default_rng(0)
    stats = NormStats(rng.uniform(-2, -1, 8), rng.uniform(1, 2, 8))
    stats.q99[3] = stats.q01[3]  # a constant dimension: its model value is kept
    relative = [((0, 7), (0, 7))]
    model = torch.from_numpy(rng.uniform(-1, 1, (1, 24, 32)))
    old_state, new_state = rng.uniform(-1, 1, 8), rng.uniform(-1, 1, 8)
    absolute = denormalize_actions(model[0].numpy(), stats)
    absolute[:, :7] += old_state[:7]
    last = continuation.LastChunk(3, model, absolute.astype(np.float32), old_state)
    out = continuation.reanchor(last, 5, new_state, stats, relative)
    assert out.shape == (19, 32)
    back = denormalize_actions(out, stats)
    back[:, :7] += new_state[:7]
    moving = [c for c in range(8) if c != 3]
    np.testing.assert_allclose(back[:, moving], last.actions[5:, moving].astype(np.float64), atol=1e-12)  # targets do not move
    np.testing.assert_allclose(out[:, 7], model[0, 5:, 7].numpy(), atol=1e-6)  # absolute gripper: same model value
    assert (out[:, 8:] == model[0, 5:, 8:].numpy()).all()  # padding columns and the constant one keep their values
    assert (out[:, 3] == model[0, 5:, 3].numpy()).all()
    joints = [0, 1, 2, 4, 5, 6]  # relative joints move by the state change, in model units
    shifted = out[:, joints] - model[0, 5:, joints].numpy()
    expected = 2 * (old_state[joints] - new_state[joints]) / (stats.q99 - stats.q01)[joints]
    np.testing.assert_allclose(shifted, np.broadcast_to(expected, shifted.shape), atol=1e-6)


# ------------------------------------------------------------------------------- the policy


@pytest.fixture(scope="module")
def policies(tiny_model):
    modes = ("inpaint", "clean_prefix", "guided")
    return {mode: make_policy(tiny_model, continuation=mode, dit_step_cache="off", num_inference_steps=4) for mode in modes}


@pytest.mark.parametrize("mode", ["inpaint", "clean_prefix", "guided"])
def test_frozen_actions_come_back_as_the_robot_executes_them(policies, mode):
    policy, cache = policies[mode]
    obs = list(observations(3, seed=1))
    session = policy.start_session(f"f-{mode}", cache.open_session(f"f-{mode}"))
    first = policy.step(session, obs[0])
    assert (first.chunk.chunk_id, first.chunk.frozen) == (1, 0) and first.chunk.continuation is None
    second = policy.step(session, continued(obs[1], executed=5, delay=4, chunk_id=1))
    assert (second.chunk.chunk_id, second.chunk.frozen, second.chunk.continuation) == (2, 4, APPLIED)
    assert np.array_equal(second.actions[:4], first.actions[5:9])  # bit for bit
    assert not np.allclose(second.actions[4:15], first.actions[9:20], atol=1e-3)  # the rest is the model's
    third = policy.step(session, continued(obs[2], executed=0, delay=24))  # no chunk_id: the last chunk
    assert third.chunk.frozen == 24 and np.array_equal(third.actions, second.actions)
    policy.end_session(session)
    cache.end_session(session.kv)
    assert session.last_chunk is None


@pytest.mark.parametrize("mode", ["inpaint", "clean_prefix", "guided"])
def test_the_action_sampler_converts_the_sample_the_dit_saw(policies, monkeypatch, mode):
    """In every denoising step the sample UniPC converts to x0 (``x0 = x - sigma v``, diffusers'
    ``convert_model_output``) is the DiT's action input. Under inpaint that is f(x), the soft-masked replacement
    applied once, not f(f(x)): frozen (f idempotent) and free rows (f the identity) cannot tell the two apart,
    the soft rows (0 < w < 1) can."""
    from diffusers import UniPCMultistepScheduler

    policy, cache = policies[mode]
    obs = list(observations(2, seed=5))
    session = policy.start_session(f"soft-{mode}", cache.open_session(f"soft-{mode}"))
    policy.step(session, obs[0])
    dit_inputs: list[torch.Tensor] = []
    converted: list[torch.Tensor] = []

    def record_dit_input(module, args, kwargs):
        if kwargs.get("action") is not None:  # a denoise forward (the commit forward carries no actions)
            dit_inputs.append(kwargs["action"].detach().clone())

    convert = UniPCMultistepScheduler.convert_model_output

    def record_converted(self, model_output, *args, sample=None, **kwargs):
        if sample.ndim == 3:  # the action sampler's (1, H, action dim); the video sampler's latents are 5-d
            converted.append(sample.detach().clone())
        return convert(self, model_output, *args, sample=sample, **kwargs)

    monkeypatch.setattr(UniPCMultistepScheduler, "convert_model_output", record_converted)
    hook = policy.dit.register_forward_pre_hook(record_dit_input, with_kwargs=True)
    try:
        result = policy.step(session, continued(obs[1], executed=5, delay=4, chunk_id=1))
    finally:
        hook.remove()
        policy.end_session(session)
        cache.end_session(session.kv)
    assert result.chunk.frozen == 4
    weights = soft_mask(24, 4, 24 - 5)
    soft = np.flatnonzero((weights > 0) & (weights < 1))
    assert len(soft) == 15  # rows [4, 19) are soft
    assert len(dit_inputs) == len(converted) == 4  # one forward and one conversion per step (step cache off)
    for seen, stepped in zip(dit_inputs, converted, strict=True):
        assert seen.shape == (len(policy.branches), 24, stepped.shape[-1])  # the call's actions, once per CFG branch
    gaps = [round((seen - stepped).abs()[:, soft].max().item(), 4) for seen, stepped in zip(dit_inputs, converted)]
    assert max(gaps) == 0.0, f"per step, the sample the sampler converted lies {gaps} from the DiT's action input on the soft rows"
    assert all(torch.equal(seen, stepped.expand_as(seen)) for seen, stepped in zip(dit_inputs, converted))


def test_guided_continues_by_the_velocity_not_by_replacing_the_actions(policies):
    """RTC's guidance (a VJP through the DiT per step) gives its own chunk: same frozen rows as inpaint, other free rows;
    a call without a continuation in a guided policy is today's chunk, bit for bit."""
    obs = list(observations(2, seed=4))
    chunks = {}
    for mode in ("inpaint", "guided"):
        policy, cache = policies[mode]
        session = policy.start_session(f"g-{mode}", cache.open_session(f"g-{mode}"))
        chunks[mode] = [policy.step(session, obs[0]).actions, policy.step(session, continued(obs[1], 3, 5)).actions]
        policy.end_session(session)
        cache.end_session(session.kv)
    assert np.array_equal(chunks["guided"][0], chunks["inpaint"][0])
    assert np.array_equal(chunks["guided"][1][:5], chunks["inpaint"][1][:5])
    assert np.abs(chunks["guided"][1][5:] - chunks["inpaint"][1][5:]).max() > 1e-3


def test_guided_is_refused_where_its_backward_cannot_run():
    cpu = torch.device("cpu")
    continuation.check_mode("guided", device=cpu, cfg_parallel=False, cuda_graphs=False, compiled=False)
    continuation.check_mode("inpaint", device=torch.device("cuda"), cfg_parallel=True, cuda_graphs=True, compiled=True)
    for blocker, kwargs in (
        ("a CUDA device", {"device": torch.device("cuda")}),
        ("CFG-parallel", {"cfg_parallel": True}),
        ("CUDA graphs", {"cuda_graphs": True}),
        ("torch.compile", {"compiled": True}),
    ):
        settings = {"device": cpu, "cfg_parallel": False, "cuda_graphs": False, "compiled": False, **kwargs}
        with pytest.raises(ValueError, match=f"^policy.continuation: guided runs on the CPU path only .* not with {blocker}; use"):
            continuation.check_mode("guided", **settings)


def test_an_execution_horizon_clean_prefix_does_not_use_is_refused_at_start_up():
    """RTC's s only shapes the soft mask of inpaint and guided; clean_prefix pins the frozen actions alone, so a set
    ``continuation_execution_horizon`` there would be silently ignored: the config is refused naming it."""
    from ardiff_server.config import ConfigError, validate_config

    policy = {"name": "dreamzero", "continuation": "clean_prefix", "continuation_execution_horizon": 4}
    with pytest.raises(ConfigError, match=r"policy: .*continuation_execution_horizon: 4 .* clean_prefix does not use"):
        validate_config({"policy": policy})
    for mode in ("inpaint", "guided"):
        assert validate_config({"policy": {**policy, "continuation": mode}}).policy_options().continuation_execution_horizon == 4
    assert validate_config({"policy": {**policy, "continuation_execution_horizon": None}}).policy_options().continuation == "clean_prefix"


def test_guidance_weight_is_rtcs_clipped_schedule():
    assert continuation.guidance_weight(1.0) == continuation.guidance_weight(0.0) == continuation.GUIDANCE_MAX_WEIGHT == 5.0
    tau = 0.3  # Black et al. 2025: min(beta, (1 - tau) / (tau r^2)), r^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2), sigma = 1 - tau
    r2 = (1 - tau) ** 2 / (tau**2 + (1 - tau) ** 2)
    assert continuation.guidance_weight(1 - tau) == pytest.approx(min(5.0, (1 - tau) / (tau * r2)), abs=1e-12)
    assert continuation.guidance_weight(0.5) == pytest.approx(2.0)


def test_a_continuation_that_cannot_apply_is_a_fresh_chunk_and_says_why(policies, tiny_model):
    policy, cache = policies["inpaint"]
    obs = list(observations(3, seed=2))
    plain = policy.start_session("plain", cache.open_session("plain"))
    reference = [policy.step(plain, o) for o in obs[:2]]
    session = policy.start_session("fresh", cache.open_session("fresh"))
    first = policy.step(session, continued(obs[0], 2, 2))
    assert (first.chunk.frozen, first.chunk.continuation) == (0, NO_PREVIOUS_CHUNK)
    assert np.array_equal(first.actions, reference[0].actions)  # served exactly as without the field
    unknown = policy.step(session, continued(obs[1], 2, 2, chunk_id=7))
    assert (unknown.chunk.frozen, unknown.chunk.continuation) == (0, UNKNOWN_CHUNK_ID)
    assert np.array_equal(unknown.actions, reference[1].actions)
    changed = RobotObservation(cameras=obs[2].cameras, states=obs[2].states, prompt="wipe the table", continuation=Continuation(1, 1))
    assert policy.step(session, changed).chunk.continuation == PROMPT_CHANGE
    policy.end_session(session)  # a reset: the session ends, the robot's next call starts a new one
    cache.end_session(session.kv)
    session = policy.start_session("fresh", cache.open_session("fresh"))
    after_reset = policy.step(session, continued(obs[0], 2, 2))
    assert (after_reset.chunk.frozen, after_reset.chunk.continuation) == (0, NO_PREVIOUS_CHUNK)
    assert np.array_equal(after_reset.actions, reference[0].actions)
    for s in (plain, session):
        policy.end_session(s)
        cache.end_session(s.kv)


RESTART_CALL = 4  # the tiny DiT's window holds 1 + 2 + 2 + 2 latent frames: the fifth call restarts it


@pytest.mark.parametrize("mode", ["inpaint", "clean_prefix", "guided"])
def test_a_continuation_across_a_window_restart_continues_the_last_chunk(policies, mode):
    """The window restart restarts the video context only: the call still continues the last chunk (its frozen rows
    bit for bit as the robot executes them, re-anchored to the new state), and the chunk after it continues it in turn.
    Its free rows are the continuation's, not the fresh chunk the same call makes without one."""
    policy, cache = policies[mode]
    obs = list(observations(RESTART_CALL + 2, seed=6))
    session = policy.start_session(f"r-{mode}", cache.open_session(f"r-{mode}"))
    replies = [policy.step(session, obs[0])]
    for o in obs[1:]:
        replies.append(policy.step(session, continued(o, executed=3, delay=5, chunk_id=replies[-1].chunk.chunk_id)))
    plain = policy.start_session(f"r-plain-{mode}", cache.open_session(f"r-plain-{mode}"))
    fresh = [policy.step(plain, o) for o in obs[: RESTART_CALL + 1]]
    for s in (session, plain):
        policy.end_session(s)
        cache.end_session(s.kv)
    assert [r.info["window_restart"] for r in replies] == [False] * RESTART_CALL + [True, False]
    for before, after in itertools.pairwise(replies):
        assert (after.chunk.frozen, after.chunk.continuation) == (5, APPLIED)
        assert after.chunk.chunk_id == before.chunk.chunk_id + 1
        assert np.array_equal(after.actions[:5], before.actions[3:8])  # bit for bit, across the restart too
    restart = replies[RESTART_CALL]
    assert fresh[RESTART_CALL].info["window_restart"] and "continuation" not in fresh[RESTART_CALL].info
    assert np.abs(restart.actions[5:] - fresh[RESTART_CALL].actions[5:]).max() > 1e-3  # the rest continues too


@pytest.mark.parametrize("mode", ["inpaint", "clean_prefix", "guided"])
def test_continuations_across_a_window_restart_batch_and_equal_their_unbatched_results(tiny_model, mode):
    """A batch holding a session whose window restarts under a continuation beside one that continues in a steady
    window and one without continuations equals each session alone (fp32, <= 1e-5)."""
    policy, cache = make_policy(
        tiny_model, max_batch=3, max_sessions=6, continuation=mode, num_inference_steps=4, dit_step_mask=[True, False, True, True]
    )
    calls = RESTART_CALL + 2
    requests = {  # a: continues, its window restarts in batch RESTART_CALL; c: joins one batch later; b: ordinary
        "a": [o if i == 0 else continued(o, 2, 6) for i, o in enumerate(observations(calls, seed=7))],
        "b": list(observations(calls, seed=8)),
        "c": [o if i == 0 else continued(o, 4, 3) for i, o in enumerate(observations(calls - 1, seed=9))],
    }
    alone = each_alone(policy, cache, requests)
    together = batched(policy, cache, requests, joins={"c": 1})
    for name in requests:
        for result, reference in zip(together[name], alone[name], strict=True):
            np.testing.assert_allclose(result.actions, reference.actions, atol=ATOL, rtol=0)
            assert (result.chunk.frozen, result.chunk.chunk_id, result.info["window_restart"]) == (
                reference.chunk.frozen,
                reference.chunk.chunk_id,
                reference.info["window_restart"],
            )
    assert alone["a"][RESTART_CALL].info["window_restart"] and alone["a"][RESTART_CALL].chunk.frozen == 6
    assert alone["c"][RESTART_CALL].info["window_restart"] and alone["c"][RESTART_CALL].chunk.frozen == 3


@pytest.mark.parametrize("mode", ["inpaint", "clean_prefix", "guided"])
def test_continuations_batch_with_ordinary_calls_and_equal_their_unbatched_results(tiny_model, mode):
    policy, cache = make_policy(
        tiny_model, max_batch=3, max_sessions=6, continuation=mode, num_inference_steps=4, dit_step_mask=[True, False, True, True]
    )
    episodes = {name: list(observations(2, seed=seed)) for seed, name in enumerate("abc")}
    requests = {  # a: continues, b: ordinary, c: asks for a continuation that cannot apply (unknown chunk)
        "a": [episodes["a"][0], continued(episodes["a"][1], 3, 5)],
        "b": episodes["b"],
        "c": [episodes["c"][0], continued(episodes["c"][1], 3, 5, chunk_id=9)],
    }
    alone = each_alone(policy, cache, requests)
    together = batched(policy, cache, requests)
    for name in requests:
        for result, reference in zip(together[name], alone[name], strict=True):
            np.testing.assert_allclose(result.actions, reference.actions, atol=ATOL, rtol=0)
            assert result.chunk.frozen == reference.chunk.frozen
    assert alone["a"][1].chunk.frozen == 5 and alone["c"][1].chunk.frozen == 0


@pytest.mark.parametrize("variant", ["tiny_agibot", "tiny_yam", "tiny_5b"])
def test_every_embodiment_and_family_continues_exactly(variant):
    from ardiff_kv import PagedKVCache
    from ardiff_policies.base import RuntimeOptions
    from ardiff_policies.dreamzero.policy import DreamZeroPolicy

    model = DreamZeroModel.load(ensure_tiny_checkpoint(variant=variant))
    policy = DreamZeroPolicy(
        DreamZeroConfig(checkpoint=f"builtin:{variant}", num_inference_steps=2, dit_step_cache="off"), RuntimeOptions(), model=model
    )
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=len(policy.branches) * spec.pages_per_branch + 1, max_sessions=1, branches=policy.branches)
    obs = list(policy.warmup_observations())[:2]
    rng = np.random.default_rng(3)
    states = [{k: rng.uniform(-1, 1, v.shape).astype(np.float32) for k, v in o.states.items()} for o in obs]
    session = policy.start_session("e", cache.open_session("e"))
    first = policy.step(session, RobotObservation(cameras=obs[0].cameras, states=states[0], prompt="fold the towel"))
    second = policy.step(
        session, RobotObservation(cameras=obs[1].cameras, states=states[1], prompt="fold the towel", continuation=Continuation(4, 6, 1))
    )
    assert second.chunk.frozen == 6 and np.array_equal(second.actions[:6], first.actions[4:10])
    assert policy.embodiment.relative_action_keys or variant == "tiny_5b"  # relative keys exercised where the embodiment has them
