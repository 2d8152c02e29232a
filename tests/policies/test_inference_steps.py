"""Per-request denoising steps (DreamZero): honoured and reported, refused out of bounds by name, the DiT step cache
carried over to the step count, batches of mixed step counts equal each session alone, the wire key."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ardiff_policies.continuation import Continuation
from ardiff_policies.dreamzero.config import UPSTREAM_STEP_MASK, DreamZeroConfig
from ardiff_policies.dreamzero.step_cache import THRESHOLDS, StepCache, resample_mask, scale_thresholds
from ardiff_policies.inference_steps import StepBounds
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from tests.helpers.dreamzero import batched, each_alone, make_policy, observations

ATOL = 1e-5


def with_steps(observation: RobotObservation, steps: int | None, continuation: Continuation | None = None) -> RobotObservation:
    return RobotObservation(
        cameras=observation.cameras, states=observation.states, prompt=observation.prompt, continuation=continuation, num_inference_steps=steps
    )


# ----------------------------------------------------------------------------- the step cache


def test_the_fixed_mask_keeps_its_share_of_the_schedule_at_another_step_count():
    assert resample_mask(UPSTREAM_STEP_MASK, 16) == tuple(UPSTREAM_STEP_MASK)
    assert resample_mask(UPSTREAM_STEP_MASK, 4) == (True,) * 4  # every quarter of the schedule holds a DiT step
    assert resample_mask(UPSTREAM_STEP_MASK, 8) == (True, True, False, True, False, True, True, True)
    assert resample_mask(UPSTREAM_STEP_MASK, 32) == tuple(m for m in UPSTREAM_STEP_MASK for _ in range(2))
    assert resample_mask([True, False, False, False], 3) == (True, False, False)
    assert StepCache.for_steps("fixed", UPSTREAM_STEP_MASK, 16, 16).mask == tuple(UPSTREAM_STEP_MASK)


def test_the_dynamic_rule_skips_the_same_share_of_a_calls_steps():
    assert scale_thresholds(16, 16) == THRESHOLDS == StepCache.for_steps("dynamic", None, 16, 16).thresholds
    assert scale_thresholds(16, 8) == ((0.95, 2), (0.93, 1))
    assert scale_thresholds(16, 4) == ((0.95, 1),)  # skipping 2 x 4 / 16 = 0.5 steps is no rule
    assert scale_thresholds(16, 2) == ()
    assert StepCache.for_steps("off", UPSTREAM_STEP_MASK, 16, 4) == StepCache("off")


# ----------------------------------------------------------------------------- the policy


@pytest.fixture(scope="module")
def policy(tiny_model):
    return make_policy(tiny_model, num_inference_steps=4, dit_step_mask=[True, False, True, True])


def test_a_requests_steps_are_honoured_and_reported(tiny_model, policy):
    """A request with 2 steps denoises exactly as a server configured for 2 steps whose mask is the carried-over one
    ([T, F, T, T] at 2 steps: both run); a request without the key gets the configured 4 (3 DiT forwards)."""
    served, cache = policy
    reference, reference_cache = make_policy(tiny_model, num_inference_steps=2, dit_step_mask=[True, True])
    obs = list(observations(2, seed=11))
    results = {}
    for name, (p, c, steps) in {
        "asked": (served, cache, 2),
        "configured": (reference, reference_cache, None),
        "default": (served, cache, None),
    }.items():
        session = p.start_session(name, c.open_session(name))
        results[name] = [p.step(session, with_steps(o, steps)) for o in obs]
        p.end_session(session)
        c.end_session(session.kv)
    for asked, configured, default in zip(results["asked"], results["configured"], results["default"], strict=True):
        assert np.array_equal(asked.actions, configured.actions)
        assert (asked.info["num_inference_steps"], asked.info["dit_forwards"]) == (2, 2)
        assert (default.info["num_inference_steps"], default.info["dit_forwards"]) == (4, 3)
        assert np.abs(asked.actions - default.actions).max() > 1e-3
    assert served.info.inference_steps == {"num_inference_steps": StepBounds(1, 4, "policy.request_inference_steps")}
    assert served.info.details["request_inference_steps"] == [1, 4]


def test_steps_out_of_bounds_are_refused_naming_the_bound(tiny_model, policy):
    served, _ = policy
    obs = next(observations(1, seed=12))
    with pytest.raises(
        UnsupportedObservation,
        match=r"^num_inference_steps: 5 is above the maximum 4 this server takes \(policy\.request_inference_steps: \[1, 4\]\)$",
    ):
        served.check_observation(with_steps(obs, 5))
    with pytest.raises(UnsupportedObservation, match=r"^num_inference_steps: expected an integer, got 2\.0$"):
        served.check_observation(with_steps(obs, 2.0))  # type: ignore[arg-type]
    served.check_observation(with_steps(obs, 4))
    wider, _ = make_policy(tiny_model, num_inference_steps=4, dit_step_cache="off", request_inference_steps=(2, 8))
    with pytest.raises(UnsupportedObservation, match=r"^num_inference_steps: 1 is below the minimum 2 .*\[2, 8\]\)$"):
        wider.check_observation(with_steps(obs, 1))
    wider.check_observation(with_steps(obs, 8))
    with pytest.raises(ValueError, match=r"request_inference_steps: expected \[min, max\] with min <= max <= 1000, got \[5, 3\]"):
        DreamZeroConfig(request_inference_steps=(5, 3))


def test_a_batch_of_mixed_step_counts_equals_each_session_alone(tiny_model):
    """Sessions asking for 2, 3 and the configured 4 steps (one of them continuing its chunk) in one batch: each
    step count denoises in its own lockstep group, every result is the session's alone (fp32, <= 1e-5)."""
    policy, cache = make_policy(tiny_model, max_batch=4, max_sessions=8, num_inference_steps=4, dit_step_cache="dynamic")
    steps = {"a": 2, "b": None, "c": 3, "d": 2}
    requests = {
        name: [with_steps(o, steps[name], Continuation(3, 4) if name == "d" and i else None) for i, o in enumerate(observations(2, seed=20 + k))]
        for k, name in enumerate(steps)
    }
    alone = each_alone(policy, cache, requests)
    together = batched(policy, cache, requests)
    for name in requests:
        for result, reference in zip(together[name], alone[name], strict=True):
            np.testing.assert_allclose(result.actions, reference.actions, atol=ATOL, rtol=0)
            for key in ("num_inference_steps", "dit_forwards"):
                assert result.info[key] == reference.info[key], (name, key)
            assert result.chunk.frozen == reference.chunk.frozen, name
    assert [alone[name][1].info["num_inference_steps"] for name in steps] == [2, 4, 3, 2]
    assert alone["d"][1].chunk.frozen == 4


# ----------------------------------------------------------------------------- the wire


def test_the_wire_key_is_decoded_where_the_policy_takes_it_and_refused_by_name_elsewhere():
    from ardiff_server.wire.decode import RequestError, decode_request

    request = dict(next(iter(_droid_requests())), num_inference_steps=np.int64(4))
    observation = decode_request(request, inference_steps=("num_inference_steps",)).observation
    assert observation.num_inference_steps == 4 and type(observation.num_inference_steps) is int
    assert pickle.loads(pickle.dumps(observation)).num_inference_steps == 4  # the engine's seam keeps it
    assert (
        decode_request(
            {k: v for k, v in request.items() if k != "num_inference_steps"}, inference_steps=("num_inference_steps",)
        ).observation.num_inference_steps
        is None
    )
    with pytest.raises(RequestError, match=r"^num_inference_steps: this server's policy takes no per-request denoising steps; leave it out$"):
        decode_request(request)
    for bad in (0, True, 2.5, "4"):
        with pytest.raises(RequestError, match=r"^num_inference_steps: expected an integer >= 1, got "):
            decode_request({**request, "num_inference_steps": bad}, inference_steps=("num_inference_steps",))


def _droid_requests():
    rng = np.random.default_rng(0)
    image = lambda: rng.integers(0, 256, (180, 320, 3), dtype=np.uint8)  # noqa: E731
    yield {
        "observation/exterior_image_0_left": image(),
        "observation/exterior_image_1_left": image(),
        "observation/wrist_image_left": image(),
        "observation/joint_position": np.zeros(7, np.float32),
        "observation/gripper_position": np.zeros(1, np.float32),
        "prompt": "pick up the cup",
        "session_id": "s",
    }
