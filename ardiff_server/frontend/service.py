"""The policy service, independent of the transport.

One code path for the protocols and the session rules, shared by the websockets server
(``server.py``) and the Ray Serve ingress (``ray_serve.py``); only the transport differs.

Per connection: one binary metadata frame (exactly RoboArena's ``PolicyServerConfig``), then
strictly one binary request frame -> one reply frame. A frame is decoded by ``wire/decode.py`` into the
request of the protocol it speaks, and answered by that protocol's handler (``openpi.py``; ``openpi_batch.py`` for
OpenPI's ``{"batch": [...]}``; ``lingbot_va.py`` for a policy whose own protocol it is), all through ``replies.py``. A bad request gets a one-line text frame
naming the problem and the connection stays open with the session untouched; an internal
failure gets a text frame too (tracebacks only with ``--debug``) and the failed session is torn
down by the engine. HTTP: ``GET /healthz`` (no key needed), ``/metrics`` and ``/info``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ardiff_server import __version__
from ardiff_server.config import AppConfig
from ardiff_server.engine.client import EngineClient
from ardiff_server.frontend import continuations
from ardiff_server.frontend.auth import ApiKeys, Unauthorized
from ardiff_server.frontend.lingbot_va import LingBotVAHandler
from ardiff_server.frontend.metrics import Metrics
from ardiff_server.frontend.openpi import OpenPIHandler
from ardiff_server.frontend.openpi_batch import OpenPIBatchHandler
from ardiff_server.frontend.replies import Replies, RequestClock
from ardiff_server.frontend.sessions import Connection, KeyLimits, SessionForbidden, SessionTable
from ardiff_server.wire.decode import Request, decode_frame
from ardiff_server.wire.protocol import DecodeLimits, ProtocolError, pack

logger = logging.getLogger(__name__)

WEBSOCKET_PATHS = ("/", "/v1/realtime/robot/openpi")  # openpi/RoboArena/DreamZero; vLLM-Omni's example client


class Transport(Protocol):
    """One client connection as the service needs it."""

    async def send(self, frame: bytes | str) -> None: ...

    async def recv(self) -> bytes | str: ...  # raises TransportClosed when the client is gone

    async def close(self, code: int, reason: str) -> None: ...


class TransportClosed(Exception):
    pass


class Handler(Protocol):
    """One protocol's requests on a connection (``openpi.py``, ``lingbot_va.py``), answered through ``Replies``."""

    async def serve(self, conn: Connection, request: Any, clock: RequestClock) -> bytes | str: ...

    def forget(self, conn: Connection) -> None: ...  # the connection closed: drop what is kept for it


@dataclass(frozen=True)
class HttpResponse:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Accept:
    """A websocket handshake to accept, authenticated as ``key`` (None without API keys)."""

    key: str | None


class PolicyService:
    def __init__(self, config: AppConfig, engine: EngineClient, *, metrics: Metrics | None = None, replicas: int | None = None) -> None:
        self.config = config  # replicas: engine replicas behind it when not engine.replicas (Ray Serve's count)
        self.engine = engine
        self.metrics = metrics or Metrics(engine)
        self.keys = ApiKeys(config.server.api_keys)
        self.sessions = SessionTable(
            engine,
            ttl_s=config.server.session_ttl_s,
            on_refused=lambda key: self.metrics.key_refusals.labels(key, "sessions").inc(),
            limits=KeyLimits(
                config.sessions_per_key(replicas),
                shared=len(set(config.server.api_keys)) > 1,
                max_sessions=config.engine.max_sessions,
                fair_keys=len(set(config.server.api_keys)) if config.server.max_sessions_per_key == "fair" else 0,
            ),
        )
        self.connections_per_key = config.connections_per_key()
        self.key_connections: Counter[str] = Counter()  # open connections per key id
        if self.keys.enabled:
            key_ids = [f"key{i}" for i in range(len(config.server.api_keys))]
            self.metrics.watch_keys(key_ids, self.sessions.open_by_key, lambda: self.key_connections)
        self.limits = DecodeLimits(
            max_message_bytes=config.server.max_frame_bytes,
            max_array_bytes=config.server.max_frame_bytes,
            max_items=config.server.max_frame_items,
        )
        self.started = time.time()
        self.connections = 0
        self.replies = Replies(self.metrics, debug=config.server.debug)
        # by the ``protocol`` of the decoded request: OpenPI's, and a policy's own beside it (PolicyInfo.native_protocol)
        self.max_batch_elements = config.batch_elements(replicas)  # server.max_batch_elements
        openpi = OpenPIHandler(self.sessions, self.replies, reply_format=config.server.reply_format)
        self.handlers: dict[str, Handler] = {
            "openpi": openpi,
            "openpi_batch": OpenPIBatchHandler(self.sessions, self.replies, openpi),
            "lingbot_va": LingBotVAHandler(self.sessions, self.replies, engine),
        }
        self._closing: set[asyncio.Task] = set()

    # -- HTTP ---------------------------------------------------------------------------

    def authenticate(self, authorization: Sequence[str], remote: str) -> str | None:
        """The key id of a handshake, or raises Unauthorized (logged once, no traceback)."""
        try:
            return self.keys.check(authorization)
        except Unauthorized as exc:
            logger.warning("refused %s: %s", remote, exc)
            raise

    def http(self, path: str, authorization: Sequence[str], remote: str) -> HttpResponse | Accept:
        """The answer to a plain HTTP request, or :class:`Accept` for a websocket handshake."""
        path = path.split("?", 1)[0]
        if path == "/healthz":
            state = self.engine.state
            if state == "ready":
                return HttpResponse(200, b"OK\n")
            detail = "; ".join(f"replica {r.index}: {r.state}" for r in self.engine.replicas())
            return HttpResponse(503, f"unavailable ({state}): {detail}\n".encode())
        if path not in (*WEBSOCKET_PATHS, "/metrics", "/info"):
            return HttpResponse(404, f"not found: {path[:100]} (websocket on {', '.join(WEBSOCKET_PATHS)})\n".encode())
        try:
            key = self.authenticate(authorization, remote)
        except Unauthorized:
            return HttpResponse(401, b"missing or invalid API key (Authorization: Api-Key <key> or Bearer <key>)\n")
        if path == "/metrics":
            return HttpResponse(200, self.metrics.render(), self.metrics.content_type)
        if path == "/info":
            return HttpResponse(200, json.dumps(self.describe(), indent=2).encode() + b"\n", "application/json")
        if self.connections >= self.config.server.max_connections:
            return HttpResponse(503, b"too many connections\n")
        if (refused := self._over_connection_limit(key, remote)) is not None:
            return HttpResponse(503, refused.encode() + b"\n")
        return Accept(key)

    def _over_connection_limit(self, key: str | None, remote: str) -> str | None:
        """Why ``key`` may not open one more connection (``server.max_connections_per_key``), or None."""
        limit = self.connections_per_key
        if key is None or limit is None or self.key_connections[key] < limit:
            return None
        self.metrics.key_refusals.labels(key, "connections").inc()
        reason = f"too many connections for {key} ({self.key_connections[key]} open, server.max_connections_per_key: {limit})"
        logger.warning("refused %s: %s", remote, reason)
        return reason

    def _max_batch(self, info) -> int:
        """Sessions per forward: what the ready replicas report (the KV pool may cap it), else the config's rule."""
        reported = [r.stats[0].max_batch for r in self.engine.replicas() if r.stats and r.stats[0].max_batch]
        return min(reported) if reported else self.config.engine.batch_for(info.max_batch if info is not None else 1)

    def describe(self) -> dict[str, Any]:
        """``GET /info``: everything about this server a client or operator may want."""
        info = self.engine.info
        return {
            "server": {"name": "ardiff-server", "version": __version__, "uptime_s": round(time.time() - self.started, 1)},
            "websocket_paths": list(WEBSOCKET_PATHS),
            "batching": {
                "max_batch": self._max_batch(info),
                "engine_max_batch": self.config.engine.batch_limit,
                "policy_max_batch": info.max_batch if info is not None else None,
                "batch_wait_ms": self.config.engine.batch_wait_ms,
                "max_batch_elements": self.max_batch_elements,  # requests one {"batch": [...]} frame may carry
            },
            "policy": info.describe() if info is not None else None,
            "continuations": continuations.describe(self._continuation_refusal(info)) if info is not None else None,
            "replicas": [
                {
                    "index": r.index,
                    "devices": r.devices,
                    "state": r.state,
                    "pids": r.pids,
                    "restarts": r.restarts,
                    "sessions": r.stats[0].sessions if r.stats else 0,
                    "sessions_placed": r.sessions_placed,
                    "kv_pages_free": [s.kv_pages_free for s in r.stats],
                    "kv_pages_total": [s.kv_pages_total for s in r.stats],
                }
                for r in self.engine.replicas()
            ],
            "limits": {"max_sessions_per_key": self.sessions.sessions_per_key()[0], "max_connections_per_key": self.connections_per_key},
            "config": self.config.public(),
        }

    # -- websocket ------------------------------------------------------------------------

    async def serve_connection(self, transport: Transport, *, key: str | None, remote: str) -> None:
        if (refused := self._over_connection_limit(key, remote)) is not None:  # handshakes that raced the check in http()
            await transport.close(1013, refused)  # 1013: try again later
            return
        if key is not None:
            self.key_connections[key] += 1
        conn = self.sessions.connect(remote=remote, key=key)
        self.connections += 1
        self.metrics.connections.set(self.connections)
        logger.info("connection %d from %s", conn.conn_id, remote)
        idle = IdleTimer(self.config.server.idle_timeout_s, lambda: self._close_idle(conn, transport))
        try:
            await transport.send(pack(self.engine.info.server_config))
            prev_total_ms: float | None = None
            while True:
                idle.arm()
                frame = await transport.recv()
                idle.disarm()
                started = time.perf_counter()
                reply = await self.serve_frame(conn, frame, prev_total_ms, started)
                await transport.send(reply)
                if isinstance(reply, bytes):
                    prev_total_ms = (time.perf_counter() - started) * 1000.0
        except TransportClosed:
            pass
        finally:
            idle.disarm()
            if key is not None:
                self.key_connections[key] -= 1
            self.connections -= 1
            self.metrics.connections.set(self.connections)
            for handler in self.handlers.values():
                handler.forget(conn)
            await self.sessions.disconnect(conn)
            logger.info("connection %d closed after %d requests", conn.conn_id, conn.requests)

    def _close_idle(self, conn: Connection, transport: Transport) -> None:
        seconds = self.config.server.idle_timeout_s
        logger.info("connection %d: closing after %.0f s without a request", conn.conn_id, seconds)
        self.metrics.closed.labels("idle").inc()
        self._closing.add(task := asyncio.ensure_future(transport.close(1000, f"idle for {seconds:.0f} s without a request (server.idle_timeout_s)")))
        task.add_done_callback(self._closing.discard)

    async def serve_frame(self, conn: Connection, frame: bytes | str, prev_total_ms: float | None, started: float) -> bytes | str:
        """One request frame -> one reply frame (binary reply, or a one-line text error)."""
        conn.requests += 1
        if isinstance(frame, str):
            return self.replies.bad_request("expected a binary msgpack frame, got a text frame")
        try:
            # Off the event loop whatever the frame's size: a 690-byte JPEG may declare 4096x4096, so bytes say
            # nothing about the decode's cost (the pixel budget bounds it; other robots wait on no decode)
            request = await asyncio.to_thread(self._decode, frame)
        except ProtocolError as exc:
            logger.info("connection %d: bad request: %s", conn.conn_id, exc)
            return self.replies.bad_request(str(exc))
        try:
            return await self.handlers[request.protocol].serve(conn, request, RequestClock(started, prev_total_ms))
        except SessionForbidden as exc:
            logger.warning("connection %d: %s", conn.conn_id, exc)
            return self.replies.forbidden(str(exc))

    def _decode(self, frame: bytes) -> Request:
        """One request frame decoded (in a worker thread) under the served policy's rules (``wire/decode.py``)."""
        info = self.engine.info  # None before an engine is ready: RoboArena's DROID keys
        return decode_frame(
            frame,
            self.limits,
            info,
            max_request_pixels=self.config.server.max_request_pixels,
            continuation_refused=self._continuation_refusal(info),
            max_batch_elements=self.max_batch_elements,
        )

    def _continuation_refusal(self, info) -> str | None:
        return continuations.continuation_refusal(self.config.policy_name, info, self.config.server.reply_format)


class IdleTimer:
    """Closes a connection that sends no request for ``seconds`` (None: never). A timer re-armed
    per request, not a timeout around each receive: cancelling a receive per request would leave
    the connection's last exception (and the frame it references) in a reference cycle."""

    def __init__(self, seconds: float | None, on_idle) -> None:
        self.seconds = seconds
        self.on_idle = on_idle
        self._handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self.seconds is not None:
            self._handle = asyncio.get_running_loop().call_later(self.seconds, self.on_idle)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
