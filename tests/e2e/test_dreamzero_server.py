"""The embedded tiny DreamZero through the real server: interleaved robots and CFG-parallel ranks."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from tests.helpers.server_harness import ServerProcess, droid_observation

SIZE = (90, 160)  # any camera size works; small keeps the client cheap


def episode(seed: int, calls: int) -> list[dict]:
    return [droid_observation(1 if i == 0 else 4, seed=seed * 1000 + i, joint0=0.05 * i, size=SIZE) for i in range(calls)]


def run(port: int, session_id: str, observations: list[dict]) -> list[dict]:
    client = WebsocketClientPolicy(host="127.0.0.1", port=port)
    return [client.infer({**o, "session_id": session_id}) for o in observations]


def kv_used(process: ServerProcess, rank: int) -> int:
    labels = f'{{rank="{rank}"}}'
    return int(process.metric(f"ardiff_kv_pages_total{labels}") - process.metric(f"ardiff_kv_pages_free{labels}"))


@pytest.mark.slow
def test_interleaved_robots_get_what_each_gets_alone(tmp_path):
    """Robots served together are batched (engine.max_batch: 4 by default); each still gets, within
    fp32 noise (1e-5), exactly what it gets alone. 9 calls: three attention windows, two restarts (random interleavings
    of whole episodes are tests/engine/test_batching.py's, in process)."""
    calls = 9
    episodes = {robot: episode(robot, calls) for robot in range(3)}
    with ServerProcess("tiny", tmp_path) as process:
        alone = {robot: run(process.port, f"alone-{robot}", obs) for robot, obs in episodes.items()}
        together: dict[int, list[dict]] = {}
        threads = [
            threading.Thread(target=lambda r=robot: together.__setitem__(r, run(process.port, f"together-{r}", episodes[r]))) for robot in episodes
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        for robot in episodes:
            assert len(together[robot]) == calls
            for call, (a, b) in enumerate(zip(alone[robot], together[robot])):
                assert b["session"]["id"] == f"together-{robot}" and b["session"]["calls"] == call + 1
                np.testing.assert_allclose(b["actions"], a["actions"], atol=1e-5, rtol=0, err_msg=f"robot {robot} call {call}")
        assert not np.array_equal(alone[0][5]["actions"], alone[1][5]["actions"])
        assert all(r["session"]["batch_size"] == 1 for replies in alone.values() for r in replies)
        assert any(r["session"]["batch_size"] > 1 for replies in together.values() for r in replies), "robots were never batched"


def test_tiny_dreamzero_serves_an_openpi_client_and_frees_pages_on_reset(tmp_path):
    with ServerProcess("tiny", tmp_path, args=["--set", "engine.warmup=false"]) as process:
        replies = run(process.port, "ep", episode(0, 5))
        assert [r["session"]["current_start_frame"] for r in replies] == [3, 5, 7, 9, 3]
        assert all(r["actions"].shape == (24, 8) and np.isfinite(r["actions"]).all() for r in replies)
        assert {"text", "vision", "vae", "prefill", "denoise", "decode"} <= set(replies[0]["policy_timing"])
        assert kv_used(process, 0) > 0
        WebsocketClientPolicy(host="127.0.0.1", port=process.port).infer({"endpoint": "reset", "session_id": "ep"})
        assert kv_used(process, 0) == 0


@pytest.mark.slow
def test_cfg_parallel_on_two_gloo_ranks_equals_one_process(tmp_path):
    observations = episode(7, 9)  # 9 calls: two window restarts (calls 5 and 9)
    with ServerProcess("tiny", tmp_path, args=["--set", "engine.warmup=false"]) as single:
        expected = run(single.port, "s", observations[:4])
        single_used = kv_used(single, 0)
        expected += run(single.port, "s", observations[4:])
    with ServerProcess("tiny", tmp_path, args=["--set", "engine.cfg_parallel_size=2", "--set", "engine.warmup=false"]) as parallel:
        got = run(parallel.port, "s", observations[:4])
        used = (kv_used(parallel, 0), kv_used(parallel, 1))
        got += run(parallel.port, "s", observations[4:])
        log = parallel.log()
    for call, (a, b) in enumerate(zip(expected, got)):
        np.testing.assert_allclose(b["actions"], a["actions"], atol=1e-5, rtol=0, err_msg=f"call {call}")
    # each rank's pool holds one branch: 7 resident frames (1 + 2 + 2 + 2) per rank vs 14 in one process
    assert used == (7, 7) and single_used == 14
    assert re.search(r"\[worker 0\].*branches \['COND'\]", log) and re.search(r"\[worker 1\].*branches \['UNCOND'\]", log)


# ----------------------------------------------------------- in-process server, tiny DreamZero


@pytest.fixture(scope="module")
def tiny_server():
    from tests.helpers.inproc_server import InprocServer

    with InprocServer({"engine": {"warmup": False}, "policy": {"name": "dreamzero", "view_size": [48, 80]}}) as running:
        yield running


def test_isaaclab_interleaving_on_one_connection_equals_each_id_alone(tiny_server):
    """Three environments' ids interleaved over one websocket for 5 rounds: every id's episode is
    exactly what it is alone (the KV, frame buffer and window of each session are its own)."""
    from openpi_client import msgpack_numpy
    from websockets.sync.client import connect

    def call(ws, obs):
        ws.send(msgpack_numpy.packb(obs))
        return msgpack_numpy.unpackb(ws.recv())

    episodes = {f"env{i}": episode(40 + i, 5) for i in range(3)}
    alone = {env: run(tiny_server.port, f"alone-{env}", obs) for env, obs in episodes.items()}
    with connect(tiny_server.url, compression=None, max_size=None) as ws:
        ws.recv()
        together = {env: [] for env in episodes}
        for round_ in range(5):
            for env, obs in episodes.items():
                together[env].append(call(ws, {**obs[round_], "session_id": f"mixed-{env}"}))
        reply = call(ws, {"endpoint": "reset", "session_ids": ["mixed-env0", "mixed-env1"]})
        assert reply["session_ids"] == ["mixed-env0", "mixed-env1"]
        assert call(ws, {**episodes["env2"][0], "session_id": "mixed-env2"})["session"]["calls"] == 6
    for env in episodes:
        assert [r["session"]["calls"] for r in together[env]] == [1, 2, 3, 4, 5]
        for a, b in zip(alone[env], together[env], strict=True):
            np.testing.assert_array_equal(a["actions"], b["actions"])


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ({"observation/wrist_image_left": np.zeros((1, 320, 3), np.uint8)}, "at least 2 pixels"),
        ({"observation/wrist_image_left": np.zeros((4, 180, 320, 3), np.uint8)}, "differ in length"),
    ],
)
def test_observations_dreamzero_cannot_take_are_bad_requests_and_cost_no_episode(tiny_server, bad, needle):
    client = WebsocketClientPolicy(host="127.0.0.1", port=tiny_server.port)
    session = f"robust-{needle[:5]}"
    first = client.infer(droid_observation(session_id=session, size=SIZE))
    assert first["session"]["calls"] == 1
    with pytest.raises(RuntimeError, match=f"bad request: .*{needle}"):
        client.infer({**droid_observation(session_id=session, size=(180, 320)), **bad})
    second = client.infer(droid_observation(4, session_id=session, size=SIZE))
    assert second["session"]["calls"] == 2 and not second["session"]["new"]  # the episode went on
    client.infer({"endpoint": "reset", "session_id": session})


def test_the_front_end_process_never_loads_torch(tmp_path):
    with ServerProcess("tiny", tmp_path, args=["--set", "engine.warmup=false"]) as process:
        maps = Path(f"/proc/{process.proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the front end mapped libtorch"
        assert WebsocketClientPolicy(host="127.0.0.1", port=process.port).infer(droid_observation(size=SIZE))["actions"].shape == (24, 8)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ([], "this machine has no CUDA device"),
        (
            ["--set", "engine.device=cpu", "--set", "engine.dtype=float32"],
            "policy.checkpoint: GEAR-Dreams/DreamZero-DROID is not in the Hugging Face cache",
        ),
        (
            ["--set", "engine.device=cpu", "--set", "policy.checkpoint=/models/DreamZero-DROID"],
            "policy.checkpoint: /models/DreamZero-DROID does not exist",
        ),
    ],
)
def test_dreamzero_droid_without_its_machine_fails_fast_with_one_line(tmp_path, overrides, needle):
    import os
    import resource
    import subprocess
    import sys
    import time

    from tests.helpers.server_harness import REPO

    if overrides == [] and os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a CUDA device")
    started = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty hub cache, no network
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run(
        [sys.executable, "-m", "ardiff_server", "--config", "dreamzero_droid", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    # CPU time, not wall time: the interpreter start included, < 1 s; a loaded CI machine stretches only the wall clock
    assert cpu_s < 2.0, f"{cpu_s:.1f} s of CPU"
    print(f"failed in {elapsed:.2f} s ({cpu_s:.2f} s CPU): {out.stderr.strip()}")
