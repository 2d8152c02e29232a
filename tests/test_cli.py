"""``ardiff-serve`` start-up (ardiff_server/cli.py): what fails before anything is loaded fails in one line."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from ardiff_server import cli
from tests.helpers.server_harness import ServerProcess


@pytest.fixture
def held_port():
    """A port another server listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def _in_use(port: int) -> str:
    return (
        f"ardiff-serve: cannot listen on 127.0.0.1:{port}: address already in use; stop the other server or pick another --port (0 picks a free one)"
    )


def test_a_port_in_use_fails_in_one_line_before_any_worker_is_spawned(held_port, monkeypatch, capsys):
    spawned = []

    def spawn(config):
        spawned.append(config)
        raise RuntimeError("a worker was spawned")

    monkeypatch.setattr("ardiff_server.engine.replicas.ReplicaSet.from_config", spawn)
    assert cli.main(["--config", "tiny", "--port", str(held_port)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [_in_use(held_port)] and captured.out == ""
    assert spawned == []


def test_the_real_server_on_a_port_in_use_exits_2_at_once_without_loading(held_port, tmp_path):
    started = time.monotonic()
    process = ServerProcess("tiny", tmp_path, args=["--port", str(held_port)])
    assert process.proc.wait(60) == 2
    time.sleep(0.2)  # the pump thread reads the last lines
    assert process.lines == [_in_use(held_port)], process.log()  # no traceback, no leaked shared memory warning
    assert time.monotonic() - started < 30  # no model load (the tiny one alone takes ~10 s on 2 cores)


class _LoadsWhileAnotherTakesThePort:
    """An engine whose model load lasts while another server starts listening on the port."""

    def __init__(self, port: int) -> None:
        self.port, self.stopped, self.thief = port, False, None

    async def start(self) -> None:
        self.thief = socket.socket()
        self.thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        self.thief.bind(("127.0.0.1", self.port))
        self.thief.listen()

    async def stop(self, grace_s: float) -> None:
        self.stopped = True
        self.thief.close()

    def kill_now(self) -> None:
        pass


def test_a_port_taken_during_the_model_load_is_one_line_and_the_engine_is_stopped(monkeypatch, capsys):
    from ardiff_server.net import free_port

    port = free_port()
    engine = _LoadsWhileAnotherTakesThePort(port)
    monkeypatch.setattr("ardiff_server.engine.replicas.ReplicaSet.from_config", lambda config: engine)
    assert cli.main(["--config", "tiny", "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [_in_use(port)]
    assert engine.stopped  # its worker and shared memory released


def test_the_listening_socket_bound_at_start_up_is_the_one_served(monkeypatch):
    """Port 0: the port printed is the one bound before the load (no second bind that could fail)."""
    from ardiff_server.config import load_config
    from ardiff_server.frontend.server import PolicyServer
    from ardiff_server.net import bind_listeners

    config = load_config("tiny", ["server.port=0"])
    sockets = bind_listeners("127.0.0.1", 0)
    bound = sockets[0].getsockname()[1]

    class Ready:
        async def start(self) -> None:
            pass

        async def stop(self, grace_s: float) -> None:
            pass

    async def serve_and_stop() -> int:
        server = PolicyServer(config, client=Ready(), listen_sockets=sockets)
        await server.start()
        port = server.port
        await server.stop()
        return port

    assert asyncio.run(serve_and_stop()) == bound


@pytest.mark.parametrize(
    ("argv", "written"),
    [
        (["--set", "engine.max_sessions", "4"], "--set engine.max_sessions=4"),
        (["--config", "tiny", "--set", "engine.max_sessions", "--port", "0"], "--set engine.max_sessions=VALUE"),
    ],
)
def test_set_with_a_space_says_how_to_write_it_in_one_line(argv, written, capsys):
    """``--set key value`` is not argparse's usage text but one line with the argument as it should be (#38 item 6)."""
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == f"ardiff-serve: --set takes KEY=VALUE as one argument: write {written}\n"
