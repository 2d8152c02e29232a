"""engine.replicas: several engines behind one port, each session pinned to the replica that opened it."""

from __future__ import annotations

import json
import os
import signal
import threading

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from ardiff_server.config import AppConfig, validate_config
from tests.helpers.fake_policy import session_tag
from tests.helpers.server_harness import ServerProcess, droid_observation, fake_config
from tests.helpers.sockets import wait_for

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    config = fake_config(replicas=2, threads=1, server={"session_ttl_s": 30})
    with ServerProcess(config, tmp_path_factory.mktemp("replicas")) as process:
        yield process


def robot_run(port: int, session: str, calls: int, joint0: float = 0.0) -> list[dict]:
    client = WebsocketClientPolicy(host="127.0.0.1", port=port)
    return [client.infer(droid_observation(session_id=session, joint0=joint0 + i)) for i in range(calls)]


def test_sessions_spread_over_replicas_and_stay_on_theirs(two_replicas):
    sessions = [f"spread-{i}" for i in range(4)]
    results: dict[str, list[dict]] = {}

    def robot(session: str) -> None:
        results[session] = robot_run(two_replicas.port, session, 4)

    threads = [threading.Thread(target=robot, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    placement = {}
    for session, replies in results.items():
        assert [r["session"]["calls"] for r in replies] == [1, 2, 3, 4]
        assert all(r["actions"][0, 2] == session_tag(session) for r in replies)
        replicas = {r["session"]["replica"] for r in replies}
        assert len(replicas) == 1, f"{session} moved between replicas {replicas}"
        placement[session] = replicas.pop()
    assert sorted(placement.values()) == [0, 0, 1, 1]  # fewest sessions first
    info = json.loads(two_replicas.http("/info")[1])
    assert [r["index"] for r in info["replicas"]] == [0, 1] and info["replicas"][0]["pids"] != info["replicas"][1]["pids"]
    assert two_replicas.metric('ardiff_sessions_placed{replica="0"}') >= 2
    for session in sessions:
        WebsocketClientPolicy(host="127.0.0.1", port=two_replicas.port).infer({"endpoint": "reset", "session_id": session})


def test_actions_equal_a_one_replica_run(two_replicas, tmp_path):
    """Routing changes nothing a robot sees: the same requests give the same replies."""
    with ServerProcess(fake_config(server={"session_ttl_s": 30}), tmp_path) as single:
        for session in ("parity-a", "parity-b", "parity-c"):
            one = robot_run(single.port, session, 3, joint0=0.5)
            two = robot_run(two_replicas.port, session, 3, joint0=0.5)
            for a, b in zip(one, two, strict=True):
                np.testing.assert_array_equal(a["actions"], b["actions"])
                assert a["session"]["calls"] == b["session"]["calls"]


def test_a_dead_replica_restarts_alone_and_only_its_sessions_start_over(tmp_path):
    with ServerProcess(fake_config(replicas=2, threads=1, server={"session_ttl_s": 30}), tmp_path) as server:
        clients = {s: WebsocketClientPolicy(host="127.0.0.1", port=server.port) for s in ("k0", "k1", "k2", "k3")}
        replica = {s: c.infer(droid_observation(session_id=s))["session"]["replica"] for s, c in clients.items()}
        assert sorted(replica.values()) == [0, 0, 1, 1]
        info = json.loads(server.http("/info")[1])
        victim_pid = info["replicas"][1]["pids"][0]
        os.kill(victim_pid, signal.SIGKILL)
        assert wait_for(lambda: server.metric('ardiff_worker_restarts_total{replica="1"}') == 1, 30)
        assert wait_for(lambda: server.metric('ardiff_worker_up{replica="1"}') == 1, 60)
        for session, client in clients.items():
            reply = client.infer(droid_observation(session_id=session))
            if replica[session] == 1:
                assert reply["session"]["new"] and reply["session"]["calls"] == 1
            else:
                assert not reply["session"]["new"] and reply["session"]["calls"] == 2
        assert server.metric('ardiff_worker_restarts_total{replica="0"}') == 0


def test_replica_devices_default_and_validation():
    def config(**engine) -> AppConfig:
        return validate_config({"engine": engine, "policy": {"name": "noop"}})

    assert config(replicas=2).engine.replica_device_lists() == [["cpu"], ["cpu"]]
    assert config(replicas=4, device="cuda", cfg_parallel_size=2).engine.replica_device_lists() == [
        ["cuda:0", "cuda:1"],
        ["cuda:2", "cuda:3"],
        ["cuda:4", "cuda:5"],
        ["cuda:6", "cuda:7"],
    ]
    explicit = config(replicas=2, replica_devices=[["cuda:3"], ["cuda:1"]])
    assert explicit.engine.replica_device_lists() == [["cuda:3"], ["cuda:1"]]
    with pytest.raises(ValueError, match="replica_devices lists 1 replicas for replicas=2"):
        config(replicas=2, replica_devices=[["cuda:0"]])
    with pytest.raises(ValueError, match="give each replica its own"):
        config(replicas=2, device="cuda:0").engine.replica_device_lists()
