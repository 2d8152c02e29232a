"""Session recordings (server.record_dir): files, their contents, crash safety, bounds, ids."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ardiff_policies.base import RuntimeOptions
from ardiff_server.config import ConfigError, preflight, validate_config
from ardiff_server.engine.inproc_client import InprocClient
from ardiff_server.engine.recorder import Chunk, Recorder, session_folder
from tests.helpers.fake_policy import FakeConfig, FakePolicy
from tests.helpers.server_harness import droid_observation

av = pytest.importorskip("av", reason="recordings need the viz extra (pip install -e '.[viz]')")
pytest.importorskip("matplotlib", reason="recordings need the viz extra (pip install -e '.[viz]')")


def tiny_engine(record_dir: Path):
    from ardiff_server.engine.builder import build_engine
    from ardiff_server.wire.decode import decode_request

    config = validate_config(
        {
            "server": {"record_dir": str(record_dir)},
            "engine": {"warmup": False, "kv_budget_gib": 0.05, "max_sessions": 2},
            "policy": {"name": "dreamzero", "view_size": [48, 80]},
        }
    )
    engine = build_engine(config)

    def observe(call: int, prompt: str = "pick up the cup"):
        return decode_request(droid_observation(1 if call == 0 else 4, size=(90, 160), seed=call, prompt=prompt, joint0=0.1 * call)).observation

    return engine, observe


def frames_in(path: Path) -> int:
    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def test_a_tiny_session_is_recorded_end_to_end(tmp_path):
    engine, observe = tiny_engine(tmp_path)
    calls = 5  # a window start, 3 steady calls, a window restart
    for call in range(calls):
        engine.infer("ep-1", observe(call), queued_ms=2.5 * call)  # as if it had waited that long for the worker
    engine.recorder.flush()  # its thread decodes and writes beside the steps
    engine.end("ep-1", "reset")
    engine.close()  # drains the writer
    folder = tmp_path / "ep-1"
    assert {p.name for p in folder.iterdir()} == {"rollout.mp4", "actions.npz", "timings.json", "actions.png"}
    arrays = np.load(folder / "actions.npz")
    assert arrays["actions"].shape == (calls, 24, 8) and arrays["raw_actions"].shape == (calls, 24, 32)
    assert arrays["state"].shape == (calls, 8) and arrays["calls"].tolist() == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(arrays["state"][:, 0], [0.1 * c for c in range(calls)], rtol=1e-6)
    timings = json.loads((folder / "timings.json").read_text())["calls"]
    assert [t["call"] for t in timings] == [1, 2, 3, 4, 5] and timings[-1]["window_restart"]
    assert {"vae", "denoise"} <= set(timings[0]["policy_timing"]) and timings[0]["server_timing"]["infer_ms"] > 0
    # the wait given, plus microseconds of this thread's own admission bookkeeping (not the call's encodes)
    assert [t["server_timing"]["queue_ms"] for t in timings] == pytest.approx([0.0, 2.5, 5.0, 7.5, 10.0], abs=5.0)
    # per call: max(frames seen, frames decoded from the chunk's 2 latents = 5) video frames
    assert frames_in(folder / "rollout.mp4") == 5 * calls
    with av.open(str(folder / "rollout.mp4")) as container:
        first = next(container.decode(video=0)).to_ndarray(format="rgb24")
    assert first.shape == (96, 2 * 160, 3)  # seen canvas | predicted canvas (tiny: 2 x 48 by 2 x 80)


def test_a_crash_loses_at_most_the_call_being_written(tmp_path):
    engine, observe = tiny_engine(tmp_path)
    for call in range(3):
        engine.infer("crash", observe(call))
        engine.recorder.flush()
    timings = tmp_path / "crash" / "timings.json"
    deadline = time.monotonic() + 30  # the recorder thread catches up
    while time.monotonic() < deadline and (not timings.exists() or len(json.loads(timings.read_text())["calls"]) < 3):
        time.sleep(0.1)
    # no end, no close: the process "crashed" here
    assert frames_in(tmp_path / "crash" / "rollout.mp4") >= 5 * 2
    assert np.load(tmp_path / "crash" / "actions.npz")["actions"].shape[0] == 3


def test_a_slow_recording_decode_never_delays_the_next_reply_and_the_recording_is_complete(tmp_path):
    """One robot on an engine served by its loop, 0.1 s between its calls, the recording's decode made slow (0.6 s a
    chunk). Before: the loop decoded between requests on the engine thread, so every next request waited for the
    previous chunk's decode (queue_ms ~600). Now the decode runs on the recorder's thread."""
    engine, observe = tiny_engine(tmp_path)
    decode = engine.recorder.decode

    def slow_decode(predicted):
        time.sleep(0.6)
        return decode(predicted)

    engine.recorder.decode = slow_decode
    calls = 4

    async def scenario():
        client = InprocClient(engine)
        await client.start()
        replies = []
        for call in range(calls):
            replies.append(await client.infer("slow", observe(call)))
            await asyncio.sleep(0.1)  # the robot executes its chunk; the previous chunk's decode has begun
        await client.end("slow", "reset")
        flushed = await asyncio.to_thread(engine.recorder.flush, 60)  # the session ended: its recording completes
        await client.stop()
        return replies, flushed

    replies, flushed = asyncio.run(scenario())
    waits = [r.queue_ms for r in replies[1:]]
    assert max(waits) < 300, f"the next request waited {waits} ms (the slow decode is 600 ms)"
    assert flushed
    folder = tmp_path / "slow"
    assert np.load(folder / "actions.npz")["calls"].tolist() == [1, 2, 3, 4]
    assert frames_in(folder / "rollout.mp4") == 5 * calls
    timings = json.loads((folder / "timings.json").read_text())
    assert timings["ended"] == "reset" and "dropped_calls" not in timings and engine.stats().recording_dropped == 0


def test_a_full_recording_queue_drops_calls_with_a_warning_and_never_blocks(tmp_path, caplog):
    """The recorder's thread stuck (a slow disk, a slow decode): past its bound the engine's add() drops the call
    with a WARNING and a counter at once instead of waiting or holding more; the recording says which calls it lacks."""
    from ardiff_server.engine.core import SessionEngine

    release = threading.Event()
    recorder = Recorder(tmp_path, max_bytes=10**9, decode=lambda predicted: release.wait(30) and predicted, max_pending=2)
    frames = np.zeros((4, 16, 16, 3), np.uint8)
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="ardiff_server.engine.recorder"):
        accepted = [
            recorder.add("stuck", Chunk(call, "p", frames, frames, np.zeros((24, 8)), np.zeros((24, 32)), np.zeros(8), {}, 1.0))
            for call in range(1, 6)
        ]
        recorder.end("stuck", "reset")
    assert time.perf_counter() - started < 0.5  # the engine never waited for the recorder
    assert accepted == [True, True, False, False, False] and recorder.dropped == 3
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records if "dropped" in r.message)) == 1  # once a session
    engine = SessionEngine(FakePolicy(FakeConfig(), RuntimeOptions()), None, max_sessions=1, recorder=recorder)
    assert engine.stats().recording_dropped == 3  # ardiff_recording_dropped_calls_total
    release.set()
    assert recorder.flush(30)
    timings = json.loads((tmp_path / "stuck" / "timings.json").read_text())
    assert [t["call"] for t in timings["calls"]] == [1, 2] and timings["dropped_calls"] == [3, 4, 5] and timings["ended"] == "reset"
    recorder.close()


def test_shutdown_writes_every_queued_call_at_once_without_waiting_for_decodes(tmp_path):
    """A backlog of slow decodes at shutdown (the front end kills the worker after server.shutdown_grace_s): the calls
    still queued are written without their decoded prediction (a black right half), so none of their actions or
    timings is lost and close() does not wait for the decodes. Before: close() decoded every one first."""
    frames = np.zeros((4, 16, 16, 3), np.uint8)

    decodes = []

    def slow_decode(predicted):
        decodes.append(predicted)
        time.sleep(1.0)
        return predicted

    recorder = Recorder(tmp_path, max_bytes=10**9, decode=slow_decode)
    for call in range(1, 7):
        recorder.add("busy", Chunk(call, "p", frames, frames, np.zeros((24, 8)), np.zeros((24, 32)), np.zeros(8), {}, 1.0))
    recorder.close()
    # close() waited for at most the decode in progress (and one begun as it was called), not six: counted, not timed,
    # since writing six calls' video at the recorder's nice 19 takes what a loaded machine leaves it
    assert len(decodes) <= 2, len(decodes)
    timings = json.loads((tmp_path / "busy" / "timings.json").read_text())
    assert [t["call"] for t in timings["calls"]] == [1, 2, 3, 4, 5, 6] and timings["ended"] == "shutdown"
    assert sum(not t["prediction_decoded"] for t in timings["calls"]) >= 4
    assert frames_in(tmp_path / "busy" / "rollout.mp4") == 4 * 6


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's (setpriority on a thread id)")
def test_the_recorder_thread_runs_at_the_lowest_cpu_priority_and_the_engine_thread_does_not(tmp_path):
    recorder = Recorder(tmp_path, max_bytes=10**9, decode=lambda predicted: predicted)
    recorder.flush()
    deadline = time.monotonic() + 10
    while os.getpriority(os.PRIO_PROCESS, recorder._thread.native_id) != 19 and time.monotonic() < deadline:
        time.sleep(0.01)  # it lowers itself as it starts
    assert os.getpriority(os.PRIO_PROCESS, recorder._thread.native_id) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # this thread (the engine's) keeps its own
    recorder.close()


def test_ids_never_leave_the_folder_and_never_collide(tmp_path):
    ids = ["../../etc/passwd", "..", ".", "a/b", "a_b", "x" * 500, "é", "/abs", "ok-id_1.2"]
    folders = [session_folder(tmp_path, i) for i in ids]
    assert len(set(folders)) == len(ids)
    for folder in folders:
        assert folder.parent == tmp_path and folder.name not in (".", "..") and "/" not in folder.name
    assert session_folder(tmp_path, "ok-id_1.2").name == "ok-id_1.2"


def test_disk_use_is_bounded_by_pruning_the_oldest_sessions(tmp_path):
    frames = np.zeros((4, 32, 32, 3), np.uint8)
    recorder = Recorder(tmp_path, max_bytes=60_000, decode=lambda predicted: predicted)

    def chunk(call: int) -> Chunk:
        noise = np.random.default_rng(call).integers(0, 255, frames.shape, dtype=np.uint8)  # incompressible
        return Chunk(call, "p", noise, noise, np.zeros((24, 8)), np.zeros((24, 32)), np.zeros(8), {}, 1.0)

    for session in range(6):
        for call in range(1, 4):
            recorder.add(f"s{session}", chunk(call))
        recorder.end(f"s{session}", "reset")
        recorder.flush()
    recorder.close()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "s5" in left and len(left) < 6, left  # the newest kept, the oldest pruned
    total = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert total < 60_000 * 2


def test_record_dir_without_the_viz_extra_fails_at_start_up(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "av" else real(name, *a))
    config = validate_config({"server": {"record_dir": str(tmp_path)}, "policy": {"name": "noop"}})
    with pytest.raises(
        ConfigError, match=r"server.record_dir needs av: \S+/bin/pip install -e '.\[viz\]' \(bash scripts/serve.sh --record DIR installs it too\)"
    ):
        preflight(config)


def test_start_up_says_where_recordings_go(tmp_path, caplog):
    config = validate_config({"server": {"record_dir": str(tmp_path / "runs")}, "policy": {"name": "noop"}})
    with caplog.at_level("INFO", logger="ardiff_server"):
        preflight(config)
    assert f"recording every session to {tmp_path / 'runs'}/<session id>/" in caplog.text


def test_a_lingbot_va_episode_is_recorded_with_its_calls_resets_and_predicted_video(tmp_path):
    """LingBot-VA (tiny): infer / compute_kv_cache / infer ..., a reset, the next episode of the same robot; and an
    OpenPI session whose calls commit and predict at once. The files read back with the client's readers."""
    from ardiff_client import video
    from ardiff_policies.episode import EpisodeCall
    from ardiff_policies.observation import RobotObservation
    from ardiff_server.config import load_config
    from ardiff_server.engine.builder import build_engine

    engine = build_engine(load_config("tiny_lingbot_va", overrides=["engine.warmup=false", f"server.record_dir={tmp_path}"]))
    policy = engine.policy
    rng = np.random.default_rng(0)

    def observe(frames: int, call: EpisodeCall | None) -> RobotObservation:
        cameras = {n: rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8) for n, (h, w) in zip(policy.cameras, policy.schema.resolutions)}
        return RobotObservation(cameras, {}, "stack the cube", call)

    def episode(calls: int) -> None:
        actions = None
        for call in range(calls):
            if call % 2 == 0:
                actions = engine.infer("robot", observe(1, EpisodeCall("infer"))).result.actions
            else:
                executed = actions.T.reshape(policy.channels, policy.frames, policy.per_frame)
                engine.infer("robot", observe(4 if call == 1 else 8, EpisodeCall("compute_kv_cache", executed_actions=executed)))
        engine.end("robot", "reset")  # LingBot-VA's reset

    episode(5)
    episode(1)  # the same robot's next episode: its own folder
    for frames in (1, 4):
        engine.infer("openpi", observe(frames, None))
    engine.recorder.flush()
    engine.close()

    folder = tmp_path / "robot"
    assert {p.name for p in folder.iterdir()} == {"rollout.mp4", "actions.npz", "timings.json", "actions.png"}
    arrays = np.load(folder / "actions.npz")
    assert arrays["calls"].tolist() == [1, 2, 3, 4, 5] and arrays["horizons"].tolist() == [32, 0, 32, 0, 32]
    assert arrays["actions"].shape == (5, 32, 16) and arrays["raw_actions"].shape == (5, 32, 30)
    assert np.isnan(arrays["actions"][1]).all() and np.isfinite(arrays["actions"][[0, 2, 4]]).all()
    assert arrays["state"].shape == (5, 0)  # LingBot-VA takes no state
    timings = json.loads((folder / "timings.json").read_text())
    assert [t["info"]["call"] for t in timings["calls"]] == ["infer", "compute_kv_cache"] * 2 + ["infer"]
    assert [t["info"]["frame_start"] for t in timings["calls"]] == [0, 2, 2, 4, 4] and timings["ended"] == "reset"
    # per call max(frames seen, frames predicted): an infer sees 1 and predicts 1 + 4 from 2 latent frames
    frames = list(video.iter_frames(folder / "rollout.mp4"))
    assert len(frames) == 5 + 4 + 5 + 8 + 5
    seen = policy._canvas(observe(1, None))
    assert seen.shape == (1, 32 + 64, 96, 3)  # the T layout: two 32x48 wrists above the 64x96 high camera
    assert frames[0].shape == (96, 2 * 96, 3)  # seen | predicted
    assert frames[0][16:, 96:].std() > 0  # the predicted half was decoded (a failed decode leaves it black)

    second = json.loads((tmp_path / "robot.2" / "timings.json").read_text())
    assert len(second["calls"]) == 1 and second["ended"] == "reset"
    openpi = json.loads((tmp_path / "openpi" / "timings.json").read_text())
    assert [t["info"]["call"] for t in openpi["calls"]] == ["infer", "commit+infer"] and openpi["ended"] == "shutdown"
    assert np.isfinite(np.load(tmp_path / "openpi" / "actions.npz")["actions"]).all()
    predicted = policy.decode_prediction(torch.zeros(1, 48, 2, *policy.embodiment.latent_size))
    assert predicted.shape == (5, 96, 96, 3) and predicted.dtype == np.uint8
