"""LingBot-VA through the engine (``policies/lingbot_va/policy.py``): batched == alone for every kind of call, bad
requests refused before any state changes, the observation's episode call across the process seam."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ardiff_policies.episode import EpisodeCall
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_server.config import load_config
from ardiff_server.engine.builder import build_engine
from ardiff_server.engine.messages import ErrorKind, ErrorReply, Infer
from tests.helpers.lingbot_va import cameras

ATOL = 1e-5


@pytest.fixture(scope="module")
def engine():
    config = load_config("tiny_lingbot_va", overrides=["engine.warmup=false", "engine.max_batch=4"])
    engine = build_engine(config)
    yield engine
    engine.close()


def robotwin_calls(engine, last_actions: list) -> list:
    """LingBot-VA's protocol: infer, compute_kv_cache, infer, compute_kv_cache, infer (guidance per request)."""
    infer = EpisodeCall("infer", video_guidance_scale=4.0, action_guidance_scale=2.0)

    def commit(frames, seed):
        return lambda: RobotObservation(
            cameras(engine, frames, seed), {}, "stack the cube", EpisodeCall("compute_kv_cache", executed_actions=last_actions[-1])
        )

    def infer_call(seed):
        return lambda: RobotObservation(cameras(engine, 1, seed), {}, "stack the cube", infer)

    return [infer_call(1), commit(4, 2), infer_call(1), commit(8, 3), infer_call(1)]


def openpi_calls(engine) -> list:
    """OpenPI: one chunk per call, its frames committing the chunk out."""
    return [lambda f=f, s=s: RobotObservation(cameras(engine, f, s), {}, "grab the mug") for f, s in ((1, 11), (4, 12), (8, 13), (8, 14), (8, 15))]


def run(engine, rounds: list[list[tuple[str, callable]]], trail: dict) -> list[list]:
    """Each round's requests given to the engine together (one batch); ``trail`` keeps a session's last actions."""
    out = []
    ids = iter(range(10_000, 20_000))
    for members in rounds:
        requests = [Infer(next(ids), sid, make()) for sid, make in members]
        replies = {r.request_id: r for r in engine.run(requests)}
        row = []
        for request in requests:
            reply = replies[request.request_id]
            assert not isinstance(reply, ErrorReply), reply.message
            row.append(reply)
            if len(reply.actions):
                trail.setdefault(request.session_id, []).append(reply.actions.T.reshape(16, 2, 16).copy())
        out.append(row)
    return out


def test_batched_equals_alone_for_infer_and_compute_kv_cache(engine):
    results = {}
    for mode in ("alone", "batched"):
        trail = {}
        a, b = f"robotwin-{mode}", f"openpi-{mode}"
        last = trail.setdefault(a, [])
        pairs = list(zip(robotwin_calls(engine, last), openpi_calls(engine), strict=True))
        if mode == "alone":
            rounds = [[(a, ra)] for ra, _ in pairs] + [[(b, rb)] for _, rb in pairs]
            replies = run(engine, rounds, trail)
            results[mode] = [r[0].actions for r in replies]
        else:
            replies = []
            for ra, rb in pairs:
                (row,) = run(engine, [[(a, ra), (b, rb)]], trail)
                assert [r.batch_size for r in row] == [2, 2]  # one batch: a commit beside a chunk, an infer beside one
                replies.append(row)
            results[mode] = [r[0].actions for r in replies] + [r[1].actions for r in replies]
        engine.end(a, "test")
        engine.end(b, "test")
    for alone, batched in zip(results["alone"], results["batched"], strict=True):
        assert alone.shape == batched.shape and alone.shape in ((32, 16), (0, 16))
        np.testing.assert_allclose(batched, alone, atol=ATOL, rtol=0)
    assert sum(len(a) for a in results["alone"]) == 8 * 32  # 3 RoboTwin chunks, 5 OpenPI chunks


def test_bad_requests_are_refused_before_the_session_changes(engine):
    first = engine.infer("checked", RobotObservation(cameras(engine, 1, 0), {}, "x", EpisodeCall("infer")))
    action = first.result.actions.T.reshape(16, 2, 16)
    bad = [
        (EpisodeCall("infer", video_guidance_scale=21.0), 1, "video_guidance_scale"),
        (EpisodeCall("compute_kv_cache", executed_actions=action[:, :1]), 4, "state"),
        (EpisodeCall("compute_kv_cache", executed_actions=np.full_like(action, np.nan)), 4, "NaN"),
        (EpisodeCall("compute_kv_cache", executed_actions=action), 5, "key frames"),
        (None, 3, "frames per camera"),
    ]
    for call, frames, words in bad:
        (reply,) = engine.run([Infer(1, "checked", RobotObservation(cameras(engine, frames, 1), {}, "x", call))])
        assert isinstance(reply, ErrorReply) and reply.kind is ErrorKind.BAD_REQUEST and words in reply.message
    missing = cameras(engine, 4, 1)
    del missing["cam_right_wrist"]
    (reply,) = engine.run([Infer(2, "checked", RobotObservation(missing, {}, "x", EpisodeCall("compute_kv_cache", executed_actions=action)))])
    assert reply.kind is ErrorKind.BAD_REQUEST and "cam_right_wrist" in reply.message
    commit = engine.infer("checked", RobotObservation(cameras(engine, 4, 1), {}, "x", EpisodeCall("compute_kv_cache", executed_actions=action)))
    assert commit.calls == 2 and commit.result.info["frame_start"] == 2  # the session went on from where it was
    engine.end("checked", "test")


def test_a_prompt_change_mid_episode_is_a_bad_request_and_the_episode_goes_on(engine):
    engine.infer("prompted", RobotObservation(cameras(engine, 1, 0), {}, "grab the mug"))
    with pytest.raises(UnsupportedObservation, match="prompt"):
        engine.infer("prompted", RobotObservation(cameras(engine, 4, 0), {}, "open the drawer"))
    assert "prompted" in engine.sessions  # refused before the session changed: the robot's episode carries on
    outcome = engine.infer("prompted", RobotObservation(cameras(engine, 4, 0), {}, "grab the mug"))
    assert not outcome.new_session and outcome.calls == 2
    engine.end("prompted", "test")
    assert engine.cache.pool.num_free == engine.cache.pool.capacity


def test_it_advertises_the_most_frames_a_call_reads_and_that_none_may_be_dropped(engine):
    """The front end's pixel budget counts PolicyInfo.max_frames_per_call frames per camera, and drops none (a count
    LingBot-VA does not take is refused, never cut to one it does)."""
    info, policy = engine.policy.info, engine.policy
    assert not info.keeps_newest_frames
    policy.check_observation(RobotObservation(cameras(engine, info.max_frames_per_call, 0), {}, "x"))  # the most it takes
    for more in (info.max_frames_per_call + 1, 64):
        with pytest.raises(UnsupportedObservation, match="frames per camera"):
            policy.check_observation(RobotObservation(cameras(engine, more, 0), {}, "x"))


def test_the_episode_call_crosses_the_process_seam():
    call = EpisodeCall("compute_kv_cache", executed_actions=np.arange(6, dtype=np.float32).reshape(1, 2, 3))
    observation = RobotObservation({"cam_high": np.zeros((4, 2, 2, 3), np.uint8)}, {}, "x", call)
    copy = pickle.loads(pickle.dumps(observation))
    assert copy.episode == call and copy.prompt == "x" and copy.cameras["cam_high"].shape == (4, 2, 2, 3)
    assert copy.with_arrays({"cam_high": np.ones((4, 2, 2, 3), np.uint8)}).episode == call
    assert call != EpisodeCall("compute_kv_cache", executed_actions=np.zeros((1, 2, 3), np.float32)) != EpisodeCall("infer")
    plain = RobotObservation({"cam_high": np.zeros((1, 2, 2, 3), np.uint8)}, {}, "x")
    assert pickle.loads(pickle.dumps(plain)).episode is None


def test_an_openpi_episode_starts_from_the_newest_frame_of_a_stack(engine):
    """A robot whose session was evicted sends its key frames to a fresh session: the episode starts over from the
    newest frame instead of failing."""
    stack = cameras(engine, 8, 21)
    newest = {name: frames[-1:] for name, frames in stack.items()}
    from_stack = engine.infer("stacked", RobotObservation(stack, {}, "grab the mug"))
    from_frame = engine.infer("single", RobotObservation(newest, {}, "grab the mug"))
    assert from_stack.result.chunk.execute_from == 16
    np.testing.assert_array_equal(from_stack.result.actions, from_frame.result.actions)
    engine.end("stacked", "test")
    engine.end("single", "test")


def test_openpi_guidance_per_request_equals_the_robotwin_protocols_and_is_bounded(engine):
    """An OpenPI chunk with guidance scales gives what LingBot-VA's own infer with those scales gives; a scale out of
    bounds is a bad request naming it and the session goes on."""
    scales = {"video_guidance_scale": 2.0, "action_guidance_scale": 3.0}
    own = engine.infer("own", RobotObservation(cameras(engine, 1, 31), {}, "grab the mug", EpisodeCall("infer", **scales)))
    default = engine.infer("default", RobotObservation(cameras(engine, 1, 31), {}, "grab the mug"))
    with pytest.raises(UnsupportedObservation, match=r"action_guidance_scale: 21\.0 outside"):
        engine.infer("openpi", RobotObservation(cameras(engine, 1, 31), {}, "grab the mug", EpisodeCall("chunk", 2.0, 21.0)))
    chunk = engine.infer("openpi", RobotObservation(cameras(engine, 1, 31), {}, "grab the mug", EpisodeCall("chunk", **scales)))
    np.testing.assert_allclose(chunk.result.actions, own.result.actions, atol=ATOL, rtol=0)
    assert np.abs(chunk.result.actions - default.result.actions).max() > 1e-4  # the scales were used
    later = engine.infer("openpi", RobotObservation(cameras(engine, 4, 32), {}, "grab the mug", EpisodeCall("chunk", 1.0, 1.0)))
    assert later.calls == 2 and later.result.chunk.call == "commit+infer" and later.result.actions.shape == (32, 16)
    for sid in ("own", "default", "openpi"):
        engine.end(sid, "test")
