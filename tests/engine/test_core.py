"""The session engine in-process: admission and eviction, pool pressure, transactional steps, churn, warm-up."""

from __future__ import annotations

import gc
import random
import re

import numpy as np
import pytest

from ardiff_kv import CapacityError, PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_server.engine.core import SessionEngine
from tests.helpers.fake_policy import FakeConfig, FakePolicy


def make_engine(sessions_in_pool: int, max_sessions: int = 16, window_pages: int = 4) -> SessionEngine:
    policy = FakePolicy(FakeConfig(window_pages=window_pages), RuntimeOptions())
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=sessions_in_pool * spec.pages_per_branch + 1, max_sessions=max_sessions, branches=policy.branches)
    return SessionEngine(policy, cache, max_sessions=max_sessions)


def obs(prompt: str = "", joint0: float = 0.0) -> RobotObservation:
    return RobotObservation(prompt=prompt, joint_position=np.full(7, joint0, np.float32))


def calls(engine: SessionEngine, session_id: str) -> int:
    return int(engine.infer(session_id, obs()).result.actions[0, 0])


def test_pool_pressure_evicts_the_least_recently_used_idle_session():
    engine = make_engine(sessions_in_pool=2)
    assert calls(engine, "a") == 1 and calls(engine, "b") == 1 and calls(engine, "a") == 2
    engine.detach("a", "switched")
    engine.detach("b", "switched")
    assert calls(engine, "c") == 1  # served: b (least recently used) made room
    assert set(engine.sessions) == {"a", "c"} and engine.endings == {"pressure": 1}
    assert calls(engine, "a") == 3  # a kept its state


def test_a_session_whose_request_waits_is_never_evicted():
    engine = make_engine(sessions_in_pool=2)
    calls(engine, "a")
    calls(engine, "b")
    engine.detach("a", "disconnected")
    engine.detach("b", "disconnected")
    engine.sessions["a"].waiting = 1  # a's request waits for its batch (its robot dropped meanwhile): take b instead
    calls(engine, "c")
    assert set(engine.sessions) == {"a", "c"}


def test_detached_sessions_are_evicted_before_connected_ones():
    engine = make_engine(sessions_in_pool=2)
    calls(engine, "a")
    calls(engine, "b")
    engine.detach("b")  # b's robot disconnected; a is still connected but older
    calls(engine, "c")
    assert set(engine.sessions) == {"a", "c"}


def test_a_session_with_a_robot_attached_is_never_evicted_and_the_newcomer_is_told_why():
    """Before: any client minting new ids ended the least recently used robot's episode, attached or not."""
    engine = make_engine(sessions_in_pool=8, max_sessions=2)
    calls(engine, "a")
    calls(engine, "b")
    with pytest.raises(
        CapacityError,
        match=r"server at capacity: 2 sessions open \(engine.max_sessions: 2\) and a robot is attached to each.*larger engine.max_sessions",
    ):
        engine.infer("intruder", obs())
    assert set(engine.sessions) == {"a", "b"} and not engine.endings
    assert calls(engine, "a") == 2 and calls(engine, "b") == 2  # both robots carry on
    pool_bound = make_engine(sessions_in_pool=1, max_sessions=4)
    calls(pool_bound, "a")
    with pytest.raises(CapacityError, match=r"the KV pool holds 1 \(engine.max_sessions: 4\).*kv_budget_gib"):
        pool_bound.infer("b", obs())


def test_lru_cap_bounds_the_table():
    engine = make_engine(sessions_in_pool=8, max_sessions=2)
    for sid in ("a", "b", "c"):
        calls(engine, sid)
        engine.detach(sid, "switched")  # the robot moves on to its next episode
    assert list(engine.sessions) == ["b", "c"] and engine.endings == {"lru": 1}


def test_a_failed_step_tears_the_session_down_and_the_next_request_starts_fresh():
    engine = make_engine(sessions_in_pool=2)
    free = engine.cache.pool.num_free
    calls(engine, "a")
    calls(engine, "a")
    with pytest.raises(RuntimeError, match="exploded"):
        engine.infer("a", obs("explode"))
    assert "a" not in engine.sessions and engine.cache.pool.num_free == free
    outcome = engine.infer("a", obs())
    assert outcome.new_session and outcome.result.actions[0, 0] == 1


def test_a_call_the_policy_refuses_in_its_step_is_a_bad_request_and_the_session_stays():
    engine = make_engine(sessions_in_pool=2)
    calls(engine, "a")
    with pytest.raises(UnsupportedObservation, match="cannot take this call now"):
        engine.infer("a", obs("refuse"))
    assert "a" in engine.sessions and calls(engine, "a") == 2 and not engine.endings


def test_every_ending_returns_every_page():
    engine = make_engine(sessions_in_pool=3)
    free = engine.cache.pool.num_free
    for sid in ("a", "b", "c"):
        calls(engine, sid)
        calls(engine, sid)
    assert engine.end("a", "reset") and engine.end("b", "session switch") and engine.end("c", "ttl")
    assert not engine.end("zzz", "reset")
    assert engine.cache.pool.num_free == free and engine.cache.num_sessions == 0


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


def test_churn_of_200_sessions_leaks_no_page_and_no_memory():
    engine = make_engine(sessions_in_pool=4, max_sessions=6)
    free = engine.cache.pool.num_free
    rng = random.Random(0)

    def churn(n: int) -> None:
        live: list[str] = []
        for i in range(n):
            sid = f"s{i}"
            for _ in range(rng.randint(1, 6)):
                calls(engine, sid)
            live.append(sid)
            ending = rng.choice(["switch", "reset", "drop", "fail", "keep"])
            if ending in ("switch", "reset"):
                engine.end(sid, ending)
            elif ending == "drop":
                engine.detach(sid)  # left for the TTL / pressure
            elif ending == "keep":
                engine.detach(sid, "switched")
            elif ending == "fail":
                with pytest.raises(RuntimeError):
                    engine.infer(sid, obs("explode"))
        for sid in live:
            engine.end(sid, "ttl")

    churn(50)  # warm the allocator
    gc.collect()
    before = _rss_kib()
    churn(200)
    gc.collect()
    grown = _rss_kib() - before
    assert engine.cache.pool.num_free == free and engine.cache.num_sessions == 0 and not engine.sessions
    assert sum(engine.endings.values()) >= 250
    assert grown < 8 * 1024, f"resident memory grew by {grown} KiB over 200 sessions"


def test_warmup_walks_a_session_and_restores_the_pool():
    engine = make_engine(sessions_in_pool=2)
    free = engine.cache.pool.num_free
    timings = engine.warmup()
    assert list(timings) == ["call1_ms"]
    assert engine.cache.pool.num_free == free and not engine.sessions and engine.steps == 0
    assert sum(engine.endings.values()) == 0


def test_warmup_progress_lines_and_summary_give_the_same_numbers(caplog):
    """`call 1/1 ... N ms` and the summary's `call1_ms` are one measurement (they once disagreed: 1072 vs 167.5)."""
    engine = make_engine(sessions_in_pool=2)
    with caplog.at_level("INFO"):
        timings = engine.warmup()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up: call ")]
    assert len(lines) == len(timings)
    for n, line in enumerate(lines, 1):
        shown = float(re.search(r" (\d+) ms", line)[1])
        # one measurement: the line prints it to the ms, the summary to 0.1 ms
        assert line.startswith(f"warm-up: call {n}/") and abs(shown - timings[f"call{n}_ms"]) <= 0.55


def test_dreamzero_warmup_walks_a_full_window_and_a_restart(tiny_model):
    from ardiff_policies.dreamzero.policy import DreamZeroConfig, DreamZeroPolicy

    policy = DreamZeroPolicy(DreamZeroConfig(view_size=(48, 80)), RuntimeOptions(), model=tiny_model)
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1)
    engine = SessionEngine(policy, cache, max_sessions=1)
    timings = engine.warmup()
    assert len(timings) == 6  # 1 + 4 calls fill the 9-frame window, 1 more restarts it
    assert cache.pool.num_free == cache.pool.capacity and cache.storage.cross.num_free == cache.storage.cross.num_slots
