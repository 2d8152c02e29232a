"""An engine in this process, as an :class:`~ardiff_server.engine.client.EngineClient`.

The engine is served by one thread running the same serving loop as the worker (``loop.py``: the
engine's scheduler decides, control requests first, inference in batches), so the event loop
never runs model code. Used by tests, scripts and Ray model replicas (which are processes already).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time
from typing import Any

from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.client import EngineState, ReplicaStatus
from ardiff_server.engine.loop import serve
from ardiff_server.engine.messages import (
    Detach,
    DetachReason,
    End,
    EngineError,
    EngineStats,
    ErrorKind,
    ErrorReply,
    Infer,
    InferReply,
    Reply,
    Request,
    Shutdown,
)


class InprocClient:
    """A stuck step cannot be killed in-process (use :class:`ProcessClient` for that): ``state``
    says ``stuck`` once a step has run past ``step_timeout_s``, and whoever hosts the engine
    decides (a Ray replica fails its health check and is replaced)."""

    def __init__(self, engine: Any, *, replica: int = 0, devices: list[str] | None = None, step_timeout_s: float | None = None) -> None:
        self.engine = engine
        self.replica = replica
        self.devices = devices or ["in-process"]
        self.step_timeout_s = step_timeout_s
        self.busy_since: float | None = None  # when the step in progress began
        self.busy_members = 1  # sessions in it: a batched step gets each member's own step_timeout_s
        self.info: PolicyInfo | None = engine.policy.info
        self.stats: tuple[EngineStats, ...] = (engine.stats(),)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: EngineState = "starting"

    @property
    def state(self) -> EngineState:
        if self._state == "ready":
            if self._thread is None or not self._thread.is_alive():
                return "stopped"
            busy, members = self.busy_since, self.busy_members
            if busy is not None and self.step_timeout_s is not None and time.monotonic() - busy > self.step_timeout_s * members:
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
        self.engine.scheduler.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, grace_s)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down"))
                future.exception()
        self._pending.clear()

    def kill_now(self) -> None:
        pass  # nothing to kill: the engine is this process

    async def infer(self, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        reply = await self._call(Infer(next(self._ids), session_id, observation, deadline))
        return dataclasses.replace(reply, replica=self.replica)

    async def end(self, session_id: str, reason: str) -> None:
        await self._call(End(next(self._ids), session_id, reason))

    async def detach(self, session_id: str, reason: DetachReason) -> None:
        await self._call(Detach(next(self._ids), session_id, reason))

    async def _call(self, request: Request) -> Any:
        if self._state != "ready":
            raise EngineError(ErrorKind.UNAVAILABLE, "the engine is not running")
        future = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = future
        self.engine.scheduler.put(request)
        reply = await future  # cancelled caller: _resolve finds the future done and drops the reply
        if isinstance(reply, ErrorReply):
            raise reply.error()
        return reply

    def _serve(self) -> None:
        try:
            serve(self.engine, lambda reply: self._loop.call_soon_threadsafe(self._resolve, reply), running=self._running)
        finally:
            self.engine.close()

    def _running(self, request_ids: tuple[int, ...] | None) -> None:
        if request_ids is None:
            self.busy_since = None
        else:
            self.busy_since, self.busy_members = time.monotonic(), max(1, len(request_ids))

    def _resolve(self, reply: Reply) -> None:
        self.stats = reply.stats or self.stats
        future = self._pending.pop(reply.request_id, None)
        if future is not None and not future.done():
            future.set_result(reply)
