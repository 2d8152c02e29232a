"""DreamZero's sim_evals client (``eval_utils/run_sim_eval.py``, the evaluation its README recommends first),
emulated from the protocol it speaks (never from its code), against the tiny DreamZero-DROID in process.

What it does, per IsaacLab DROID environment (``num_envs=1``):
* connects like RoboArena's client (no compression, no size limit, 60 s pings / 600 s timeout) and reads the
  metadata frame, using nothing from it;
* every ``open_loop_horizon`` (8) steps sends one request: the three cameras as single (180, 320, 3) uint8 frames
  (``resize_with_pad`` of the simulator's images: black bars), ``observation/joint_position`` of shape (1, 7) and
  ``observation/gripper_position`` of shape (1, 1), float64, as the simulator's per-environment tensors come,
  a dummy ``observation/cartesian_position`` of zeros (6,), ``prompt``, a uuid4 ``session_id`` and
  ``endpoint: "infer"``;
* reads ``reply["actions"]`` (or a bare array), asserts it is 2-D with 8 columns, executes rows 0..7;
* ``reset()`` between episodes only mints a new uuid: nothing is sent.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from openpi_client import msgpack_numpy
from websockets.sync.client import connect

from tests.helpers.inproc_server import InprocServer

OPEN_LOOP_HORIZON = 8


@pytest.fixture(scope="module")
def server():
    config = {"engine": {"warmup": False, "kv_budget_gib": 0.05}, "policy": {"name": "dreamzero", "view_size": [48, 80]}}
    with InprocServer(config) as running:
        yield running


def padded_frame(rng: np.random.Generator) -> np.ndarray:
    """A 16:9 simulator image letterboxed into 180x320 (resize_with_pad keeps the aspect: here it adds bars)."""
    frame = np.zeros((180, 320, 3), np.uint8)
    frame[10:170] = rng.integers(0, 256, (160, 320, 3), dtype=np.uint8)
    return frame


def sim_request(rng: np.random.Generator, joints: np.ndarray, gripper: float, session_id: str, instruction: str) -> dict:
    return {
        "observation/exterior_image_0_left": padded_frame(rng),  # the sim's right camera
        "observation/exterior_image_1_left": padded_frame(rng),  # its left camera
        "observation/wrist_image_left": padded_frame(rng),
        "observation/joint_position": joints.reshape(1, 7).astype(np.float64),  # (num_envs, 7)
        "observation/cartesian_position": np.zeros((6,), dtype=np.float64),
        "observation/gripper_position": np.array([[gripper]], dtype=np.float64),  # (num_envs, 1)
        "prompt": instruction,
        "session_id": session_id,
        "endpoint": "infer",
    }


def call(ws, request: dict):
    ws.send(msgpack_numpy.Packer().pack(request))
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def test_sim_evals_episodes_run_with_per_environment_state_arrays(server):
    rng = np.random.default_rng(0)
    with connect(server.url, compression=None, max_size=None, ping_interval=60, ping_timeout=600) as ws:
        msgpack_numpy.unpackb(ws.recv())  # the metadata frame; the client ignores it
        for episode in range(2):
            session_id = str(uuid.uuid4())  # reset(): a new id, nothing sent
            joints, gripper = np.array([0.0, -0.6, 0.0, -2.4, 0.0, 1.8, 0.8]), 0.0
            for chunk in range(2):
                reply = call(ws, sim_request(rng, joints, gripper, session_id, "put the cube in the bowl"))
                assert not isinstance(reply, str), reply
                actions = reply["actions"] if isinstance(reply, dict) else reply
                assert len(actions.shape) == 2 and actions.shape[-1] == 8  # the client's own asserts
                assert reply["session"]["id"] == session_id and reply["session"]["calls"] == chunk + 1
                for step in range(OPEN_LOOP_HORIZON):  # executed open loop; the gripper binarized client-side
                    action = actions[step]
                    joints, gripper = action[:7].astype(np.float64), float(action[-1] > 0.5)
            assert episode == 0 or reply["session"]["new"] is False


def test_a_batch_of_one_is_the_same_state_and_a_real_batch_is_refused_in_one_line(server):
    rng = np.random.default_rng(1)
    joints = np.array([0.1, -0.5, 0.2, -2.2, 0.1, 1.7, 0.6])
    request = sim_request(rng, joints, 1.0, "batched", "pick up the can")
    flat = {**request, "observation/joint_position": joints, "observation/gripper_position": np.array([1.0]), "session_id": "flat"}
    with connect(server.url, compression=None, max_size=None) as ws:
        ws.recv()
        batched_reply, flat_reply = call(ws, request), call(ws, flat)
        np.testing.assert_array_equal(batched_reply["actions"], flat_reply["actions"])
        two_envs = {**request, "observation/joint_position": np.zeros((2, 7)), "session_id": "batched"}
        error = call(ws, two_envs)
        assert isinstance(error, str) and "\n" not in error
        assert error == "bad request: observation/joint_position: expected 7 numbers (float array or list), got shape (2, 7)"
        two_grippers = {**request, "observation/gripper_position": np.zeros((2, 1)), "session_id": "batched"}
        assert call(ws, two_grippers) == "bad request: observation/gripper_position: expected 1 number (float, float array or list), got shape (2, 1)"
        after = call(ws, {**request, "session_id": "batched"})  # the connection and the session carry on
        assert after["session"]["calls"] == 2 and not after["session"]["new"]
