"""AgiBot and YAM DreamZeros (the tiny post-trained-style checkpoints) served end to end to openpi's client.

A client learns everything from the metadata frame and ``GET /info`` (cameras and their resolutions, state
keys and dims, the action split, the horizon) and sends ``observation/<camera>`` / ``observation/<state key>``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from ardiff_client import replay
from tests.helpers.inproc_server import InprocServer
from tests.helpers.server_harness import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


def request_from_schema(metadata: dict, frames: int, *, seed: int = 0, batch_axis: bool = False, prompt: str = "fold the towel") -> dict:
    """What a robot sends, built from the metadata frame alone."""
    rng = np.random.default_rng(seed)
    request = {}
    for camera in metadata["observation"]["cameras"]:
        h, w = camera["resolution"]
        shape = (h, w, 3) if frames == 1 else (frames, h, w, 3)
        request[camera["key"]] = rng.integers(0, 256, shape, dtype=np.uint8)
    for part in metadata["observation"]["state"]:
        value = rng.uniform(-0.5, 0.5, part["dim"])
        request[part["key"]] = value[None] if batch_axis else value  # (dim,) or a batch of one (1, dim)
    request["prompt"] = prompt
    return request


@pytest.fixture(scope="module")
def agibot():
    config = {
        "engine": {"warmup": False, "kv_budget_gib": 0.05},
        "policy": {"name": "dreamzero", "checkpoint": "builtin:tiny_agibot", "view_size": [48, 80]},
    }
    with InprocServer(config) as running:
        yield running


def test_agibot_metadata_frame_and_info_say_what_to_send_and_what_comes_back(agibot):
    client = WebsocketClientPolicy(host="127.0.0.1", port=agibot.port)
    metadata = client.get_server_metadata()
    assert metadata["embodiment"] == "agibot" and metadata["needs_session_id"] is True
    cameras = metadata["observation"]["cameras"]
    assert [c["key"] for c in cameras] == ["observation/top_head", "observation/hand_left", "observation/hand_right"]
    assert all(c["resolution"] == [96, 160] for c in cameras)  # metadata.json's modalities.video
    state = {p["key"]: p["dim"] for p in metadata["observation"]["state"]}
    assert state == {
        "observation/left_arm_joint_position": 7,
        "observation/right_arm_joint_position": 7,
        "observation/left_effector_position": 1,
        "observation/right_effector_position": 1,
        "observation/head_position": 2,
        "observation/waist_position": 2,
    }
    actions = metadata["actions"]
    assert actions["horizon"] == 24 and actions["dim"] == 22
    split = {s["name"]: (s["start"], s["stop"], s["relative_to_state"]) for s in actions["split"]}
    assert split["left_arm_joint_position"] == (0, 7, True) and split["robot_velocity"] == (20, 22, False)
    status, body = agibot.http("/info")
    policy = json.loads(body)["policy"]
    assert status == 200 and policy["action_shape"] == [24, 22] and policy["server_config"] == metadata
    assert policy["embodiment"]["tag"] == "agibot" and policy["embodiment"]["embodiment_id"] == 26
    assert policy["embodiment"]["observation"] == metadata["observation"]
    assert "experiment_cfg/conf.yaml" in policy["embodiment"]["sources"]["keys"]
    # how many frames per call: 1 at a session's start, then 4 (said once, in both places)
    assert metadata["frames_per_call"]["first"] == 1 and metadata["frames_per_call"]["later"] == 4
    assert policy["frames_per_call"] == metadata["frames_per_call"]


def test_agibot_episode_over_openpi_client_and_bad_requests_name_the_key(agibot):
    client = WebsocketClientPolicy(host="127.0.0.1", port=agibot.port)
    metadata = client.get_server_metadata()
    first = client.infer({**request_from_schema(metadata, 1), "session_id": "agi"})
    assert first["actions"].shape == (24, 22) and first["actions"].dtype == np.float32 and np.isfinite(first["actions"]).all()
    assert first["session"]["new"] and first["session"]["current_start_frame"] == 3
    second = client.infer({**request_from_schema(metadata, 4, seed=1), "session_id": "agi"})
    assert second["session"]["calls"] == 2 and second["session"]["current_start_frame"] == 5
    bad = request_from_schema(metadata, 4, seed=2)
    del bad["observation/head_position"]
    bad["observation/head_pos"] = np.zeros(2)
    with pytest.raises(
        RuntimeError, match=r"bad request: observation/head_position: missing; expected 2 numbers .*unknown keys \['observation/head_pos'\]"
    ):
        client.infer({**bad, "session_id": "agi"})
    wrong = {**request_from_schema(metadata, 4, seed=2), "observation/waist_position": np.zeros((2, 2))}  # a real batch
    with pytest.raises(
        RuntimeError, match=r"bad request: observation/waist_position: expected 2 numbers \(float array or list\), got shape \(2, 2\)"
    ):
        client.infer({**wrong, "session_id": "agi"})
    with pytest.raises(RuntimeError, match=r"bad request: observation/top_head: missing; expected a uint8 RGB image"):
        client.infer({k: v for k, v in request_from_schema(metadata, 4).items() if k != "observation/top_head"} | {"session_id": "agi"})
    third = client.infer({**request_from_schema(metadata, 4, seed=3), "session_id": "agi"})
    assert third["session"]["calls"] == 3 and not third["session"]["new"]  # bad requests cost no episode
    client.infer({"endpoint": "reset", "session_id": "agi"})


def test_ardiff_client_drives_the_agibot_schema_with_synthetic_frames(agibot, capsys, tmp_path):
    record = tmp_path / "agibot.npz"
    argv = ["--port", str(agibot.port), "--calls", "3", "--json", "--quiet", "--record", str(record)]
    assert replay.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["camera_keys"] == ["observation/top_head", "observation/hand_left", "observation/hand_right"]
    assert report["image_size"] == [96, 160] and report["calls"] == 3 and report["ended"] == "calls"
    assert all(r["actions_shape"] == [24, 22] for r in report["records"])
    sent = [r["state"] for r in report["records"]]
    assert set(sent[0]) == {
        "left_arm_joint_position",
        "right_arm_joint_position",
        "left_effector_position",
        "right_effector_position",
        "head_position",
        "waist_position",
    }
    assert sent[0]["head_position"] == [0.0, 0.0] and sent[1]["head_position"] != [0.0, 0.0]  # fed back from the chunk
    with np.load(record) as data:
        assert data["state"].shape == (3, 20) and data["actions"].shape == (3, 24, 22)
        np.testing.assert_allclose(data["state"][1, 16:18], data["actions"][0, -1, 16:18], atol=1e-6)  # --feedback end


def test_tiny_yam_config_serves_openpi_clients_from_its_own_process(tmp_path):
    """``ardiff-serve --config tiny_yam``: a worker process, shared-memory frames, the YAM schema."""
    with ServerProcess("tiny_yam", tmp_path, args=["--set", "engine.warmup=false", "--set", "engine.kv_budget_gib=0.05"]) as process:
        client = WebsocketClientPolicy(host="127.0.0.1", port=process.port)
        metadata = client.get_server_metadata()
        assert metadata["embodiment"] == "yam" and metadata["actions"]["dim"] == 14
        assert [c["name"] for c in metadata["observation"]["cameras"]] == [
            "top_camera-images-rgb",
            "left_camera-images-rgb",
            "right_camera-images-rgb",
        ]
        assert [(p["name"], p["dim"]) for p in metadata["observation"]["state"]] == [
            ("left_joint_pos", 6),
            ("left_gripper_pos", 1),
            ("right_joint_pos", 6),
            ("right_gripper_pos", 1),
        ]
        flat = client.infer({**request_from_schema(metadata, 1, seed=5), "session_id": "flat"})
        batched = client.infer({**request_from_schema(metadata, 1, seed=5, batch_axis=True), "session_id": "batched"})
        assert flat["actions"].shape == (24, 14)
        np.testing.assert_array_equal(flat["actions"], batched["actions"])  # (dim,) and (1, dim) are one state
        later = client.infer({**request_from_schema(metadata, 4, seed=6), "session_id": "flat"})
        assert later["session"]["calls"] == 2
        status, body = process.http("/info")
        assert status == 200 and json.loads(body)["policy"]["embodiment"]["relative_action_keys"] == [
            "left_joint_pos",
            "left_gripper_pos",
            "right_joint_pos",
            "right_gripper_pos",
        ]
        reply = client.infer({"endpoint": "reset", "session_ids": ["flat", "batched"]})
        assert reply["status"] == "reset successful"
        assert process.metric('ardiff_kv_blocks_total{rank="0"}') == process.metric('ardiff_kv_blocks_free{rank="0"}')
