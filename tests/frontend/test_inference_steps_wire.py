"""A request's ``num_inference_steps`` over the websocket: served and reported by a policy that takes it (DreamZero),
refused naming the bound outside it with the session untouched, refused by name by a policy that takes none."""

from __future__ import annotations

from tests.helpers.inproc_server import DROID, TINY_DREAMZERO, InprocServer


def test_a_requests_steps_are_served_reported_and_bounded_by_name():
    with InprocServer({"engine": {"warmup": False}, "policy": TINY_DREAMZERO}) as server:
        asked, default, refused, after = server.exchange(
            [
                {**DROID, "session_id": "s", "num_inference_steps": 1},
                {**DROID, "session_id": "s"},
                {**DROID, "session_id": "s", "num_inference_steps": 3},
                {**DROID, "session_id": "s", "num_inference_steps": 2},
            ],
        )
        assert (asked["session"]["num_inference_steps"], asked["session"]["dit_forwards"]) == (1, 1)
        assert default["session"]["num_inference_steps"] == 2
        assert refused == "bad request: num_inference_steps: 3 is above the maximum 2 this server takes (policy.request_inference_steps: [1, 2])"
        assert after["session"]["calls"] == 3  # the refused request left the session as it was


def test_a_policy_that_takes_no_steps_refuses_the_key_by_name():
    with InprocServer({"engine": {"warmup": False}, "policy": {"name": "noop"}}) as server:
        (refused,) = server.exchange([{**DROID, "session_id": "s", "num_inference_steps": 4}])
        assert refused == "bad request: num_inference_steps: this server's policy takes no per-request denoising steps; leave it out"
