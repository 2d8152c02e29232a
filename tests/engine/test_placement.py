"""Where a new session goes and where each session stays (engine/placement.py), and ReplicaSet on top of it."""

from __future__ import annotations

import asyncio
import os

import pytest

from ardiff_server.engine.messages import EngineStats, InferReply
from ardiff_server.engine.placement import ReplicaLoad, SessionPlacement, least_loaded
from ardiff_server.engine.replicas import ReplicaSet


def test_least_loaded_compares_in_the_documented_order():
    base = ReplicaLoad()
    # 1. a replica that can serve beats one that is restarting, whatever else
    assert least_loaded({"a": ReplicaLoad(ready=False), "b": ReplicaLoad(sessions_placed=9)}) == "b"
    # 2. fewest sessions placed by this front end
    assert least_loaded({"a": ReplicaLoad(sessions_placed=2), "b": ReplicaLoad(sessions_placed=1, sessions_open=5)}) == "b"
    # 3. then fewest sessions the replica reports
    assert least_loaded({"a": ReplicaLoad(sessions_open=3), "b": ReplicaLoad(sessions_open=1, kv_pages_free=0)}) == "b"
    # 4. then most free KV pages
    assert least_loaded({"a": ReplicaLoad(kv_pages_free=10), "b": ReplicaLoad(kv_pages_free=20, queue_len=4)}) == "b"
    # 5. then the shortest queue
    assert least_loaded({"a": ReplicaLoad(queue_len=2), "b": ReplicaLoad(queue_len=1)}) == "b"
    # 6. a tie goes to the first
    assert least_loaded({"x": base, "y": base, "z": base}) == "x"
    with pytest.raises(ValueError, match="no replica"):
        least_loaded({})


def test_a_session_stays_until_it_ends_or_its_replica_goes():
    placement: SessionPlacement[int] = SessionPlacement()
    loads = {0: ReplicaLoad(), 1: ReplicaLoad()}
    assert placement.place("a", loads) == 0
    assert placement.place("b", {0: ReplicaLoad(sessions_placed=1), 1: ReplicaLoad()}) == 1
    assert placement.get("a") == 0 and "b" in placement and len(placement) == 2
    assert placement.counts() == {0: 1, 1: 1}
    assert placement.forget("a") == 0 and placement.get("a") is None and placement.forget("a") is None
    placement.pin("c", 1)
    assert sorted(placement.forget_replicas(lambda replica: replica == 1)) == ["b", "c"]
    assert len(placement) == 0


def test_sweep_forgets_only_sessions_idle_past_the_limit():
    placement: SessionPlacement[str] = SessionPlacement()
    placement.pin("old", "r0", now=0.0)
    placement.pin("fresh", "r0", now=0.0)
    placement.touch("fresh", now=90.0)
    placement.touch("unknown", now=90.0)  # touching an unplaced session places nothing
    assert placement.sweep(idle_s=60.0, now=100.0) == ["old"]
    assert placement.get("fresh") == "r0" and "unknown" not in placement


class FakeClient:
    """An engine client with a settable state and KV stats; records what it was asked."""

    def __init__(self, replica: int, *, free: int = 100, state: str = "ready") -> None:
        self.replica = replica
        self.state = state
        self.info = None
        self.stats = (EngineStats(kv_pages_free=free),)
        self.calls: list[tuple[str, str]] = []

    async def infer(self, session_id, observation, *, deadline=None):
        self.calls.append(("infer", session_id))
        return InferReply(0, session_id, None, {}, {}, True, 1, 0.0, replica=self.replica)

    async def end(self, session_id, reason):
        self.calls.append(("end", session_id))

    async def detach(self, session_id, reason):
        self.calls.append(("detach", session_id))

    def replicas(self):
        from ardiff_server.engine.client import ReplicaStatus

        return [ReplicaStatus(self.replica, ["cpu"], self.state, stats=self.stats)]


def test_replica_set_places_by_the_rule_and_routes_every_later_request_to_the_same_replica():
    async def scenario():
        clients = [FakeClient(0, free=10), FakeClient(1, free=50), FakeClient(2, state="restarting", free=999)]
        replicas = ReplicaSet(clients)
        await replicas.infer("s1", None)  # all empty: most free pages among the ready ones
        await replicas.infer("s2", None)  # replica 1 has one placed now: replica 0
        await replicas.infer("s1", None)  # sticks
        await replicas.detach("s2", "switched")
        assert clients[1].calls == [("infer", "s1"), ("infer", "s1")]
        assert clients[0].calls == [("infer", "s2"), ("detach", "s2")]
        assert clients[2].calls == []
        assert {r.index: r.sessions_placed for r in replicas.replicas()} == {0: 1, 1: 1, 2: 0}
        await replicas.end("s1", "reset")
        await replicas.end("never-seen", "reset")  # nothing to end anywhere
        assert clients[1].calls[-1] == ("end", "s1") and replicas.placement.get("s1") is None
        replicas._forget_replica(clients[0])  # replica 0 restarted: its session starts over elsewhere
        await replicas.infer("s2", None)
        assert clients[1].calls[-1] == ("infer", "s2")

    asyncio.run(scenario())


def test_replica_set_needs_an_engine():
    with pytest.raises(ValueError, match="at least one"):
        ReplicaSet([])


class GpuReplica:
    """A replica on a GPU whose worker is this test process (what it holds in host RAM is measured)."""

    def __init__(self, index: int, started: list[int]) -> None:
        self.index, self.started, self.devices = index, started, [f"cuda:{index}"]
        self.pids = [os.getpid()]

    async def start(self) -> None:
        self.started.append(self.index)


def test_replicas_start_only_if_the_host_holds_what_the_first_one_holds_for_each(monkeypatch):
    """Replica 0 holds its CPU encoders in host RAM; replicas 1-3 would each hold as much. The host is
    checked once, for all of them, before any of them loads; one line says how many fit."""
    from ardiff_server.engine import replicas
    from ardiff_server.engine.messages import EngineError

    held = replicas.process_anonymous_bytes(os.getpid())
    assert held > 0  # this process's own tensors and heap

    started: list[int] = []

    def start(available: int) -> None:
        monkeypatch.setattr(replicas, "host_available_bytes", lambda: available)
        started.clear()
        asyncio.run(ReplicaSet([GpuReplica(i, started) for i in range(4)]).start())

    start(4 * held)
    assert started == [0, 1, 2, 3]
    with pytest.raises(EngineError, match=r"host memory: replica 0 holds .* GiB .* 3 more replica\(s\) need .*: set engine\.replicas=2,") as caught:
        start(int(1.5 * held))
    assert started == [0] and "\n" not in str(caught.value)  # refused before replicas 1-3 loaded anything
