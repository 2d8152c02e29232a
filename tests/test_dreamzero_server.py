"""The embedded tiny DreamZero through the real server: interleaved robots and CFG-parallel ranks."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from tests.server_harness import ServerProcess, droid_observation

SIZE = (90, 160)  # any camera size works; small keeps the client cheap


def episode(seed: int, calls: int) -> list[dict]:
    return [droid_observation(1 if i == 0 else 4, seed=seed * 1000 + i, joint0=0.05 * i, size=SIZE) for i in range(calls)]


def run(port: int, session_id: str, observations: list[dict]) -> list[dict]:
    client = WebsocketClientPolicy(host="127.0.0.1", port=port)
    return [client.infer({**o, "session_id": session_id}) for o in observations]


def kv_used(process: ServerProcess, rank: int) -> int:
    labels = f'{{rank="{rank}"}}'
    return int(process.metric(f"ardiff_kv_blocks_total{labels}") - process.metric(f"ardiff_kv_blocks_free{labels}"))


@pytest.mark.slow
def test_interleaved_robots_get_exactly_what_each_gets_alone(tmp_path):
    episodes = {robot: episode(robot, 30) for robot in range(3)}
    with ServerProcess("tiny", tmp_path) as process:
        alone = {robot: run(process.port, f"alone-{robot}", obs) for robot, obs in episodes.items()}
        together: dict[int, list[dict]] = {}
        threads = [
            threading.Thread(target=lambda r=robot: together.__setitem__(r, run(process.port, f"together-{r}", episodes[r])))
            for robot in episodes
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        for robot in episodes:
            assert len(together[robot]) == 30
            for call, (a, b) in enumerate(zip(alone[robot], together[robot])):
                assert b["session"]["id"] == f"together-{robot}" and b["session"]["calls"] == call + 1
                assert np.array_equal(a["actions"], b["actions"]), f"robot {robot} call {call} differs"
        assert not np.array_equal(alone[0][5]["actions"], alone[1][5]["actions"])


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
    observations = episode(7, 13)  # 13 calls: two window restarts
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
