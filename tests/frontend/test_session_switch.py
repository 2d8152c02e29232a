"""A robot that moves to a new session id on a full server, and connect/disconnect churn under a
per-key limit (issue #34, item 2).

First the session table against the real engine answering each call as it is made (so the engine
sees requests in exactly the order the table sends them: deterministic), then the real server
(in-process engine) over loopback websockets: a switch releases the old session before the new
one is admitted, so the new episode is served on its first request and the old session, switched
away from, is the one evicted (its KV pages back in the pool); a disconnected session whose detach
is still in flight is idle, so a key at its limit is served on every cycle; a refusal names
``server at capacity`` once.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

import numpy as np
import pytest
from openpi_client import msgpack_numpy
from websockets.sync.client import connect

from ardiff_kv import PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.client import ReplicaStatus
from ardiff_server.engine.core import SessionEngine
from ardiff_server.engine.messages import Detach, End, ErrorReply, Infer, InferReply
from ardiff_server.frontend.sessions import KeyLimits, SessionTable
from tests.helpers.fake_policy import FakeConfig, FakePolicy
from tests.helpers.inproc_server import InprocServer
from tests.helpers.server_harness import droid_observation, fake_config

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

OBS = RobotObservation(prompt="p", joint_position=np.zeros(7, np.float32))


class DirectEngine:
    """The real engine (fake policy) serving each call at once in the event loop's thread.
    ``detach_s``: a detach is answered that much later (it waits for the step in progress)."""

    def __init__(self, max_sessions: int, detach_s: float = 0.0) -> None:
        policy = FakePolicy(FakeConfig(), RuntimeOptions())
        spec = policy.kv_spec()
        cache = PagedKVCache(spec, num_pages=8 * spec.pages_per_branch + 1, max_sessions=8, branches=policy.branches)
        self.engine = SessionEngine(policy, cache, max_sessions=max_sessions)
        self.info = policy.info
        self.detach_s = detach_s
        self._ids = itertools.count()

    async def infer(self, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        reply = self.engine.handle(Infer(next(self._ids), session_id, observation))
        if isinstance(reply, ErrorReply):
            raise reply.error()
        return reply

    async def detach(self, session_id: str, reason: str) -> None:
        await asyncio.sleep(self.detach_s)
        self.engine.handle(Detach(next(self._ids), session_id, reason))

    async def end(self, session_id: str, reason: str) -> None:
        self.engine.handle(End(next(self._ids), session_id, reason))

    def replicas(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(0, ["cpu"], "ready", stats=(self.engine.stats(),))]


def test_a_switch_tells_the_engine_before_the_new_session_reaches_it():
    """engine.max_sessions 2: robot 1 on s1, robot 2 on s3; robot 1 moves to s1-episode2. Before:
    the detach of s1 was started in the background and the new request reached the engine first,
    which saw two attached sessions and refused it; only a retry was served."""

    async def scenario():
        direct = DirectEngine(max_sessions=2)
        engine, pool = direct.engine, direct.engine.cache.pool
        table = SessionTable(direct, ttl_s=30)
        one, two = table.connect(), table.connect()
        assert (await table.infer(one, "s1", OBS)).new_session and (await table.infer(two, "s3", OBS)).new_session
        free = pool.num_free
        reply = await table.infer(one, "s1-episode2", OBS)
        assert reply.new_session and reply.calls == 1
        assert list(engine.sessions) == ["s3", "s1-episode2"] and engine.endings == {"lru": 1}  # s1 evicted, s3 untouched
        assert pool.num_free == free  # s1's page back, the new session's first one taken
        assert (await table.infer(two, "s3", OBS)).calls == 2
        await table.end(one, ["s1-episode2"])
        await table.end(two, ["s3"])
        assert pool.num_free == pool.capacity
        await table.drain()

    asyncio.run(scenario())


def test_a_disconnected_session_whose_detach_is_in_flight_makes_room_for_its_keys_next_session():
    """max_sessions_per_key 1: a robot disconnects and its key's next connection opens a session at
    once, while the detach of the first (waiting for the step in progress) holds its lock. Before:
    that lock made it look in use, and the new session was refused ("a robot is on each")."""

    async def scenario():
        direct = DirectEngine(max_sessions=4, detach_s=0.05)
        table = SessionTable(direct, ttl_s=30, limits=KeyLimits(1))
        first = table.connect(key="key0")
        await table.infer(first, "a", OBS)
        await table.disconnect(first)
        await asyncio.sleep(0)  # the detach has started
        reply = await table.infer(table.connect(key="key0"), "b", OBS)
        assert reply.new_session and list(direct.engine.sessions) == ["b"] and direct.engine.endings == {"quota": 1}
        await table.drain()

    asyncio.run(scenario())


# -- the real server -------------------------------------------------------------------------


def open_robot(server: InprocServer, key: str | None = None):
    headers = {"Authorization": f"Api-Key {key}"} if key is not None else None
    ws = connect(server.url, compression=None, max_size=None, additional_headers=headers)
    ws.recv()  # metadata
    return ws


def call(ws, session_id: str | None = None, prompt: str = "pick up the cup") -> dict | str:
    ws.send(msgpack_numpy.packb(droid_observation(session_id=session_id, prompt=prompt)))
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def served(reply: dict | str) -> dict:
    assert not isinstance(reply, str), reply
    return reply["session"]


def test_switches_on_a_full_server_are_served_first_time_and_the_old_sessions_return_their_pages():
    """The same switch end to end, five times in a row (before: most were refused once)."""
    with InprocServer(fake_config(max_sessions=2)) as server, open_robot(server) as one, open_robot(server) as two:
        engine, pool = server.engine, server.engine.cache.pool
        served(call(one, "s1"))
        served(call(two, "s3"))
        free = pool.num_free
        for episode in range(2, 7):
            session = served(call(one, f"s1-episode{episode}"))
            assert session["new"] and session["calls"] == 1
            assert sorted(engine.sessions) == [f"s1-episode{episode}", "s3"]
            assert pool.num_free == free  # the old episode's pages went back
        assert engine.endings == {"lru": 5}
        assert served(call(two, "s3"))["calls"] == 2


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


def test_a_switch_at_a_keys_limit_is_served_first_time():
    """server.max_sessions_per_key 2 (the engine holds 4): key0's robot 1 moves to new episodes while
    robot 2 is on the key's other session: each time its old session makes room, nobody else's."""
    config = fake_config(max_sessions=4, server={"api_keys": ["alpha", "beta"], "max_sessions_per_key": 2})
    with InprocServer(config) as server, open_robot(server, "alpha") as one, open_robot(server, "alpha") as two:
        served(call(one, "a1"))
        served(call(two, "a2"))
        for episode in range(2, 5):
            assert served(call(one, f"a1-episode{episode}"))["new"]
        assert served(call(two, "a2"))["calls"] == 2
        assert sorted(server.engine.sessions) == ["a1-episode4", "a2"]


@pytest.mark.parametrize("named", [True, False], ids=["session-ids", "connection-sessions"])
def test_fifty_connect_disconnect_cycles_of_a_key_at_its_limit_are_all_served(named: bool):
    """One key at max_sessions_per_key 1 (the TTL keeps disconnected sessions) while another key's
    robot keeps the engine stepping: each cycle connects, serves a new session and closes. Before:
    most cycles were refused, the last cycle's detach waiting behind a step with its session's lock."""
    config = fake_config(max_sessions=4, server={"api_keys": ["alpha", "beta"], "max_sessions_per_key": 1, "session_ttl_s": 60})
    with InprocServer(config) as server:
        stop = threading.Event()

        def busy() -> None:
            with open_robot(server, "beta") as ws:
                while not stop.is_set():
                    served(call(ws, "busy", prompt="sleep:0.02"))

        robot = threading.Thread(target=busy, daemon=True)
        robot.start()
        refused = []
        try:
            for cycle in range(50):
                with open_robot(server, "alpha") as ws:
                    reply = call(ws, f"episode-{cycle}" if named else None)
                    if isinstance(reply, str):
                        refused.append((cycle, reply))
        finally:
            stop.set()
            robot.join(10)
        assert refused == []
        assert len(server.engine.sessions) == 2  # the key's last session and the busy robot's
