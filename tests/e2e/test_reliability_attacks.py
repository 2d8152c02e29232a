"""Reliability: the failures an adversarial run found, each pinned by a regression test.

No robot may lose its episode because of another robot's reset, a slow queue or a bad frame;
authentication may not be turned off by accident; one connection may not make the server buffer
without bound; shutdown may not wait on a stuck worker. See docs/failure-model.md.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from ardiff_server.wire.jpeg import encode_jpeg
from tests.helpers.server_harness import REPO, ServerProcess, droid_observation, fake_config
from tests.helpers.sockets import RawWebSocket, peak_rss_mib, reset_peak_rss, rss_mib, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


def infer(ws, obs: dict) -> dict | str:
    ws.send(msgpack_numpy.packb(obs))
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def open_ws(server: ServerProcess, **kwargs):
    ws = connect(server.url, compression=None, max_size=None, **kwargs)
    ws.recv()  # metadata
    return ws


def raw_http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data


# ---------------------------------------------------------------- control plane and timeouts


def test_a_reset_does_not_wait_behind_other_robots_and_kills_no_worker(tmp_path):
    """7 busy robots + one reset used to time the reset out after 60 s and SIGKILL the worker;
    control requests are now served between steps, ahead of queued inference."""
    with ServerProcess(fake_config(), tmp_path) as server:
        pid = server.worker_pids()[0]
        resetter = open_ws(server)
        assert infer(resetter, droid_observation(session_id="to-reset"))["actions"][0, 0] == 1
        done: dict[str, float] = {}

        def busy(i: int) -> None:
            with open_ws(server) as ws:
                reply = infer(ws, droid_observation(session_id=f"busy-{i}", prompt="sleep:0.8"))
                assert reply["actions"][0, 0] == 1
                done[f"busy-{i}"] = time.monotonic()

        threads = [threading.Thread(target=busy, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.4)  # the worker runs one step, three are queued (~2.4 s of work)
        assert infer(resetter, {"endpoint": "reset", "session_id": "to-reset"})["status"] == "reset successful"
        done["reset"] = time.monotonic()
        for t in threads:
            t.join(30)
        later = sorted(t for name, t in done.items() if name != "reset")
        assert done["reset"] < later[1], "the reset waited behind queued inference"
        assert server.metric("ardiff_worker_restarts_total") == 0 and server.worker_pids()[0] == pid
        assert infer(resetter, droid_observation(session_id="to-reset"))["actions"][0, 0] == 1


def test_the_request_timeout_counts_only_a_requests_own_compute(tmp_path):
    """request_timeout_s=1.5 with 5 sessions of 1 s compute each: queueing is not compute."""
    with ServerProcess(fake_config(server={"request_timeout_s": 1.5}), tmp_path) as server:
        replies: list = []

        def robot(i: int) -> None:
            client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
            replies.append(client.infer(droid_observation(session_id=f"slow-{i}", prompt="sleep:1.0")))

        threads = [threading.Thread(target=robot, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(replies) == 5 and all(r["actions"][0, 0] == 1 for r in replies)
        assert max(r["server_timing"]["queue_ms"] for r in replies) > 1500  # some waited longer than the timeout
        assert server.metric("ardiff_worker_restarts_total") == 0


def test_a_stopped_worker_is_reported_then_replaced_by_the_progress_watchdog(tmp_path):
    with ServerProcess(fake_config(server={"request_timeout_s": 2.0}), tmp_path) as server:
        pid = server.worker_pids()[0]
        os.kill(pid, signal.SIGSTOP)  # idle and stopped: not stuck (nothing to do), but not alive either
        try:
            assert wait_for(lambda: server.http("/healthz")[0] == 503, 10), "healthz still 200 for a stopped worker"
            assert "unresponsive" in server.http("/healthz")[1]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert wait_for(lambda: server.http("/healthz") == (200, "OK\n"), 10)
        assert server.metric("ardiff_worker_restarts_total") == 0  # liveness alone never kills

        os.kill(pid, signal.SIGSTOP)  # now with a request waiting: no progress past the step timeout
        client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
        with pytest.raises(RuntimeError, match="no progress for 2 s"):
            client.infer(droid_observation(session_id="waiting"))
        assert wait_for(lambda: server.http("/healthz") == (200, "OK\n"), 30)
        assert server.worker_pids()[0] != pid and server.metric("ardiff_worker_restarts_total") == 1
        assert client.infer(droid_observation(session_id="waiting"))["actions"][0, 0] == 1


def test_a_restart_skips_the_warm_up_and_reports_its_duration(tmp_path):
    with ServerProcess(fake_config(), tmp_path) as server:
        warmed = lambda: sum("warm-up:" in line and "calls per batch size" in line for line in server.lines)  # noqa: E731 - the summary line
        assert warmed() == 1
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        assert wait_for(lambda: any("worker restarted in" in line for line in server.lines), 60)
        assert server.metric("ardiff_worker_restart_seconds") > 0
        assert warmed() == 1  # nothing compiled: nothing to warm


# --------------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--api-key", ""], {}, "api_keys[0] is empty"),
        (["--api-key", "  "], {}, "api_keys[0] is empty"),
        (["--api-key", "a b"], {}, "api_keys[0] contains whitespace"),
        ([], {"ARDIFF_API_KEYS": ""}, "api_keys[0] is empty"),
        (["--api-key-file", "/nonexistent/keys"], {}, "No such file"),
    ],
)
def test_empty_or_blank_api_keys_are_refused_at_start_up(tmp_path, args, env, needle):
    started = time.monotonic()
    process = ServerProcess(fake_config(), tmp_path, args=args, env=env)
    assert process.proc.wait(30) == 2
    time.sleep(0.1)
    assert needle in process.log() and "Traceback" not in process.log()
    assert time.monotonic() - started < 10


def test_keys_from_a_file_and_the_environment_and_every_header_form(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# robots\nfile-key\n\n")
    with ServerProcess(fake_config(), tmp_path, args=["--api-key-file", str(keys)], env={"ARDIFF_API_KEYS": "env-key"}) as server:
        assert "file-key" not in " ".join(server.proc.args)
        for header in ("Api-Key file-key", "Bearer env-key", "bearer file-key", "API-KEY env-key"):
            assert server.http("/metrics", {"Authorization": header})[0] == 200, header
        for header in ("Api-Key ", "Bearer", "Basic file-key", "Api-Key wrong", "Api-Key file-key2"):
            assert server.http("/metrics", {"Authorization": header})[0] == 401, header
        client = WebsocketClientPolicy(host="127.0.0.1", port=server.port, api_key="env-key")
        assert client.infer(droid_observation())["actions"][0, 0] == 1
        with connect(server.url, additional_headers={"Authorization": "Bearer file-key"}) as ws:
            assert isinstance(ws.recv(), bytes)


def test_malformed_credentials_get_401_without_a_traceback(tmp_path):
    with ServerProcess(fake_config(), tmp_path, args=["--api-key", "s3cret"]) as server:
        handshake = (
            b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        )
        cases = [
            handshake + b"Authorization: Api-Key s3cret\r\nAuthorization: Api-Key s3cret\r\n\r\n",  # duplicated
            handshake + "Authorization: Api-Key s3crét\r\n\r\n".encode(),  # non-ASCII
            handshake + b"Authorization: Api-Key \xff\xfe\r\n\r\n",  # not even UTF-8
            handshake + b"Authorization: \r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nAuthorization: Bearer x\r\n\r\n",
        ]
        for request in cases:
            assert raw_http(server.port, request).startswith(b"HTTP/1.1 401"), request
        assert raw_http(server.port, handshake + b"Authorization: Bearer s3cret\r\n\r\n").startswith(b"HTTP/1.1 101")
        time.sleep(0.2)
        assert "Traceback" not in server.log() and "Internal Server Error" not in server.log()


def test_a_session_belongs_to_the_key_that_opened_it(tmp_path):
    with ServerProcess(fake_config(), tmp_path, args=["--api-key", "alpha", "--api-key", "beta"]) as server:
        alpha = WebsocketClientPolicy(host="127.0.0.1", port=server.port, api_key="alpha")
        beta = WebsocketClientPolicy(host="127.0.0.1", port=server.port, api_key="beta")
        assert alpha.infer(droid_observation(session_id="robot-1"))["actions"][0, 0] == 1
        with pytest.raises(RuntimeError, match="forbidden: session robot-1 belongs to another API key"):
            beta.infer(droid_observation(session_id="robot-1"))
        with pytest.raises(RuntimeError, match="forbidden"):
            beta.infer({"endpoint": "reset", "session_id": "robot-1"})
        assert alpha.infer(droid_observation(session_id="robot-1"))["actions"][0, 0] == 2  # untouched


# ------------------------------------------------------------------ what one connection may cost


def test_a_ping_flood_is_cut_off_and_memory_stays_flat(tmp_path):
    """A raw client that sends pings and never reads grew the front end by 1 GiB in 25 s."""
    config = fake_config(server={"write_limit_bytes": 2**20})
    with ServerProcess(config, tmp_path) as server:
        flooder = RawWebSocket(server.port, rcvbuf=4096)
        rss_before = rss_mib(server.proc.pid)
        ping = RawWebSocket.header(125, opcode=0x9) + b"p" * 125
        burst, sent, closed = ping * 512, 0, False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                flooder.sock.sendall(burst)
                sent += 512
            except OSError:
                closed = True
                break
        grown = rss_mib(server.proc.pid) - rss_before
        flooder.close()
        print(f"ping flood: {sent} pings sent before the server cut the connection; RSS +{grown:.1f} MiB")
        assert closed, "the server kept reading a client that never reads its pongs"
        assert grown < 30
        assert server.metric('ardiff_connections_closed_total{reason="write_limit"}') == 1
        assert server.http("/healthz") == (200, "OK\n")


def test_idle_connections_are_closed_with_a_reason(tmp_path):
    with ServerProcess(fake_config(server={"idle_timeout_s": 1.0}), tmp_path) as server:
        with open_ws(server) as ws:
            assert infer(ws, droid_observation())["actions"][0, 0] == 1
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
        assert "idle for 1 s" in closed.value.rcvd.reason
        assert server.metric('ardiff_connections_closed_total{reason="idle"}') == 1


def decoy_jpeg(side: int = 4096) -> bytes:
    """690 bytes whose header declares side x side: the scan is cut short and ended with EOI (Pillow fills the rest)."""
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 30)).save(buffer, format="JPEG", quality=10)
    return buffer.getvalue()[:688] + b"\xff\xd9"


def test_decoy_jpegs_are_refused_from_their_headers_and_move_neither_memory_nor_other_robots(tmp_path):
    """Issue #34: a 6.5 KiB request (four copies of a 690-byte JPEG whose header claims 4096x4096) cost ~1.1 GiB of
    RSS and stalled every robot and /healthz for 3-4 s; 64 frames x 3 cameras (~130 KiB) would have decoded to ~9 GiB.
    Now the headers are counted against server.max_request_pixels and nothing is decoded; the largest request the
    budget allows moves the front end's peak RSS by its decoded pixels plus one frame in Pillow."""
    budget = 4 * 3 * 720 * 1280  # DreamZero-DROID's auto budget: 31.6 MiB of uint8 RGB
    cameras = ("observation/exterior_image_0_left", "observation/exterior_image_1_left", "observation/wrist_image_left")
    with ServerProcess(fake_config(server={"max_request_pixels": budget}), tmp_path) as server:
        pids = (server.proc.pid, server.worker_pids()[0])
        victim, attacker = open_ws(server), open_ws(server)
        assert infer(victim, droid_observation(session_id="victim"))["actions"][0, 0] == 1
        latencies, health, stop = [], [], threading.Event()

        def robot() -> None:
            while not stop.is_set():
                started = time.monotonic()
                assert not isinstance(infer(victim, droid_observation(session_id="victim")), str)
                latencies.append(time.monotonic() - started)
                health.append(server.http("/healthz")[0])

        for pid in pids:
            reset_peak_rss(pid)
        rss = [rss_mib(pid) for pid in pids]
        thread = threading.Thread(target=robot)
        thread.start()
        small = {**droid_observation(session_id="attacker", size=(18, 32)), cameras[2]: [decoy_jpeg()] * 4}
        assert len(msgpack_numpy.packb(small)) < 8 * 1024
        for _ in range(5):
            reply = infer(attacker, small)
            assert isinstance(reply, str) and reply.startswith(f"bad request: {cameras[2]}: 4 frame(s) of 4096x4096 "), reply
            assert f"over its budget of {budget} (server.max_request_pixels)" in reply
        every = {**droid_observation(session_id="attacker"), **{key: [decoy_jpeg()] * 64 for key in cameras}}
        for _ in range(3):
            assert infer(attacker, every).startswith(f"bad request: {cameras[0]}: 64 frame(s) of 4096x4096 ")
        time.sleep(0.5)
        stop.set()
        thread.join(30)
        grown = [peak_rss_mib(pid) - before for pid, before in zip(pids, rss)]
        print(
            f"decoys: peak RSS +{grown[0]:.1f} MiB front end, +{grown[1]:.1f} MiB worker; robot's slowest of {len(latencies)} "
            f"requests {max(latencies) * 1000:.0f} ms"
        )
        assert max(grown) < 16, grown  # nothing decoded (the victim's own frames and the attacker's are a few MiB)
        assert set(health) == {200} and max(latencies) < 1.0  # /healthz and the robot never waited on a decode

        # the most the budget allows: 3 cameras x 4 JPEG frames of 720x1280, decoded and served
        y, x = np.mgrid[0:720, 0:1280]
        frames = [encode_jpeg(np.stack([127 + 100 * np.sin(x / (9 + i) + y / 13 + c) for c in range(3)], -1).astype(np.uint8)) for i in range(4)]
        largest = {**droid_observation(session_id="attacker"), **{key: frames for key in cameras}}
        assert infer(attacker, largest)["actions"][0, 0] == 1  # (its first one touches the shared-memory arena's pages)
        reset_peak_rss(pids[0])
        before = rss_mib(pids[0])
        assert infer(attacker, largest)["actions"][0, 0] == 2
        grown, decoded = peak_rss_mib(pids[0]) - before, budget * 3 / 2**20
        print(f"largest request within the budget ({decoded:.1f} MiB decoded): peak RSS +{grown:.1f} MiB")
        # its pixels, one frame in Pillow and the request itself (~37 MiB alone; ~44 here, where the decode threads'
        # malloc arenas still hold an earlier request's freed stacks); a decoded decoy stack alone was 1 GiB
        assert grown < 2 * decoded
        assert infer(attacker, {**largest, cameras[2]: [*frames, frames[0]]}).startswith(f"bad request: {cameras[2]}: 5 frame(s) of 720x1280 ")


def test_a_frame_of_tiny_objects_is_refused_at_once(tmp_path):
    """780 KB of ~260k msgpack items took 60-100 ms each to scan on the event loop."""
    with ServerProcess(fake_config(), tmp_path) as server, open_ws(server) as ws:
        hostile = msgpack.packb({"observation/joint_position": [0] * 65535, "x": [[0] * 4] * 50000})
        ws.send(hostile)
        reply = ws.recv()
        assert reply.startswith("bad request: message has more than 1024 list elements"), reply
        assert infer(ws, droid_observation())["actions"][0, 0] == 1


# ------------------------------------------------------------------------------- shutdown


def stuck_with_a_request_in_flight(tmp_path, grace_s: float):
    """A server whose worker is stopped (SIGSTOP) while one request waits on it."""
    server = ServerProcess(fake_config(server={"shutdown_grace_s": grace_s}), tmp_path).wait_ready()
    pid = server.worker_pids()[0]
    ws = open_ws(server)
    os.kill(pid, signal.SIGSTOP)
    ws.send(msgpack_numpy.packb(droid_observation(session_id="in-flight")))
    time.sleep(0.3)
    return server, pid, ws


def test_sigterm_with_a_stuck_worker_answers_in_flight_requests_and_exits_quickly(tmp_path):
    server, pid, ws = stuck_with_a_request_in_flight(tmp_path, grace_s=1.0)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    reply = ws.recv(timeout=10)
    assert isinstance(reply, str) and reply.startswith("internal error:") and "shutting down" in reply
    assert server.proc.wait(15) == 0
    assert time.monotonic() - started < 6
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_second_signal_exits_at_once(tmp_path):
    server, pid, _ws = stuck_with_a_request_in_flight(tmp_path, grace_s=30.0)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    server.proc.wait(10)
    assert time.monotonic() - started < 3
    assert wait_for(lambda: not _alive(pid), 10), "the stopped worker outlived the server"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_serve_help_is_fast_and_never_loads_torch():
    code = "import sys, ardiff_server.cli; ardiff_server.cli.parse_args(['--config', 'tiny']); print('torch' in sys.modules)"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
    help_started = time.monotonic()
    subprocess.run([sys.executable, "-m", "ardiff_server", "--help"], cwd=REPO, capture_output=True, timeout=60, check=True)
    print(f"import + parse {help_started - started:.2f} s; ardiff-serve --help {time.monotonic() - help_started:.2f} s")
