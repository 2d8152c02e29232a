"""When the runner asks for its next chunk (``AsyncChunkRunner(asking=...)``): ``adaptive`` as late as the server's
estimate of the next call (``server_timing.next_call_p90_ms``) allows, keeping ``margin_steps`` and ``blend_steps``;
``half`` at half the chunk; ``adaptive`` without an estimate asks as ``half`` does. Each continuation says how
many seconds of actions the robot had left (the server's deadline for it)."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_client.async_runner import AsyncChunkRunner, DelayedRequester, SimulatedClock
from ardiff_client.chunk_reply import ReplyError, parse_chunk_reply

HZ, H = 15.0, 24
ACTIONS = np.arange(H, dtype=np.float64)[:, None] * np.ones((H, 8))


def episode(asking: str, latency_s: float, estimate_ms: float | None, steps: int = 150, **kwargs) -> tuple[list[dict], dict]:
    """The continuations a runner sent against a server whose every reply takes ``latency_s`` and says ``estimate_ms``."""
    asked: list[dict] = []
    calls = iter(range(1, 10_000))

    def infer(request: dict) -> dict:
        asked.append(request.get("continuation"))
        reply = {"actions": ACTIONS, "chunk_id": next(calls), "frozen": 0}
        if estimate_ms is not None:
            reply["server_timing"] = {"next_call_p90_ms": estimate_ms, "infer_ms": 1.0}
        return reply

    clock = SimulatedClock()
    runner = AsyncChunkRunner(DelayedRequester(infer, clock, latency_s), control_hz=HZ, asking=asking, clock=clock, sleep=clock.sleep, **kwargs)
    summary = runner.run(lambda: {}, lambda action: None, steps).summary()
    return [c for c in asked if c is not None], summary


def test_adaptive_asks_when_the_estimate_margin_and_blend_are_left():
    # 0.3 s at 15 Hz: a delay of ceil(4.5) = 5 actions; + margin 1 + blend 3 = ask with 9 left, at index 24 - 9 = 15
    asked, summary = episode("adaptive", 0.3, 300.0)
    assert {c["executed"] for c in asked} == {15} and {c["delay"] for c in asked} == {5}
    assert all(c["actions_left_s"] == pytest.approx(9 / HZ) for c in asked)
    assert summary["steady_idle_per_chunk"] == 0 and summary["asked_left_median"] == 9
    # a server that expects a slower call than the robot saw (the load grew): the estimate wins, 7 + 1 + 3 = 11 left
    slower, _ = episode("adaptive", 0.3, 450.0)
    assert {c["executed"] for c in slower} == {H - 11}
    # slower still (0.6 s: 9 + 1 = 10 left at the latest): the blend rows are spent only up to half the chunk, 12 left,
    # and a call that needs more than half (0.8 s: 12 + 1) asks at its delay and margin, as half asking would
    assert {c["executed"] for c in episode("adaptive", 0.3, 600.0)[0]} == {H - 12}
    assert {c["executed"] for c in episode("adaptive", 0.3, 800.0)[0]} == {H - 13}
    # a faster estimate than the robot's own measured latency never asks later than that latency allows
    faster, _ = episode("adaptive", 0.3, 50.0)
    assert {c["executed"] for c in faster} == {15}
    tight, _ = episode("adaptive", 0.3, 300.0, margin_steps=0, blend_steps=0)
    assert {c["executed"] for c in tight} == {H - 5}


def test_half_asks_at_half_the_chunk_and_adaptive_without_an_estimate_falls_back_to_it():
    half, half_summary = episode("half", 0.3, 300.0)
    assert {c["executed"] for c in half} == {12}  # 12 left: max(5 + 1, 0.5 x 24)
    fallback, _ = episode("adaptive", 0.3, None)
    assert {c["executed"] for c in fallback} == {12}
    _, adaptive_summary = episode("adaptive", 0.3, 300.0)
    # fewer calls for the same actions, and neither stands still after the first chunk
    assert adaptive_summary["calls_per_chunk"] < half_summary["calls_per_chunk"]
    assert adaptive_summary["steady_idle_per_chunk"] == half_summary["steady_idle_per_chunk"] == 0


def test_bad_asking_arguments_and_a_bad_estimate_are_refused_by_name():
    with pytest.raises(ValueError, match="asking: expected one of"):
        AsyncChunkRunner(lambda request: {}, control_hz=HZ, asking="late")
    with pytest.raises(ValueError, match="blend_steps must be >= 0"):
        AsyncChunkRunner(lambda request: {}, control_hz=HZ, blend_steps=-1)
    assert parse_chunk_reply({"actions": ACTIONS, "server_timing": {"next_call_p90_ms": 250}}, 1).next_call_s == 0.25
    assert parse_chunk_reply({"actions": ACTIONS, "server_timing": {"infer_ms": 3.0}}, 1).next_call_s is None
    with pytest.raises(ReplyError, match=r"reply 2: server_timing.next_call_p90_ms: expected a finite number of milliseconds >= 0, got -1"):
        parse_chunk_reply({"actions": ACTIONS, "server_timing": {"next_call_p90_ms": -1}}, 2)
