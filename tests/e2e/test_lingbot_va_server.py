"""``ardiff-serve --config tiny_lingbot_va``: LingBot-VA served to its own RoboTwin protocol (a client written from
the protocol, one session per connection) and to OpenPI clients with interleaved session ids, from the same server."""

from __future__ import annotations

import json

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from tests.helpers.lingbot_va_client import CAMERAS, LingBotVAClient, ServerError, robotwin_frame, run_episode
from tests.helpers.server_harness import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

SIZE = (64, 96)  # the tiny RoboTwin geometry's head camera
SHAPE = (16, 2, 16)  # upstream's reply: (used channels, frames per chunk, actions per frame)


def openpi_request(frames: list[dict], session_id: str, prompt: str) -> dict:
    """The same frames as OpenPI keys: observation/<camera> as (T, H, W, 3) stacks (one frame: (H, W, 3))."""
    request = {"session_id": session_id, "prompt": prompt}
    for camera in CAMERAS:
        stack = np.stack([frame[camera] for frame in frames])
        request["observation/" + camera.removeprefix("observation.images.")] = stack[0] if len(frames) == 1 else stack
    return request


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("tiny_lingbot_va", tmp_path_factory.mktemp("lingbot"), args=["--set", "engine.warmup=false"]) as process:
        yield process


def test_robotwin_client_runs_episodes_with_a_reset(server):
    with LingBotVAClient(server.url) as client:
        assert client.metadata["embodiment"] == "lingbot_va_tiny_robotwin" and "lingbot_va" in client.metadata["protocols"]
        actions, _ = run_episode(client, "grab the white mug", 5, seed=1, size=SIZE)
        assert [a.shape for a in actions] == [SHAPE] * 5 and all(a.dtype == np.float32 and np.isfinite(a).all() for a in actions)
        again, _ = run_episode(client, "grab the white mug", 2, seed=1, size=SIZE)  # reset: a fresh episode, same seed
        np.testing.assert_array_equal(again[0], actions[0])
        np.testing.assert_array_equal(again[1], actions[1])
        other, _ = run_episode(client, "stack the red cube", 1, seed=1, size=SIZE)
        assert np.abs(other[0] - actions[0]).max() > 1e-4  # another prompt, another chunk
        client.call({"reset": True, "prompt": "done"})
    assert server.metric('ardiff_kv_blocks_total{rank="0"}') == server.metric('ardiff_kv_blocks_free{rank="0"}')


def test_bad_requests_name_the_key_and_keep_the_episode(server):
    with LingBotVAClient(server.url) as client:
        frame = robotwin_frame(np.random.default_rng(0), *SIZE, "x")
        with pytest.raises(ServerError, match="before reset"):
            client.call({"obs": frame})
        client.call({"reset": True, "prompt": "grab the white mug"})
        with pytest.raises(ServerError, match="action_guidance_scale"):
            client.call({"obs": frame, "action_guidance_scale": 50.0})
        with pytest.raises(ServerError, match="cam_left_wrist"):
            client.call({"obs": {k: v for k, v in frame.items() if k != CAMERAS[1]}})
        action = client.call({"obs": frame, "video_guidance_scale": 5.0, "action_guidance_scale": 1.0})["action"]
        with pytest.raises(ServerError, match="state"):
            client.call({"obs": [frame] * 4, "compute_kv_cache": True, "state": action[:, :1]})
        client.call({"obs": [frame] * 4, "compute_kv_cache": True, "state": action})  # the episode goes on
        assert client.call({"obs": frame})["action"].shape == SHAPE


def test_both_protocols_report_the_same_timings_and_metrics(server):
    """LingBot-VA's replies are timed and counted as OpenPI's (``frontend/replies.py``): every call's server_timing has
    its compute and its wait in the engine (and the connection's previous request), and every call is observed in the
    infer, queue and request histograms (LingBot-VA's once fed only the first)."""
    timing_keys = {"infer_ms", "queue_ms", "encode_ms", "prev_total_ms", "next_call_p90_ms"}  # encode_ms: only a call that encoded
    histograms = ("ardiff_infer_seconds_count", "ardiff_queue_seconds_count", "ardiff_request_seconds_count")
    before = [server.metric(name) for name in (*histograms, 'ardiff_requests_total{outcome="ok"}')]
    frame = robotwin_frame(np.random.default_rng(7), *SIZE, "x")
    with LingBotVAClient(server.url) as client:
        reset = client.call({"reset": True, "prompt": "grab the white mug"})["server_timing"]
        infer = client.call({"obs": frame})
        commit = client.call({"obs": [frame] * 4, "compute_kv_cache": True, "state": infer["action"]})["server_timing"]
        client.call({"reset": True, "prompt": "done"})
    assert set(reset) == {"infer_ms"} and reset["infer_ms"] > 0  # no call ran: its own time; the connection's first request
    for timing in (infer["server_timing"], commit):
        assert {"infer_ms", "queue_ms", "prev_total_ms"} <= set(timing) <= timing_keys, timing
        assert timing["infer_ms"] > 0 and timing["queue_ms"] >= 0 and timing["prev_total_ms"] > 0
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    first = policy.infer(openpi_request([frame], "timed", "x"))["server_timing"]
    assert {"infer_ms", "queue_ms"} <= set(first) <= timing_keys - {"prev_total_ms"}, first
    assert policy.infer({"endpoint": "reset", "session_ids": ["timed"]})["status"] == "reset successful"
    after = [server.metric(name) for name in (*histograms, 'ardiff_requests_total{outcome="ok"}')]
    assert [b - a for a, b in zip(before, after)] == [3, 3, 3, 3]  # infer, compute_kv_cache, the OpenPI infer


def test_openpi_sessions_interleave_and_equal_the_robotwin_protocol(server):
    """Two OpenPI sessions, interleaved on one connection, each one chunk per call (its key frames commit the chunk
    out). Same seed, prompt and frames as a RoboTwin-protocol episode: the same actions."""
    prompt = "grab the white mug"
    with LingBotVAClient(server.url) as client:
        reference, frames = run_episode(client, prompt, 5, seed=3, size=SIZE)
        client.call({"reset": True, "prompt": "done"})
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    metadata = policy.get_server_metadata()
    assert [c["key"] for c in metadata["observation"]["cameras"]] == [
        "observation/cam_high",
        "observation/cam_left_wrist",
        "observation/cam_right_wrist",
    ]
    assert metadata["actions"]["horizon"] == 32 and metadata["actions"]["dim"] == 16
    other = [[robotwin_frame(np.random.default_rng(9), *SIZE, "")] * len(f) for f in frames]
    for chunk in range(5):
        for session_id, sent in (("left", frames), ("right", other)):
            reply = policy.infer(openpi_request(sent[chunk], session_id, prompt))
            actions = reply["actions"]
            assert actions.shape == (32, 16) and np.isfinite(actions).all()
            assert reply["session"]["calls"] == chunk + 1 and reply["session"]["execute_from"] == (16 if chunk == 0 else 0)
            if session_id == "left":  # time-major (frames x actions per frame, channels) of upstream's (16, 2, 16)
                np.testing.assert_allclose(actions.T.reshape(SHAPE), reference[chunk], atol=1e-5, rtol=0)
    assert policy.infer({"endpoint": "reset", "session_ids": ["left", "right"]})["status"] == "reset successful"
    status, body = server.http("/info")
    assert status == 200 and json.loads(body)["policy"]["native_protocol"] == "lingbot_va"


def test_each_connection_is_its_own_session(server):
    """Two RoboTwin-protocol connections interleaved message by message: each runs its own episode, equal to it alone."""
    prompt = "grab the white mug"
    with LingBotVAClient(server.url) as alone:
        reference, frames = run_episode(alone, prompt, 3, seed=5, size=SIZE)
        alone.call({"reset": True, "prompt": "done"})
    with LingBotVAClient(server.url) as a, LingBotVAClient(server.url) as b:
        a.call({"reset": True, "prompt": prompt})
        b.call({"reset": True, "prompt": "stack the red cube"})
        for chunk in range(3):
            got = a.call({"obs": frames[0][0], "video_guidance_scale": 5.0, "action_guidance_scale": 1.0})["action"]
            other = b.call({"obs": frames[0][0]})["action"]
            np.testing.assert_allclose(got, reference[chunk], atol=1e-5, rtol=0)
            assert np.abs(other - got).max() > 1e-4
            a.call({"obs": frames[chunk + 1], "compute_kv_cache": True, "state": got})
            b.call({"obs": frames[chunk + 1], "compute_kv_cache": True, "state": other})
        a.call({"reset": True, "prompt": "done"})
        b.call({"reset": True, "prompt": "done"})


def test_openpi_requests_carry_guidance_scales_bounded_like_the_robotwin_protocol(server):
    prompt = "grab the white mug"
    with LingBotVAClient(server.url) as client:
        reference, frames = run_episode(client, prompt, 1, seed=4, size=SIZE, guidance=(2.0, 3.0))
        client.call({"reset": True, "prompt": "done"})
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    request = openpi_request(frames[0], "guided", prompt)
    with pytest.raises(RuntimeError, match=r"video_guidance_scale: 50\.0 outside"):
        policy.infer({**request, "video_guidance_scale": 50.0})
    with pytest.raises(RuntimeError, match="action_guidance_scale: expected a number"):
        policy.infer({**request, "action_guidance_scale": "high"})
    actions = policy.infer({**request, "video_guidance_scale": 2.0, "action_guidance_scale": 3.0})["actions"]
    np.testing.assert_allclose(actions.T.reshape(SHAPE), reference[0], atol=1e-5, rtol=0)
    assert policy.infer({"endpoint": "reset", "session_ids": ["guided"]})["status"] == "reset successful"


def test_a_repeated_first_infer_is_served_again_and_the_episode_goes_on(server):
    """reset, infer, infer on LingBot-VA's protocol: the second infer of the first chunk is served as the first was, and
    the episode's commit and next chunk are what they are without the repeat. Over OpenPI a repeated first request (one
    frame again, where the chunk out's key frames belong) is a one-line bad request and the session goes on."""
    prompt = "grab the white mug"
    free = server.metric('ardiff_kv_blocks_free{rank="0"}')  # earlier tests' idle sessions may hold pages
    with LingBotVAClient(server.url) as client:
        reference, frames = run_episode(client, prompt, 2, seed=6, size=SIZE)
        client.call({"reset": True, "prompt": prompt})
        infer = {"obs": frames[0][0], "video_guidance_scale": 5.0, "action_guidance_scale": 1.0}
        first = client.call(infer)["action"]
        np.testing.assert_array_equal(client.call(infer)["action"], first)
        np.testing.assert_allclose(first, reference[0], atol=1e-5, rtol=0)
        client.call({"obs": frames[1], "compute_kv_cache": True, "state": first})
        np.testing.assert_allclose(client.call(infer)["action"], reference[1], atol=1e-5, rtol=0)
        client.call({"reset": True, "prompt": "done"})
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    reply = policy.infer(openpi_request(frames[0], "repeated", prompt))
    np.testing.assert_allclose(reply["actions"].T.reshape(SHAPE), reference[0], atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError) as refused:
        policy.infer(openpi_request(frames[0], "repeated", prompt))
    message = str(refused.value).removeprefix("Error in inference server:\n")  # openpi-client's prefix
    assert message.startswith("bad request: observation: 1 frame per camera") and "\n" not in message
    reply = policy.infer(openpi_request(frames[1], "repeated", prompt))
    assert reply["session"]["calls"] == 2 and not reply["session"]["new"]
    np.testing.assert_allclose(reply["actions"].T.reshape(SHAPE), reference[1], atol=1e-5, rtol=0)
    assert policy.infer({"endpoint": "reset", "session_ids": ["repeated"]})["status"] == "reset successful"
    assert server.metric('ardiff_kv_blocks_free{rank="0"}') == free


def test_both_protocols_continue_chunks_with_frozen_rows_exact(server):
    """A continuation over LingBot-VA's protocol (infer while the chunk executes, commit its frames afterwards) and over
    OpenPI (the key frames commit the chunk out, the next continues it): the first ``delay`` actions are the executing
    chunk's ``[executed, executed + delay)`` as the robot got them; /info and the metadata say continuations; every
    page goes back at the end."""
    prompt = "grab the white mug"
    free = server.metric('ardiff_kv_blocks_free{rank="0"}')
    rng = np.random.default_rng(8)
    frame = robotwin_frame(rng, *SIZE, prompt)
    with LingBotVAClient(server.url) as client:
        assert client.metadata["continuations"] is True
        client.call({"reset": True, "prompt": prompt})
        first = client.call({"obs": frame})
        assert (first["chunk_id"], first["frozen"]) == (1, 0) and "continuation" not in first
        with pytest.raises(ServerError, match="past the 32-action chunk"):
            client.call({"obs": frame, "continuation": {"executed": 30, "delay": 4}})
        with pytest.raises(ServerError, match="continues nothing"):
            client.call({"obs": [frame] * 4, "compute_kv_cache": True, "state": first["action"], "continuation": {"executed": 0, "delay": 0}})
        second = client.call({"obs": frame, "continuation": {"executed": 20, "delay": 4, "chunk_id": 1}})
        assert (second["chunk_id"], second["frozen"], second["continuation"]) == (2, 4, "applied")
        old, new = first["action"].reshape(16, 32), second["action"].reshape(16, 32)  # (channels, time)
        np.testing.assert_array_equal(new[:, :4], old[:, 20:24])
        client.call({"obs": [robotwin_frame(rng, *SIZE, prompt) for _ in range(4)], "compute_kv_cache": True, "state": first["action"]})
        third = client.call({"obs": frame, "continuation": {"executed": 8, "delay": 8}})
        assert (third["chunk_id"], third["frozen"]) == (3, 8)
        np.testing.assert_array_equal(third["action"].reshape(16, 32)[:, :8], new[:, 8:16])
        client.call({"reset": True, "prompt": "done"})
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    assert policy.get_server_metadata()["continuations"] is True
    plain = policy.infer(openpi_request([frame], "continued", prompt))
    assert (plain["chunk_id"], plain["frozen"]) == (1, 0)
    keys = [robotwin_frame(rng, *SIZE, prompt) for _ in range(4)]
    continued = policy.infer({**openpi_request(keys, "continued", prompt), "continuation": {"executed": 24, "delay": 6, "chunk_id": 1}})
    assert (continued["chunk_id"], continued["frozen"], continued["continuation"]) == (2, 6, "applied")
    assert continued["session"]["call"] == "commit+infer" and continued["session"]["execute_from"] == 0
    np.testing.assert_array_equal(continued["actions"][:6], plain["actions"][24:30])
    assert policy.infer({"endpoint": "reset", "session_ids": ["continued"]})["status"] == "reset successful"
    status, body = server.http("/info")
    info = json.loads(body)
    assert status == 200 and info["continuations"] == {"accepted": True}
    assert info["policy"]["continuation"]["mode"] == "inpaint" and set(info["policy"]["continuation"]["request"]["continuation"]) >= {
        "executed",
        "delay",
    }
    assert server.metric('ardiff_kv_blocks_free{rank="0"}') == free


def test_ardiff_client_async_continues_lingbot_va_chunks(server, capsys):
    """``ardiff-client --async`` against LingBot-VA: its metadata says continuations, so the robot loop sends them (every
    asked one applied: each request's key frames commit the chunk out, the next chunk continues it); the real clock
    on a shared CI machine, so only what any latency gives is asserted."""
    from ardiff_client import replay

    free = server.metric('ardiff_kv_blocks_free{rank="0"}')
    args = ["--port", str(server.port), "--async", "--control-hz", "8", "--steps", "96", "--json", "--quiet", "--size", "64x96"]
    assert replay.main([*args, "--prompt", "grab the white mug"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["mode"] == "continuation" and summary["steps"] == 96 and summary["chunks"] >= 2
    assert summary["fresh"] == {}, summary  # every chunk after the first continued the one before
    assert server.metric('ardiff_kv_blocks_free{rank="0"}') == free  # the episode's reset returned its pages


def test_ardiff_client_plain_drives_robotwin_from_its_metadata_and_resets(server, capsys):
    """Plain ``ardiff-client`` against LingBot-VA's RoboTwin twin (#38 item 4): the cameras and frames per call come from
    the metadata (1 frame, then 4, then 8: the call that failed before it read them), and the run ends its session."""
    from ardiff_client import replay

    free = server.metric('ardiff_kv_blocks_free{rank="0"}')
    status = replay.main(["--port", str(server.port), "--calls", "4", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    report = json.loads(out)
    assert report["calls"] == 4 and report["error"] is None
    assert [record["frames"] for record in report["records"]] == [1, 4, 8, 8]
    assert server.metric('ardiff_kv_blocks_free{rank="0"}') == free  # the run's reset returned its pages
