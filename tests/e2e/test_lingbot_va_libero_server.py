"""``ardiff-serve --config tiny_lingbot_va_libero``: upstream's LIBERO evaluation client's call order
(``evaluation/libero/client.py``, written here from its loop) over LingBot-VA's own protocol on a real socket, and the
same episode over OpenPI, against the tiny twin of LingBot-VA's LIBERO embodiment."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from safetensors.torch import load_file

from ardiff_policies.lingbot_va.tiny import TINY_LIBERO_EMBODIMENT
from tests.helpers.lingbot_va_client import LingBotVAClient, ServerError
from tests.helpers.scripts import load_script
from tests.helpers.server_harness import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

RECORD = load_script("record_upstream_lingbot_va_libero")  # the episodes, frames and seed the references were made with
REFERENCE = Path(__file__).parents[1] / "reference_data" / RECORD.NAME
CAMERAS = TINY_LIBERO_EMBODIMENT.cameras
SHAPE = (7, 4, 4)  # upstream's reply: (used channels, frames per chunk, actions per frame)


def libero_episode(client: LingBotVAClient, episode: dict) -> tuple[list[np.ndarray], list[list[dict]]]:
    """Upstream's ``run_one``: reset with the task's language; per chunk infer with the episode's first observation,
    execute every action (the first chunk's first latent frame skipped) keeping a key frame after every
    ``action.shape[2] // 4`` of them, then compute_kv_cache with those frames and the action array as received; the
    chunk during which the simulator says done is not committed. Returns every chunk's actions and the frames sent
    (the first observation, then each committed chunk's key frames)."""
    assert set(client.call({"reset": True, "prompt": episode["prompt"]})) == {"server_timing"}
    first = RECORD.libero_frame(CAMERAS, episode["frames"])
    actions, sent = [], [[first]]
    for chunk in range(episode["chunks"] + episode["unfinished"]):
        action = client.call({"obs": first, "prompt": episode["prompt"]})["action"]
        actions.append(action)
        if chunk == episode["chunks"]:  # the simulator says done while this chunk executes: the client stops here
            break
        assert action.shape[2] % 4 == 0
        per_frame = action.shape[2] // 4
        key_frames = 0
        for _frame in range(1 if chunk == 0 else 0, action.shape[1]):
            for j in range(action.shape[2]):
                key_frames += (j + 1) % per_frame == 0  # (the simulator steps with action[:, frame, j] here)
        frames = RECORD.episode_frames(CAMERAS, episode, chunk, key_frames)
        reply = client.call({"obs": frames, "compute_kv_cache": True, "imagine": False, "state": action})
        assert set(reply) == {"server_timing"}
        sent.append(frames)
    return actions, sent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("tiny_lingbot_va_libero", tmp_path_factory.mktemp("libero"), args=["--set", "engine.warmup=false"]) as process:
        yield process


def test_the_metadata_tells_libero_cameras_frames_per_call_and_actions(server):
    with LingBotVAClient(server.url) as client:
        meta = client.metadata
    assert meta["embodiment"] == "lingbot_va_tiny_libero" and meta["protocols"] == ["openpi", "lingbot_va"]
    assert [c["key"] for c in meta["observation"]["cameras"]] == ["observation/agentview_rgb", "observation/eye_in_hand_rgb"]
    assert meta["frames_per_call"] == {"first": 1, "after_first_chunk": 12, "later": 16}
    assert (meta["actions"]["horizon"], meta["actions"]["dim"]) == (16, 7)
    assert meta["guidance"]["video_guidance_scale"] == 5 and meta["guidance"]["action_guidance_scale"] == 1


def test_libero_clients_call_order_runs_episodes_on_one_connection(server):
    """Two episodes on one connection as the client runs them (the first ends mid-chunk, uncommitted), then the first
    again: replayed from the seed at reset. A bad request names the camera and the episode goes on. With the recorded
    references: the actions are upstream's server's over the same calls (<= 1e-5). Every KV page is back after."""
    with LingBotVAClient(server.url) as client:
        runs = [libero_episode(client, episode)[0] for episode in RECORD.EPISODES]
        for actions, episode in zip(runs, RECORD.EPISODES):
            assert [a.shape for a in actions] == [SHAPE] * (episode["chunks"] + episode["unfinished"])
            assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in actions)
        again, _ = libero_episode(client, RECORD.EPISODES[0])
        for a, b in zip(again, runs[0]):
            np.testing.assert_array_equal(a, b)
        client.call({"reset": True, "prompt": RECORD.EPISODES[1]["prompt"]})
        first = RECORD.libero_frame(CAMERAS, 3)
        with pytest.raises(ServerError, match="eye_in_hand_rgb"):
            client.call({"obs": {CAMERAS[0]: first[CAMERAS[0]]}, "prompt": RECORD.EPISODES[1]["prompt"]})
        assert client.call({"obs": first})["action"].shape == SHAPE
        client.call({"reset": True, "prompt": "done"})
    assert server.metric('ardiff_kv_blocks_total{rank="0"}') == server.metric('ardiff_kv_blocks_free{rank="0"}')
    if not REFERENCE.with_suffix(".safetensors").exists():
        pytest.skip(f"{REFERENCE.name}.safetensors is absent: record it with scripts/record_upstream_lingbot_va_libero.py")
    tensors = load_file(REFERENCE.with_suffix(".safetensors"))
    for n, actions in enumerate(runs):
        for chunk, action in enumerate(actions):
            error = np.abs(action - tensors[f"ep{n}.actions.{chunk}"].numpy()).max()
            assert error <= 1e-5, f"episode {n} chunk {chunk}: max abs error {error:.2e} against upstream's server"


def test_the_same_episode_over_openpi_gives_the_same_actions(server):
    """One OpenPI request per chunk (the first observation, then each chunk's key frames, which commit the chunk out):
    the actions of the LingBot-VA-protocol episode, time-major; the first chunk's first latent frame not executed."""
    episode = RECORD.EPISODES[1]
    with LingBotVAClient(server.url) as client:
        reference, sent = libero_episode(client, episode)
        client.call({"reset": True, "prompt": "done"})
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    for chunk, frames in enumerate(sent[: len(reference)]):
        request = {"session_id": "libero", "prompt": episode["prompt"]}
        for camera in CAMERAS:
            stack = np.stack([frame[camera] for frame in frames])
            request["observation/" + camera.removeprefix("observation.images.")] = stack[0] if len(frames) == 1 else stack
        reply = policy.infer(request)
        assert reply["actions"].shape == (16, 7) and reply["session"]["execute_from"] == (4 if chunk == 0 else 0)
        np.testing.assert_allclose(reply["actions"].T.reshape(SHAPE), reference[chunk], atol=1e-5, rtol=0)
    assert policy.infer({"endpoint": "reset", "session_ids": ["libero"]})["status"] == "reset successful"
    status, body = server.http("/info")
    assert status == 200 and json.loads(body)["policy"]["native_protocol"] == "lingbot_va"


def test_ardiff_client_drives_libero_from_its_metadata(server, capsys):
    """ardiff-client reads the cameras and frames_per_call from the metadata: 1 frame, then 12, then 16."""
    from ardiff_client import replay

    status = replay.main(["--port", str(server.port), "--calls", "3", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    report = json.loads(out)
    assert report["calls"] == 3 and report["error"] is None
    assert [record["frames"] for record in report["records"]] == [1, 12, 16]
