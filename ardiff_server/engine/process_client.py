"""An engine in worker process(es), as the front end's :class:`~ardiff_server.engine.client.EngineClient`.

This is where an observation leaves the front end: :meth:`ProcessClient.infer` copies its camera
arrays into shared memory (``shm.py``), frames an :class:`Infer` message onto the socket to the
worker (``channel.py``) and awaits the reply with the same request id.

Supervision: the client keeps one :class:`~ardiff_server.engine.worker_group.WorkerGroup` running.
A progress watchdog (the worker answers a ping every second with the step it is computing and
since when) declares the group stuck when a step runs past ``server.request_timeout_s`` (times the
sessions in it: a batch member's budget is its own compute, never its batch-mates'), fails
that request and restarts the group; the same pings tell ``/healthz`` when the process stopped
answering at all. A group that dies is restarted too; its sessions are gone (``on_restart``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.channel import read_message
from ardiff_server.engine.client import EngineState, ReplicaStatus, done_if_sessions_gone
from ardiff_server.engine.messages import (
    ControlReply,
    Detach,
    DetachReason,
    End,
    EngineError,
    EngineStats,
    ErrorKind,
    ErrorReply,
    Infer,
    InferReply,
    Ping,
    Pong,
    Reply,
    Request,
    Shutdown,
)
from ardiff_server.engine.shm import Allocation, SharedArena, create_arena
from ardiff_server.engine.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0  # a ping this often: liveness, and which step runs since when
HEARTBEAT_TIMEOUT_S = 10.0  # no pong for this long: /healthz says the worker is unresponsive


@dataclass
class _Pending:
    future: asyncio.Future
    allocations: list[Allocation] = field(default_factory=list)
    infer: bool = False
    started_at: float | None = None  # when the worker began its step


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
        self._group: WorkerGroup | None = None
        self._stopping_group: WorkerGroup | None = None  # the one stop() is waiting for
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
        return self._group.pids if self._group else []

    def replicas(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(self.replica, self.devices, self.state, self.pids, self.stats, self.restarts, self.last_restart_s)]

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        self._arena = create_arena(self.config.engine.shm_mib)
        await self._launch(warmup=self.config.engine.warmup)
        self._watchdog = asyncio.ensure_future(self._watch())

    async def _launch(self, *, warmup: bool) -> None:
        started = time.perf_counter()
        group, ready = await WorkerGroup.launch(
            self.raw_config,
            world_size=self.world_size,
            replica=self.replica,
            log_level=self.log_level,
            arena_name=self._arena.name if self._arena is not None else None,
            warmup=warmup,
            startup_timeout_s=self.config.engine.startup_timeout_s,
        )
        self._group = group
        self.info, self.stats, self.warmup_ms = ready.info, ready.stats, ready.warmup_ms
        self._last_progress = self._last_pong = time.monotonic()
        group.tasks.append(asyncio.ensure_future(self._read(group)))
        group.on_exit(self._on_exit)
        self._state = "ready"
        self._ready.set()
        logger.info(
            "replica %d: worker ready in %.1f s (pids %s, devices %s)",
            self.replica,
            time.perf_counter() - started,
            group.pids,
            self.devices,
        )

    async def stop(self, grace_s: float = 3.0) -> None:
        """Ask the worker to finish, kill it after ``grace_s``; pending requests fail at once."""
        self._stopping = True
        self._state = "stopped"
        if self._watchdog is not None:
            self._watchdog.cancel()
        group, self._group = self._group, None
        self._stopping_group = group
        self._fail_all(EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down"))
        if group is not None:
            await group.stop(Shutdown(), grace_s)
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def kill_now(self) -> None:
        for group in (self._group, self._stopping_group):
            if group is not None:
                group.kill()
        if self._arena is not None:
            self._arena.close()  # unlink: nothing else will

    # -- requests -----------------------------------------------------------------------

    async def infer(self, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        request_id = next(self._ids)
        group = await self._ready_group()
        allocations: list[Allocation] = []
        if self._arena is not None:
            placed = self._arena.put(observation)
            if placed is not None:
                observation, allocations = placed
        reply = await self._call(group, Infer(request_id, session_id, observation, deadline), allocations, infer=True)
        return dataclasses.replace(reply, replica=self.replica)

    async def end(self, session_id: str, reason: str) -> None:
        await self._control(End(next(self._ids), session_id, reason))

    async def detach(self, session_id: str, reason: DetachReason) -> None:
        await self._control(Detach(next(self._ids), session_id, reason))

    async def _control(self, request: Request) -> None:
        """Control requests never kill a worker: a dead or restarting worker holds no sessions,
        so there is nothing left to end and the request is simply done."""
        if self._group is None or not self._ready.is_set():
            return
        with done_if_sessions_gone():
            await self._call(self._group, request, [], infer=False)

    async def _ready_group(self) -> WorkerGroup:
        if self._stopping:
            raise EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), self.config.engine.startup_timeout_s)
            except TimeoutError:
                raise EngineError(ErrorKind.UNAVAILABLE, "the inference worker is not running (restart in progress)") from None
        if self._group is None:
            raise EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        return self._group

    async def _call(self, group: WorkerGroup, request: Request, allocations: list[Allocation], *, infer: bool) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = _Pending(future, allocations, infer)
        try:
            group.send(request)
        except (ConnectionError, RuntimeError):
            self._settle(request.request_id, EngineError(ErrorKind.WORKER_DIED, "the inference worker died; it is being restarted"))
        # A cancelled caller (a shutting-down connection) cancels only this future: the request stays
        # pending, and its shared-memory allocation reserved, until the worker answers or dies.
        # (No asyncio.shield: it costs two extra event-loop turns on every reply.)
        reply = await future
        if isinstance(reply, ErrorReply):
            raise reply.error()
        return reply

    # -- worker messages ----------------------------------------------------------------

    async def _read(self, group: WorkerGroup) -> None:
        try:
            while True:
                self._dispatch(await read_message(group.reader))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self._on_exit(group)
        except asyncio.CancelledError:
            pass

    def _dispatch(self, message: Any) -> None:
        now = time.monotonic()
        self._last_pong = now  # any message proves the process is alive
        if isinstance(message, Pong):
            for request_id in message.running:  # one step, or one batch
                pending = self._pending.get(request_id)
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

    def _on_exit(self, group: WorkerGroup) -> None:
        """A worker process exited or its socket closed."""
        if group.dead:
            return
        group.forget()
        group.kill()
        if group is not self._group:
            return
        self._group = None
        self._ready.clear()
        self.stats = ()  # its sessions are gone: they count for no key, metric or capacity while it restarts
        codes = group.exit_codes
        self._fail_all(EngineError(ErrorKind.WORKER_DIED, f"the inference worker died (exit codes {codes}); it is being restarted"))
        if self._stopping:
            return
        logger.error("replica %d: worker died (exit codes %s); restarting, its sessions start fresh", self.replica, codes)
        self._begin_restart(group)

    def _begin_restart(self, dead: WorkerGroup) -> None:
        self.restarts += 1
        self._state = "restarting"
        self._restarting = asyncio.ensure_future(self._restart(dead))
        if self.on_restart is not None:
            self.on_restart(self)

    async def _restart(self, dead: WorkerGroup) -> None:
        started = time.perf_counter()
        await dead.reap()  # the old processes are gone (and their GPU memory free) before new ones start
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
            group, now = self._group, time.monotonic()
            if group is None or group.dead:
                continue
            if now - last_ping >= HEARTBEAT_INTERVAL_S:
                last_ping = now
                try:
                    group.send(Ping(next(self._ids)))
                except (ConnectionError, RuntimeError):
                    pass
            running = [p.started_at for p in self._pending.values() if p.started_at is not None]
            limit = self.step_timeout_s * max(1, len(running))  # a batched step: each member's own budget
            if running and now - min(running) > limit:
                self._declare_stuck(group, f"inference took longer than {limit:.0f} s; the worker was restarted")
            elif not running and self._pending and now - self._last_progress > self.step_timeout_s:
                self._declare_stuck(group, f"the inference worker made no progress for {self.step_timeout_s:.0f} s; it was restarted")

    def _declare_stuck(self, group: WorkerGroup, message: str) -> None:
        """Kill a stuck worker. The request it is stuck on (or, if none started, every waiting one)
        gets ``message``; requests queued behind a running one learn that the worker restarted."""
        logger.error("replica %d: worker stuck (%s); killing pids %s", self.replica, message, group.pids)
        self._state = "stuck"
        running = [rid for rid, p in self._pending.items() if p.started_at is not None]
        for request_id in running or [rid for rid, p in self._pending.items() if p.infer]:
            self._settle(request_id, EngineError(ErrorKind.TIMEOUT, message))
        self._on_exit(group)
