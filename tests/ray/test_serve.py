"""``ardiff-serve --ray`` end to end on a local Ray cluster: the real CLI, Ray Serve's proxy, the
ingress and two tiny-DreamZero model replicas, driven by openpi clients over TLS (``--tls-cert``:
wss:// and https:// through Serve's proxy, a CA made by the test and trusted by the clients).

Skipped without Ray (``pip install -e '.[ray]'``). One server for the module (~1 min to start on
two cores: Ray, Serve and two replicas that each load torch and the model).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]')")
pytest.importorskip("fastapi", reason="Ray Serve's FastAPI is not installed (pip install -e '.[ray]')")

from openpi_client import msgpack_numpy  # noqa: E402
from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402
from websockets.exceptions import InvalidMessage, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from tests.helpers.certs import TestCA  # noqa: E402
from tests.helpers.server_harness import ServerProcess, droid_observation  # noqa: E402

KEY = "ray-test-key"
WSS_HOST = "wss://localhost"  # the openpi client builds ws:// itself unless given a scheme
AUTH = {"Authorization": f"Api-Key {KEY}"}
SIZE = (90, 160)
ROBOTS = [f"robot-{i}" for i in range(4)]
CALLS = 3
# threads=1 and one robot per forward: bitwise the same as the reference engine (a batched forward equals
# it only up to float summation order, ~1e-7; batching's own equality tests: tests/engine/test_batching.py)
OVERRIDES = ["engine.warmup=false", "engine.threads=1", "engine.max_batch=1"]


def episode(robot: int, start: int, calls: int) -> list[dict]:
    return [droid_observation(1 if i == 0 else 4, seed=robot * 1000 + i, joint0=0.05 * i, size=SIZE) for i in range(start, start + calls)]


def reference_actions(sequences: dict[str, list[dict]]) -> dict[str, list[np.ndarray]]:
    """The same observations through one in-process engine (what a 1-replica server computes),
    decoded by the server's own code."""
    import torch

    from ardiff_server.config import load_config
    from ardiff_server.engine.builder import build_engine
    from ardiff_server.wire.decode import decode_request
    from ardiff_server.wire.protocol import pack, unpack

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = build_engine(load_config("tiny", OVERRIDES))
        return {
            session: [np.asarray(engine.infer(session, decode_request(unpack(pack(o))).observation).result.actions, np.float32) for o in obs]
            for session, obs in sequences.items()
        }
    finally:
        torch.set_num_threads(threads)


def replicas(process: ServerProcess) -> dict[int, dict]:
    import json

    status, body = process.http("/info", AUTH)
    assert status == 200, body
    return {r["index"]: r for r in json.loads(body)["replicas"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    cert, key, _ = ca.issue("ray-proxy")
    args = ["--ray", "--api-key", KEY, "--set", "ray.num_replicas=2", "--tls-cert", str(cert), "--tls-key", str(key)]
    for override in OVERRIDES:
        args += ["--set", override]
    process = ServerProcess("tiny", tmp_path_factory.mktemp("ray"), args=args)
    process.client_ssl = ca.client_context()
    try:
        process.wait_ready(timeout=300)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SSL_CERT_FILE", str(ca.path))  # the clients trust the test's CA (after the server started: not its environment)
            yield process
    finally:
        process.stop(timeout=60)


def openpi_client(server, attempts: int = 3, timeout_s: float = 60.0) -> WebsocketClientPolicy:
    """An openpi client, connected within a bound. A TLS handshake that fails (Serve's proxy under load) can leave
    websockets' sync client joining its receive thread forever (seen once with websockets 17.4 beside a busy
    test worker); each attempt runs in a daemon thread, so a hung one is abandoned and the next tries afresh."""
    for _ in range(attempts):
        result: dict[str, object] = {}

        def attempt(result=result) -> None:
            try:
                result["client"] = WebsocketClientPolicy(host=WSS_HOST, port=server.port, api_key=KEY)
            except Exception as exc:
                result["error"] = exc

        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if "client" in result:
            return result["client"]
    pytest.fail(f"no connection to the Ray Serve proxy in {attempts} attempts of {timeout_s:.0f} s: {result.get('error', 'hung')}")


@pytest.fixture(scope="module")
def robots(server):
    """Four robots, each on its own connection with its own session, CALLS calls in parallel."""
    clients = {sid: openpi_client(server) for sid in ROBOTS}
    replies: dict[str, list[dict]] = {}

    def drive(sid: str) -> None:
        replies[sid] = [clients[sid].infer({**o, "session_id": sid}) for o in episode(ROBOTS.index(sid), 0, CALLS)]

    threads = [threading.Thread(target=drive, args=(sid,)) for sid in ROBOTS]
    for t in threads:
        t.start()
    expected = reference_actions({sid: episode(ROBOTS.index(sid), 0, CALLS) for sid in ROBOTS})  # meanwhile
    for t in threads:
        t.join(timeout=300)
    return {"clients": clients, "replies": replies, "expected": expected}


def test_http_routes_metadata_and_keys(server):
    assert server.http("/healthz") == (200, "OK\n")
    assert server.http("/info")[0] == 401
    assert server.http("/nowhere", AUTH)[0] == 404
    listed = replicas(server)
    assert sorted(listed) == [0, 1] and all(r["state"] == "ready" and r["pids"] for r in listed.values())
    metrics = server.http("/metrics", AUTH)[1]
    assert 'ardiff_worker_up{replica="0"} 1.0' in metrics and 'ardiff_worker_up{replica="1"} 1.0' in metrics
    with pytest.raises(InvalidStatus) as refused:
        WebsocketClientPolicy(host=WSS_HOST, port=server.port)
    assert refused.value.response.status_code == 401
    client = openpi_client(server)
    assert client.get_server_metadata()["needs_session_id"] is True


def test_tls_through_serves_proxy_and_plain_ws_is_refused_at_once(server):
    assert server.scheme == "wss" and server.http("/healthz") == (200, "OK\n")  # https://
    started = time.perf_counter()
    with pytest.raises(InvalidMessage):  # DreamZero's and RoboArena's clients try ws:// first, then wss://
        connect(f"ws://127.0.0.1:{server.port}", open_timeout=10)
    assert time.perf_counter() - started < 1.0
    with connect(f"wss://localhost:{server.port}", additional_headers=AUTH) as ws:
        assert msgpack_numpy.unpackb(ws.recv())["needs_session_id"] is True


def test_each_robot_keeps_one_replica_and_gets_what_one_engine_gives(server, robots):
    placement = {}
    for sid, replies in robots["replies"].items():
        sessions = [r["session"] for r in replies]
        assert [s["id"] for s in sessions] == [sid] * CALLS
        assert [s["calls"] for s in sessions] == list(range(1, CALLS + 1))
        assert [s["new"] for s in sessions] == [True] + [False] * (CALLS - 1)
        assert len({(s["replica"], s["replica_id"]) for s in sessions}) == 1, f"{sid} moved between replicas"
        placement[sid] = sessions[0]["replica"]
        for call, (got, want) in enumerate(zip(replies, robots["expected"][sid], strict=True)):
            np.testing.assert_array_equal(got["actions"], want, err_msg=f"{sid} call {call + 1}")
    assert sorted(placement.values()) == [0, 0, 1, 1], f"new sessions go to the least-loaded replica: {placement}"
    listed = replicas(server)
    for index in (0, 1):
        assert listed[index]["sessions"] == listed[index]["sessions_placed"] == 2


def test_frames_over_uvicorns_16_mib_default_pass_the_proxy(server):
    with connect(server.url, compression=None, max_size=None, additional_headers=AUTH) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb({"observation/joint_position": np.zeros(17 * 2**20 // 8)}))  # 17 MiB
        reply = ws.recv(timeout=60)
    assert isinstance(reply, str) and reply.startswith("bad request: observation/joint_position")


def test_killing_a_replica_restarts_only_its_sessions(server, robots):
    clients = robots["clients"]
    placement = {sid: replies[-1]["session"]["replica"] for sid, replies in robots["replies"].items()}
    victim = placement[ROBOTS[0]]
    victims = [sid for sid in ROBOTS if placement[sid] == victim]
    survivors = [sid for sid in ROBOTS if placement[sid] != victim]
    (pid,) = replicas(server)[victim]["pids"]

    # One victim robot has a call in flight when its replica's process is killed.
    outcome: dict = {}

    def in_flight() -> None:
        try:
            outcome["reply"] = clients[victims[0]].infer({**episode(0, CALLS, 1)[0], "session_id": victims[0]})
        except RuntimeError as exc:
            outcome["error"] = str(exc)

    caller = threading.Thread(target=in_flight)
    caller.start()
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    caller.join(timeout=120)
    if "error" in outcome:  # killed mid-step (the usual case): the robot is told, the connection stays
        assert "internal error: the model replica holding this session died" in outcome["error"]
        assert f"session {victims[0]} starts over on the next request" in outcome["error"]

    # The other replica's robots carry on while the replica is being replaced.
    for sid in survivors:
        reply = clients[sid].infer({**episode(ROBOTS.index(sid), CALLS, 1)[0], "session_id": sid})
        assert reply["session"]["calls"] == CALLS + 1 and not reply["session"]["new"]
        assert reply["session"]["replica"] == placement[sid]

    deadline = time.monotonic() + 180
    while True:
        listed = replicas(server)
        if listed.get(victim, {}).get("state") == "ready" and listed[victim]["pids"] not in ([], [pid]):
            break
        assert time.monotonic() < deadline, f"replica {victim} was not replaced: {listed}"
        time.sleep(1.0)
    assert listed[victim]["restarts"] == 1 and listed[1 - victim]["restarts"] == 0
    assert server.http("/healthz") == (200, "OK\n")

    for sid in victims:  # a fresh session, said so, then it sticks again
        first, second = (clients[sid].infer({**o, "session_id": sid}) for o in episode(ROBOTS.index(sid), 0, 2))
        assert first["session"]["new"] and first["session"]["calls"] == 1
        assert not second["session"]["new"] and second["session"]["calls"] == 2
        assert first["session"]["replica_id"] == second["session"]["replica_id"]
    for sid in survivors:
        reply = clients[sid].infer({**episode(ROBOTS.index(sid), CALLS + 1, 1)[0], "session_id": sid})
        assert reply["session"]["calls"] == CALLS + 2 and reply["session"]["replica"] == placement[sid]


def test_reset_ends_the_session_and_its_placement(server, robots):
    client = robots["clients"][ROBOTS[1]]
    assert client.infer({"endpoint": "reset", "session_id": ROBOTS[1]})["status"] == "reset successful"
    reply = client.infer({**episode(1, 0, 1)[0], "session_id": ROBOTS[1]})
    assert reply["session"]["new"] and reply["session"]["calls"] == 1


def gone(pids: list[int], timeout: float = 20.0) -> bool:
    """Whether every pid has exited (a zombie counts: nobody may reap Ray's orphans in a container)."""

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_sigterm_takes_the_application_down(server):
    pids = [pid for r in replicas(server).values() for pid in r["pids"]]
    assert server.stop(timeout=60) == 0, server.log()
    assert gone(pids), f"replica processes {pids} outlived the server"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ARDIFF_RAY_CFG"), reason="starts a second Ray cluster (~1 min on 2 cores); ARDIFF_RAY_CFG=1 runs it")
def test_a_cfg_parallel_replica_runs_a_worker_pair_equal_to_one_process(tmp_path):
    args = ["--ray", "--set", "engine.cfg_parallel_size=2", "--set", "ray.num_cpus=2"]
    for override in OVERRIDES:
        args += ["--set", override]
    observations = episode(7, 0, 4)
    process = ServerProcess("tiny", tmp_path, args=args)
    try:
        process.wait_ready(timeout=300)
        (replica,) = replicas(process).values()
        assert len(replica["pids"]) == 2 and len(replica["kv_pages_total"]) == 2  # rank 0 and rank 1
        client = WebsocketClientPolicy(host="127.0.0.1", port=process.port, api_key=None)
        got = [client.infer({**o, "session_id": "cfg"})["actions"] for o in observations]
    finally:
        process.stop(timeout=60)
    for call, (a, b) in enumerate(zip(got, reference_actions({"cfg": observations})["cfg"], strict=True)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"call {call + 1}")
    assert gone(replica["pids"]), f"worker processes {replica['pids']} outlived the server"
