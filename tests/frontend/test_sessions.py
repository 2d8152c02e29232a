"""The session table in-process, against a scripted engine: keyed by id, every transition under
the session's lock, TTLs, ownership by API key, and the races that used to lose episodes."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Literal

import pytest

from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.messages import EngineError, ErrorKind, InferReply
from ardiff_server.frontend.sessions import SessionForbidden, SessionTable

OBS = RobotObservation(prompt="p")


class ScriptedEngine:
    """Counts calls per session like the engine does, and records every control request.
    ``delay`` holds infer requests of a session until released by the test."""

    def __init__(self, infer_s: float = 0.0, control_s: float = 0.0) -> None:
        self.calls: Counter[str] = Counter()
        self.log: list[tuple[str, str, str]] = []  # (what, session, detail)
        self.infer_s, self.control_s = infer_s, control_s
        self.running: set[str] = set()
        self.fail_next: EngineError | None = None
        self.info = None

    async def infer(self, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        assert session_id not in self.running, f"two requests of {session_id} ran at once"
        self.running.add(session_id)
        try:
            await asyncio.sleep(self.infer_s)
            if self.fail_next is not None:
                error, self.fail_next = self.fail_next, None
                self.calls.pop(session_id, None)  # the engine lost it (worker died)
                raise error
            self.calls[session_id] += 1
            self.log.append(("infer", session_id, str(self.calls[session_id])))
            return InferReply(0, session_id, None, {}, {}, self.calls[session_id] == 1, self.calls[session_id], 0.0)
        finally:
            self.running.discard(session_id)

    async def end(self, session_id: str, reason: str) -> None:
        await asyncio.sleep(self.control_s)
        self.log.append(("end", session_id, reason))
        self.calls.pop(session_id, None)

    async def detach(self, session_id: str, reason: Literal["switched", "disconnected"]) -> None:
        await asyncio.sleep(self.control_s)
        self.log.append(("detach", session_id, reason))

    def ended(self) -> list[tuple[str, str]]:
        return [(sid, reason) for what, sid, reason in self.log if what == "end"]


def run(scenario):
    return asyncio.run(scenario())


async def infer(table: SessionTable, conn, session_id: str | None = None) -> int:
    return (await table.infer(conn, table.resolve(conn, session_id), OBS)).calls


def test_ids_interleaved_on_one_connection_each_continue():
    """IsaacLab-Arena: one websocket, one session id per parallel environment, interleaved."""

    async def scenario():
        engine = ScriptedEngine()
        table = SessionTable(engine, ttl_s=10)
        conn = table.connect()
        counts = {sid: [] for sid in ("env0", "env1", "env2")}
        for _ in range(5):
            for sid in counts:
                counts[sid].append(await infer(table, conn, sid))
        await table.drain()
        assert counts == {sid: [1, 2, 3, 4, 5] for sid in counts}
        assert engine.ended() == []
        # moving away makes a session the first eviction candidate, once per move
        assert ("detach", "env0", "switched") in engine.log
        assert table.used_by(conn) == ["env0", "env1", "env2"]
        assert await table.end(conn, ["env0", "env1"]) == ["env0", "env1"]
        assert sorted(engine.ended()) == [("env0", "reset"), ("env1", "reset")]
        assert await infer(table, conn, "env2") == 6 and await infer(table, conn, "env0") == 1
        assert table.used_by(conn) == ["env0", "env2"]

    run(scenario)


def test_a_new_id_is_a_fresh_episode_and_reset_forgets_entries():
    async def scenario():
        engine = ScriptedEngine()
        table = SessionTable(engine, ttl_s=1.0)
        conn = table.connect()
        for i in range(100):  # RoboArena: a new id per episode, reset at the end of each
            assert await infer(table, conn, f"episode-{i}") == 1
            await table.end(conn, [f"episode-{i}"])
        await table.end(conn, ["never-used"])
        await table.drain()
        return table.tracked

    assert run(scenario) == 0


def test_connections_without_ids_get_their_own_sessions():
    async def scenario():
        table = SessionTable(ScriptedEngine(), ttl_s=1.0)
        a, b = table.connect(), table.connect()
        assert [await infer(table, a), await infer(table, b), await infer(table, a)] == [1, 1, 2]
        assert table.resolve(a, None) != table.resolve(b, None)

    run(scenario)


def test_ttl_starts_when_the_last_connection_goes_and_a_resume_cancels_it():
    async def scenario():
        engine = ScriptedEngine()
        table = SessionTable(engine, ttl_s=0.2)
        first, second = table.connect(), table.connect()
        await infer(table, first, "robot")
        await infer(table, second, "robot")  # two connections on one session
        await table.disconnect(first)
        await asyncio.sleep(0.3)
        assert engine.ended() == []  # second still holds it
        await table.disconnect(second)
        await asyncio.sleep(0.1)
        third = table.connect()
        assert await infer(table, third, "robot") == 3  # resumed within the TTL
        await table.disconnect(third)
        await asyncio.sleep(0.35)
        await table.drain()
        assert engine.ended() == [("robot", "ttl")] and table.tracked == 0

    run(scenario)


def test_a_zero_ttl_ends_a_session_when_its_last_connection_goes():
    async def scenario():
        engine = ScriptedEngine()
        table = SessionTable(engine, ttl_s=0)
        first, second = table.connect(), table.connect()
        await infer(table, first, "robot")
        await infer(table, second, "robot")
        await table.disconnect(first)
        await table.drain()
        assert engine.ended() == []  # second still holds it
        await table.disconnect(second)
        await table.drain()
        assert engine.ended() == [("robot", "ttl")] and table.tracked == 0
        assert await infer(table, table.connect(), "robot") == 1  # a fresh episode after

    run(scenario)


def test_reconnect_during_detach_does_not_shorten_the_ttl():
    """A robot back while its old connection's detach is in flight, which later drops again,
    still gets the full TTL after its *last* disconnect."""

    async def scenario():
        engine = ScriptedEngine(control_s=0.05)
        table = SessionTable(engine, ttl_s=1.0)
        first = table.connect()
        await infer(table, first, "robot-1")
        await table.disconnect(first)
        await asyncio.sleep(0.01)
        second = table.connect()
        await infer(table, second, "robot-1")  # back within 10 ms, while the detach is in flight
        await asyncio.sleep(0.9)
        await table.disconnect(second)  # drops again at t = 0.96 s ...
        await asyncio.sleep(0.1)  # ... and is back at t = 1.06 s, well within the TTL
        assert await infer(table, table.connect(), "robot-1") == 3
        await table.drain()
        return engine.ended()

    assert run(scenario) == []


@pytest.mark.parametrize("robot_first", [True, False])
def test_an_expiry_firing_in_the_turn_a_robot_resumes_is_consistent(robot_first: bool):
    """Expiry and resume both run under the session's lock; whichever gets it first wins, and
    the other sees its effect: a resumed session is never released behind the robot's back, and
    a session that expired first is fresh (calls 1, new) for the returning robot."""

    async def scenario():
        engine = ScriptedEngine(infer_s=0.01)
        table = SessionTable(engine, ttl_s=60)
        conn = table.connect()
        await infer(table, conn, "r")
        await table.disconnect(conn)
        await table.drain()
        armed = table._entries["r"].epoch
        if robot_first:
            resumed = asyncio.ensure_future(infer(table, table.connect(), "r"))
            table._on_expiry("r", armed)  # the timer fires in the same turn
        else:
            table._on_expiry("r", armed)
            resumed = asyncio.ensure_future(infer(table, table.connect(), "r"))
        calls = await resumed
        await table.drain()
        if robot_first:
            assert calls == 2 and engine.ended() == []
        else:
            assert calls == 1 and engine.ended() == [("r", "ttl")]
        assert engine.calls["r"] == calls  # the front end and the engine agree

    run(scenario)


def test_requests_of_one_session_from_two_connections_run_one_at_a_time_and_in_order():
    async def scenario():
        engine = ScriptedEngine(infer_s=0.01)
        table = SessionTable(engine, ttl_s=10)
        a, b = table.connect(), table.connect()
        results = await asyncio.gather(*(infer(table, c, "shared") for _ in range(10) for c in (a, b)))
        assert sorted(results) == list(range(1, 21))

    run(scenario)


def test_a_switch_never_ends_the_previous_session_under_another_connections_request():
    """Connection 1 moves from A to B while connection 2 is mid-request on A: A continues."""

    async def scenario():
        engine = ScriptedEngine(infer_s=0.05)
        table = SessionTable(engine, ttl_s=10)
        one, two = table.connect(), table.connect()
        await infer(table, one, "A")
        on_a = asyncio.ensure_future(infer(table, two, "A"))
        await asyncio.sleep(0.01)
        await infer(table, one, "B")
        assert await on_a == 2 and await infer(table, one, "A") == 3
        await table.drain()
        assert engine.ended() == []

    run(scenario)


def test_a_reset_waiting_behind_a_request_ends_the_session_after_it_and_a_waiter_revives_it():
    async def scenario():
        engine = ScriptedEngine(infer_s=0.05)
        table = SessionTable(engine, ttl_s=10)
        a, b = table.connect(), table.connect()
        first = asyncio.ensure_future(infer(table, a, "S"))
        await asyncio.sleep(0.01)
        reset = asyncio.ensure_future(table.end(b, ["S"]))
        after = asyncio.ensure_future(infer(table, a, "S"))
        assert await first == 1
        await reset
        assert await after == 1  # ran after the reset: a fresh episode, on the same lock
        assert engine.ended() == [("S", "reset")]
        assert len(table._entries) == 1 and table._entries["S"].lock is not None

    run(scenario)


def test_an_engine_failure_keeps_the_entry_and_its_lock():
    """A worker restart used to drop entries whose locks were held, so the next request of that
    session could run beside one still waiting on the old lock."""

    async def scenario():
        engine = ScriptedEngine(infer_s=0.02)
        table = SessionTable(engine, ttl_s=10)
        conn, other = table.connect(), table.connect()
        await infer(table, conn, "S")
        engine.fail_next = EngineError(ErrorKind.WORKER_DIED, "the inference worker died")
        failing = asyncio.ensure_future(infer(table, conn, "S"))
        waiting = [asyncio.ensure_future(infer(table, other, "S")) for _ in range(3)]
        with pytest.raises(EngineError):
            await failing
        assert sorted(await asyncio.gather(*waiting)) == [1, 2, 3]  # strictly one at a time, fresh

    run(scenario)


def test_sessions_belong_to_the_key_that_opened_them():
    async def scenario():
        engine = ScriptedEngine()
        table = SessionTable(engine, ttl_s=10)
        owner, intruder = table.connect(key="key0"), table.connect(key="key1")
        await infer(table, owner, "robot-7")
        with pytest.raises(SessionForbidden, match="belongs to another API key"):
            await infer(table, intruder, "robot-7")
        with pytest.raises(SessionForbidden):
            await table.end(intruder, ["robot-7"])
        assert await infer(table, table.connect(key="key0"), "robot-7") == 2  # same key, another connection
        await table.end(owner, ["robot-7"])
        assert await infer(table, intruder, "robot-7") == 1  # ended: the id is free again
        assert engine.ended() == [("robot-7", "reset")]

    run(scenario)


def test_a_batch_is_on_all_its_sessions_at_once_and_leaves_the_ones_before_it():
    """``infer_batch``: every call is sent before any is awaited (they overlap in the engine), none of a batch's sessions
    is detached for another of the batch, the previous request's session is, and a single request after the batch
    leaves every one of it. An id-less reset ends the whole batch."""

    async def scenario():
        engine = ScriptedEngine(infer_s=0.05)
        table = SessionTable(engine, ttl_s=10)
        conn = table.connect()
        overlap: list[int] = []
        real_infer = engine.infer

        async def watched(session_id, observation, *, deadline=None):
            overlap.append(len(engine.running) + 1)
            return await real_infer(session_id, observation, deadline=deadline)

        engine.infer = watched
        assert await infer(table, conn, "single") == 1
        replies = await table.infer_batch(conn, [(sid, OBS, None) for sid in ("b0", "b1", "b2")])
        await table.drain()
        assert [r.calls for r in replies] == [1, 1, 1] and overlap[1:] == [1, 2, 3]  # all three in the engine at once
        assert [entry for entry in engine.log if entry[0] == "detach"] == [("detach", "single", "switched")]
        again = await table.infer_batch(conn, [(sid, OBS, None) for sid in ("b0", "b1", "b2")])
        await table.drain()
        assert [r.calls for r in again] == [2, 2, 2] and len([e for e in engine.log if e[0] == "detach"]) == 1
        assert table.current_sessions(conn) == ["b0", "b1", "b2"]
        assert await infer(table, conn, "b1") == 3  # a single request of one of them leaves the other two
        await table.drain()
        assert sorted(sid for what, sid, _ in engine.log[-3:] if what == "detach") == ["b0", "b2"]
        await table.infer_batch(conn, [(sid, OBS, None) for sid in ("b0", "b2")])
        await table.end(conn, table.current_sessions(conn))
        assert engine.ended() == [("b0", "reset"), ("b2", "reset")] and table.current_sessions(conn) == [conn.default_session]

    run(scenario)


def test_a_refused_call_of_a_batch_is_its_own_and_the_others_are_served():
    async def scenario():
        engine = ScriptedEngine()
        table = SessionTable(engine, ttl_s=10)
        owner, other = table.connect(key="key0"), table.connect(key="key1")
        await table.infer(owner, "mine", OBS)
        replies = await table.infer_batch(other, [("a", OBS, None), ("mine", OBS, None), ("b", OBS, None)])
        assert isinstance(replies[1], SessionForbidden)
        assert [r.calls for r in (replies[0], replies[2])] == [1, 1] and engine.calls["mine"] == 1

    run(scenario)
