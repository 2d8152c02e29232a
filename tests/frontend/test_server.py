"""End-to-end: the real server process driven by the real openpi client and RoboArena-style clients."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.helpers.fake_policy import session_tag
from tests.helpers.server_harness import ServerProcess, droid_observation, fake_config
from tests.helpers.sockets import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(fake_config(), tmp_path_factory.mktemp("server")) as process:
        yield process


def infer(ws, obs: dict) -> dict | str:
    ws.send(msgpack_numpy.packb(obs))
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def test_openpi_client_metadata_infer_reset_and_session_switch(server):
    client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    meta = client.get_server_metadata()
    assert meta == {
        "image_resolution": [180, 320],
        "needs_wrist_camera": True,
        "n_external_cameras": 2,
        "needs_stereo_camera": False,
        "needs_session_id": True,
        "action_space": "joint_position",
    }

    first = client.infer(droid_observation(session_id="ep1-A", joint0=0.5))
    assert first["actions"].dtype == np.float32 and first["actions"].shape == (4, 8)
    assert first["actions"][0, :3].tolist() == [1.0, 0.5, session_tag("ep1-A")]
    # no previous request yet, no deadline; the estimate of the next call is this one's own service time so far
    assert set(first["server_timing"]) == {"infer_ms", "queue_ms", "next_call_p90_ms"}
    assert first["server_timing"]["next_call_p90_ms"] >= first["server_timing"]["infer_ms"]
    assert "compute" in first["policy_timing"]
    second = client.infer(droid_observation(4, session_id="ep1-A", joint0=0.25))
    assert second["actions"][0, :2].tolist() == [2.0, 0.25]
    assert "prev_total_ms" in second["server_timing"]

    assert client.infer(droid_observation(session_id="ep1-A", endpoint="reset"))["status"] == "reset successful"
    assert client.infer(droid_observation(session_id="ep1-A"))["actions"][0, 0] == 1.0  # fresh after reset

    # A new id is a fresh episode; switching back continues the earlier one (sessions are keyed by id)
    assert client.infer(droid_observation(session_id="ep2-A"))["actions"][0, 0] == 1.0
    assert client.infer(droid_observation(session_id="ep1-A"))["actions"][0, 0] == 2.0


def test_a_window_starts_own_encode_is_its_compute_not_queueing(server):
    """An idle server; a first call whose session-own encode (the encoder thread's window-start work) takes 0.3 s.
    Before: queue_ms was the round trip minus the batched step, so the encode showed as 0.3 s of queueing."""
    client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    session = f"encode-{uuid.uuid4()}"
    first = client.infer(droid_observation(session_id=session, prompt="encode:0.3"))["server_timing"]
    assert first["encode_ms"] >= 300 and first["infer_ms"] >= first["encode_ms"]  # its own work, wherever it ran
    assert first["queue_ms"] < 100, first  # nobody else's work was in front of it
    steady = client.infer(droid_observation(4, session_id=session, prompt="encode:0.3"))["server_timing"]
    assert "encode_ms" not in steady and steady["infer_ms"] < 300 and steady["queue_ms"] < 100  # no encode on a steady call
    client.infer(droid_observation(session_id=session, endpoint="reset"))  # the module's server holds few sessions
    client._ws.close()


def test_connections_without_session_ids_get_their_own_sessions(server):
    a = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    b = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    for calls in (1, 2):
        ra, rb = a.infer(droid_observation()), b.infer(droid_observation())
        assert ra["actions"][0, 0] == rb["actions"][0, 0] == calls
        assert ra["session"]["id"] != rb["session"]["id"]


def test_roboarena_style_client_episodes(server):
    """websockets client, endpoint key, 1-indexed cameras, reset between episodes, new id per episode."""
    with connect(server.url, compression=None, max_size=None) as ws:
        assert msgpack_numpy.unpackb(ws.recv())["action_space"] == "joint_position"
        for _episode in range(2):
            session = f"{uuid.uuid4()}-A"
            for call in range(1, 4):
                reply = infer(ws, droid_observation(1 if call == 1 else 4, session_id=session, one_indexed=True, endpoint="infer"))
                assert reply["actions"][0, 0] == call and reply["actions"][0, 2] == session_tag(session)
            assert infer(ws, {"endpoint": "reset", "session_id": session}) == {
                "status": "reset successful",
                "session_ids": [session],
                "session_id": session,
            }


def test_policy_failure_is_an_error_frame_and_the_session_starts_over(server):
    with connect(server.url, compression=None, max_size=None) as ws:
        ws.recv()
        assert infer(ws, droid_observation(session_id="boom"))["actions"][0, 0] == 1
        error = infer(ws, droid_observation(session_id="boom", prompt="explode"))
        assert isinstance(error, str) and error.startswith("internal error:") and "exploded on purpose" in error
        assert "Traceback" not in error  # only with --debug
        assert infer(ws, droid_observation(session_id="boom"))["actions"][0, 0] == 1  # a fresh session


BAD_FRAMES = st.one_of(
    st.text(max_size=40),  # text frames
    st.binary(max_size=200),  # garbage bytes
    st.sampled_from(
        [
            msgpack.packb([1, 2, 3]),
            msgpack.packb("just a string"),
            msgpack.packb({"observation/joint_position": [1.0, 2.0]}),
            msgpack.packb(
                {"observation/wrist_image_left": {b"__ndarray__": True, b"data": b"\x00" * 10, b"dtype": "|u1", b"shape": [10**9, 10**9, 3]}}
            ),
            msgpack.packb({"observation/wrist_image_left": {b"__ndarray__": True, b"data": b"", b"dtype": "|O", b"shape": [0]}}),
            msgpack.packb({"observation/wrist_image_left": {b"__ndarray__": True, b"data": b"\x00" * 7, b"dtype": "<f4", b"shape": [2]}}),
            msgpack_numpy.packb({"observation/wrist_image_left": np.zeros((4, 4), np.uint8)}),
            msgpack_numpy.packb({"observation/exterior_image_0_left": np.zeros((8, 8, 3), np.float32)}),
            msgpack_numpy.packb({"prompt": 5}),
            msgpack_numpy.packb({"session_id": ["x"]}),
            msgpack_numpy.packb({"endpoint": "explode"}),
            msgpack_numpy.packb(droid_observation())[:-7],  # truncated
            msgpack.packb(msgpack.ExtType(1, b"x")),
        ]
    ),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.lists(BAD_FRAMES, min_size=1, max_size=3))
def test_malformed_frames_get_specific_errors_and_leave_the_session_untouched(server, bad):
    session = f"prop-{uuid.uuid4()}"
    with connect(server.url, compression=None, max_size=None) as ws:
        ws.recv()
        assert infer(ws, droid_observation(session_id=session, joint0=0.1))["actions"][0, 0] == 1
        for frame in bad:
            ws.send(frame)
            reply = ws.recv()
            assert isinstance(reply, str) and reply.startswith("bad request:"), reply
            assert len(reply.splitlines()) == 1
        good = infer(ws, droid_observation(4, session_id=session, joint0=0.3))
        assert good["actions"][0, :3].tolist() == [2.0, np.float32(0.3), session_tag(session)]


def test_healthz_answers_fast_while_a_slow_policy_computes(server):
    stop = threading.Event()

    def robot(i: int) -> None:
        client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
        while not stop.is_set():
            client.infer(droid_observation(session_id=f"slow-{i}", prompt="sleep:0.5"))

    threads = [threading.Thread(target=robot, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the worker is busy and requests are queued
    latencies = []
    for _ in range(10):
        start = time.perf_counter()
        status, body = server.http("/healthz")
        latencies.append(time.perf_counter() - start)
        assert (status, body) == (200, "OK\n")
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert max(latencies) < 0.1, latencies


def test_metrics_are_prometheus_text(server):
    status, text = server.http("/metrics")
    assert status == 200
    for name in ("ardiff_requests_total{", "ardiff_infer_seconds_bucket", "ardiff_sessions_open", "ardiff_kv_pages_free{", "ardiff_kv_pages_total{"):
        assert name in text
    assert server.metric('ardiff_requests_total{outcome="ok"}') >= 1
    assert server.metric('ardiff_kv_pages_total{rank="0"}') > 0


def test_killing_the_worker_mid_request_errors_that_client_then_serves_again(tmp_path):
    with ServerProcess(fake_config(), tmp_path) as process:
        client = WebsocketClientPolicy(host="127.0.0.1", port=process.port)
        assert client.infer(droid_observation(session_id="r1"))["actions"][0, 0] == 1
        pid = process.worker_pids()[0]
        threading.Timer(0.7, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(RuntimeError, match="worker died"):
            client.infer(droid_observation(session_id="r1", prompt="sleep:5"))
        reply = client.infer(droid_observation(session_id="r1"))  # waits for the restarted worker
        assert reply["actions"][0, 0] == 1  # sessions start fresh
        assert process.worker_pids()[0] != pid
        assert process.metric("ardiff_worker_restarts_total") == 1
        assert process.metric('ardiff_kv_pages_free{rank="0"}') < process.metric('ardiff_kv_pages_total{rank="0"}')
        client.infer(droid_observation(session_id="r1", endpoint="reset"))
        assert process.metric('ardiff_kv_pages_free{rank="0"}') == process.metric('ardiff_kv_pages_total{rank="0"}')


def test_api_keys_are_enforced_at_the_handshake(tmp_path):
    with ServerProcess(fake_config(), tmp_path, args=["--api-key", "s3cret", "--api-key", "other"]) as process:
        with pytest.raises(InvalidStatus) as refused:
            WebsocketClientPolicy(host="127.0.0.1", port=process.port)
        assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus):
            WebsocketClientPolicy(host="127.0.0.1", port=process.port, api_key="wrong")
        client = WebsocketClientPolicy(host="127.0.0.1", port=process.port, api_key="other")
        assert client.infer(droid_observation())["actions"][0, 0] == 1
        assert process.http("/metrics")[0] == 401
        assert process.http("/metrics", {"Authorization": "Api-Key s3cret"})[0] == 200
        assert process.http("/healthz") == (200, "OK\n")


def test_oversize_frames_are_refused_and_others_carry_on(tmp_path):
    with ServerProcess(fake_config(server={"max_frame_bytes": 2**20}), tmp_path) as process:
        with connect(process.url, compression=None, max_size=None) as ws:
            ws.recv()
            ws.send(b"\x00" * (2**20 + 1))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv()
            assert closed.value.rcvd.code == 1009  # message too big
        client = WebsocketClientPolicy(host="127.0.0.1", port=process.port)
        assert client.infer(droid_observation(size=(90, 160)))["actions"][0, 0] == 1


def test_disconnected_session_resumes_within_the_ttl_and_expires_after(tmp_path):
    with ServerProcess(fake_config(server={"session_ttl_s": 1.5}), tmp_path) as process:
        for expected in (1, 2):
            with connect(process.url, compression=None, max_size=None) as ws:
                ws.recv()
                assert infer(ws, droid_observation(session_id="robot-7"))["actions"][0, 0] == expected
        time.sleep(3.0)
        with connect(process.url, compression=None, max_size=None) as ws:
            ws.recv()
            assert infer(ws, droid_observation(session_id="robot-7"))["actions"][0, 0] == 1
        assert process.metric('ardiff_session_endings_total{reason="ttl"}') == 1


def test_sigterm_shuts_down_cleanly(tmp_path):
    process = ServerProcess(fake_config(), tmp_path).wait_ready()
    pids = process.worker_pids()
    assert process.stop() == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sighup_without_tls_is_logged_and_ignored(server):
    """A certbot hook or a closed terminal sends SIGHUP; without TLS there is nothing to reload, and
    its default action (terminate) would end every robot's episode."""
    with connect(server.url, compression=None, max_size=None) as robot:
        robot.recv()
        assert "actions" in infer(robot, droid_observation(session_id="hup"))
        os.kill(server.proc.pid, signal.SIGHUP)
        assert wait_for(lambda: "SIGHUP ignored: nothing to reload without TLS" in server.log(), 10), server.log()
        assert "actions" in infer(robot, droid_observation(session_id="hup"))  # same connection, same session
    assert server.proc.poll() is None and server.http("/healthz") == (200, "OK\n")


def test_bad_config_fails_fast_with_a_named_key(tmp_path):
    process = ServerProcess(fake_config(mystery=1), tmp_path)
    assert process.proc.wait(60) == 2
    time.sleep(0.2)
    assert "engine.mystery: unknown key" in process.log()


def test_a_request_past_its_timeout_gets_an_error_and_the_stuck_worker_is_replaced(tmp_path):
    with ServerProcess(fake_config(server={"request_timeout_s": 1.0}), tmp_path) as process:
        client = WebsocketClientPolicy(host="127.0.0.1", port=process.port)
        pid = process.worker_pids()[0]
        with pytest.raises(RuntimeError, match="longer than 1 s"):
            client.infer(droid_observation(session_id="slow", prompt="sleep:30"))
        assert client.infer(droid_observation(session_id="slow"))["actions"][0, 0] == 1
        assert process.worker_pids()[0] != pid
        assert process.metric('ardiff_requests_total{outcome="timeout"}') == 1
