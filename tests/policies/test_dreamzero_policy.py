"""The DreamZero policy on the tiny checkpoint: the AR rollout, resets, KV lifecycle, CFG."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from ardiff_kv import Branch, PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.dreamzero.policy import DreamZeroConfig, DreamZeroPolicy
from ardiff_policies.guidance import Guidance
from ardiff_policies.observation import RobotObservation
from tests.helpers.dreamzero import TINY, ThreadPair, make_policy, observations, rollout


def test_thirteen_call_rollout_walks_the_window_and_frees_every_page(tiny_model):
    policy, cache = make_policy(tiny_model)
    session, results = rollout(policy, cache, observations(13))
    frames = [r.info["current_start_frame"] for r in results]
    assert frames == [3, 5, 7, 9] * 3 + [3]  # 0 -> 3 -> 5 -> 7 -> 9 -> (window restart) ...
    assert [r.info["window_restart"] for r in results] == [False] * 4 + [True, False, False, False] * 2 + [True]
    for r in results:
        assert r.actions.shape == (24, 8) and r.actions.dtype == np.float32 and np.isfinite(r.actions).all()
        assert set(r.timing_ms) == {"frames", "text", "vision", "vae", "prefill", "denoise", "decode"}
    assert results[0].info["dit_forwards"] == 8  # upstream's default fixed step mask runs 8 of 16
    # resident window before the window restart: 1 + 2 + 2 + 2 frames per branch
    assert len(session.kv.branch(Branch.COND).resident) == 1  # after the last restart: the first frame
    cache.end_session(session.kv)
    policy.end_session(session)
    assert cache.pool.num_free == cache.pool.capacity and cache.storage.cross.num_free == cache.storage.cross.num_slots


def test_repeated_rollouts_are_bit_identical(tiny_model):
    policy, cache = make_policy(tiny_model)
    _, first = rollout(policy, cache, observations(6), "a")
    _, second = rollout(policy, cache, observations(6), "b")
    for x, y in zip(first, second):
        assert np.array_equal(x.actions, y.actions)
    assert not np.array_equal(first[1].actions, first[2].actions)  # the observation matters


def test_a_failure_mid_forward_leaves_no_page_and_the_next_call_starts_clean(tiny_model, monkeypatch):
    policy, cache = make_policy(tiny_model)
    obs = list(observations(3))
    session, _ = rollout(policy, cache, obs[:2], "victim")
    held = session.kv.pages_held
    forward = policy.dit.forward
    calls = {"n": 0}

    def exploding(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # during the denoise loop of the third call
            raise RuntimeError("layer 17 exploded")
        return forward(*args, **kwargs)

    monkeypatch.setattr(policy.dit, "forward", exploding)
    with pytest.raises(RuntimeError, match="layer 17 exploded"):
        policy.step(session, obs[2])
    monkeypatch.setattr(policy.dit, "forward", forward)
    # the prefill of the failed call committed (2 frames per branch); the aborted forward holds nothing
    assert session.kv.pages_held == held + 4 and all(session.kv.branch(b).pending is None for b in Branch)
    # what the engine does on failure: tear the session down
    cache.end_session(session.kv)
    policy.end_session(session)
    assert cache.pool.num_free == cache.pool.capacity
    _, fresh = rollout(policy, cache, obs[:1], "victim")
    _, reference = rollout(policy, cache, obs[:1], "reference")
    assert np.array_equal(fresh[0].actions, reference[0].actions)


def test_a_changed_prompt_resets_the_session(tiny_model):
    policy, cache = make_policy(tiny_model)
    obs = list(observations(3))
    session, _ = rollout(policy, cache, obs[:2])
    other = RobotObservation(**{**obs[2].__dict__, "prompt": "open the drawer"})
    result = policy.step(session, other)
    assert result.info["prompt_change"] and result.info["current_start_frame"] == 3
    assert session.kv.cross_ready(Branch.COND) == (True, True)


@pytest.mark.parametrize("mode, forwards", [("off", 16), ("fixed", 8)])
def test_dit_step_cache_modes(tiny_model, mode, forwards):
    policy, cache = make_policy(tiny_model, dit_step_cache=mode)
    _, results = rollout(policy, cache, observations(2))
    assert [r.info["dit_forwards"] for r in results] == [forwards, forwards]


def test_dynamic_step_cache_runs_at_least_two_steps_and_stays_finite(tiny_model):
    policy, cache = make_policy(tiny_model, dit_step_cache="dynamic")
    _, results = rollout(policy, cache, observations(2))
    assert all(2 <= r.info["dit_forwards"] <= 16 and np.isfinite(r.actions).all() for r in results)


def test_decoupled_inference_noise_schedule_is_upstreams():
    """Upstream (WANPolicyHead.lazy_joint_video_action): video sigmas * (sigma_max - f) / sigma_max + f in float32 on
    the GPU, where / by a Python scalar is * by its float32 reciprocal; timesteps = int64(sigmas[:-1] * 1000)."""
    from ardiff_policies.dreamzero.samplers import DecoupledVideoSampler
    from ardiff_policies.wan.samplers import FlowUniPCSampler

    plain, video = FlowUniPCSampler(), DecoupledVideoSampler(0.8)
    plain.set_timesteps(16, 5.0)
    video.set_timesteps(16, 5.0)
    sigmas = plain.sigmas.numpy()
    sigma_max = sigmas[0].item()
    f32 = np.float32
    expected = sigmas * f32(sigma_max - 0.8) * (f32(1.0) / f32(sigma_max)) + f32(0.8)
    assert expected.dtype == np.float32 and np.array_equal(video.sigmas.numpy(), expected)
    assert video.sigmas[-1].item() == f32(0.8) and abs(video.sigmas[0].item() - sigma_max) < 1e-6
    assert video.timesteps.tolist() == (expected[:-1] * f32(1000)).astype(np.int64).tolist()
    assert video.timesteps[0] == 999 and video.timesteps[-1] >= 800


def test_decoupled_inference_noise_changes_only_the_video_schedule(tiny_model, monkeypatch):
    import dataclasses

    decoupled = copy.copy(tiny_model)
    decoupled.action_head_config = dataclasses.replace(tiny_model.action_head_config, decouple_inference_noise=True)
    seen: dict[str, list[tuple[int, int]]] = {"plain": [], "decoupled": []}
    current = ["plain"]
    forward = tiny_model.dit.forward  # one DiT, shared by both models

    def recording(*args, **kwargs):
        if kwargs.get("action") is not None:  # a denoise step: (video timestep, action timestep)
            seen[current[0]].append((int(args[1][0, 0]), int(kwargs["timestep_action"][0, 0])))
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny_model.dit, "forward", recording)
    results = {}
    for name, model in (("plain", tiny_model), ("decoupled", decoupled)):
        current[0] = name
        policy, cache = make_policy(model, dit_step_cache="off")
        _, results[name] = rollout(policy, cache, observations(2))
    plain, decoupled_steps = seen["plain"], seen["decoupled"]
    assert [a for _, a in plain] == [a for _, a in decoupled_steps]  # action timesteps: the full schedule
    assert min(v for v, _ in plain) < 300 and min(v for v, _ in decoupled_steps) >= 800  # video stops at 80 % noise
    assert all(np.isfinite(r.actions).all() for r in results["decoupled"])
    assert not np.array_equal(results["plain"][1].actions, results["decoupled"][1].actions)


def test_branches_computed_apart_and_combined_equal_one_process_cfg(tiny_model):
    """The contract CFG-parallel relies on: each branch alone + exchanged predictions == both here."""
    single, cache = make_policy(tiny_model)
    _, expected = rollout(single, cache, observations(5))

    pair = ThreadPair()
    results: dict[int, list] = {}

    def rank(r: int) -> None:
        # Each rank owns its model, as separate processes do (diffusers' VAE keeps encode
        # caches on the module, so one module must not be shared between threads).
        model = copy.deepcopy(tiny_model)
        policy, rank_cache = make_policy(model, branches=(Branch(r),), guidance=Guidance.parallel(r, pair.endpoint(r)))
        assert policy.branches == (Branch(r),) and rank_cache.branches == (Branch(r),)
        results[r] = rollout(policy, rank_cache, observations(5))[1]
        assert rank_cache.storage.cross.num_slots == 3  # one branch per session on this rank

    pair.run(rank)
    for e, a, b in zip(expected, results[0], results[1]):
        np.testing.assert_allclose(a.actions, e.actions, atol=1e-5, rtol=0)
        assert np.array_equal(a.actions, b.actions)  # both ranks hold the same chunk


def test_metadata_is_exactly_roboarenas_policy_server_config(tiny_model):
    policy, _ = make_policy(tiny_model)
    assert policy.info.server_config == {
        "image_resolution": [180, 320],
        "needs_wrist_camera": True,
        "n_external_cameras": 2,
        "needs_stereo_camera": False,
        "needs_session_id": True,
        "action_space": "joint_position",
    }
    assert policy.info.action_shape == [24, 8] and policy.info.describe()["model"] == "dreamzero"


@pytest.mark.parametrize(
    ("cameras", "match"),
    [
        ({"wrist": (1, 1, 320, 3)}, "observation/wrist_image_left: images need at least 2 pixels"),  # the key the client sent
        ({"exterior_left": (4, 180, 1, 3)}, "observation/exterior_image_1_left: images need at least 2 pixels"),
        ({"wrist": (1, 180, 320, 3), "exterior_left": (4, 180, 320, 3)}, "differ in length .*'observation/wrist_image_left': 1"),
    ],
)
def test_observations_dreamzero_cannot_take_are_refused_before_the_step(tiny_model, cameras, match):
    from ardiff_policies.observation import UnsupportedObservation

    policy, _ = make_policy(tiny_model)
    observation = RobotObservation(**{name: np.zeros(shape, np.uint8) for name, shape in cameras.items()})
    with pytest.raises(UnsupportedObservation, match=match):
        policy.check_observation(observation)
    policy.check_observation(RobotObservation(wrist=np.zeros((4, 2, 2, 3), np.uint8)))  # the smallest that works


@pytest.mark.parametrize(("first", "other"), [(0, 1), (1, 2)])
def test_errors_name_the_camera_keys_the_client_sent(tiny_model, first, other):
    """A client on the 0-indexed convention (_0_left, _1_left) is told about its own keys, never
    _2_left, which it did not send; the decoded observation carries them through pickling (the
    worker's seam) and the shared-memory copy (with_arrays)."""
    import pickle

    from ardiff_policies.observation import UnsupportedObservation
    from ardiff_server.wire.decode import decode_request
    from tests.helpers.server_harness import droid_observation

    request = droid_observation(4, one_indexed=first == 1)
    request[f"observation/exterior_image_{other}_left"] = request[f"observation/exterior_image_{other}_left"][:1]
    observation = decode_request(request).observation
    observation = pickle.loads(pickle.dumps(observation)).with_arrays({"wrist": observation.wrist})
    policy, _ = make_policy(tiny_model)
    with pytest.raises(UnsupportedObservation) as caught:
        policy.check_observation(observation)
    message = str(caught.value)
    sent = {"observation/wrist_image_left": 4, f"observation/exterior_image_{first}_left": 4, f"observation/exterior_image_{other}_left": 1}
    assert message == f"camera frame stacks differ in length (frames per camera): {sent}"


def test_a_view_size_that_does_not_fit_the_checkpoint_is_refused(tiny_model):
    from ardiff_policies.base import StartRefused

    # a StartRefused: the worker prints this one line, not a traceback
    with pytest.raises(StartRefused, match="frame_seqlen=60"):
        DreamZeroPolicy(DreamZeroConfig(view_size=(176, 320)), RuntimeOptions(), model=tiny_model)


def test_an_unknown_compile_backend_is_refused_in_one_line(tiny_model):
    from ardiff_policies.base import StartRefused

    with pytest.raises(StartRefused, match=r"engine.compile_backend: 'inductr' is not a torch.compile backend.*inductor"):
        DreamZeroPolicy(DreamZeroConfig(**TINY), RuntimeOptions(compile=True, compile_backend="inductr"), model=tiny_model)


def test_config_validation():
    with pytest.raises(ValueError, match="dit_step_mask has 3 entries"):
        DreamZeroConfig(dit_step_mask=[True, False, True])
    with pytest.raises(ValueError, match="extra"):
        DreamZeroConfig(mystery=1)


def test_compiled_dit_blocks_trace_whole_and_match_eager(tiny_model):
    """engine.compile: every DiT block compiles as one graph (fullgraph would raise on a break);
    shapes recompile (prefill of 1 / 2 frames, denoise), slots, tables and layers do not."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    eager, cache = make_policy(tiny_model)
    _, expected = rollout(eager, cache, observations(3))

    model = copy.deepcopy(tiny_model)
    counter = CompileCounter()
    torch._dynamo.reset()
    options = RuntimeOptions(compile=True, compile_backend=counter)
    compiled = DreamZeroPolicy(DreamZeroConfig(**TINY), options, model=model)
    spec = compiled.kv_spec()
    compiled_cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1)
    _, got = rollout(compiled, compiled_cache, observations(3))
    for a, b in zip(expected, got):
        np.testing.assert_allclose(b.actions, a.actions, atol=1e-5, rtol=0)
    assert counter.frame_count == 3, f"{counter.frame_count} compiled graphs"


def test_compiled_blocks_keep_a_graph_for_every_batch_shape(tiny_model):
    """Each batch size is new shapes for a dynamic=False, fullgraph compile. Dynamo's recompile
    limit (8 by default; 2 here, to meet it sooner) must not fail a batch when the shapes outgrow
    it: the policy raises it for engine.max_batch."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from ardiff_server.engine.core import SessionEngine
    from ardiff_server.engine.messages import Infer, InferReply

    counter = CompileCounter()
    torch._dynamo.reset()
    # config.patch, not monkeypatch: the config module's attributes do not survive monkeypatch's undo
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=2):
        policy = DreamZeroPolicy(
            DreamZeroConfig(**TINY), RuntimeOptions(compile=True, compile_backend=counter, max_batch=2), model=copy.deepcopy(tiny_model)
        )
        spec = policy.kv_spec()
        cache = PagedKVCache(spec, num_pages=2 * 2 * spec.pages_per_branch + 1, max_sessions=2, max_batch=2)
        engine = SessionEngine(policy, cache, max_sessions=2, max_batch=2)
        obs = observations(2)
        for sessions in (["a"], ["b", "c"]):
            for call in obs:
                replies = engine.run([Infer(i, sid, call) for i, sid in enumerate(sessions)])
                assert all(isinstance(r, InferReply) for r in replies), [getattr(r, "message", "") for r in replies]
            for sid in sessions:
                engine.end(sid, "done")
    assert counter.frame_count > 2  # more graphs than the limit the test started from
    assert torch._dynamo.config.recompile_limit >= 8  # the process's setting is intact afterwards
