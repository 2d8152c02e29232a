"""Deadlines on the wire: a request's ``continuation.actions_left_s`` becomes the engine's deadline (the frame's
arrival plus it), so over the front end a robot about to run dry is served before one with actions to spare; its
reply says the slack its step started with and the server's estimate of its next call, and ``/metrics`` counts both."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ardiff_client.records import ServerError
from ardiff_client.websocket_client import WebsocketPolicy
from tests.helpers.inproc_server import InprocServer
from tests.helpers.server_harness import fake_config

STEP_S = 0.15  # every fake step
BLOCK_S = 0.8  # the first robot's step: the others arrive while it runs


def request(session_id: str, prompt: str = "work", actions_left_s: float | None = None) -> dict:
    out = {
        "observation/joint_position": np.zeros(7),
        "observation/gripper_position": np.zeros(1),
        "prompt": prompt,
        "session_id": session_id,
    }
    if actions_left_s is not None:
        out["continuation"] = {"executed": 0, "delay": 0, "actions_left_s": actions_left_s}
    return out


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels or "le" not in s.labels}


@pytest.mark.parametrize("schedule", ["deadline", "arrival"])
def test_a_late_deadline_waits_behind_an_early_one_over_the_front_end(schedule):
    config = fake_config(schedule=schedule, warmup=False, policy={"delay_s": STEP_S, "continuations": True})
    with InprocServer(config) as server:
        done: dict[str, float] = {}
        replies: dict[str, dict] = {}

        def robot(session_id: str, body: dict, start_at: float) -> None:
            with WebsocketPolicy(server.url) as policy:
                time.sleep(max(0.0, start_at - time.monotonic()))
                replies[session_id] = policy(body)
                done[session_id] = time.monotonic()

        start = time.monotonic() + 0.5  # every connection is open by then
        robots = [
            ("blocker", request("blocker", prompt=f"sleep:{BLOCK_S}"), start),
            # arrives first, with 5 s of actions left: it can wait
            ("slack", request("slack", actions_left_s=5.0), start + 0.2),
            # arrives after it, 0.1 s from running dry (it will: it waits out the blocker's step)
            ("dry", request("dry", actions_left_s=0.1), start + 0.35),
        ]
        threads = [threading.Thread(target=robot, args=r) for r in robots]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        order = sorted(done, key=done.get)
        assert order == (["blocker", "dry", "slack"] if schedule == "deadline" else ["blocker", "slack", "dry"])
        timing = {sid: reply["server_timing"] for sid, reply in replies.items()}
        assert "deadline_slack_ms" not in timing["blocker"]  # no deadline: due now, nothing to miss
        assert timing["dry"]["deadline_slack_ms"] < 0  # its step started after its robot ran dry
        assert timing["slack"]["deadline_slack_ms"] > 0
        # the deadline is the frame's arrival plus actions_left_s: slack 5 s less the wait before its step
        waited_s = BLOCK_S - 0.2 + (STEP_S if schedule == "deadline" else 0.0)
        assert 5.0 - waited_s - 0.3 < timing["slack"]["deadline_slack_ms"] / 1000.0 < 5.0 - waited_s + 0.1
        assert all(t["next_call_p90_ms"] > 0 for t in timing.values())
        status, text = server.http("/metrics")
        got = samples(text)
        assert status == 200
        assert got["ardiff_deadline_misses_total"] == 1
        assert got["ardiff_deadline_slack_seconds_count"] == 2


def test_a_bad_deadline_is_a_bad_request_and_the_session_carries_on():
    with InprocServer(fake_config(warmup=False, policy={"continuations": True})) as server, WebsocketPolicy(server.url) as policy:
        with pytest.raises(
            ServerError, match=r"server error: bad request: continuation.actions_left_s: expected a finite number of seconds >= 0, got -1"
        ):
            policy(request("robot", actions_left_s=-1.0))
        assert policy(request("robot", actions_left_s=0.5))["server_timing"]["deadline_slack_ms"] > 0
