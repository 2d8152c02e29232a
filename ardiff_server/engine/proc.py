"""The worker process: one engine rank behind a socket to the front end.

Rank 0 holds the socket. A reader thread takes requests off it into a :class:`RequestInbox`
(control first) and answers liveness pings at once, with the request the main thread is
computing and for how long (the front end's progress watchdog and a request's compute timeout
run from there; no message per step, so a fast step costs no extra wake-up of the front end);
the main thread serves the inbox one request at a time.

CFG-parallel (``engine.cfg_parallel_size: 2``): two processes form a ``torch.distributed``
group. Rank 0 broadcasts each request over a gloo control group; both ranks serve it in
lock-step (each its own CFG branch and KV pool) and rank 0 replies with both ranks' stats.

Messages are pickled :mod:`messages` objects in ``multiprocessing.connection`` framing (a
4-byte big-endian length, then the bytes), which the front end reads with asyncio streams.
"""

from __future__ import annotations

import logging
import pickle
import signal
import socket
import threading
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)


class Channel:
    """Pickled messages over a ``multiprocessing`` connection; sends are serialized by a lock
    (the main thread replies while the reader thread answers pings)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())


def worker_main(
    rank: int,
    world_size: int,
    raw_config: dict,
    sock: socket.socket | None,
    dist_port: int,
    log_level: int,
    arena_name: str | None,
    warmup: bool,
) -> None:
    """Entry point of a worker process (rank 0 holds the socket to the front end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when workers stop
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: %(message)s")
    started = time.perf_counter()
    channel = Channel(Connection(sock.detach())) if sock is not None else None

    import torch.distributed as dist

    from ardiff_server.config import validate_config
    from ardiff_server.engine.core import build_engine, set_threads
    from ardiff_server.engine.messages import Ready, StartFailed
    from ardiff_server.engine.shm import SharedArena

    control = None
    try:
        config = validate_config(raw_config, source=raw_config.get("source", "<config>"))
        set_threads(config, world_size)
        if world_size > 1:
            backend = config.engine.dist_backend
            if backend == "auto":
                backend = "nccl" if config.engine.rank_device(rank).startswith("cuda") else "gloo"
            timeout = timedelta(seconds=config.server.request_timeout_s + 60)
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world_size, timeout=timeout)
            control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        engine = build_engine(config, rank, world_size, control)
        warmup_ms = engine.warmup() if warmup else {}
        arena = SharedArena.attach(arena_name) if arena_name else None
    except BaseException as exc:
        from policies.base import StartRefused

        if isinstance(exc, StartRefused):  # the policy explains itself in one line (e.g. its memory plan)
            logger.error("%s", exc)
            error = str(exc)
        else:
            logger.exception("worker failed to start")
            error = f"{type(exc).__name__}: {exc}"
        if channel is not None:
            channel.send(StartFailed(error, traceback.format_exc()))
        raise SystemExit(1) from None
    stats = gather_stats(engine, control)  # a collective: every rank takes part
    if channel is not None:
        channel.send(Ready(engine.policy.info, stats, warmup_ms, time.perf_counter() - started))
    try:
        if rank == 0:
            _serve(engine, channel, control, arena)
        else:
            _follow(engine, control, arena)
    finally:
        engine.close()
        if world_size > 1:
            dist.destroy_process_group()


def gather_stats(engine, control) -> tuple:
    if control is None:
        return (engine.stats(),)
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(gathered, engine.stats(), group=control)
    return tuple(gathered)


def _broadcast(request: Any, control) -> Any:
    import torch.distributed as dist

    box = [request]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


class Running:
    """What the main thread is computing (read by the reader thread to answer pings)."""

    def __init__(self) -> None:
        self.request: tuple[int, float] | None = None  # (request_id, time.monotonic() at its start)


def _serve(engine, channel: Channel, control, arena) -> None:
    from ardiff_server.engine.core import RequestInbox
    from ardiff_server.engine.messages import Infer, Shutdown

    inbox, running = RequestInbox(), Running()
    threading.Thread(target=_read_requests, args=(channel, inbox, running), name="ardiff-worker-inbox", daemon=True).start()
    while True:
        if inbox.empty() and engine.idle_work():  # recording: only while no request waits
            continue
        request, queued_ms = inbox.get()
        if control is not None:
            _broadcast(request, control)
        if isinstance(request, Shutdown):
            return
        if isinstance(request, Infer) and arena is not None:
            request = replace(request, observation=arena.view(request.observation))
        running.request = (request.request_id, time.monotonic())
        try:
            reply = engine.handle(request, stats=lambda: gather_stats(engine, control), queued_ms=queued_ms)
        finally:
            running.request = None
        channel.send(reply)


def _follow(engine, control, arena) -> None:
    """CFG-parallel rank 1: serve whatever rank 0 broadcasts, in the same order."""
    from ardiff_server.engine.messages import Infer, Shutdown

    while True:
        request = _broadcast(None, control)
        if isinstance(request, Shutdown):
            return
        if isinstance(request, Infer) and arena is not None:
            request = replace(request, observation=arena.view(request.observation))
        engine.handle(request, stats=lambda: gather_stats(engine, control))


def _read_requests(channel: Channel, inbox, running: Running) -> None:
    from ardiff_server.engine.messages import Ping, Pong, Shutdown

    while True:
        try:
            message = channel.recv()
        except (EOFError, OSError):  # the front end is gone
            inbox.put(Shutdown())
            return
        if isinstance(message, Ping):
            current = running.request
            if current is None:
                channel.send(Pong(message.request_id))
            else:
                channel.send(Pong(message.request_id, running=current[0], running_s=time.monotonic() - current[1]))
        else:
            inbox.put(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

