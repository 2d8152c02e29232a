"""The worker process: one engine rank behind a socket to the front end.

Rank 0 holds the socket. A reader thread takes requests off it into the engine's
:class:`~ardiff_server.engine.scheduler.Scheduler` (control first) and answers liveness pings at
once, with the requests the main thread is computing and for how long (the front end's progress
watchdog and a request's compute timeout run from there; no message per step, so a fast step
costs no extra wake-up of the front end); the main thread runs the serving loop (``loop.py``):
the scheduler's rounds, carried out by ``SessionEngine.execute``.

CFG-parallel (``engine.cfg_parallel_size: 2``): two processes form a ``torch.distributed``
group. Rank 0's scheduler decides every round and broadcasts it over a gloo control group; both
ranks carry it out in lock-step (each its own CFG branch and KV pool; the policy's phases agree
on which sessions failed), both gather every rank's stats (a collective), and rank 0 replies.

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
        from ardiff_policies.base import StartRefused

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
        channel.send(Ready(engine.policy.info, stats, engine.warmup_ms, time.perf_counter() - started))
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
    """Every rank's stats, in rank order (a collective under CFG-parallel)."""
    if control is None:
        return (engine.stats(),)
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(gathered, engine.stats(), group=control)
    return tuple(gathered)


def _broadcast(round: Any, control) -> Any:
    import torch.distributed as dist

    box = [round]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def _execute(engine, round, control, arena) -> list:
    """One round on any rank: the engine's replies, with every rank's stats attached."""
    if arena is not None and round.admit:  # camera arrays: views of the shared-memory arena, valid until answered
        round = replace(
            round, admit=tuple(replace(a, request=replace(a.request, observation=arena.view(a.request.observation))) for a in round.admit)
        )
    replies = engine.execute(round)
    if control is not None:
        stats = gather_stats(engine, control)
        replies = [replace(reply, stats=stats) for reply in replies]
    return replies


class Running:
    """What the main thread is computing (read by the reader thread to answer pings)."""

    def __init__(self) -> None:
        self.requests: tuple[tuple[int, ...], float] | None = None  # (request ids, time.monotonic() at the start)

    def __call__(self, request_ids: tuple[int, ...] | None) -> None:
        self.requests = None if request_ids is None else (request_ids, time.monotonic())


def _serve(engine, channel: WorkerChannel, control, arena) -> None:
    from ardiff_server.engine.loop import serve

    running = Running()
    threading.Thread(target=_read_requests, args=(channel, engine.scheduler, running), name="ardiff-worker-inbox", daemon=True).start()
    share = None if control is None else (lambda round: _broadcast(round, control))
    serve(engine, channel.send, execute=lambda round: _execute(engine, round, control, arena), share=share, running=running)


def _follow(engine, control, arena) -> None:
    """CFG-parallel rank 1: carry out the rounds rank 0's scheduler decided, in the same order."""
    from ardiff_server.engine.loop import follow

    follow(lambda: _broadcast(None, control), lambda round: _execute(engine, round, control, arena))


def _read_requests(channel: WorkerChannel, scheduler, running: Running) -> None:
    from ardiff_server.engine.messages import Ping, Pong, Shutdown

    while True:
        try:
            message = channel.recv()
        except (EOFError, OSError):  # the front end is gone
            scheduler.put(Shutdown())
            return
        if isinstance(message, Ping):
            current = running.requests
            if current is None:
                channel.send(Pong(message.request_id))
            else:
                channel.send(Pong(message.request_id, running=current[0], running_s=time.monotonic() - current[1]))
        else:
            scheduler.put(message)
