"""A robot that moves to a new session id on a full server (issue #34, items 2 and 6).

The real server (in-process engine) over loopback websockets: the switch releases the old
session before the new one is admitted, so the new episode is served on its first request (the
old session, switched away from, is the one evicted and its KV pages return to the pool); the
same under a per-key limit, and over many connect/disconnect cycles of one key.
"""

from __future__ import annotations

import pytest
from openpi_client import msgpack_numpy
from websockets.sync.client import connect

from tests.helpers.inproc_server import InprocServer
from tests.helpers.server_harness import droid_observation, fake_config

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


def open_robot(server: InprocServer, key: str | None = None):
    headers = {"Authorization": f"Api-Key {key}"} if key is not None else None
    ws = connect(server.url, compression=None, max_size=None, additional_headers=headers)
    ws.recv()  # metadata
    return ws


def call(ws, session_id: str | None = None) -> dict | str:
    ws.send(msgpack_numpy.packb(droid_observation(session_id=session_id)))
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def served(reply: dict | str) -> dict:
    assert not isinstance(reply, str), reply
    return reply["session"]


def test_a_newcomer_on_a_full_server_is_told_why_once():
    """The refusal named ``server at capacity`` twice (the engine's message, prefixed again by the service)."""
    with InprocServer(fake_config(max_sessions=2)) as server, open_robot(server) as one, open_robot(server) as two:
        served(call(one, "a"))
        served(call(two, "b"))
        with open_robot(server) as three:
            assert call(three, "c") == (
                "server at capacity: 2 sessions open (engine.max_sessions: 2) and a robot is attached to each; "
                "retry after a robot resets or disconnects, or serve more with a larger engine.max_sessions or more engine.replicas"
            )
        assert served(call(one, "a"))["calls"] == 2
