"""LingBot-VA's episode logic (policies/lingbot_va/episode.py) against upstream's own server on the tiny checkpoint.

The reference (scripts/record_upstream_lingbot_va.py, ``policy.*``) is a whole episode of upstream's ``VA_Server``:
reset, four chunks of infer + compute_kv_cache with the RoboTwin client's messages, the window sliding twice, its
global generator seeded after the reset. The same episode here, from a session generator seeded at reset and batched
with other robots' sessions, gives the same actions within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ardiff_policies.lingbot_va.episode import CommitRequest, EpisodeError, InferRequest, LingBotVAEpisodes
from ardiff_policies.lingbot_va.tiny import TINY_EMBODIMENT, ensure_tiny_checkpoint
from tests.helpers.lingbot_va import ATOL, load_reference, make_cache
from tests.helpers.scripts import load_script

RECORD = load_script("record_upstream_lingbot_va")  # its observation and key-frame functions: the inputs


@pytest.fixture(scope="module")
def reference():
    return load_reference()


@pytest.fixture(scope="module")
def policy() -> LingBotVAEpisodes:
    return LingBotVAEpisodes.load(ensure_tiny_checkpoint(), TINY_EMBODIMENT)


def chunk(policy, session, index, seed_offset=0):
    """One chunk of the RoboTwin client's loop: infer, then compute_kv_cache with the key frames it saw (4 per latent
    frame; the first chunk's frame 0 is the observation) and the actions it executed."""
    e = TINY_EMBODIMENT
    action = policy.infer(session, RECORD.observation(e.cameras, index + seed_offset))
    frames = RECORD.key_frames(e.cameras, index + seed_offset, 4 * (e.frame_chunk_size - (index == 0)))
    policy.compute_kv_cache(session, frames, action)
    return action


def test_a_reset_replays_the_episode_from_its_seed(reference, policy):
    meta, tensors = reference
    p = meta["policy"]
    cache = make_cache(policy)
    session = policy.start_session("robot", cache.open_session("robot"))
    observation = RECORD.observation(TINY_EMBODIMENT.cameras, 0)
    policy.reset(session, "pick up the red cup", seed=5)
    policy.infer(session, observation)  # a half-done episode: predicted pages, a used generator and VAE streams
    policy.reset(session, p["prompt"], seed=p["seed"])
    assert np.abs(policy.infer(session, observation) - tensors["policy.actions.0"].numpy()).max() <= ATOL
    policy.reset(session, p["prompt"], seed=p["seed"] + 1)
    assert not np.allclose(policy.infer(session, observation), tensors["policy.actions.0"].numpy(), atol=1e-3)


def test_an_episode_batched_with_other_robots_matches_upstreams_server(reference, policy):
    """The whole recorded episode (4 chunks, the window sliding twice) while sessions share every denoising forward, each with its own pages, noise, guidance scales and frame position
    (the other robot is a chunk ahead: one conditions on its first observation while the other reads its window), and
    a refused request in the batch costs nobody else: the reference robot's actions are still upstream's."""
    meta, tensors = reference
    p = meta["policy"]
    e = TINY_EMBODIMENT
    cache = make_cache(policy, sessions=3)
    robot = policy.start_session("robot", cache.open_session("robot"))
    other = policy.start_session("other", cache.open_session("other"))
    idle = policy.start_session("idle", cache.open_session("idle"))  # never reset: refused
    policy.reset(robot, p["prompt"], seed=p["seed"])
    policy.reset(other, "pick up the red cup", seed=3)
    chunk(policy, other, 0, seed_offset=7)
    evicted = []
    for index in range(p["chunks"]):
        results = policy.infer_batch(
            [
                InferRequest(robot, RECORD.observation(e.cameras, index)),  # the configured scales: upstream's run
                InferRequest(idle, RECORD.observation(e.cameras, index)),
                InferRequest(other, RECORD.observation(e.cameras, index + 8), 3.0, 2.0),
            ]
        )
        assert isinstance(results[1], EpisodeError) and "before reset" in str(results[1])
        expected = tensors[f"policy.actions.{index}"].numpy()
        assert results[0].shape == expected.shape == (16, 2, 16) and results[0].dtype == np.float32
        error = np.abs(results[0] - expected).max()
        assert error <= ATOL, f"chunk {index} batched: max abs error {error:.3g} vs upstream"
        assert np.isfinite(results[2]).all() and not np.allclose(results[2], results[0])
        if index == 0:
            latent_error = (robot.first_latent - tensors["policy.first_latent"]).abs().max().item()
            assert latent_error <= ATOL, f"the encoded first observation: max abs error {latent_error:.3g}"
        evicted.append(robot.kv.branch(0).evicted_pages)
        committed = policy.compute_kv_cache_batch(
            [
                CommitRequest(robot, RECORD.key_frames(e.cameras, index, 4 * (e.frame_chunk_size - (index == 0))), results[0]),
                CommitRequest(idle, RECORD.key_frames(e.cameras, index, 8), results[0]),
                CommitRequest(other, RECORD.key_frames(e.cameras, index + 8, 4 * e.frame_chunk_size), results[2]),
            ]
        )
        assert committed[0] is None and committed[2] is None and "before reset" in str(committed[1])
    assert idle.kv.pages_held == 0 and other.frame_start == robot.frame_start + 2 == 2 * p["chunks"] + 2
    assert evicted[1] == 0 and evicted[-1] > 0, "the episode was meant to slide the window"
    for session in (robot, other, idle):
        cache.end_session(session.kv)
    assert cache.pool.num_allocated == 0


def test_bad_requests_are_refused_by_key_and_leave_the_episode_intact(reference, policy):
    meta, tensors = reference
    p = meta["policy"]
    e = TINY_EMBODIMENT
    cache = make_cache(policy)
    session = policy.start_session("robot", cache.open_session("robot"))
    with pytest.raises(EpisodeError, match="before reset"):
        policy.infer(session, RECORD.observation(e.cameras, 0))
    with pytest.raises(EpisodeError, match="prompt"):
        policy.reset(session, ["not", "a", "string"], seed=1)
    with pytest.raises(EpisodeError, match="seed"):
        policy.reset(session, p["prompt"], seed=-1)
    policy.reset(session, p["prompt"], seed=p["seed"])
    with pytest.raises(EpisodeError, match="video_guidance_scale"):
        policy.infer(session, RECORD.observation(e.cameras, 0), video_guidance_scale=1e9)
    with pytest.raises(EpisodeError, match="action_guidance_scale"):
        policy.infer(session, RECORD.observation(e.cameras, 0), action_guidance_scale=float("nan"))
    broken = RECORD.observation(e.cameras, 0)
    del broken[e.cameras[2]]
    with pytest.raises(EpisodeError, match="cam_right_wrist"):
        policy.infer(session, broken)
    action = policy.infer(session, RECORD.observation(e.cameras, 0))
    assert np.abs(action - tensors["policy.actions.0"].numpy()).max() <= ATOL  # nothing above moved the episode
    with pytest.raises(EpisodeError, match="state"):
        policy.compute_kv_cache(session, RECORD.key_frames(e.cameras, 0, 4), action[:, :1])
    with pytest.raises(EpisodeError, match="obs: 3 key frames"):
        policy.compute_kv_cache(session, RECORD.key_frames(e.cameras, 0, 3), action)
    policy.compute_kv_cache(session, RECORD.key_frames(e.cameras, 0, 4), action)
    action = policy.infer(session, RECORD.observation(e.cameras, 1))
    assert np.abs(action - tensors["policy.actions.1"].numpy()).max() <= ATOL


def test_a_repeated_first_infer_is_served_as_the_first_and_the_episode_goes_on(reference, policy):
    """reset, infer, infer: the second infer of the first chunk (no commit between) starts again from where the first
    did (VAE streams, generator, no predicted pages), so it is the first's chunk; with another observation, that
    observation's first chunk. The commit and the next chunk are then the episode's as if it had been asked once."""
    meta, tensors = reference
    p = meta["policy"]
    e = TINY_EMBODIMENT
    cache = make_cache(policy)
    session = policy.start_session("robot", cache.open_session("robot"))
    policy.reset(session, p["prompt"], seed=p["seed"])
    observation = RECORD.observation(e.cameras, 0)
    first = policy.infer(session, observation)
    assert np.abs(first - tensors["policy.actions.0"].numpy()).max() <= ATOL
    np.testing.assert_array_equal(policy.infer(session, observation), first)
    elsewhere = policy.infer(session, RECORD.observation(e.cameras, 5))
    fresh = policy.start_session("fresh", cache.open_session("fresh"))
    policy.reset(fresh, p["prompt"], seed=p["seed"])
    np.testing.assert_array_equal(elsewhere, policy.infer(fresh, RECORD.observation(e.cameras, 5)))
    cache.end_session(fresh.kv)
    np.testing.assert_array_equal(policy.infer(session, observation), first)
    policy.compute_kv_cache(session, RECORD.key_frames(e.cameras, 0, 4 * (e.frame_chunk_size - 1)), first)
    action = policy.infer(session, RECORD.observation(e.cameras, 1))
    assert np.abs(action - tensors["policy.actions.1"].numpy()).max() <= ATOL
    cache.end_session(session.kv)
    assert cache.pool.num_allocated == 0


def test_a_repeated_first_infer_in_a_failed_batch_is_retried_alone_and_still_the_first(reference, policy, monkeypatch):
    meta, tensors = reference
    p = meta["policy"]
    e = TINY_EMBODIMENT
    cache = make_cache(policy)
    robot = policy.start_session("robot", cache.open_session("robot"))
    other = policy.start_session("other", cache.open_session("other"))
    policy.reset(robot, p["prompt"], seed=p["seed"])
    policy.reset(other, "pick up the red cup", seed=3)
    observation = RECORD.observation(e.cameras, 0)
    first = policy.infer(robot, observation)
    forward = policy._forward

    def batched_forward_fails(sessions, *args, **kwargs):
        if len(sessions) > 1:
            raise RuntimeError("injected: a batched forward failed")
        return forward(sessions, *args, **kwargs)

    monkeypatch.setattr(policy, "_forward", batched_forward_fails)
    again, _ = policy.infer_batch([InferRequest(robot, observation), InferRequest(other, RECORD.observation(e.cameras, 9))])
    monkeypatch.undo()
    np.testing.assert_array_equal(again, first)
    policy.compute_kv_cache(robot, RECORD.key_frames(e.cameras, 0, 4 * (e.frame_chunk_size - 1)), first)
    action = policy.infer(robot, RECORD.observation(e.cameras, 1))
    assert np.abs(action - tensors["policy.actions.1"].numpy()).max() <= ATOL
    for session in (robot, other):
        cache.end_session(session.kv)
    assert cache.pool.num_allocated == 0


def test_the_kv_geometry_of_the_shipped_embodiments():
    from ardiff_policies.lingbot_va.checkpoint import TransformerConfig
    from ardiff_policies.lingbot_va.embodiments import FRANKA, ROBOTWIN
    from ardiff_policies.lingbot_va.episode import kv_spec

    full = TransformerConfig()
    robotwin = kv_spec(ROBOTWIN, full, torch.bfloat16)
    # 24x20 latents -> 120 tokens per frame, 240 per chunk, 32 actions: pages of 16; 36 chunks of 17 pages
    assert (robotwin.page_size, robotwin.window_pages, robotwin.max_new_pages) == (16, 612, 15)
    franka = kv_spec(FRANKA, full, torch.bfloat16)
    # 14x60 latents -> 210 tokens per frame, 840 per chunk, 80 actions: pages of 40; 15 chunks of 23 pages
    assert (franka.page_size, franka.window_pages, franka.max_new_pages) == (40, 345, 21)
    gib = robotwin.window_pages * robotwin.page_bytes * 2 / 2**30  # both CFG branches
    assert 6.5 < gib < 7.0  # a RoboTwin session's window in bf16: ~6.7 GiB
