"""Per-key limits (``server.max_sessions_per_key``, ``max_connections_per_key``): one key holder cannot
take every slot, and another key's sessions are never evicted to make room for it.

The session table against an engine that keeps a fixed-size LRU table as the real one does, so an
eviction the front end failed to prevent shows up in ``engine.evicted``; then the real server
(in-process engine) with two keys, its error frames, 503s and per-key metrics.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

import pytest
from openpi_client import msgpack_numpy
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from ardiff_policies.observation import RobotObservation
from ardiff_server.config import ConfigError, load_config, preflight
from ardiff_server.engine.client import ReplicaStatus
from ardiff_server.engine.messages import EngineError, EngineStats, ErrorKind, InferReply
from ardiff_server.frontend.service import PolicyService
from ardiff_server.frontend.sessions import KeyLimits, SessionTable
from ardiff_server.ray.plan import plan_deployment
from tests.helpers.inproc_server import InprocServer
from tests.helpers.server_harness import droid_observation, fake_config, metric_value

OBS = RobotObservation(prompt="p")
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


class LruEngine:
    """The engine's session table as the front end sees it: ``capacity`` sessions, the least recently
    served one evicted when a new session needs room, the ids it holds in every reply's stats."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self.sessions: OrderedDict[str, int] = OrderedDict()  # id -> calls
        self.evicted: list[str] = []
        self.ended: list[tuple[str, str]] = []
        self.fail_next: EngineError | None = None
        self.hold: asyncio.Event | None = None  # when set by a test: infer waits for it
        self.info = None

    async def infer(self, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        new = session_id not in self.sessions
        if new:
            while len(self.sessions) >= self.capacity:
                self.evicted.append(self.sessions.popitem(last=False)[0])
            self.sessions[session_id] = 0
        self.sessions.move_to_end(session_id)
        self.sessions[session_id] += 1
        return InferReply(0, session_id, None, {}, {}, new, self.sessions[session_id], 0.0)

    async def end(self, session_id: str, reason: str) -> None:
        if self.sessions.pop(session_id, None) is not None:
            self.ended.append((session_id, reason))

    async def detach(self, session_id: str, reason: str) -> None:
        pass

    def replicas(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(0, ["cpu"], "ready", stats=(EngineStats(session_ids=tuple(self.sessions), session_capacity=self.capacity),))]


def run(scenario):
    return asyncio.run(scenario())


async def infer(table: SessionTable, conn, session_id: str) -> int:
    return (await table.infer(conn, session_id, OBS)).calls


async def refused(table: SessionTable, conn, session_id: str) -> str:
    with pytest.raises(EngineError) as caught:
        await infer(table, conn, session_id)
    assert caught.value.kind is ErrorKind.CAPACITY
    return str(caught.value)


def test_a_key_at_its_limit_is_refused_while_a_robot_is_on_each_of_its_sessions():
    async def scenario():
        engine, refusals = LruEngine(capacity=4), []
        table = SessionTable(engine, ttl_s=10, limits=KeyLimits(2, shared=True), on_refused=refusals.append)
        a, b, c = (table.connect(key="key0") for _ in range(3))
        other = [table.connect(key="key1") for _ in range(2)]
        assert [await infer(table, a, "a1"), await infer(table, b, "b1")] == [1, 1]
        message = await refused(table, c, "c1")
        assert "key0 holds 2 sessions (server.max_sessions_per_key: 2) and a robot is on each" in message
        assert refusals == ["key0"]
        assert [await infer(table, a, "a1"), await infer(table, b, "b1")] == [2, 2]  # existing sessions keep working
        assert [await infer(table, conn, f"k1-{i}") for i, conn in enumerate(other)] == [1, 1]  # the other key is untouched
        assert table.open_by_key() == {"key0": 2, "key1": 2}
        assert engine.evicted == [] and engine.ended == []

    run(scenario)


def test_a_key_at_its_limit_ends_its_own_idle_sessions_disconnected_first_never_another_keys():
    async def scenario():
        engine = LruEngine(capacity=8)
        table = SessionTable(engine, ttl_s=60, limits=KeyLimits(3, shared=True))
        robot, visitor = table.connect(key="key0"), table.connect(key="key0")
        stranger = table.connect(key="key1")
        await infer(table, stranger, "theirs")
        await table.disconnect(stranger)  # key1's session is idle (awaiting its TTL): still never a victim
        await infer(table, robot, "s1")
        await infer(table, visitor, "d1")
        await table.disconnect(visitor)  # d1: disconnected
        await infer(table, robot, "s2")  # s1: switched away from (its robot may come back)
        await table.drain()
        assert await infer(table, robot, "s3") == 1  # key0 at 3: its disconnected d1 goes first, though s1 is older
        assert engine.ended == [("d1", "quota")]
        assert await infer(table, robot, "s4") == 1  # then the least recently used switched one
        assert engine.ended == [("d1", "quota"), ("s1", "quota")]
        assert "theirs" in engine.sessions and engine.evicted == []
        assert table.open_by_key() == {"key0": 3, "key1": 1}

    run(scenario)


def test_sessions_the_engine_ended_free_their_slot_and_come_back_only_through_admission():
    async def scenario():
        engine = LruEngine(capacity=4)
        table = SessionTable(engine, ttl_s=10, limits=KeyLimits(1, shared=True))
        first, second = table.connect(key="key0"), table.connect(key="key0")
        await infer(table, first, "x")
        engine.sessions.clear()  # the replica restarted: x is gone, and only the engine's stats say so
        assert await infer(table, second, "y") == 1
        message = await refused(table, first, "x")  # x's robot comes back: a new session, and y has a robot on it
        assert "key0 holds 1 sessions" in message
        assert table.open_by_key() == {"key0": 1}

        engine.fail_next = EngineError(ErrorKind.POLICY, "exploded")  # a failed step tears the session down
        with pytest.raises(EngineError):
            await infer(table, second, "y")
        assert table.open_by_key() == {}
        assert await infer(table, first, "x") == 1

    run(scenario)


def test_a_refused_or_bad_first_request_holds_no_slot():
    async def scenario():
        engine = LruEngine(capacity=4)
        table = SessionTable(engine, ttl_s=10, limits=KeyLimits(1, shared=True))
        conn = table.connect(key="key0")
        engine.fail_next = EngineError(ErrorKind.BAD_REQUEST, "no wrist image")
        with pytest.raises(EngineError):
            await infer(table, conn, "bad")
        assert table.open_by_key() == {}
        assert await infer(table, conn, "good") == 1
        engine.fail_next = EngineError(ErrorKind.BAD_REQUEST, "no wrist image")  # a bad request on an open session leaves it
        with pytest.raises(EngineError):
            await infer(table, conn, "good")
        assert table.open_by_key() == {"key0": 1}
        assert await infer(table, conn, "good") == 2

    run(scenario)


def test_with_several_keys_no_new_session_makes_the_engine_evict():
    """No per-key limit at all, but three keys share an engine of 4 sessions: a fourth key's
    session is refused rather than evicting a busy key's session, and a key that has an idle
    session of its own makes room with it."""

    async def scenario():
        engine = LruEngine(capacity=4)
        table = SessionTable(engine, ttl_s=10, limits=KeyLimits(None, shared=True, max_sessions=4))
        busy = [table.connect(key="key0") for _ in range(3)]
        for i, conn in enumerate(busy):
            await infer(table, conn, f"k0-{i}")
        await infer(table, table.connect(key="key1"), "k1-0")
        message = await refused(table, table.connect(key="key2"), "k2-0")
        assert "the engine's 4 sessions are taken (0 by key2, 4 by other keys) and none of key2's is idle" in message
        assert await infer(table, busy[0], "k0-next") == 1  # key0 moves on: its own previous session makes room
        assert engine.ended == [("k0-0", "quota")] and engine.evicted == []

    run(scenario)


def test_a_fair_share_follows_what_the_engine_really_holds():
    """Two keys, engine.max_sessions 8 (a fair share of 4 each) but a KV pool that holds 4: each key
    gets 2, so one key filling its configured share cannot starve the other."""

    async def scenario():
        engine = LruEngine(capacity=4)
        table = SessionTable(engine, ttl_s=10, limits=KeyLimits(4, shared=True, max_sessions=8, fair_keys=2))
        for i in range(2):
            await infer(table, table.connect(key="key0"), f"k0-{i}")
        message = await refused(table, table.connect(key="key0"), "k0-2")
        assert "key0 holds 2 sessions (server.max_sessions_per_key: fair, 2 of the engine's 4 for each of 2 keys)" in message
        assert await infer(table, table.connect(key="key1"), "k1-0") == 1
        assert engine.evicted == [] and table.open_by_key() == {"key0": 2, "key1": 1}

    run(scenario)


def test_info_reports_the_share_the_table_enforces():
    """One fair-share rule (config.fair_share) for /info and for enforcement: with a KV pool that holds
    4 of engine.max_sessions 8, /info says 2 per key, the number a key is refused past."""
    config = load_config("tiny", ["server.api_keys=[a, b]", "engine.max_sessions=8"])
    service = PolicyService(config, LruEngine(capacity=4))
    assert config.sessions_per_key() == 4  # configured: 8 // 2
    assert service.describe()["limits"]["max_sessions_per_key"] == 2

    async def scenario():
        for i in range(2):
            await infer(service.sessions, service.sessions.connect(key="key0"), f"k0-{i}")
        message = await refused(service.sessions, service.sessions.connect(key="key0"), "k0-2")
        assert "key0 holds 2 sessions (server.max_sessions_per_key: fair, 2 of the engine's 4 for each of 2 keys)" in message

    run(scenario)


def test_concurrent_new_sessions_of_a_key_cannot_both_take_its_last_slot():
    async def scenario():
        engine = LruEngine(capacity=8)
        table = SessionTable(engine, ttl_s=10, limits=KeyLimits(2, shared=True))
        await infer(table, table.connect(key="key0"), "first")
        engine.hold = asyncio.Event()  # both first requests in flight at once
        racing = [asyncio.ensure_future(infer(table, table.connect(key="key0"), f"new-{i}")) for i in range(2)]
        await asyncio.sleep(0.01)
        engine.hold.set()
        outcomes = await asyncio.gather(*racing, return_exceptions=True)
        assert sorted(type(o).__name__ for o in outcomes) == ["EngineError", "int"], outcomes
        assert table.open_by_key() == {"key0": 2}

    run(scenario)


def test_one_tenant_keeps_the_engines_lru():
    """No keys, or one: no limits unless set, and a new session may evict the least recently used (as before)."""

    async def scenario():
        engine = LruEngine(capacity=2)
        table = SessionTable(engine, ttl_s=10)
        for i in range(3):
            await infer(table, table.connect(), f"s{i}")
        assert engine.evicted == ["s0"]

    run(scenario)


# -- the config ----------------------------------------------------------------------------


def test_fair_shares_and_explicit_limits():
    def limits(*overrides: str) -> tuple[int | None, int | None]:
        config = load_config("tiny", list(overrides))
        return config.sessions_per_key(), config.connections_per_key()

    assert limits() == (None, None)  # no keys
    assert limits("server.api_keys=[a]") == (None, None)  # one key: it may use the whole engine
    assert limits("server.api_keys=[a, b]", "engine.max_sessions=8", "engine.replicas=2", "server.max_connections=10") == (8, 5)
    assert limits("server.api_keys=[a, b, c]", "engine.max_sessions=2") == (1, 21)  # at least one each
    assert limits("server.api_keys=[a, b]", "server.max_sessions_per_key=3", "server.max_connections_per_key=null") == (3, None)
    # On Ray Serve the share is of the deployment's replicas (ray.num_replicas, or max_replicas), not engine.replicas.
    config = load_config("tiny", ["server.api_keys=[a, b]", "engine.max_sessions=4", "ray.min_replicas=1", "ray.max_replicas=3"])
    assert PolicyService(config, LruEngine(), replicas=plan_deployment(config).most_replicas).sessions.limits.sessions_per_key == 6
    assert PolicyService(config, LruEngine()).sessions.limits.sessions_per_key == 2
    with pytest.raises(ConfigError, match=r"max_sessions_per_key: Value error, expected a count >= 1, fair .* or null"):
        load_config("tiny", ["server.max_sessions_per_key=0"])
    with pytest.raises(ConfigError, match=r"server\.max_connections_per_key: 2 needs API keys"):
        preflight(load_config("tiny", ["server.max_connections_per_key=2"]))


# -- the real server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    config = fake_config(max_sessions=4, server={"api_keys": ["alpha", "beta"], "max_connections_per_key": 3})
    with InprocServer(config) as running:
        yield running


def open_robot(server, key: str):
    ws = connect(server.url, compression=None, max_size=None, additional_headers={"Authorization": f"Api-Key {key}"})
    ws.recv()
    return ws


def call(ws, obs: dict):
    ws.send(msgpack_numpy.packb(obs))
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def metric(server, name: str) -> float:
    return metric_value(server.http("/metrics", {"Authorization": "Api-Key alpha"})[1], name)


def test_two_keys_share_the_engine_fairly_and_see_their_counts_per_key_id(server):
    info = json.loads(server.http("/info", {"Authorization": "Api-Key beta"})[1])
    assert info["limits"] == {"max_sessions_per_key": 2, "max_connections_per_key": 3}  # 4 sessions / 2 keys
    alpha = [open_robot(server, "alpha") for _ in range(3)]
    beta = open_robot(server, "beta")
    try:
        assert [call(ws, droid_observation(session_id=f"alpha-{i}"))["actions"][0, 0] for i, ws in enumerate(alpha[:2])] == [1, 1]
        reply = call(alpha[2], droid_observation(session_id="alpha-2"))
        assert reply.startswith("server at capacity: key0 holds 2 sessions (server.max_sessions_per_key: 2)") and "\n" not in reply
        assert call(alpha[0], droid_observation(session_id="alpha-0"))["actions"][0, 0] == 2  # still working
        assert call(beta, droid_observation(session_id="beta-0"))["actions"][0, 0] == 1
        assert metric(server, 'ardiff_key_sessions_open{key="key0"}') == 2
        assert metric(server, 'ardiff_key_sessions_open{key="key1"}') == 1
        assert metric(server, 'ardiff_key_refusals_total{key="key0",limit="sessions"}') == 1
        assert metric(server, 'ardiff_key_refusals_total{key="key1",limit="sessions"}') == 0
        assert metric(server, 'ardiff_key_connections_open{key="key0"}') == 3
        assert metric(server, 'ardiff_requests_total{outcome="capacity"}') == 1

        with pytest.raises(InvalidStatus) as too_many:  # a fourth connection of alpha: refused at the handshake
            open_robot(server, "alpha")
        assert too_many.value.response.status_code == 503
        assert too_many.value.response.body == b"too many connections for key0 (3 open, server.max_connections_per_key: 3)\n"
        assert metric(server, 'ardiff_key_refusals_total{key="key0",limit="connections"}') == 1
        open_robot(server, "beta").close()  # beta is not affected

        text = server.http("/metrics", {"Authorization": "Api-Key alpha"})[1]
        assert "alpha" not in text and "beta" not in text  # key ids only, never the keys
        for reason in ("lru", "pressure"):  # the engine never had to evict
            with pytest.raises(KeyError):
                metric_value(text, f'ardiff_session_endings_total{{reason="{reason}"}}')
    finally:
        for ws in [*alpha, beta]:
            ws.close()


def test_a_reset_gives_the_slot_back(server):
    with open_robot(server, "beta") as first, open_robot(server, "beta") as second:
        for ws, sid in ((first, "b-1"), (second, "b-2")):
            assert call(ws, droid_observation(session_id=sid))["actions"][0, 0] == 1
        with open_robot(server, "beta") as third:
            assert call(third, droid_observation(session_id="b-3")).startswith("server at capacity: key1 holds 2 sessions")
            assert call(first, {"endpoint": "reset", "session_id": "b-1"})["status"] == "reset successful"
            assert call(third, droid_observation(session_id="b-3"))["actions"][0, 0] == 1
