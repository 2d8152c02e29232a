"""The asynchronous client half against a live server (the real PolicyServer with the tiny DreamZero).

The robot loop runs on its real clock at a control rate whose chunk (24 actions) lasts longer than a
tiny-model inference, so in steady state it never stands still; every splice must land on actions the
server froze, and those must be exactly what the robot executed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ardiff_client import replay
from ardiff_client.async_runner import AsyncChunkRunner, DelayedRequester, SimulatedClock, joint_columns
from ardiff_client.websocket_client import WebsocketPolicy
from tests.helpers.inproc_server import InprocServer

CONFIG = {
    "engine": {"warmup": False},
    "policy": {"name": "dreamzero", "view_size": [48, 80], "image_resolution": [48, 80], "num_inference_steps": 2, "dit_step_cache": "off"},
}


@pytest.fixture(scope="module")
def server():
    with InprocServer(CONFIG) as running:
        yield running


def test_the_runner_never_waits_and_splices_at_frozen_actions(server):
    rng = np.random.default_rng(0)
    executed: list[np.ndarray] = []
    state = {"joints": np.zeros(7, np.float32)}

    def observe() -> dict:
        images = {f"observation/exterior_image_{i}_left": rng.integers(0, 255, (48, 80, 3), dtype=np.uint8) for i in (0, 1)}
        return {**images, "observation/joint_position": state["joints"].copy(), "observation/gripper_position": np.zeros(1, np.float32)}

    def act(action: np.ndarray) -> None:
        executed.append(action.copy())
        state["joints"] = action[:7].astype(np.float32)

    replies: list[dict] = []
    with WebsocketPolicy(server.url) as policy:
        assert joint_columns(policy.metadata) == list(range(7))

        def recording(request: dict) -> dict:
            reply = policy(request)
            replies.append({"request": request.get("continuation"), "reply": reply})
            return reply

        # The robot's clock is simulated and every reply takes exactly 0.5 s of it (8 control steps at 15 Hz), whatever
        # the shared CI machine's real inference time: the schedule is deterministic, the replies are the live server's.
        clock = SimulatedClock()
        requester = DelayedRequester(recording, clock, latency_s=0.5)
        runner = AsyncChunkRunner(requester, control_hz=15, prompt="stack the blocks", joint_columns=list(range(7)), clock=clock, sleep=clock.sleep)
        report = runner.run(observe, act, steps=90)
        policy.reset(runner.session_id)
    summary = report.summary()
    assert report.chunks >= 4 and len(executed) == 90 - report.idle_steps
    assert report.idle_steps == 8, summary  # only while the first chunk is computed: 0.5 s x 15 Hz, rounded up
    continued = [r for r in replies if r["request"] is not None]
    assert continued and all(r["reply"]["continuation"] == "applied" or r["reply"]["frozen"] == 0 for r in continued)
    assert any(r["reply"]["frozen"] > 0 for r in continued)
    # each frozen prefix is what the previous chunk said for those steps, bit for bit
    by_id = {r["reply"]["chunk_id"]: r["reply"]["actions"] for r in replies}
    for r in continued:
        frozen, asked = r["reply"]["frozen"], r["request"]
        if frozen:
            old = by_id[asked["chunk_id"]]
            assert np.array_equal(r["reply"]["actions"][:frozen], old[asked["executed"] : asked["executed"] + frozen])
    assert summary["latency_p50_ms"] > 0 and summary["seam_jump"] == summary["seam_jump"]


def test_blocking_mode_stands_still_while_it_waits_and_async_modes_do_not():
    chunk = {"actions": np.arange(24, dtype=np.float64)[:, None] * np.ones((24, 8)), "chunk_id": 1, "frozen": 0}
    runs = {}
    for mode in ("blocking", "async", "continuation"):
        clock = SimulatedClock()
        runner = AsyncChunkRunner(DelayedRequester(lambda request: chunk, clock, 0.4), control_hz=15, mode=mode, clock=clock, sleep=clock.sleep)
        runs[mode] = runner.run(lambda: {}, lambda a: None, steps=150).summary()
    assert runs["blocking"]["idle_steps_per_chunk"] == runs["blocking"]["steady_idle_per_chunk"] == 6  # latency x rate per chunk
    assert runs["async"]["idle_steps"] == runs["continuation"]["idle_steps"] == 6  # only the first chunk
    assert runs["async"]["steady_idle_per_chunk"] == runs["continuation"]["steady_idle_per_chunk"] == 0
    assert runs["async"]["chunks"] > runs["blocking"]["chunks"]
    # row k of every chunk is k: where a chunk is left its next action would have moved every column by 1
    assert runs["async"]["old_step_at_seam"] == pytest.approx(np.sqrt(8))
    assert np.isnan(runs["blocking"]["old_step_at_seam"])  # nothing left of the old chunk when blocking


def test_overlap_asks_early_enough_to_leave_old_actions_past_the_frozen_ones():
    """0.3 s at 15 Hz: the delay needs 5 + 1 actions left; overlap 0.5 asks at 12 left, so the continuation's
    executed + delay leaves 7 old actions for the soft mask (overlap 0: one, the margin's)."""
    chunk = {"actions": np.zeros((24, 8)), "chunk_id": 1, "frozen": 0}
    asked = {}
    for overlap in (0.0, 0.5):
        clock, requests = SimulatedClock(), []

        def infer(request: dict, requests: list = requests) -> dict:
            requests.append(request.get("continuation"))
            return chunk

        runner = AsyncChunkRunner(DelayedRequester(infer, clock, 0.3), control_hz=15, overlap=overlap, clock=clock, sleep=clock.sleep)
        report = runner.run(lambda: {}, lambda a: None, steps=120)
        assert report.idle_steps == 5  # only the first chunk, either way
        asked[overlap] = {(c["executed"], c["delay"]) for c in requests[2:]}
    assert asked == {0.0: {(18, 5)}, 0.5: {(12, 5)}}
    with pytest.raises(ValueError, match="overlap must be in"):
        AsyncChunkRunner(lambda request: chunk, control_hz=15, overlap=1.0)


def test_ardiff_client_async_runs_an_episode(server, capsys):
    """The real clock and a background thread (a shared CI machine: only what any latency gives is asserted)."""
    status = replay.main(["--port", str(server.port), "--async", "--control-hz", "4", "--steps", "40", "--json", "--quiet", "--size", "48x80"])
    assert status == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["mode"] == "continuation" and summary["steps"] == 40 and summary["chunks"] >= 1
    assert summary["idle_steps"] < 40 and summary["latency_p50_ms"] > 0


def test_the_contract_on_the_wire_and_in_info(server):
    from openpi_client import msgpack_numpy
    from websockets.sync.client import connect

    from ardiff_server.wire.jpeg import encode_jpeg

    info = json.loads(server.http("/info")[1])
    contract = info["policy"]["continuation"]
    assert contract["mode"] == "inpaint" and set(contract["request"]["continuation"]) == {"executed", "delay", "chunk_id"}
    assert {"chunk_id", "frozen", "continuation"} <= set(contract["reply"])
    image = np.full((48, 80, 3), 90, np.uint8)
    base = {
        "observation/exterior_image_0_left": image,
        "observation/joint_position": np.zeros(7),
        "observation/gripper_position": np.zeros(1),
        "prompt": "stack",
        "session_id": "wire",
    }
    with connect(server.url, compression=None) as ws:
        ws.recv()  # metadata

        def call(request):
            ws.send(msgpack_numpy.packb(request))
            reply = ws.recv()
            return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)

        plain = call(base)
        assert (plain["chunk_id"], plain["frozen"]) == (1, 0) and "continuation" not in plain
        too_far = call({**base, "continuation": {"executed": 20, "delay": 5}})
        assert too_far.startswith("bad request: continuation.executed + continuation.delay = 20 + 5 is past the 24-action chunk")
        corrupt = call({**base, "observation/wrist_image_left": encode_jpeg(image)[:100]})
        assert corrupt.startswith("bad request: observation/wrist_image_left: expected ") and "corrupt JPEG" in corrupt
        jpeg = {**base, "observation/exterior_image_0_left": encode_jpeg(image), "continuation": {"executed": 2, "delay": 3, "chunk_id": 1}}
        continued = call(jpeg)  # the session was untouched by the bad requests: it continues chunk 1
        assert (continued["chunk_id"], continued["frozen"], continued["continuation"]) == (2, 3, "applied")
        assert np.array_equal(continued["actions"][:3], plain["actions"][2:5])
        assert continued["session"]["frozen"] == 3
