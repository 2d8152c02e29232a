"""Every client that talks to DreamZero servers today, emulated from the protocol it speaks (never
from its code), against the real PolicyServer (in-process engine: these are protocol tests)."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.helpers.fake_policy import session_tag
from tests.helpers.inproc_server import InprocServer
from tests.helpers.roboarena import PolicyServerConfig
from tests.helpers.server_harness import REPO, droid_observation, fake_config

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


@pytest.fixture(scope="module")
def server():
    with InprocServer(fake_config()) as running:
        yield running


@pytest.fixture(scope="module")
def array_server():
    with InprocServer(fake_config(server={"reply_format": "array"})) as running:
        yield running


def call(ws, obs: dict):
    ws.send(msgpack_numpy.packb(obs))
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def test_roboarena_server_test_builds_the_dataclass_and_runs_an_episode(server):
    with connect(server.url, compression=None, max_size=None) as ws:
        config = PolicyServerConfig(**msgpack_numpy.unpackb(ws.recv()))
        h, w = config.image_resolution
        for n in range(1, 4):
            obs = {
                "observation/exterior_image_0_left": np.zeros((h, w, 3), np.uint8),
                "observation/exterior_image_1_left": np.zeros((h, w, 3), np.uint8),
                "observation/wrist_image_left": np.zeros((h, w, 3), np.uint8),
                "observation/joint_position": np.zeros(7),
                "observation/gripper_position": np.zeros(1),
                "prompt": "pick up the cup",
                "session_id": "38DSA3hd3",
                "endpoint": "infer",
            }
            assert call(ws, obs)["actions"][0, 0] == n
        assert call(ws, {"endpoint": "reset", "session_id": "38DSA3hd3"})["status"] == "reset successful"


def test_dreamzero_client_sequence_with_bare_array_replies(array_server):
    """DreamZero's test_client_AR.py: 1 frame, then (4, H, W, 3) stacks, float64 state, a new uuid
    per episode, ``reset({})`` without an id, and it asserts the reply is a bare (N, 8) array."""
    with connect(array_server.url, compression=None, max_size=None) as ws:
        PolicyServerConfig(**msgpack_numpy.unpackb(ws.recv()))
        for _episode in range(2):
            session = str(uuid.uuid4())
            for n in range(1, 4):
                frames = 1 if n == 1 else 4
                obs = droid_observation(frames, session_id=session, joint0=0.25 * n)
                obs["observation/joint_position"] = obs["observation/joint_position"].astype(np.float64)
                actions = call(ws, obs)
                assert isinstance(actions, np.ndarray) and actions.dtype == np.float32 and actions.shape == (4, 8)
                assert actions[0, :3].tolist() == [n, 0.25 * n, session_tag(session)]
            reply = call(ws, {"endpoint": "reset"})  # reset({}): the connection's current session
            assert reply["status"] == "reset successful" and reply["session_ids"] == [session]
        error = call(ws, {"observation/joint_position": "not numbers"})
        assert isinstance(error, str) and error.startswith("bad request:")  # errors stay text frames


def test_isaaclab_arena_interleaves_ids_on_one_connection_and_resets_them(server):
    ids = [f"env{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    with connect(server.url, compression=None, max_size=None) as ws:
        ws.recv()
        for round_ in range(1, 6):
            for i, sid in enumerate(ids):
                reply = call(ws, droid_observation(session_id=sid, joint0=float(i)))
                assert reply["session"]["calls"] == round_ and reply["actions"][0, 2] == session_tag(sid)
        reply = call(ws, {"endpoint": "reset", "session_ids": ids[:2]})
        assert reply == {"status": "reset successful", "session_ids": ids[:2]}
        assert [call(ws, droid_observation(session_id=sid))["session"]["calls"] for sid in ids] == [1, 1, 6]
        reply = call(ws, {"endpoint": "reset", "session_ids": None})  # every session this connection used
        assert reply["session_ids"] == sorted(ids)
        assert [call(ws, droid_observation(session_id=sid))["session"]["calls"] for sid in ids] == [1, 1, 1]


SESSION_ID_FORMS = {
    "str": str,
    "int": int,
    "np.int32": np.int32,
    "np.uint64": np.uint64,
    "array[int]": lambda n: np.array([n]),
    "array[str]": lambda n: np.array([str(n)]),
    "bytes": lambda n: str(n).encode(),
    "np.str_": lambda n: np.str_(str(n)),
    "list": lambda n: [n],
}


@pytest.mark.parametrize("form", SESSION_ID_FORMS)
def test_session_ids_of_every_accepted_type_are_one_session(server, form):
    number = uuid.uuid4().int % 10**9
    with connect(server.url, compression=None, max_size=None) as ws:
        ws.recv()
        first = droid_observation()
        first["session_id"] = SESSION_ID_FORMS[form](number)
        assert call(ws, first)["session"]["id"] == str(number)
        assert call(ws, droid_observation(session_id=f" {number} "))["session"]["calls"] == 2  # the same session


def test_session_ids_that_are_not_one_id_are_bad_requests(server):
    with connect(server.url, compression=None, max_size=None) as ws:
        ws.recv()
        for bad in ({}, 1.5, True, ["a", "b"], np.zeros((1, 1)), "", "x" * 300):
            obs = droid_observation()
            obs["session_id"] = bad
            reply = call(ws, obs)
            assert isinstance(reply, str) and reply.startswith("bad request: session_id:"), (bad, reply)


def test_bearer_keys_and_the_vllm_omni_route(tmp_path):
    with InprocServer(fake_config(server={"api_keys": ["k-123"]})) as keyed:
        for path in ("/", "/v1/realtime/robot/openpi"):
            with connect(keyed.url + path, additional_headers={"Authorization": "Bearer k-123"}) as ws:
                PolicyServerConfig(**msgpack_numpy.unpackb(ws.recv()))
                assert call(ws, droid_observation(session_id=f"route{path}"))["session"]["calls"] == 1
        with pytest.raises(InvalidStatus) as refused:
            connect(keyed.url, additional_headers={"Authorization": "Bearer nope"})
        assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus) as unknown:
            connect(keyed.url + "/somewhere", additional_headers={"Authorization": "Bearer k-123"})
        assert unknown.value.response.status_code == 404
        assert keyed.http("/info")[0] == 401 and keyed.http("/healthz") == (200, "OK\n")


def test_info_has_everything_the_metadata_frame_does_not(server):
    status, body = server.http("/info")
    info = json.loads(body)
    assert status == 200
    assert info["policy"]["action_shape"] == [4, 8] and info["policy"]["model"] == "fake"
    assert info["server"]["version"] and info["websocket_paths"] == ["/", "/v1/realtime/robot/openpi"]
    assert info["replicas"][0]["state"] == "ready"
    assert info["config"]["server"]["api_keys"] == "<0 key(s)>" and info["config"]["policy"]["name"] == "fake"


def test_the_readme_openpi_snippet_runs_as_written(server):
    """The README's first Python block, pointed at this server's port."""
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "port=8000" in snippet
    snippet = snippet.replace("port=8000", f"port={server.port}")
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["reply"]["actions"].shape == (4, 8)


def test_openpi_client_metadata_and_reset_call(server):
    client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    assert PolicyServerConfig(**client.get_server_metadata()).needs_session_id
    client.infer(droid_observation(session_id="openpi-1"))
    # openpi's reset() sends nothing; a robot resets through infer with the endpoint key
    assert client.infer({"endpoint": "reset", "session_id": "openpi-1"})["status"] == "reset successful"
    assert client.infer(droid_observation(session_id="openpi-1"))["session"]["calls"] == 1


def test_readme_mentions_the_session_model():
    readme = Path(REPO / "README.md").read_text()
    assert "session_ttl_s" in readme and "/info" in readme and "typing_extensions" in readme
