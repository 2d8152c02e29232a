"""What the front end talks to: an :class:`EngineClient`.

* :class:`ProcessClient`: an engine in a worker process (a CFG-parallel pair: two), spawned and
  restarted by this client. The socket to it is read and written by the event loop through
  asyncio streams (no threads); camera arrays go through shared memory (``shm.py``). A progress
  watchdog (the worker reports when each step starts) declares the worker stuck when a step runs
  past ``server.request_timeout_s``, fails that request and restarts the worker; a liveness
  ping tells ``/healthz`` when the process stopped answering at all.
* :class:`InprocClient`: an engine in this process, served by one thread (tests, scripts and Ray
  replicas, which are processes already).
* :class:`ReplicaSet`: several clients behind one interface, each session pinned to the replica
  that opened it (``engine.replicas``).

This module imports no torch: the front end process never loads it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ardiff_server.engine.messages import (
    ControlReply,
    Detach,
    EngineError,
    EngineStats,
    ErrorKind,
    ErrorReply,
    Infer,
    InferReply,
    Ping,
    Pong,
    Ready,
    Release,
    Reply,
    Request,
    Shutdown,
    StartFailed,
)
from ardiff_server.engine.shm import Allocation, SharedArena, create_arena
from policies.info import PolicyInfo
from policies.observation import RobotObservation

logger = logging.getLogger(__name__)

EngineState = Literal["starting", "ready", "restarting", "stuck", "unresponsive", "stopped"]

HEARTBEAT_INTERVAL_S = 1.0  # a ping this often: liveness, and which step runs since when
HEARTBEAT_TIMEOUT_S = 10.0  # no pong for this long: /healthz says the worker is unresponsive


class EngineClient(Protocol):
    """The engine as the front end sees it. Every method may raise :class:`EngineError`."""

    info: PolicyInfo | None

    @property
    def state(self) -> EngineState: ...

    async def start(self) -> None: ...

    async def infer(self, session_id: str, observation: RobotObservation) -> InferReply: ...

    async def release(self, session_id: str, reason: str) -> None: ...

    async def detach(self, session_id: str, why: Literal["switched", "disconnected"]) -> None: ...

    async def stop(self, grace_s: float = 3.0) -> None: ...

    def kill_now(self) -> None:
        """SIGKILL every engine process at once (a second Ctrl-C): no waiting, no cleanup."""

    def replicas(self) -> list[ReplicaStatus]: ...


@dataclass
class ReplicaStatus:
    """One engine replica as ``/metrics`` and ``/info`` show it."""

    index: int
    devices: list[str]
    state: EngineState
    pids: list[int] = field(default_factory=list)
    stats: tuple[EngineStats, ...] = ()
    restarts: int = 0
    last_restart_s: float = 0.0
    sessions_placed: int = 0  # sessions the front end routes here


@dataclass
class _Pending:
    future: asyncio.Future
    allocations: list[Allocation] = field(default_factory=list)
    infer: bool = False
    started_at: float | None = None  # when the worker began its step


class _Generation:
    """One started set of worker processes (one rank, or a CFG-parallel pair) and their socket."""

    def __init__(self, procs: list[Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.procs = procs
        self.reader = reader
        self.writer = writer
        self.tasks: list[asyncio.Task] = []
        self.dead = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


_HEADER = struct.Struct("!i")  # multiprocessing.connection's framing: a signed 4-byte length


class ProcessClient:
    """An engine in worker process(es), restarted when it dies or gets stuck."""

    def __init__(self, config, *, replica: int = 0, devices: list[str] | None = None, log_level: int | None = None) -> None:
        self.config = config
        self.replica = replica
        self.world_size = config.engine.cfg_parallel_size
        self.devices = devices or [config.engine.rank_device(rank) for rank in range(self.world_size)]
        raw = config.model_dump(mode="json")
        raw["engine"] = {**raw["engine"], "device": self.devices[0], "devices": self.devices if self.world_size > 1 else None}
        self.raw_config = raw
        self.log_level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        self.step_timeout_s = config.server.request_timeout_s
        self.info: PolicyInfo | None = None
        self.stats: tuple[EngineStats, ...] = ()
        self.warmup_ms: dict[str, float] = {}
        self.restarts = 0
        self.last_restart_s = 0.0
        self.on_restart: Callable[[ProcessClient], None] | None = None
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._gen: _Generation | None = None
        self._stopping_gen: _Generation | None = None  # the one stop() is waiting for
        self._arena: SharedArena | None = None
        self._ready = asyncio.Event()
        self._state: EngineState = "starting"
        self._stopping = False
        self._last_progress = time.monotonic()
        self._last_pong = time.monotonic()
        self._watchdog: asyncio.Task | None = None
        self._restarting: asyncio.Task | None = None

    # -- state --------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        silent = time.monotonic() - self._last_pong
        if self._state == "ready" and silent > min(HEARTBEAT_TIMEOUT_S, max(self.step_timeout_s, 2 * HEARTBEAT_INTERVAL_S)):
            return "unresponsive"  # not even the reader thread answers: stopped, or wedged holding the GIL
        return self._state

    @property
    def pids(self) -> list[int]:
        return self._gen.pids if self._gen else []

    def replicas(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(self.replica, self.devices, self.state, self.pids, self.stats, self.restarts, self.last_restart_s)]

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        self._arena = create_arena(self.config.engine.shm_mib)
        await self._launch(warmup=self.config.engine.warmup)
        self._watchdog = asyncio.ensure_future(self._watch())

    async def _launch(self, *, warmup: bool) -> None:
        started = time.perf_counter()
        parent, child = socket.socketpair()
        ctx = mp.get_context("spawn")
        from ardiff_server.engine.worker import free_port, worker_main  # noqa: PLC0415 - torch-free at import

        port = free_port() if self.world_size > 1 else 0
        arena_name = self._arena.name if self._arena is not None else None
        procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, self.world_size, self.raw_config, child if rank == 0 else None, port, self.log_level, arena_name, warmup),
                name=f"ardiff-worker-r{self.replica}-{rank}", daemon=True,
            )  # fmt: skip
            for rank in range(self.world_size)
        ]
        await asyncio.to_thread(_start_all, procs)
        child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent, limit=2**16)
        gen = _Generation(procs, reader, writer)
        try:
            hello = await self._first_message(gen)
        except BaseException:
            gen.kill()
            writer.close()
            raise
        self._gen = gen
        self.info, self.stats, self.warmup_ms = hello.info, hello.stats, hello.warmup_ms
        self._last_progress = self._last_pong = time.monotonic()
        gen.tasks.append(asyncio.ensure_future(self._read(gen)))
        loop = asyncio.get_running_loop()
        for proc in procs:
            loop.add_reader(proc.sentinel, self._on_exit, gen)
        self._state = "ready"
        self._ready.set()
        logger.info(
            "replica %d: worker ready in %.1f s (pids %s, devices %s)",
            self.replica, time.perf_counter() - started, gen.pids, self.devices,
        )  # fmt: skip

    async def _first_message(self, gen: _Generation) -> Ready:
        """The worker's Ready, or a clear failure (start-up error, early exit, timeout)."""
        read = asyncio.ensure_future(_read_message(gen.reader))
        deadline = time.monotonic() + self.config.engine.startup_timeout_s
        try:
            while not read.done():
                await asyncio.wait([read], timeout=0.5)
                if not read.done() and any(not p.is_alive() for p in gen.procs):
                    await asyncio.wait([read], timeout=1.0)  # the failure message may still be in flight
                    if read.done():
                        break
                    codes = [p.exitcode for p in gen.procs]
                    raise EngineError(ErrorKind.UNAVAILABLE, f"worker exited during start-up (exit codes {codes}); see its log above")
                if time.monotonic() > deadline:
                    raise EngineError(ErrorKind.UNAVAILABLE, f"worker not ready after {self.config.engine.startup_timeout_s:.0f} s")
            try:
                message = read.result()
            except (asyncio.IncompleteReadError, ConnectionError):
                raise EngineError(ErrorKind.UNAVAILABLE, "worker exited during start-up; see its log above") from None
        finally:
            read.cancel()
        if isinstance(message, StartFailed):
            raise EngineError(ErrorKind.UNAVAILABLE, f"worker failed to start: {message.error}", message.traceback)
        if not isinstance(message, Ready):
            raise EngineError(ErrorKind.UNAVAILABLE, f"worker sent {type(message).__name__} before Ready")
        return message

    async def stop(self, grace_s: float = 3.0) -> None:
        """Ask the worker to finish, kill it after ``grace_s``; pending requests fail at once."""
        self._stopping = True
        self._state = "stopped"
        if self._watchdog is not None:
            self._watchdog.cancel()
        gen, self._gen = self._gen, None
        self._stopping_gen = gen
        self._fail_all(EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down"))
        if gen is not None:
            try:
                self._write(gen, Shutdown())  # served after the step in progress, if any
                await asyncio.wait_for(gen.writer.drain(), grace_s)
            except (ConnectionError, RuntimeError, TimeoutError):
                pass
            self._forget(gen)
            deadline = time.monotonic() + grace_s
            while any(p.is_alive() for p in gen.procs) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            gen.kill()
            await asyncio.to_thread(_join_all, gen.procs)
            gen.writer.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def kill_now(self) -> None:
        for gen in (self._gen, self._stopping_gen):
            if gen is not None:
                gen.kill()
        if self._arena is not None:
            self._arena.close()  # unlink: nothing else will

    # -- requests -----------------------------------------------------------------------

    async def infer(self, session_id: str, observation: RobotObservation) -> InferReply:
        request_id = next(self._ids)
        gen = await self._ready_generation()
        allocations: list[Allocation] = []
        if self._arena is not None:
            placed = self._arena.put(observation)
            if placed is not None:
                observation, allocations = placed
        reply = await self._call(gen, Infer(request_id, session_id, observation), allocations, infer=True)
        return dataclasses.replace(reply, replica=self.replica)

    async def release(self, session_id: str, reason: str) -> None:
        await self._control(Release(next(self._ids), session_id, reason))

    async def detach(self, session_id: str, why: Literal["switched", "disconnected"]) -> None:
        await self._control(Detach(next(self._ids), session_id, why))

    async def _control(self, request: Request) -> None:
        """Control requests never kill a worker: a dead or restarting worker holds no sessions,
        so there is nothing left to release and the request is simply done."""
        if self._gen is None or not self._ready.is_set():
            return
        try:
            await self._call(self._gen, request, [], infer=False)
        except EngineError as exc:
            if exc.kind not in (ErrorKind.WORKER_DIED, ErrorKind.TIMEOUT, ErrorKind.UNAVAILABLE):
                raise

    async def _ready_generation(self) -> _Generation:
        if self._stopping:
            raise EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), self.config.engine.startup_timeout_s)
            except TimeoutError:
                raise EngineError(ErrorKind.UNAVAILABLE, "the inference worker is not running (restart in progress)") from None
        if self._gen is None:
            raise EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        return self._gen

    async def _call(self, gen: _Generation, request: Request, allocations: list[Allocation], *, infer: bool) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = _Pending(future, allocations, infer)
        try:
            self._write(gen, request)
        except (ConnectionError, RuntimeError):
            self._settle(request.request_id, EngineError(ErrorKind.WORKER_DIED, "the inference worker died; it is being restarted"))
        # A cancelled caller (a shutting-down connection) cancels only this future: the request stays
        # pending, and its shared-memory allocation reserved, until the worker answers or dies.
        # (No asyncio.shield: it costs two extra event-loop turns on every reply.)
        reply = await future
        if isinstance(reply, ErrorReply):
            raise reply.error()
        return reply

    def _write(self, gen: _Generation, message: Any) -> None:
        if gen.dead or gen.writer.is_closing():
            raise ConnectionError("worker socket closed")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        gen.writer.write(_HEADER.pack(len(data)) + data)  # buffered by asyncio: never blocks the loop

    # -- worker messages ----------------------------------------------------------------

    async def _read(self, gen: _Generation) -> None:
        try:
            while True:
                message = await _read_message(gen.reader)
                self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self._on_exit(gen)
        except asyncio.CancelledError:
            pass

    def _dispatch(self, message: Any) -> None:
        now = time.monotonic()
        self._last_pong = now  # any message proves the process is alive
        if isinstance(message, Pong):
            pending = self._pending.get(message.running) if message.running is not None else None
            if pending is not None and pending.started_at is None:  # a new step began: progress
                pending.started_at = now - message.running_s
                self._last_progress = now
            return
        self._last_progress = now
        if isinstance(message, InferReply | ControlReply | ErrorReply):
            if message.stats:
                self.stats = message.stats
            self._settle(message.request_id, message)
            return
        logger.warning("replica %d: unexpected worker message %s", self.replica, type(message).__name__)

    def _settle(self, request_id: int, outcome: Reply | EngineError) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        if self._arena is not None:
            for allocation in pending.allocations:
                self._arena.free(allocation)
        if pending.future.done():
            return
        if isinstance(outcome, EngineError):
            pending.future.set_exception(outcome)
            pending.future.exception()  # mark retrieved: the caller may be gone
        else:
            pending.future.set_result(outcome)

    def _fail_all(self, error: EngineError) -> None:
        for request_id in list(self._pending):
            self._settle(request_id, error)

    # -- death, stuck, restart ------------------------------------------------------------

    def _on_exit(self, gen: _Generation) -> None:
        """A worker process exited or its socket closed."""
        if gen.dead:
            return
        self._forget(gen)
        gen.kill()
        if gen is not self._gen:
            return
        self._gen = None
        self._ready.clear()
        codes = [p.exitcode for p in gen.procs]
        self._fail_all(EngineError(ErrorKind.WORKER_DIED, f"the inference worker died (exit codes {codes}); it is being restarted"))
        if self._stopping:
            return
        logger.error("replica %d: worker died (exit codes %s); restarting, its sessions start fresh", self.replica, codes)
        self._begin_restart()

    def _forget(self, gen: _Generation) -> None:
        gen.dead = True
        loop = asyncio.get_running_loop()
        for proc in gen.procs:
            loop.remove_reader(proc.sentinel)
        for task in gen.tasks:
            task.cancel()

    def _begin_restart(self) -> None:
        self.restarts += 1
        self._state = "restarting"
        self._restarting = asyncio.ensure_future(self._restart())
        if self.on_restart is not None:
            self.on_restart(self)

    async def _restart(self) -> None:
        started = time.perf_counter()
        delay = 1.0
        # Warm-up exists to compile and capture; without either, a restart serves at once.
        warmup = self.config.engine.warmup and (self.config.engine.compile or self.config.engine.cuda_graphs)
        while not self._stopping:
            try:
                await self._launch(warmup=warmup)
                break
            except EngineError as exc:
                logger.error("replica %d: worker restart failed: %s; retrying in %.0f s", self.replica, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        self.last_restart_s = time.perf_counter() - started
        logger.info("replica %d: worker restarted in %.1f s (restart #%d)", self.replica, self.last_restart_s, self.restarts)

    async def _watch(self) -> None:
        """Progress watchdog and liveness pings, once a second."""
        last_ping = 0.0
        while not self._stopping:
            await asyncio.sleep(0.5)
            gen, now = self._gen, time.monotonic()
            if gen is None or gen.dead:
                continue
            if now - last_ping >= HEARTBEAT_INTERVAL_S:
                last_ping = now
                try:
                    self._write(gen, Ping(next(self._ids)))
                except (ConnectionError, RuntimeError):
                    pass
            running = next((p for p in self._pending.values() if p.started_at is not None), None)
            if running is not None and now - running.started_at > self.step_timeout_s:
                self._declare_stuck(gen, f"inference took longer than {self.step_timeout_s:.0f} s; the worker was restarted")
            elif self._pending and now - self._last_progress > self.step_timeout_s:
                self._declare_stuck(gen, f"the inference worker made no progress for {self.step_timeout_s:.0f} s; it was restarted")

    def _declare_stuck(self, gen: _Generation, message: str) -> None:
        """Kill a stuck worker. The request it is stuck on (or, if none started, every waiting one)
        gets ``message``; requests queued behind a running one learn that the worker restarted."""
        logger.error("replica %d: worker stuck (%s); killing pids %s", self.replica, message, gen.pids)
        self._state = "stuck"
        running = [rid for rid, p in self._pending.items() if p.started_at is not None]
        for request_id in running or [rid for rid, p in self._pending.items() if p.infer]:
            self._settle(request_id, EngineError(ErrorKind.TIMEOUT, message))
        self._on_exit(gen)


async def _read_message(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def _start_all(procs: list[Any]) -> None:
    for proc in procs:
        proc.start()


def _join_all(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(timeout=10)


# ------------------------------------------------------------------------------ in-process


class InprocClient:
    """An engine in this process, served by one thread so the event loop never runs model code.

    A stuck step cannot be killed in-process (use :class:`ProcessClient` for that): ``state`` says
    ``stuck`` once a step has run past ``step_timeout_s``, and whoever hosts the engine decides
    (a Ray replica fails its health check and is replaced).
    """

    def __init__(self, engine: Any, *, replica: int = 0, devices: list[str] | None = None, step_timeout_s: float | None = None) -> None:
        self.engine = engine
        self.replica = replica
        self.devices = devices or ["in-process"]
        self.step_timeout_s = step_timeout_s
        self.busy_since: float | None = None  # when the step in progress began
        self.info: PolicyInfo | None = engine.policy.info
        self.stats: tuple[EngineStats, ...] = (engine.stats(),)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: EngineState = "starting"
        from ardiff_server.engine.core import RequestInbox  # noqa: PLC0415 - the engine module loads torch

        self._inbox = RequestInbox()

    @classmethod
    def from_config(cls, config, *, replica: int = 0) -> InprocClient:
        from ardiff_server.engine.core import build_engine  # noqa: PLC0415

        engine = build_engine(config)
        if config.engine.warmup:
            engine.warmup()
        return cls(engine, replica=replica, devices=[config.engine.device])

    @property
    def state(self) -> EngineState:
        if self._state == "ready":
            if self._thread is None or not self._thread.is_alive():
                return "stopped"
            busy = self.busy_since
            if busy is not None and self.step_timeout_s is not None and time.monotonic() - busy > self.step_timeout_s:
                return "stuck"
        return self._state

    def replicas(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(self.replica, self.devices, self.state, [os.getpid()], self.stats)]

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._serve, name="ardiff-engine", daemon=True)
        self._thread.start()
        self._state = "ready"

    async def stop(self, grace_s: float = 3.0) -> None:
        self._state = "stopped"
        self._inbox.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, grace_s)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down"))
                future.exception()
        self._pending.clear()

    def kill_now(self) -> None:
        pass  # nothing to kill: the engine is this process

    async def infer(self, session_id: str, observation: RobotObservation) -> InferReply:
        reply = await self._call(Infer(next(self._ids), session_id, observation))
        return dataclasses.replace(reply, replica=self.replica)

    async def release(self, session_id: str, reason: str) -> None:
        await self._call(Release(next(self._ids), session_id, reason))

    async def detach(self, session_id: str, why: Literal["switched", "disconnected"]) -> None:
        await self._call(Detach(next(self._ids), session_id, why))

    async def _call(self, request: Request) -> Any:
        if self._state != "ready":
            raise EngineError(ErrorKind.UNAVAILABLE, "the engine is not running")
        future = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = future
        self._inbox.put(request)
        reply = await future  # cancelled caller: _resolve finds the future done and drops the reply
        if isinstance(reply, ErrorReply):
            raise reply.error()
        return reply

    def _serve(self) -> None:
        while True:
            if self._inbox.empty() and self.engine.idle_work():  # recording: only while no request waits
                continue
            request, queued_ms = self._inbox.get()
            if isinstance(request, Shutdown):
                self.engine.close()
                return
            self.busy_since = time.monotonic()
            try:
                reply = self.engine.handle(request, queued_ms=queued_ms)
            finally:
                self.busy_since = None
            self._loop.call_soon_threadsafe(self._resolve, reply)

    def _resolve(self, reply: Reply) -> None:
        self.stats = reply.stats or self.stats
        future = self._pending.pop(reply.request_id, None)
        if future is not None and not future.done():
            future.set_result(reply)


# ------------------------------------------------------------------------------- replicas


class ReplicaSet:
    """Several engines behind one interface; a session stays on the replica that opened it.

    A new session goes to the replica with the fewest sessions placed on it, then the most free
    KV pages. A replica that dies restarts alone: only the sessions placed on it start over
    (their next reply says ``session.new``); the others never notice.
    """

    def __init__(self, clients: list[Any]) -> None:
        if not clients:
            raise ValueError("a ReplicaSet needs at least one engine")
        self.clients = clients
        self._placement: dict[str, int] = {}
        for client in clients:
            if isinstance(client, ProcessClient):
                client.on_restart = self._forget_replica

    @classmethod
    def from_config(cls, config) -> ReplicaSet:
        return cls([ProcessClient(config, replica=r, devices=devices) for r, devices in enumerate(config.engine.replica_device_lists())])

    @property
    def info(self) -> PolicyInfo | None:
        return next((c.info for c in self.clients if c.info is not None), None)

    @property
    def state(self) -> EngineState:
        states = [c.state for c in self.clients]
        if any(s == "ready" for s in states):
            return "ready"
        return next((s for s in ("stuck", "unresponsive", "restarting", "starting") if s in states), "stopped")

    def replicas(self) -> list[ReplicaStatus]:
        statuses = []
        for client in self.clients:
            for status in client.replicas():
                status.sessions_placed = sum(1 for r in self._placement.values() if r == client.replica)
                statuses.append(status)
        return statuses

    async def start(self) -> None:
        # One at a time: replicas loading a model at once would compete for the same disk and cores.
        for client in self.clients:
            await client.start()

    async def stop(self, grace_s: float = 3.0) -> None:
        await asyncio.gather(*(client.stop(grace_s) for client in self.clients))

    def kill_now(self) -> None:
        for client in self.clients:
            client.kill_now()

    async def infer(self, session_id: str, observation: RobotObservation) -> InferReply:
        index = self._placement.get(session_id)
        if index is None:
            index = self._place(session_id)
        return await self.clients[index].infer(session_id, observation)

    async def release(self, session_id: str, reason: str) -> None:
        index = self._placement.pop(session_id, None)
        if index is not None:
            await self.clients[index].release(session_id, reason)

    async def detach(self, session_id: str, why: Literal["switched", "disconnected"]) -> None:
        index = self._placement.get(session_id)
        if index is not None:
            await self.clients[index].detach(session_id, why)

    def _place(self, session_id: str) -> int:
        counts = [0] * len(self.clients)
        for index in self._placement.values():
            counts[index] += 1

        def load(i: int) -> tuple[int, int, int]:
            client = self.clients[i]
            usable = 0 if client.state == "ready" else 1  # prefer replicas that can serve now
            free = sum(s.kv_pages_free for s in client.stats) if client.stats else 0
            return (usable, counts[i], -free)

        index = min(range(len(self.clients)), key=load)
        self._placement[session_id] = index
        return index

    def _forget_replica(self, client: ProcessClient) -> None:
        """A replica restarted: its sessions are gone; new requests for them are placed afresh."""
        lost = [sid for sid, index in self._placement.items() if index == client.replica]
        for session_id in lost:
            del self._placement[session_id]
        if lost:
            logger.warning("replica %d restarted: %d session(s) start over", client.replica, len(lost))
