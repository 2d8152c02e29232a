"""The inference worker process(es) and the server-side client that talks to them.

The server's event loop never runs model code. :class:`WorkerClient` spawns the worker
(``multiprocessing`` spawn start method: CUDA-safe), sends it requests from a sender thread
(a large observation never blocks the loop on a full pipe) and resolves replies from a reader
thread that also watches the process sentinels. If a worker dies, every in-flight request fails
with :class:`WorkerDied`, a fresh worker is started (sessions start over) and serving goes on;
a request that runs past its timeout kills the (stuck) worker the same way.

CFG-parallel (``engine.cfg_parallel_size: 2``): two worker processes form a ``torch.distributed``
group. Rank 0 receives each request and broadcasts it over a gloo control group; both ranks run
the same engine step in lock-step (each its own CFG branch and KV pool); rank 0 replies with
both ranks' stats.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any
from collections.abc import Callable

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """The worker could not serve a request."""


class WorkerDied(WorkerError):
    pass


class WorkerTimeout(WorkerError):
    pass


class WorkerStartError(WorkerError):
    pass


# =============================================================================== worker side


def worker_main(rank: int, world_size: int, raw_config: dict, conn: Connection | None, dist_port: int, log_level: int) -> None:
    """Entry point of a worker process (rank 0 holds the pipe to the server)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when workers stop
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    from ardiff_server.config import validate_config

    config = validate_config(raw_config, source=raw_config.get("source", "<config>"))
    torch.set_num_threads(config.engine.threads or max(1, (os.cpu_count() or 1) // world_size))
    control = None
    if world_size > 1:
        backend = config.engine.dist_backend
        if backend == "auto":
            backend = "nccl" if config.engine.rank_device(rank).startswith("cuda") else "gloo"
        timeout = timedelta(seconds=config.server.request_timeout_s + 60)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world_size, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    try:
        engine = build_engine(config, rank, world_size, control)
        warmup = engine.warmup() if config.engine.warmup else {}
    except BaseException as exc:
        logger.exception("worker failed to start")
        if conn is not None:
            conn.send({"type": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        raise SystemExit(1) from None
    stats = _all_stats(engine, control)  # a collective: every rank takes part
    if conn is not None:
        conn.send({"type": "ready", "metadata": engine.policy.info.server_config, "warmup": warmup, "stats": stats})
    try:
        _serve(engine, conn, control)
    finally:
        engine.release_all("shutdown")
        if world_size > 1:
            dist.destroy_process_group()


def build_engine(config, rank: int, world_size: int, control=None):
    """Policy and KV cache for this rank, sized from the engine config."""
    import torch
    import torch.distributed as dist

    from ardiff_server.engine import SessionEngine, kv_budget_bytes
    from kv import PagedKVCache
    from policies.base import RuntimeOptions, build_policy
    from policies.guidance import Guidance

    device = torch.device(config.engine.rank_device(rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    guidance = Guidance.single() if world_size == 1 else Guidance.parallel(rank)
    options = RuntimeOptions(
        device=str(device), dtype=config.engine.dtype, guidance=guidance, compile=config.engine.compile,
        compile_backend=config.engine.compile_backend, cuda_graphs=config.engine.cuda_graphs,
    )  # fmt: skip
    policy = build_policy(config.policy_name, config.policy_options(), options)
    spec = policy.kv_spec()
    cache = None
    if spec is not None:
        budget = kv_budget_bytes(config.engine.kv_budget_gib, config.engine.kv_memory_fraction, device)
        pages = PagedKVCache.pages_for_budget(spec, budget, max_sessions=config.engine.max_sessions, num_branches=len(policy.branches))
        if world_size > 1:  # both ranks must make the same admission decisions: agree on the pool size
            agreed = torch.tensor([pages])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
            pages = int(agreed)
        cache = PagedKVCache(
            spec, num_pages=pages + 1, max_sessions=config.engine.max_sessions, branches=policy.branches,
            device=device, attention_backend=config.engine.attention_backend,
        )  # fmt: skip
        logger.info(
            "KV cache: %d pages of %d tokens (%.1f MiB each), %d sessions, branches %s, %.1f MiB in all",
            cache.pool.capacity, spec.page_size, spec.page_bytes / 2**20, cache.session_capacity,
            [b.name for b in policy.branches], cache.storage_bytes / 2**20,
        )  # fmt: skip
    return SessionEngine(policy, cache, max_sessions=config.engine.max_sessions, rank=rank)


def _serve(engine, conn: Connection | None, control) -> None:
    import torch.distributed as dist

    parallel = control is not None
    while True:
        if conn is not None:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the server is gone
                message = {"type": "shutdown"}
        else:
            message = None
        if parallel:
            box = [message]
            dist.broadcast_object_list(box, src=0, group=control)
            message = box[0]
        if message["type"] == "shutdown":
            return
        reply = handle(engine, message)
        stats = _all_stats(engine, control)
        if conn is not None:
            reply["id"] = message.get("id")
            reply["stats"] = stats
            conn.send(reply)


def handle(engine, message: dict) -> dict[str, Any]:
    """One request against the engine; never raises (errors become replies)."""
    from kv import CapacityError as EngineCapacityError

    kind = message["type"]
    try:
        if kind == "infer":
            outcome = engine.infer(message["session_id"], message["observation"])
            result = outcome.result
            return {
                "ok": True, "actions": result.actions, "timing_ms": result.timing_ms, "info": result.info,
                "new_session": outcome.new_session, "calls": outcome.calls, "compute_ms": outcome.compute_ms,
            }  # fmt: skip
        if kind == "release":
            return {"ok": True, "released": engine.release(message["session_id"], message["reason"])}
        if kind == "detach":
            engine.detach(message["session_id"])
            return {"ok": True}
        return {"ok": False, "kind": "protocol", "error": f"unknown worker message {kind!r}"}
    except EngineCapacityError as exc:
        return {"ok": False, "kind": "capacity", "error": str(exc)}
    except Exception as exc:
        logger.exception("request failed (session %s)", message.get("session_id"))
        return {"ok": False, "kind": "policy", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _all_stats(engine, control) -> list[dict]:
    if control is None:
        return [engine.stats()]
    import torch.distributed as dist

    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, engine.stats(), group=control)
    return gathered


# =============================================================================== server side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Processes:
    """One started worker generation: its processes and its pipe."""

    def __init__(self, raw_config: dict, world_size: int, log_level: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        port = _free_port() if world_size > 1 else 0
        self.procs = [
            ctx.Process(
                target=worker_main, args=(rank, world_size, raw_config, child if rank == 0 else None, port, log_level),
                name=f"ardiff-worker-{rank}", daemon=True,
            )  # fmt: skip
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        child.close()

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = wait([self.conn, *self.sentinels], timeout=1.0)
            if self.conn in ready:
                try:
                    message = self.conn.recv()
                except EOFError:
                    message = None
                if message and message["type"] == "ready":
                    return message
                detail = f"{message['error']}\n{message.get('traceback', '')}" if message else "no message"
                self.kill()
                raise WorkerStartError(f"worker failed to start: {detail}")
            if any(not p.is_alive() for p in self.procs):
                codes = [p.exitcode for p in self.procs]
                self.kill()
                raise WorkerStartError(f"worker exited during start-up (exit codes {codes}); see its log above")
        self.kill()
        raise WorkerStartError(f"worker not ready after {timeout:.0f} s")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        self.conn.close()


class WorkerClient:
    def __init__(self, config, *, on_restart: Callable[[], None] | None = None, log_level: int | None = None) -> None:
        self.config = config
        self.raw_config = config.model_dump(mode="json")
        self.world_size = config.engine.cfg_parallel_size
        self.on_restart = on_restart
        self.log_level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        self.metadata: dict = {}
        self.stats: list[dict] = []
        self.warmup: dict = {}
        self.restarts = 0
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._procs: _Processes | None = None
        self._outbox: queue.Queue | None = None
        self._ready = asyncio.Event()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def pids(self) -> list[int]:
        return self._procs.pids if self._procs else []

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._launch()

    async def _launch(self) -> None:
        started = time.perf_counter()
        procs = await asyncio.to_thread(_Processes, self.raw_config, self.world_size, self.log_level)
        try:
            hello = await asyncio.to_thread(procs.wait_ready, self.config.engine.startup_timeout_s)
        except BaseException:
            procs.kill()
            raise
        self._procs = procs
        self.metadata, self.stats, self.warmup = hello["metadata"], hello["stats"], hello["warmup"]
        self._outbox = queue.Queue()
        threading.Thread(target=self._send_loop, args=(procs, self._outbox), name="ardiff-worker-send", daemon=True).start()
        threading.Thread(target=self._read_loop, args=(procs,), name="ardiff-worker-read", daemon=True).start()
        self._ready.set()
        logger.info("worker ready in %.1f s (pids %s)", time.perf_counter() - started, procs.pids)

    # -- threads ------------------------------------------------------------------------

    def _send_loop(self, procs: _Processes, outbox: queue.Queue) -> None:
        while True:
            message = outbox.get()
            if message is None:
                return
            try:
                procs.conn.send(message)
            except (OSError, ValueError):  # the worker died; the reader reports it
                return

    def _read_loop(self, procs: _Processes) -> None:
        while True:
            ready = wait([procs.conn, *procs.sentinels])
            if procs.conn in ready:
                try:
                    reply = procs.conn.recv()
                except (EOFError, OSError):
                    break
                self._loop.call_soon_threadsafe(self._resolve, reply)
                continue
            break  # a worker process exited
        self._loop.call_soon_threadsafe(self._on_death, procs)

    # -- loop side ----------------------------------------------------------------------

    def _resolve(self, reply: dict) -> None:
        self.stats = reply.get("stats", self.stats)
        future = self._pending.pop(reply.get("id"), None)
        if future is not None and not future.done():
            future.set_result(reply)

    def _on_death(self, procs: _Processes) -> None:
        if procs is not self._procs:
            return
        self._ready.clear()
        self._outbox.put(None)
        procs.kill()
        self._procs = None
        codes = [p.exitcode for p in procs.procs]
        for future in self._pending.values():
            if not future.done():
                future.set_exception(WorkerDied(f"the inference worker died (exit codes {codes}); it is being restarted"))
        self._pending.clear()
        if self._stopping:
            return
        self.restarts += 1
        logger.error("worker died (exit codes %s); restarting (restart #%d), sessions start fresh", codes, self.restarts)
        if self.on_restart is not None:
            self.on_restart()
        asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        delay = 1.0
        while not self._stopping:
            try:
                await self._launch()
                return
            except WorkerStartError as exc:
                logger.error("worker restart failed: %s; retrying in %.0f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def request(self, message: dict, timeout: float | None = None) -> dict:
        """Send one message and await its reply. Raises WorkerDied / WorkerTimeout."""
        if self._stopping:
            raise WorkerDied("the server is shutting down")
        try:
            await asyncio.wait_for(self._ready.wait(), self.config.engine.startup_timeout_s)
        except TimeoutError:
            raise WorkerDied("the inference worker is not running (restart in progress)") from None
        request_id = next(self._ids)
        future = self._loop.create_future()
        self._pending[request_id] = future
        self._outbox.put({**message, "id": request_id})
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            self._pending.pop(request_id, None)
            logger.error("request %d exceeded %.0f s; killing the stuck worker", request_id, timeout)
            self._ready.clear()  # later requests wait for the replacement, not the dying worker
            self.kill()
            raise WorkerTimeout(f"inference took longer than {timeout:.0f} s; the worker was restarted") from None

    def kill(self) -> None:
        """SIGKILL the worker processes (the reader notices and restarts them)."""
        if self._procs is not None:
            for pid in self._procs.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (connections closing during shutdown need no replies)."""
        self._stopping = True

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        procs = self._procs
        if procs is None:
            return
        self._outbox.put({"type": "shutdown"})
        self._outbox.put(None)
        deadline = time.monotonic() + timeout
        for proc in procs.procs:
            await asyncio.to_thread(proc.join, max(0.1, deadline - time.monotonic()))
        procs.kill()
        self._procs = None
