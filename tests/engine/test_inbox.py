"""The engine's inbox (engine/inbox.py): control first, inference in batches, waiting only when told to."""

from __future__ import annotations

import threading
import time

from ardiff_server.engine.inbox import RequestInbox
from ardiff_server.engine.messages import Detach, End, Infer
from policies.observation import RobotObservation


def infer(i: int) -> Infer:
    return Infer(i, f"s{i}", RobotObservation())


def test_a_batch_is_what_is_queued_up_to_the_limit_in_arrival_order():
    inbox = RequestInbox()
    for i in range(5):
        inbox.put(infer(i))
    assert [r.request_id for r, _ in inbox.get_batch(3)] == [0, 1, 2]
    assert [r.request_id for r, _ in inbox.get_batch(3)] == [3, 4]  # never waits to fill by default
    assert inbox.empty()


def test_control_requests_come_alone_and_first():
    inbox = RequestInbox()
    inbox.put(infer(0))
    inbox.put(End(1, "x", "reset"))
    inbox.put(Detach(2, "y", "switched"))
    assert [type(r).__name__ for r, _ in inbox.get_batch(8)] == ["End"]
    assert [type(r).__name__ for r, _ in inbox.get_batch(8)] == ["Detach"]
    assert [r.request_id for r, _ in inbox.get_batch(8)] == [0]


def test_a_partial_batch_waits_for_more_only_with_a_wait_and_a_control_request_ends_the_wait():
    inbox = RequestInbox()
    inbox.put(infer(0))
    threading.Timer(0.05, inbox.put, args=(infer(1),)).start()
    started = time.monotonic()
    assert [r.request_id for r, _ in inbox.get_batch(2, wait_s=2.0)] == [0, 1]  # filled: no need to wait on
    assert time.monotonic() - started < 1.0
    inbox.put(infer(2))
    threading.Timer(0.05, inbox.put, args=(End(3, "x", "reset"),)).start()
    started = time.monotonic()
    assert [type(r).__name__ for r, _ in inbox.get_batch(4, wait_s=2.0)] == ["End"]  # the reset does not wait
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    assert [r.request_id for r, _ in inbox.get_batch(4, wait_s=0.1)] == [2]  # waited its 0.1 s, then went alone
    assert 0.09 <= time.monotonic() - started < 1.0


def test_put_back_returns_requests_to_the_head_keeping_their_wait():
    inbox = RequestInbox()
    for i in range(3):
        inbox.put(infer(i))
    time.sleep(0.05)
    taken = inbox.get_batch(2)
    inbox.put(infer(3))
    inbox.put_back(taken[1:])
    again = inbox.get_batch(8)
    assert [r.request_id for r, _ in again] == [1, 2, 3]
    assert again[0][1] >= 50.0 and again[2][1] < 50.0
