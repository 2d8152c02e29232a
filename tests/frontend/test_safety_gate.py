"""The safety gate over a real socket (policy.safety): a reject is a one-line ``bad request`` and the session and the
server carry on; a clamp says so in the reply; ``/info`` shows the gate, ``/metrics`` counts both by check."""

from __future__ import annotations

import json

import numpy as np

from tests.helpers.inproc_server import TINY_DREAMZERO, InprocServer
from tests.helpers.server_harness import metric_value


def droid(gripper: float = 0.3, frames: int = 1) -> dict:
    shape = (48, 80, 3) if frames == 1 else (frames, 48, 80, 3)
    return {
        "observation/exterior_image_0_left": np.full(shape, 40, np.uint8),
        "observation/exterior_image_1_left": np.full(shape, 90, np.uint8),
        "observation/wrist_image_left": np.full(shape, 140, np.uint8),
        "observation/joint_position": np.zeros(7),
        "observation/gripper_position": np.array([gripper]),
        "prompt": "pick up the cup",
        "session_id": "robot",
    }


def test_a_reject_is_a_one_line_bad_request_and_the_session_and_server_carry_on():
    gate = {"mode": "reject", "limits": {"gripper_position": {"max_first_step": 2.0}}}
    with InprocServer({"engine": {"warmup": False}, "policy": {**TINY_DREAMZERO, "safety": gate}}) as server:
        first, rejected, after = server.exchange([droid(), droid(gripper=50.0, frames=4), droid(frames=4)])
        assert isinstance(rejected, str) and "\n" not in rejected
        assert rejected.startswith("bad request: safety gate: first: gripper_position[0]: the first action is ")
        assert "limit 2 (policy.safety.limits.gripper_position.max_first_step)" in rejected
        assert (first["chunk_id"], after["chunk_id"]) == (1, 2)  # the rejected call left no chunk behind
        assert after["session"]["calls"] == 2 and after["safety"] == {"mode": "reject", "clamped": {}}
        metrics = server.http("/metrics")[1]
        assert metric_value(metrics, 'ardiff_safety_rejects_total{check="first"}') == 1
        assert metric_value(metrics, 'ardiff_safety_clamps_total{check="first"}') == 0
        assert json.loads(server.http("/info")[1])["policy"]["safety"]["mode"] == "reject"


def test_a_clamp_says_which_checks_clamped_in_the_reply_and_in_the_metrics():
    gate = {"mode": "clamp", "limits": {"joint_position": {"max_step": 0.001}}}
    with InprocServer({"engine": {"warmup": False}, "policy": {**TINY_DREAMZERO, "safety": gate}}) as server:
        (reply,) = server.exchange([droid()])
        assert reply["safety"]["mode"] == "clamp" and reply["safety"]["clamped"]["step"]["values"] > 0
        assert np.all(np.abs(np.diff(reply["actions"][:, :7], axis=0)) <= 0.001 + 1e-5)
        assert metric_value(server.http("/metrics")[1], 'ardiff_safety_clamps_total{check="step"}') == 1
        info = json.loads(server.http("/info")[1])["policy"]["safety"]
        assert info["limits"] == {"joint_position": {"max_step": 0.001}} and info["control_hz"] == 15.0


def test_after_a_reject_a_continuation_of_the_last_chunk_applies_as_if_the_rejected_call_never_came():
    """The attack: a rejected call that asked to continue chunk 1, then a continuation of chunk 1 again. The rejected
    call left chunk 1 the session's last chunk, so the continuation applies and its frozen rows are chunk 1's; the
    chunk that follows is the one a twin session that never sent the rejected call gets."""
    gate = {"mode": "reject", "limits": {"gripper_position": {"max_first_step": 2.0}}}
    with InprocServer({"engine": {"warmup": False}, "policy": {**TINY_DREAMZERO, "safety": gate}}) as server:
        twin = {"session_id": "twin"}
        first, twin_first = server.exchange([droid(), {**droid(), **twin}])
        # no frozen rows (delay 0): the first action is checked against the observed gripper, and refused
        bad = {**droid(gripper=50.0, frames=4), "continuation": {"chunk_id": 1, "executed": 2, "delay": 0}}
        after = {**droid(frames=4), "continuation": {"chunk_id": 1, "executed": 4, "delay": 2}}
        rejected, continued, twin_continued = server.exchange([bad, after, {**after, **twin}])
        assert isinstance(rejected, str) and rejected.startswith("bad request: safety gate: first: ")
        assert (continued["chunk_id"], continued["frozen"], continued["session"]["calls"]) == (2, 2, 2)
        assert "continuation" not in continued or continued["continuation"] == "applied"
        np.testing.assert_array_equal(continued["actions"][:2], first["actions"][4:6])  # chunk 1's rows, as executed
        np.testing.assert_array_equal(first["actions"], twin_first["actions"])
        np.testing.assert_array_equal(continued["actions"], twin_continued["actions"])
