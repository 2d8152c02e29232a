"""Batched requests (openpi PR #941's ``{"batch": [obs, ...]}``) through the real server and the tiny DreamZero, over
a real socket with openpi-client's own msgpack: a batch equals its elements sent one by one, runs them in one
forward, keeps their order, refuses a bad element alone in its slot and a batch over the bound as a whole."""

from __future__ import annotations

import numpy as np
import pytest
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.sync.client import connect

from tests.helpers.server_harness import ServerProcess, droid_observation

SIZE = (90, 160)
ENVS = 3
MAX_ELEMENTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # batch_wait_ms: a partial batch waits for the rest, so the test does not depend on how fast the frame is read
    args = ["--set", "engine.warmup=false", "--set", "engine.batch_wait_ms=200", "--set", f"server.max_batch_elements={MAX_ELEMENTS}"]
    with ServerProcess("tiny", tmp_path_factory.mktemp("batch"), args=args) as process:
        yield process


def observation(env: int, call: int) -> dict:
    return droid_observation(1 if call == 0 else 4, seed=100 * env + call, joint0=0.1 * env - 0.05 * call, size=SIZE)


class Socket:
    """A raw websocket speaking openpi-client's msgpack (``openpi_client.msgpack_numpy``), as #941's client does."""

    def __init__(self, port: int) -> None:
        self.ws = connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, open_timeout=30)
        self.metadata = msgpack_numpy.unpackb(self.ws.recv())

    def send(self, payload: dict) -> dict | str:
        self.ws.send(msgpack_numpy.packb(payload))
        reply = self.ws.recv(timeout=300)
        return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)

    def close(self) -> None:
        self.ws.close()


def test_a_batch_equals_its_elements_one_by_one_and_runs_in_one_forward(server):
    calls = 3
    alone = []
    for env in range(ENVS):
        client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
        alone.append([client.infer({**observation(env, call), "session_id": f"alone-{env}"}) for call in range(calls)])
        client._ws.close()
    before = server.metric('ardiff_requests_total{outcome="ok"}')
    socket = Socket(server.port)
    batches = [socket.send({"batch": [observation(env, call) for env in range(ENVS)]}) for call in range(calls)]
    socket.close()
    for call, reply in enumerate(batches):
        assert isinstance(reply, dict) and len(reply["batch"]) == ENVS, reply
        ids = [slot["session"]["id"] for slot in reply["batch"]]
        assert len(set(ids)) == ENVS and all(sid.endswith(f"-batch{env}") for env, sid in enumerate(ids))  # slot i: env i
        for env, slot in enumerate(reply["batch"]):
            assert slot["session"]["calls"] == call + 1 and slot["session"]["new"] == (call == 0)
            np.testing.assert_allclose(slot["actions"], alone[env][call]["actions"], atol=1e-5, rtol=0, err_msg=f"env {env} call {call}")
    assert not np.allclose(alone[0][1]["actions"], alone[1][1]["actions"])  # the order is the envs', not interchangeable
    assert all(r["session"]["batch_size"] == 1 for replies in alone for r in replies)
    later = [slot["session"]["batch_size"] for reply in batches[1:] for slot in reply["batch"]]
    assert later == [ENVS] * len(later), "a steady batch did not run in one forward"
    assert server.metric('ardiff_requests_total{outcome="ok"}') - before == ENVS * calls  # each element counted
    assert server.metric("ardiff_request_batch_elements_count") >= calls
    assert server.metric("ardiff_request_batch_elements_sum") >= ENVS * calls


def test_a_bad_element_is_refused_in_its_slot_and_the_others_go_on(server):
    socket = Socket(server.port)
    first = socket.send({"batch": [{**observation(env, 0), "session_id": f"slot-{env}"} for env in range(ENVS)]})
    assert [slot["session"]["calls"] for slot in first["batch"]] == [1, 1, 1]
    bad_before = server.metric('ardiff_requests_total{outcome="bad_request"}')
    ok_before = server.metric('ardiff_requests_total{outcome="ok"}')
    broken = {**observation(1, 1), "session_id": "slot-1"}
    del broken["observation/joint_position"]
    reply = socket.send({"batch": [{**observation(0, 1), "session_id": "slot-0"}, broken, {**observation(2, 1), "session_id": "slot-2"}]})
    slots = reply["batch"]
    assert slots[1] == {
        "error": "bad request: observation/joint_position: missing; expected 7 numbers (float array or list), the arm's joint positions "
        "(DROID actions are joint positions relative to them)",
        "outcome": "bad_request",
    }
    assert [slots[0]["session"]["id"], slots[2]["session"]["id"]] == ["slot-0", "slot-2"]
    assert slots[0]["session"]["calls"] == slots[2]["session"]["calls"] == 2 and slots[0]["actions"].shape == (24, 8)
    assert server.metric('ardiff_requests_total{outcome="bad_request"}') - bad_before == 1
    assert server.metric('ardiff_requests_total{outcome="ok"}') - ok_before == 2
    # slot-1's session is untouched: its next call is its second
    again = socket.send({"batch": [{**observation(1, 1), "session_id": "slot-1"}]})
    assert again["batch"][0]["session"]["calls"] == 2
    # an id-less reset ends the connection's current sessions: every one of its last batch
    assert socket.send({"endpoint": "reset"})["session_ids"] == ["slot-1"]
    assert socket.send({"endpoint": "reset", "session_ids": ["slot-0", "slot-2"]})["status"] == "reset successful"
    socket.close()


def test_a_batch_over_the_bound_is_refused_whole_and_the_connection_stays(server):
    socket = Socket(server.port)
    refused = socket.send({"batch": [observation(env, 0) for env in range(MAX_ELEMENTS + 1)]})
    assert refused == f"bad request: batch: expected at most {MAX_ELEMENTS} requests (server.max_batch_elements), got {MAX_ELEMENTS + 1}"
    served = socket.send({"batch": [observation(0, 0)]})
    assert served["batch"][0]["session"]["calls"] == 1
    socket.close()
