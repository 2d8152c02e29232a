"""The worker process: one engine rank behind a socket to the front end.

Rank 0 holds the socket. A reader thread takes requests off it into a :class:`RequestInbox`
(control first) and answers liveness pings at once, with the requests the main thread is
computing and for how long (the front end's progress watchdog and a request's compute timeout
run from there; no message per step, so a fast step costs no extra wake-up of the front end);
the main thread serves the inbox: one control request, or a batch of up to ``engine.max_batch``
waiting inference requests in one step (``SessionEngine.serve``).

CFG-parallel (``engine.cfg_parallel_size: 2``): two processes form a ``torch.distributed``
group. Rank 0 broadcasts each request over a gloo control group; both ranks serve it in
lock-step (each its own CFG branch and KV pool), both gather every rank's stats (a
collective), and rank 0 replies with them.

Start-up, in order: validate the config, join the process group, build and warm up the engine
(``builder.start_engine``), attach the shared-memory arena, send :class:`Ready` (or
:class:`StartFailed`), then serve until :class:`Shutdown` or the front end goes away.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ardiff_server.engine.channel import WorkerChannel

logger = logging.getLogger(__name__)


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
    channel = WorkerChannel(sock) if sock is not None else None

    import torch.distributed as dist

    from ardiff_server.config import validate_config
    from ardiff_server.engine.builder import start_engine
    from ardiff_server.engine.messages import Ready, StartFailed
    from ardiff_server.engine.shm import SharedArena

    control = None
    try:
        config = validate_config(raw_config, source=raw_config.get("source", "<config>"))
        if world_size > 1:
            backend = config.engine.dist_backend
            if backend == "auto":
                backend = "nccl" if config.engine.rank_device(rank).startswith("cuda") else "gloo"
            timeout = timedelta(seconds=config.server.request_timeout_s + 60)
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world_size, timeout=timeout)
            control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        engine = start_engine(config, rank, world_size, control, warmup=warmup)
        arena = SharedArena.attach(arena_name) if arena_name else None
    except BaseException as exc:
        logger.exception("worker failed to start")
        if channel is not None:
            channel.send(StartFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    stats = gather_stats(engine, control)  # a collective: every rank takes part
    if channel is not None:
        channel.send(Ready(engine.policy.info, stats, engine.warmup_ms, time.perf_counter() - started))
    try:
        if rank == 0:
            _serve(engine, channel, control, arena, engine.max_batch, config.engine.batch_wait_s)
        else:
            _follow(engine, control, arena)
    finally:
        engine.close()
        if world_size > 1:
            dist.destroy_process_group()


def gather_stats(engine, control) -> tuple:
    """Every rank's stats, in rank order (a collective under CFG-parallel)."""
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


def _serve_items(engine, items: list, control, arena) -> tuple[list, list]:
    """What the inbox handed over, on any rank: the engine's replies (with every rank's stats
    attached) and the requests to put back in the inbox."""
    from ardiff_server.engine.messages import Infer

    if arena is not None:
        items = [(replace(r, observation=arena.view(r.observation)) if isinstance(r, Infer) else r, q) for r, q in items]
    replies, deferred = engine.serve(items)
    if control is not None:
        stats = gather_stats(engine, control)
        replies = [replace(reply, stats=stats) for reply in replies]
    return replies, deferred  # deferred requests keep their views: viewing a view again changes nothing


class Running:
    """What the main thread is computing (read by the reader thread to answer pings)."""

    def __init__(self) -> None:
        self.requests: tuple[tuple[int, ...], float] | None = None  # (request ids, time.monotonic() at the start)


def _serve(engine, channel: WorkerChannel, control, arena, max_batch: int, wait_s: float) -> None:
    from ardiff_server.engine.inbox import RequestInbox
    from ardiff_server.engine.messages import Shutdown

    inbox, running = RequestInbox(), Running()
    threading.Thread(target=_read_requests, args=(channel, inbox, running), name="ardiff-worker-inbox", daemon=True).start()
    while True:
        if inbox.empty() and engine.idle_work():  # recording: only while no request waits
            continue
        items = inbox.get_batch(max_batch, wait_s)
        if control is not None:
            _broadcast(items, control)
        if isinstance(items[0][0], Shutdown):
            return
        running.requests = (tuple(request.request_id for request, _ in items), time.monotonic())
        try:
            replies, deferred = _serve_items(engine, items, control, arena)
        finally:
            running.requests = None
        inbox.put_back(deferred)
        for reply in replies:
            channel.send(reply)


def _follow(engine, control, arena) -> None:
    """CFG-parallel rank 1: serve whatever rank 0 broadcasts, in the same order (the same batches:
    admission is deterministic, so both ranks defer the same requests)."""
    from ardiff_server.engine.messages import Shutdown

    while True:
        items = _broadcast(None, control)
        if isinstance(items[0][0], Shutdown):
            return
        _serve_items(engine, items, control, arena)


def _read_requests(channel: WorkerChannel, inbox, running: Running) -> None:
    from ardiff_server.engine.messages import Ping, Pong, Shutdown

    while True:
        try:
            message = channel.recv()
        except (EOFError, OSError):  # the front end is gone
            inbox.put(Shutdown())
            return
        if isinstance(message, Ping):
            current = running.requests
            if current is None:
                channel.send(Pong(message.request_id))
            else:
                channel.send(Pong(message.request_id, running=current[0], running_s=time.monotonic() - current[1]))
        else:
            inbox.put(message)
