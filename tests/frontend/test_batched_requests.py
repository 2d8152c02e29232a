"""Batched requests in the front end (``frontend/openpi_batch.py``) against the in-process server and the fake policy:
each slot its element's own reply or error (another key's session, a derived id taken), both reply formats, the
bound in ``/info``. The tiny DreamZero's numbers and one forward: tests/e2e/test_batched_requests.py."""

from __future__ import annotations

import json

import numpy as np
from openpi_client import msgpack_numpy
from websockets.sync.client import connect

from tests.helpers.fake_policy import session_tag
from tests.helpers.inproc_server import InprocServer
from tests.helpers.server_harness import droid_observation, fake_config, metric_value

SIZE = (18, 32)


def robot(server, key: str | None = None):
    headers = {"Authorization": f"Api-Key {key}"} if key else None
    ws = connect(server.url, compression=None, max_size=None, additional_headers=headers)
    ws.recv()  # metadata
    return ws


def ask(ws, request: dict):
    ws.send(msgpack_numpy.packb(request))
    reply = ws.recv(timeout=30)
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def obs(session_id: str | None = None, joint0: float = 0.0) -> dict:
    return droid_observation(session_id=session_id, joint0=joint0, size=SIZE)


def test_another_keys_session_is_refused_in_its_slot_and_the_others_are_served():
    with InprocServer(fake_config(max_sessions=6, server={"api_keys": ["alpha", "beta"]})) as server:
        alpha, beta = robot(server, "alpha"), robot(server, "beta")
        assert ask(alpha, obs("mine"))["actions"][0, 0] == 1
        reply = ask(beta, {"batch": [obs("b0", 0.25), obs("mine"), obs("b1", 0.5)]})
        first, refused, last = reply["batch"]
        assert refused == {"error": "forbidden: session mine belongs to another API key", "outcome": "forbidden"}
        assert (first["session"]["id"], last["session"]["id"]) == ("b0", "b1")  # in order, each its own session
        assert first["actions"][0, :3].tolist() == [1.0, 0.25, session_tag("b0")]
        assert last["actions"][0, :3].tolist() == [1.0, 0.5, session_tag("b1")]
        assert ask(alpha, obs("mine"))["actions"][0, 0] == 2  # its owner's episode goes on
        metrics = server.http("/metrics", {"Authorization": "Api-Key alpha"})[1]
        assert metric_value(metrics, 'ardiff_requests_total{outcome="forbidden"}') == 1
        assert metric_value(metrics, 'ardiff_requests_total{outcome="ok"}') == 4
        assert metric_value(metrics, "ardiff_request_batch_elements_sum") == 3
        alpha.close()
        beta.close()


def test_derived_sessions_follow_the_slot_and_an_explicit_id_may_not_take_one():
    with InprocServer(fake_config(max_sessions=4, max_batch=4, policy={"max_batch": 4})) as server:
        info = json.loads(server.http("/info")[1])
        assert info["batching"]["max_batch_elements"] == 4  # auto: engine.max_sessions x replicas
        ws = robot(server)
        first = ask(ws, {"batch": [obs(), obs()]})["batch"]
        ids = [slot["session"]["id"] for slot in first]
        assert ids[0].endswith("-batch0") and ids[1] == ids[0][: -len("0")] + "1"
        second = ask(ws, {"batch": [obs(), obs()]})["batch"]
        assert [slot["session"]["calls"] for slot in second] == [2, 2]  # slot i keeps its episode
        taken = ask(ws, {"batch": [obs(ids[1]), obs()]})["batch"]  # element 0 names slot 1's derived session
        assert (taken[0]["session"]["id"], taken[0]["session"]["calls"]) == (ids[1], 3)
        assert taken[1] == {
            "error": f"bad request: session_id: {ids[1]!r} is element 0's too; each element is its own session",
            "outcome": "bad_request",
        }
        ws.close()


def test_the_array_reply_format_puts_the_bare_actions_in_each_slot():
    with InprocServer(fake_config(server={"reply_format": "array"})) as server:
        ws = robot(server)
        broken = obs("b")
        broken["observation/gripper_position"] = np.array([np.nan])
        slots = ask(ws, {"batch": [obs("a", 0.5), broken]})["batch"]
        assert isinstance(slots[0], np.ndarray) and slots[0].dtype == np.float32 and slots[0][0, :2].tolist() == [1.0, 0.5]
        assert slots[1]["outcome"] == "bad_request" and slots[1]["error"].startswith("bad request: observation/gripper_position: expected finite")
        ws.close()
