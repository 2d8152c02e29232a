"""A request's denoising steps over the websocket (``num_inference_steps``, ``action_num_inference_steps``): served and
reported by a policy that takes them (DreamZero the first; LingBot-VA both, on OpenPI's wire and its own), refused
naming the bound outside it with the session untouched, refused by name by a policy that takes none."""

from __future__ import annotations

import json

import numpy as np

from ardiff_server.config import load_config
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


def test_dreamzero_refuses_the_action_loops_key_by_name():
    with InprocServer({"engine": {"warmup": False}, "policy": TINY_DREAMZERO}) as server:
        (refused,) = server.exchange([{**DROID, "session_id": "s", "action_num_inference_steps": 4}])
        assert refused == (
            "bad request: action_num_inference_steps: this server's policy takes no per-request action denoising steps "
            "(it takes num_inference_steps); leave it out"
        )


def lingbot_va_server() -> InprocServer:
    return InprocServer(load_config("tiny_lingbot_va", overrides=["engine.warmup=false", "server.port=0"]))


def lingbot_va_cameras(frames: int, seed: int, prefix: str) -> dict[str, np.ndarray]:
    """The tiny RoboTwin cameras (64x96 high, 32x48 wrists): ``frames`` of each, a stack unless one frame is asked of
    LingBot-VA's own wire (``prefix`` ``observation/`` for OpenPI, ``observation.images.`` for LingBot-VA's)."""
    rng = np.random.default_rng(seed)
    sizes = {"cam_high": (64, 96), "cam_left_wrist": (32, 48), "cam_right_wrist": (32, 48)}
    shape = (frames,) if prefix == "observation/" else ()
    return {prefix + name: rng.integers(0, 256, (*shape, h, w, 3), dtype=np.uint8) for name, (h, w) in sizes.items()}


def test_lingbot_va_serves_its_steps_on_both_wires_and_says_them():
    """OpenPI: the session map says the steps each loop ran and the forwards; out of bounds is refused naming the
    setting. LingBot-VA's own wire: a reset's steps are every infer's of its episode, an infer's own override them,
    the reply says them; a commit carrying steps and a reset out of bounds are refused by name."""
    with lingbot_va_server() as server:
        asked, refused = server.exchange(
            [
                {**lingbot_va_cameras(1, 1, "observation/"), "prompt": "stack", "session_id": "o", "num_inference_steps": 1},
                {**lingbot_va_cameras(4, 2, "observation/"), "prompt": "stack", "session_id": "o", "action_num_inference_steps": 3},
            ]
        )
        assert {k: asked["session"][k] for k in ("num_inference_steps", "action_num_inference_steps", "dit_forwards")} == {
            "num_inference_steps": 1,
            "action_num_inference_steps": 2,
            "dit_forwards": 5,
        }
        assert refused == (
            "bad request: action_num_inference_steps: 3 is above the maximum 2 this server takes (policy.request_action_inference_steps: [1, 2])"
        )
        info = json.loads(server.http("/info")[1])["policy"]
        assert info["inference_steps"] == {
            "num_inference_steps": {"min": 1, "max": 2, "setting": "policy.request_inference_steps"},
            "action_num_inference_steps": {"min": 1, "max": 2, "setting": "policy.request_action_inference_steps"},
        }
        first = lingbot_va_cameras(1, 3, "observation.images.")
        bad_reset, _, episode, own, bad_commit, _, plain = server.exchange(
            [
                {"reset": True, "prompt": "stack", "num_inference_steps": 9},
                {"reset": True, "prompt": "stack", "action_num_inference_steps": 1},
                {"obs": first},
                {"obs": first, "num_inference_steps": 1},
                {"obs": [first] * 4, "compute_kv_cache": True, "state": np.zeros((16, 2, 16), np.float32), "num_inference_steps": 1},
                {"reset": True, "prompt": "stack"},
                {"obs": first},
            ]
        )
        assert bad_reset == "bad request: num_inference_steps: 9 is above the maximum 2 this server takes (policy.request_inference_steps: [1, 2])"
        assert (episode["num_inference_steps"], episode["action_num_inference_steps"]) == (2, 1)  # the reset's action steps
        assert (own["num_inference_steps"], own["action_num_inference_steps"]) == (1, 1)  # its own video steps, the reset's action steps
        assert bad_commit == (
            "bad request: num_inference_steps: a compute_kv_cache denoises nothing; send it with the infer (or the reset, for the episode)"
        )
        assert (plain["num_inference_steps"], plain["action_num_inference_steps"]) == (2, 2)  # a new reset names none: the embodiment's
