"""TLS (``--tls-cert``/``--tls-key``): wss:// and https:// on the one port, with a CA the test makes.

Clients written from the protocol (never from their code): the unmodified openpi client given a
``wss://`` host, and the ws://-first, wss://-fallback pattern of DreamZero's and RoboArena's
clients, which must fall back within milliseconds, not a timeout. Plus a certificate reload
(SIGHUP) that keeps connected robots, and bad certificates refused at start-up in one line.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import time
import urllib.error
import urllib.request

import msgpack
import pytest
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import InvalidMessage
from websockets.sync.client import connect

from ardiff_server import cli
from ardiff_server.frontend.metrics import TLS_FAILURES
from tests.helpers.certs import TestCA, peer_serial
from tests.helpers.inproc_server import InprocServer
from tests.helpers.roboarena import PolicyServerConfig
from tests.helpers.server_harness import ServerProcess, droid_observation, fake_config, metric_value
from tests.helpers.sockets import wait_for

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def server(ca):
    cert, key, _ = ca.issue("server")
    with InprocServer(fake_config(server={"tls_cert": str(cert), "tls_key": str(key)}), client_ssl=ca.client_context()) as running:
        yield running


def infer(ws, obs: dict) -> dict | str:
    ws.send(msgpack_numpy.packb(obs))
    reply = ws.recv()
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def metric(server, name: str) -> float:
    return metric_value(server.http("/metrics")[1], name)


def test_the_unmodified_openpi_client_over_wss_with_the_ca_trusted(server, ca, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.path))  # what a lab does for its own CA; a public CA needs nothing
    client = WebsocketClientPolicy(host="wss://localhost", port=server.port)
    assert client.get_server_metadata()["action_space"] == "joint_position"
    assert client.infer(droid_observation(session_id="wss-1"))["actions"][0, 0] == 1
    assert client.infer(droid_observation(session_id="wss-1"))["actions"][0, 0] == 2
    assert client._ws.socket.version() in ("TLSv1.2", "TLSv1.3")


def test_ws_first_then_wss_is_refused_in_milliseconds_not_a_timeout(server, ca):
    """DreamZero's policy_client.py and RoboArena's client: ``ws://`` first, ``wss://`` when it fails."""
    before = metric(server, 'ardiff_tls_handshake_failures_total{kind="plaintext"}')
    started = time.perf_counter()
    with pytest.raises(InvalidMessage):  # "did not receive a valid HTTP response": the connection was closed
        connect(f"ws://localhost:{server.port}", compression=None, max_size=None, open_timeout=10)
    refused_s = time.perf_counter() - started
    assert refused_s < 1.0, f"ws:// to the TLS port took {refused_s:.3f} s to fail"
    with connect(f"wss://localhost:{server.port}", ssl=ca.client_context(), compression=None, max_size=None) as ws:
        config = PolicyServerConfig(**msgpack.unpackb(ws.recv()))  # RoboArena builds its dataclass from the metadata frame
        assert config.needs_session_id
        reply = infer(ws, droid_observation(session_id="fallback"))
        assert reply["actions"][0, 0] == 1 and reply["session"]["id"] == "fallback"
    fallback_s = time.perf_counter() - started
    assert fallback_s < 3.0, f"ws:// then wss:// took {fallback_s:.3f} s"
    print(f"ws:// refused in {refused_s * 1000:.1f} ms; wss:// fallback and one request done {fallback_s * 1000:.0f} ms after the first try")

    started = time.perf_counter()
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # http:// to the TLS port: closed, no reply
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10)
    assert time.perf_counter() - started < 1.0
    assert metric(server, 'ardiff_tls_handshake_failures_total{kind="plaintext"}') == before + 2


def test_https_routes_on_the_same_port(server):
    assert server.http("/healthz") == (200, "OK\n")
    status, text = server.http("/metrics")
    assert status == 200 and "ardiff_requests_total" in text
    for kind in TLS_FAILURES:
        assert f'ardiff_tls_handshake_failures_total{{kind="{kind}"}}' in text
    assert server.http("/nowhere")[0] == 404


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_a_client_limited_to_tls_1_1_is_refused_and_counted(server):
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    client.set_ciphers("DEFAULT:@SECLEVEL=0")
    client.minimum_version = client.maximum_version = ssl.TLSVersion.TLSv1_1
    before = metric(server, 'ardiff_tls_handshake_failures_total{kind="protocol_version"}')
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw, pytest.raises(ssl.SSLError):
        client.wrap_socket(raw, server_hostname="localhost")
    assert wait_for(lambda: metric(server, 'ardiff_tls_handshake_failures_total{kind="protocol_version"}') == before + 1, 5)


def test_a_client_that_sends_nothing_is_dropped_after_the_handshake_timeout(ca):
    cert, key, _ = ca.issue("slow")
    config = fake_config(server={"tls_cert": str(cert), "tls_key": str(key), "tls_handshake_timeout_s": 0.5})
    with InprocServer(config, client_ssl=ca.client_context()) as running, socket.create_connection(("127.0.0.1", running.port), timeout=10) as raw:
        started = time.perf_counter()
        assert raw.recv(1) == b""  # closed by the server
        assert 0.4 < time.perf_counter() - started < 3.0


def test_a_reload_serves_the_new_certificate_to_new_connections_and_keeps_open_ones(ca, tmp_path):
    first_cert, first_key, first_serial = ca.issue("first")
    cert, key = tmp_path / "fullchain.pem", tmp_path / "privkey.pem"
    shutil.copy(first_cert, cert)
    shutil.copy(first_key, key)
    with InprocServer(fake_config(server={"tls_cert": str(cert), "tls_key": str(key)}), client_ssl=ca.client_context()) as running:
        url = f"wss://localhost:{running.port}"
        robot = connect(url, ssl=ca.client_context(), compression=None, max_size=None)
        robot.recv()
        assert peer_serial(robot) == first_serial and infer(robot, droid_observation(session_id="r"))["actions"][0, 0] == 1

        renewed_cert, renewed_key, renewed_serial = ca.issue("renewed")
        shutil.copy(renewed_cert, cert)
        shutil.copy(renewed_key, key)
        assert running._call(_reload(running)) is True

        assert infer(robot, droid_observation(session_id="r"))["actions"][0, 0] == 2  # the open connection carries on
        with connect(url, ssl=ca.client_context()) as fresh:
            assert peer_serial(fresh) == renewed_serial
        with connect(f"wss://127.0.0.1:{running.port}", ssl=ca.client_context()) as by_address:  # no SNI sent
            assert peer_serial(by_address) == renewed_serial

        key.write_text("half-written renewal\n")  # a failed reload keeps the certificate being served
        assert running._call(_reload(running)) is False
        with connect(url, ssl=ca.client_context()) as after_failure:
            assert peer_serial(after_failure) == renewed_serial
        assert infer(robot, droid_observation(session_id="r"))["actions"][0, 0] == 3
        robot.close()
        assert metric(running, 'ardiff_tls_reloads_total{result="ok"}') == 1
        assert metric(running, 'ardiff_tls_reloads_total{result="failed"}') == 1


async def _reload(running: InprocServer) -> bool:
    return running.server.tls.reload()


def test_sighup_reloads_the_certificate_of_a_running_server(ca, tmp_path):
    first_cert, first_key, first_serial = ca.issue("process-first")
    renewed_cert, renewed_key, renewed_serial = ca.issue("process-renewed")
    cert, key = tmp_path / "fullchain.pem", tmp_path / "privkey.pem"
    shutil.copy(first_cert, cert)
    shutil.copy(first_key, key)
    with ServerProcess(fake_config(), tmp_path, args=["--tls-cert", str(cert), "--tls-key", str(key)]) as process:
        assert process.scheme == "wss" and f"listening on wss://127.0.0.1:{process.port}" in process.log()
        process.client_ssl = ca.client_context()
        with connect(process.url, ssl=ca.client_context(), compression=None, max_size=None) as robot:
            robot.recv()
            assert peer_serial(robot) == first_serial
            assert infer(robot, droid_observation(session_id="hup"))["actions"][0, 0] == 1
            shutil.copy(renewed_cert, cert)
            shutil.copy(renewed_key, key)
            started = time.perf_counter()
            os.kill(process.proc.pid, signal.SIGHUP)
            assert wait_for(lambda: process.metric('ardiff_tls_reloads_total{result="ok"}') == 1, 10), process.log()
            print(f"SIGHUP reload visible in /metrics after {(time.perf_counter() - started) * 1000:.0f} ms")
            with connect(process.url, ssl=ca.client_context()) as fresh:
                assert peer_serial(fresh) == renewed_serial
            assert infer(robot, droid_observation(session_id="hup"))["actions"][0, 0] == 2  # not dropped
        assert process.http("/healthz") == (200, "OK\n")
        assert process.proc.poll() is None


@pytest.fixture(scope="module")
def bad_pairs(ca, tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad")
    cert, key, _ = ca.issue("good")
    _, other_key, _ = ca.issue("other")
    (directory / "garbage.pem").write_text("not a certificate\n")
    return {
        "missing": ([str(directory / "nope.pem"), str(key)], r"server\.tls_cert: .*nope\.pem does not exist"),
        "unreadable": ([str(directory), str(key)], r"server\.tls_cert: cannot read .* \(Is a directory\)"),
        "not_pem": ([str(directory / "garbage.pem"), str(key)], r"server\.tls_cert: .*garbage\.pem holds no PEM certificate"),
        "key_not_pem": ([str(cert), str(directory / "garbage.pem")], r"server\.tls_key: .*garbage\.pem holds no PEM private key"),
        "mismatched": ([str(cert), str(other_key)], r"server\.tls_key: .*other\.key is not the private key of the certificate in .*good\.pem"),
        "encrypted": ([str(cert), str(ca.encrypted_key("enc"))], r"server\.tls_key: .*encrypted with a passphrase; .*openssl pkey"),
        "no_key": ([str(cert), None], r"server\.tls_cert: .*good\.pem holds no PEM private key \(no server\.tls_key was given"),
    }


@pytest.mark.parametrize("case", ["missing", "unreadable", "not_pem", "key_not_pem", "mismatched", "encrypted", "no_key"])
def test_a_bad_certificate_or_key_fails_at_start_up_in_one_line(bad_pairs, case, capsys):
    (cert, key), needle = bad_pairs[case]
    args = ["--config", "tiny", "--tls-cert", cert, *(["--tls-key", key] if key else [])]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ardiff-serve: ") and re.search(needle, err), err


def test_a_mismatched_key_stops_the_real_server_before_any_worker(ca, tmp_path):
    cert, _, _ = ca.issue("lonely")
    _, other_key, _ = ca.issue("stranger")
    process = ServerProcess("tiny", tmp_path, args=["--tls-cert", str(cert), "--tls-key", str(other_key)])
    assert process.proc.wait(60) == 2
    time.sleep(0.2)
    log = process.log()
    assert "is not the private key of the certificate" in log and "worker" not in log and "loading" not in log, log
