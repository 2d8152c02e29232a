"""``ardiff-serve --config tiny_zero_wam``: Zero-WAM served to upstream's RoboTwin protocol (jianwenli96/Zero-WAM's client:
a reset naming the demonstration with use_icl / icl_demo_id / guidance, then infer / compute_kv_cache; written from the
protocol) and to OpenPI (the demonstration named on a session's first call), from one server whose demonstration root
holds good, too large, malformed and video-only demonstrations."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from ardiff_policies.lingbot_va.zero_wam_tiny import write_tiny_demonstrations
from tests.helpers.lingbot_va_client import CAMERAS, LingBotVAClient, ServerError, robotwin_frame
from tests.helpers.server_harness import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

SIZE = (32, 64)  # the tiny Zero-WAM's cameras
SHAPE = (16, 2, 16)  # upstream's reply: (used channels, frames per chunk, actions per frame)
DEMO = "tiny/wave"
ICL = {"use_icl": True, "icl_demo_id": DEMO, "video_guidance_scale": -1.0, "icl_guidance_scale": 5.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = write_tiny_demonstrations(tmp_path_factory.mktemp("demonstrations"))
    torch.save({"latent": torch.zeros(1, 48, 9, 4, 4)}, root / "too_long.pth")  # 36 tokens: the bound is 4 frames, 16
    (root / "broken.pth").write_bytes(b"not a torch file")
    torch.save({"latent": torch.zeros(1, 16, 2, 4, 4)}, root / "wrong_channels.pth")
    (root / "video_only.mp4").write_bytes(b"\x00")
    args = ["--set", "engine.warmup=false", "--set", f"policy.demonstration_root={root}"]
    with ServerProcess("tiny_zero_wam", tmp_path_factory.mktemp("zero_wam"), args=args) as process:
        yield process


def openpi_request(frames: list[dict], session_id: str, prompt: str, **extra) -> dict:
    request = {"session_id": session_id, "prompt": prompt, **extra}
    for camera in CAMERAS:
        stack = np.stack([frame[camera] for frame in frames])
        request["observation/" + camera.removeprefix("observation.images.")] = stack[0] if len(frames) == 1 else stack
    return request


def run_episode(client: LingBotVAClient, prompt: str, chunks: int, *, seed: int, reset: dict) -> tuple[list, list]:
    """Upstream's client loop: reset naming the demonstration, then per chunk infer (with the client's default
    guidance keys, which the server does not read), a key frame every 4 executed actions (the first chunk's first
    frame skipped), compute_kv_cache with those frames and the action array. Returns each chunk's actions and the
    frames sent, in the order an OpenPI client would send them."""
    rng = np.random.default_rng(seed)
    assert set(client.call({"reset": True, "prompt": prompt, "save_visualization": True, **reset})) == {"server_timing"}
    first = robotwin_frame(rng, *SIZE, prompt)
    actions, sent = [], [[first]]
    for chunk in range(chunks):
        reply = client.call({"obs": first, "prompt": prompt, "save_visualization": True, "video_guidance_scale": -1.0, "action_guidance_scale": 1.0})
        assert (reply["chunk_id"], reply["frozen"]) == (chunk + 1, 0)
        action = reply["action"]
        actions.append(action)
        key_frames = [robotwin_frame(rng, *SIZE, prompt) for _ in range(4 * (action.shape[1] - (chunk == 0)))]
        sent.append(key_frames)
        reply = client.call({"obs": key_frames, "compute_kv_cache": True, "imagine": False, "save_visualization": True, "state": action})
        assert set(reply) == {"server_timing"}
    return actions, sent


def all_pages_free(server) -> bool:
    """Every KV page back in the pool (each test ends its sessions' episodes with a reset that pins nothing)."""
    return server.metric('ardiff_kv_blocks_free{rank="0"}') == server.metric('ardiff_kv_blocks_total{rank="0"}')


def test_the_robotwin_client_runs_episodes_with_a_demonstration_and_every_page_comes_back(server):
    prompt = "grab the white mug"
    with LingBotVAClient(server.url) as client:
        assert client.metadata["embodiment"] == "zero_wam_tiny_robotwin" and client.metadata["continuations"] is False
        assert client.metadata["demonstration"]["key"] == "icl_demo_id"
        actions, _ = run_episode(client, prompt, 4, seed=1, reset=ICL)
        assert [a.shape for a in actions] == [SHAPE] * 4 and all(a.dtype == np.float32 and np.isfinite(a).all() for a in actions)
        again, _ = run_episode(client, prompt, 2, seed=1, reset=ICL)  # a reset: the same episode from the same seed
        np.testing.assert_array_equal(again[0], actions[0])
        np.testing.assert_array_equal(again[1], actions[1])
        other, _ = run_episode(client, prompt, 1, seed=1, reset={**ICL, "icl_demo_id": "tiny/stack_blocks/episode0"})
        assert np.abs(other[0] - actions[0]).max() > 1e-4  # another demonstration, another chunk
        text_cfg, _ = run_episode(client, prompt, 1, seed=1, reset={"use_icl": False, "video_guidance_scale": 5.0})
        assert np.abs(text_cfg[0] - actions[0]).max() > 1e-4
        client.call({"reset": True, "prompt": "done", "use_icl": False})
    assert all_pages_free(server)  # the last reset's episode holds nothing before its first chunk (no demonstration)
    status, body = server.http("/info")
    info = json.loads(body)
    assert status == 200 and info["policy"]["model"] == "zero_wam_tiny_robotwin" and info["policy"]["native_protocol"] == "lingbot_va"
    assert info["policy"]["server_config"]["demonstration"]["max_latent_frames"] == 4
    assert info["continuations"]["accepted"] is False and "zero_wam does not continue chunks" in json.dumps(info["continuations"])


@pytest.mark.parametrize(
    ("demo", "reason"),
    [
        ("missing/one", "no one.pth under the demonstration root"),
        ("too_long", "more than the 16 a session may pin"),
        ("broken", "cannot read broken.pth"),
        ("wrong_channels", "16 channels; the VAE has 48"),
        ("video_only", "only video_only.mp4 exists"),
        ("../escape", "must be relative, without '..'"),
    ],
)
def test_a_bad_demonstration_is_a_one_line_bad_request_and_the_server_keeps_serving(server, demo, reason):
    prompt = "grab the white mug"
    with LingBotVAClient(server.url) as client:
        with pytest.raises(ServerError) as refused:
            client.call({"reset": True, "prompt": prompt, **ICL, "icl_demo_id": demo})
        message = str(refused.value)
        assert message.startswith("bad request: icl_demo_id") and reason in message and "\n" not in message, message
        with pytest.raises(ServerError, match="before reset"):  # the failed reset began nothing
            client.call({"obs": robotwin_frame(np.random.default_rng(0), *SIZE, prompt)})
        actions, _ = run_episode(client, prompt, 1, seed=2, reset=ICL)  # the next reset works
        assert actions[0].shape == SHAPE
        client.call({"reset": True, "prompt": "done", "use_icl": False})


def test_reset_keys_are_checked_by_name(server):
    prompt = "grab the white mug"
    frame = robotwin_frame(np.random.default_rng(0), *SIZE, prompt)
    with LingBotVAClient(server.url) as client:
        for bad, match in (
            ({"icl_latent_path": "/data/x.pth"}, "icl_latent_path: server-side paths are not taken"),
            ({"icl_demo_id": None, "use_icl": True}, "icl_demo_id: missing; use_icl is true"),
            ({"use_icl": "yes"}, "use_icl: expected true or false"),
            ({"icl_guidance_scale": 99.0}, r"icl_guidance_scale: 99\.0 outside"),
            ({"prompt": ""}, "prompt: Zero-WAM's episode needs the task's prompt"),
        ):
            with pytest.raises(ServerError, match=match):
                client.call({"reset": True, "prompt": prompt, **ICL, **bad})
        client.call({"reset": True, "prompt": prompt, **ICL})
        with pytest.raises(ServerError, match="continuation: policy zero_wam does not continue chunks"):
            client.call({"obs": frame, "continuation": {"executed": 0, "delay": 2}})
        action = client.call({"obs": frame})["action"]
        with pytest.raises(ServerError, match="obs: 8 key frames; this chunk takes 4"):
            client.call({"obs": [frame] * 8, "compute_kv_cache": True, "state": action})
        client.call({"obs": [frame] * 4, "compute_kv_cache": True})  # state is not read (upstream's server never does)
        assert client.call({"obs": frame})["action"].shape == SHAPE
        client.call({"reset": True, "prompt": "done", "use_icl": False})


def test_openpi_names_the_demonstration_on_the_first_call_and_equals_the_robotwin_protocol(server):
    """An OpenPI session, one chunk per call (its key frames commit the chunk out), its demonstration named on the first
    call: the same actions as the RoboTwin-protocol episode of the same seed, prompt, frames and demonstration."""
    prompt = "grab the white mug"
    with LingBotVAClient(server.url) as client:
        reference, frames = run_episode(client, prompt, 3, seed=3, reset=ICL)
        client.call({"reset": True, "prompt": "done", "use_icl": False})
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    metadata = policy.get_server_metadata()
    assert metadata["actions"]["horizon"] == 32 and metadata["demonstration"]["served"] is True
    start = {"icl_demo_id": DEMO, "icl_guidance_scale": 5.0}
    for chunk in range(3):
        reply = policy.infer(openpi_request(frames[chunk], "robot", prompt, **(start if chunk in (0, 2) else {})))
        assert reply["session"]["execute_from"] == (16 if chunk == 0 else 0) and reply["chunk_id"] == chunk + 1
        assert reply["session"]["guidance"] == "in-context" and reply["session"]["demonstration"] == DEMO
        np.testing.assert_allclose(reply["actions"].T.reshape(SHAPE), reference[chunk], atol=1e-5, rtol=0)
    refusals = (
        ({"icl_demo_id": "tiny/stack_blocks/episode0"}, "icl_demo_id: 'tiny/stack_blocks/episode0' differs from this episode's 'tiny/wave'"),
        ({"action_guidance_scale": 2.0}, "action_guidance_scale: this server's policy takes no action guidance"),
        ({"continuation": {"executed": 0, "delay": 1}}, "continuation: policy zero_wam does not continue chunks"),
    )
    for extra, match in refusals:
        with pytest.raises(RuntimeError, match=match):
            policy.infer(openpi_request(frames[3], "robot", prompt, **extra))
    with pytest.raises(RuntimeError, match=r"icl_demo_id 'missing': no missing\.pth"):
        policy.infer(openpi_request(frames[0], "other", prompt, icl_demo_id="missing"))
    assert policy.infer({"endpoint": "reset", "session_ids": ["robot", "other"]})["status"] == "reset successful"
    assert all_pages_free(server)
