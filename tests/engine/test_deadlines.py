"""Deadline order (engine.schedule: deadline): the earliest robot to run out of actions goes first.

A request's deadline is when its robot runs out of actions (``Infer.deadline``, the engine's
monotonic clock); a request without one is due at its arrival. Before, the scheduler served in
arrival order only: an early ask with 0.8 s of actions left went before a robot that ran dry in 0.1 s.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ardiff_kv import PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.core import SessionEngine
from ardiff_server.engine.messages import End, Infer, InferReply
from ardiff_server.engine.scheduler import Admitted, Scheduler, SessionState
from tests.helpers.batching import ATOL, alone, observation
from tests.helpers.batching import make_engine as dreamzero_engine
from tests.helpers.fake_policy import FakeConfig, FakePolicy


def infer(request_id: int, session_id: str, deadline: float | None = None) -> Infer:
    return Infer(request_id, session_id, RobotObservation(), deadline)


def admit_all(scheduler: Scheduler) -> None:
    """Admit every arrival, ready (what the engine does for a request without session-own work)."""
    for a in scheduler.next_round().admit:
        session = SessionState(a.request.session_id, None, None)
        scheduler.admit(Admitted(a.request, session, True, a.queued_ms / 1000.0, a.due), ready=True)


def next_batch(scheduler: Scheduler) -> list[int]:
    """The next batch's request ids, taken out of the admitted table (as the engine's step does)."""
    ids = [rid for rid, _ in scheduler.next_round(timeout_s=5).batch]
    scheduler.take(ids)
    return ids


def fake_engine(max_batch: int = 1, schedule: str = "deadline") -> SessionEngine:
    policy = FakePolicy(FakeConfig(max_batch=max_batch), RuntimeOptions())
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=8 * spec.pages_per_branch + 1, max_sessions=8, branches=policy.branches, max_batch=max_batch)
    return SessionEngine(policy, cache, max_sessions=8, max_batch=max_batch, schedule=schedule)


# -- order ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["deadline", "arrival"])
def test_a_late_deadline_waits_behind_an_early_one_and_arrival_order_serves_first_come(schedule):
    now = time.monotonic()
    scheduler = Scheduler(max_batch=2, schedule=schedule)
    for request in (infer(1, "slack", now + 0.8), infer(2, "dry", now + 0.1), infer(3, "later", now + 0.5)):
        scheduler.put(request)
    admit_all(scheduler)
    first = next_batch(scheduler)
    assert first == ([2, 3] if schedule == "deadline" else [1, 2])  # the robot with 0.8 s left waits
    assert next_batch(scheduler) == ([1] if schedule == "deadline" else [3])


def test_engine_steps_earliest_deadline_first_and_each_reply_says_its_slack():
    engine = fake_engine(max_batch=1)
    now = time.monotonic()
    requests = [
        Infer(1, "slack", RobotObservation(), now + 30.0),
        Infer(2, "blocking", RobotObservation()),  # no deadline: due at its arrival, now
        Infer(3, "dry", RobotObservation(), now + 10.0),
        Infer(4, "ran-dry", RobotObservation(), now - 1.0),  # its robot already stands still
    ]
    replies = engine.run(requests)
    # due: 2 and 4 at their arrival (4's deadline is before it arrived: due now, after 2 which came first), 3, then 1
    assert [r.request_id for r in replies] == [2, 4, 3, 1]
    by_id = {r.request_id: r for r in replies}
    assert all(isinstance(r, InferReply) for r in replies)
    assert by_id[2].deadline_slack_s is None and not by_id[2].deadline_missed
    assert by_id[4].deadline_slack_s < -1.0 and by_id[4].deadline_missed
    assert 9.0 < by_id[3].deadline_slack_s < 10.0 and not by_id[3].deadline_missed
    assert 29.0 < by_id[1].deadline_slack_s < 30.0


def test_ties_keep_arrival_order_and_no_deadlines_is_arrival_order():
    due = time.monotonic() + 1.0
    scheduler = Scheduler(max_batch=1)
    for request_id, sid in enumerate("abcd"):
        scheduler.put(infer(request_id, sid, due if sid in "bd" else None))
    admit_all(scheduler)
    # a and c are due at their arrivals (now, a first), b and d at the same deadline (b came first)
    assert [next_batch(scheduler) for _ in range(4)] == [[0], [2], [1], [3]]
    scheduler = Scheduler(max_batch=2)
    for request_id, sid in enumerate("abcde"):
        scheduler.put(infer(request_id, sid))
    admit_all(scheduler)
    assert [next_batch(scheduler) for _ in range(3)] == [[0, 1], [2, 3], [4]]


def test_control_requests_still_go_first():
    scheduler = Scheduler(max_batch=1)
    scheduler.put(infer(1, "a", time.monotonic() - 5.0))  # as urgent as a request can be
    scheduler.put(End(2, "b", "reset"))
    assert scheduler.next_round().control == End(2, "b", "reset")


def test_a_session_never_runs_twice_in_one_forward_whatever_its_deadlines():
    now = time.monotonic()
    scheduler = Scheduler(max_batch=3)
    for request in (infer(1, "a", now + 5.0), infer(2, "a", now + 0.1), infer(3, "b", now + 1.0)):
        scheduler.put(request)
    admit_all(scheduler)
    assert next_batch(scheduler) == [3, 1]  # a's later request waits for its earlier one, however urgent
    assert next_batch(scheduler) == [2]


# -- none starves ---------------------------------------------------------------------------------


def test_a_stream_of_early_deadlines_cannot_keep_a_due_now_request_waiting():
    """One step at a time, and every round another robot asks with only 10 ms of actions left. The
    blocking client's request (no deadline: due at its arrival) waits only for those due before it came."""
    scheduler = Scheduler(max_batch=1)
    ids = iter(range(1000))
    for k in range(3):  # already waiting when the blocking request comes, due before it
        scheduler.put(infer(next(ids), f"early{k}", time.monotonic() + 0.01))
    time.sleep(0.02)
    blocking = next(ids)
    scheduler.put(infer(blocking, "blocking"))
    served: list[int] = []
    for k in range(20):
        scheduler.put(infer(next(ids), f"stream{k}", time.monotonic() + 0.01))
        admit_all(scheduler)
        served += next_batch(scheduler)
        if blocking in served:
            break
    assert served.index(blocking) <= 3, served


def test_a_far_deadline_is_served_once_due_now_arrivals_come_later_than_it():
    """Its key never moves; a due-now request's key is its arrival, which grows: so it is passed
    only until the arrivals reach its deadline."""
    scheduler = Scheduler(max_batch=1)
    far = time.monotonic() + 0.2
    scheduler.put(infer(0, "far", far))
    served: list[int] = []
    for k in range(1, 200):
        scheduler.put(infer(k, f"now{k}"))
        admit_all(scheduler)
        served += next_batch(scheduler)
        if 0 in served:
            break
        time.sleep(0.005)
    assert 0 in served and time.monotonic() >= far


def test_a_partial_batch_stops_waiting_for_company_at_its_deadline():
    scheduler = Scheduler(max_batch=4, batch_wait_s=2.0)
    scheduler.put(infer(1, "a", time.monotonic() + 0.1))
    admit_all(scheduler)
    started = time.monotonic()
    assert next_batch(scheduler) == [1] and time.monotonic() - started < 1.0


# -- the tables ------------------------------------------------------------------------------------


def test_one_admitted_table_whose_rows_are_the_session_tables():
    """The scheduler keeps the only admitted table: each waiting request once, its session the
    table's own row, whose ``waiting`` counts it; a step takes them out."""
    engine = fake_engine(max_batch=4)
    assert not hasattr(engine, "_admitted") and engine.sessions is engine.scheduler.sessions
    for request_id, sid in enumerate("abc"):
        engine.scheduler.put(Infer(request_id, sid, RobotObservation(prompt="encode:0.05" if sid == "c" else "")))
    round = engine.scheduler.next_round()
    assert engine.execute(round) == []
    table = engine.scheduler._admitted
    assert sorted(table) == [0, 1, 2]
    for entry in table.values():
        assert entry.session is engine.sessions[entry.request.session_id] and entry.session.waiting == 1
    replies = []
    while len(replies) < 3:
        replies += engine.execute(engine.scheduler.next_round(wait_for_prepared=True))
    assert all(isinstance(r, InferReply) for r in replies) and not table
    assert all(s.waiting == 0 for s in engine.sessions.values()) and engine.scheduler.empty()


# -- a batch formed by deadline equals each member alone -------------------------------------------


def test_a_batch_formed_by_deadline_equals_each_member_alone(tiny_model, reference_engine):
    """Three robots, room for two per forward: the two earliest deadlines form the batch (not the
    two that came first), and every robot's actions equal its calls alone."""
    rng = np.random.default_rng(11)
    engine = dreamzero_engine(tiny_model, max_batch=2)
    episodes = {sid: [observation(rng, i == 0) for i in range(2)] for sid in ("slack", "dry", "soon")}
    left = {"slack": 5.0, "dry": 0.1, "soon": 1.0}
    got: dict[str, list[np.ndarray]] = {sid: [] for sid in episodes}
    for call in range(2):
        now = time.monotonic()
        requests = [Infer(10 * call + i, sid, episodes[sid][call], now + left[sid]) for i, sid in enumerate(episodes)]
        replies = engine.run(requests)
        assert [r.session_id for r in replies] == ["dry", "soon", "slack"]
        assert [r.batch_size for r in replies] == [2, 2, 1]
        for reply in replies:
            got[reply.session_id].append(reply.actions)
    for sid, episode in episodes.items():
        for call, (a, b) in enumerate(zip(alone(reference_engine, f"ref-{sid}", episode), got[sid])):
            np.testing.assert_allclose(b, a, atol=ATOL, rtol=0, err_msg=f"{sid} call {call}")


@pytest.fixture(scope="module")
def reference_engine(tiny_model):
    return dreamzero_engine(tiny_model, max_sessions=2, max_batch=1)


# -- the option and the metrics --------------------------------------------------------------------


def test_engine_schedule_is_an_option_and_an_unknown_schedule_fails_with_its_name():
    from ardiff_server.config import EngineConfig

    assert EngineConfig().schedule == "deadline" and EngineConfig(schedule="arrival").schedule == "arrival"
    with pytest.raises(ValueError, match="schedule"):
        EngineConfig(schedule="fifo")


def test_metrics_count_misses_and_the_slack_of_calls_with_a_deadline():
    from ardiff_server.frontend.metrics import Metrics

    class NoReplicas:
        def replicas(self) -> list:
            return []

    metrics = Metrics(NoReplicas())
    reply = lambda slack: InferReply(0, "s", np.zeros((1, 1)), {}, {}, False, 1, 0.0, deadline_slack_s=slack)  # noqa: E731
    for slack in (0.3, -0.05, None):
        metrics.observe_deadline(reply(slack))
    value = metrics.registry.get_sample_value
    assert value("ardiff_deadline_misses_total") == 1
    assert value("ardiff_deadline_slack_seconds_count") == 2 and value("ardiff_deadline_slack_seconds_bucket", {"le": "0.0"}) == 1
