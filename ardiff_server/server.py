"""The websocket front end: OpenPI protocol on one port, plus /healthz and /metrics.

Per connection: one binary metadata frame, then strictly one binary request frame -> one
binary reply frame. A bad request gets a one-line text frame naming the problem and the
connection stays open with the session untouched; an internal failure gets a text frame too
(tracebacks only with ``--debug``) and the failed session is torn down by the engine.

This loop never runs model code: observations are decoded here and handed to the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
import time
from typing import Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from ardiff_server import __version__
from ardiff_server.config import AppConfig
from ardiff_server.metrics import Metrics
from ardiff_server.observations import decode_request
from ardiff_server.protocol import DecodeLimits, ProtocolError, pack, unpack
from ardiff_server.sessions import SessionRegistry
from ardiff_server.worker import WorkerClient, WorkerDied, WorkerTimeout

logger = logging.getLogger(__name__)


class PolicyServer:
    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.limits = DecodeLimits(max_message_bytes=config.server.max_frame_bytes, max_array_bytes=config.server.max_frame_bytes)
        self.worker = WorkerClient(config, on_restart=self._on_worker_restart)
        self.sessions = SessionRegistry(ttl_s=config.server.session_ttl_s, release=self._release, detach=self._detach)
        self._server: Server | None = None
        self._connections = 0

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the worker (model load + warm-up), then listen."""
        await self.worker.start()
        self.metrics.update_engine(self.worker.stats)
        self.metrics.worker_up.set(1)
        server_cfg = self.config.server
        self._server = await serve(
            self._handle,
            server_cfg.host,
            server_cfg.port,
            process_request=self._process_request,
            compression=None,  # images are already dense; deflate would burn event-loop CPU
            max_size=server_cfg.max_frame_bytes,
            # Clients send one request and wait for its reply: stop reading a connection that has
            # a second frame queued. The default (16) let one client that pipelines without
            # reading replies park ~17 x max_frame_bytes (1 GiB at 64 MiB) in this process.
            max_queue=1,
            ping_interval=server_cfg.ping_interval_s,
            ping_timeout=server_cfg.ping_timeout_s,
            server_header=f"ardiff-server/{__version__}",
        )

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.worker.begin_shutdown()
        if self._server is not None:
            self._server.close()  # closes connections with 1001 (going away)
            await self._server.wait_closed()
        await self.worker.stop()
        self.metrics.worker_up.set(0)

    # -- HTTP ---------------------------------------------------------------------------

    def _authorized(self, headers: Headers) -> bool:
        keys = self.config.server.api_keys
        if not keys:
            return True
        scheme, _, token = (headers.get("Authorization") or "").partition(" ")
        return scheme == "Api-Key" and any(hmac.compare_digest(token, key) for key in keys)

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            if self.worker.ready:
                return connection.respond(http.HTTPStatus.OK, "OK\n")
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "worker starting\n")
        if not self._authorized(request.headers):
            logger.warning("refused %s: missing or wrong API key", connection.remote_address)
            return connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or invalid API key (Authorization: Api-Key <key>)\n")
        if path == "/metrics":
            body = self.metrics.render()
            headers = Headers([("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
            return Response(http.HTTPStatus.OK.value, "OK", headers, body)
        if self._connections >= self.config.server.max_connections:
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n")
        return None  # a websocket handshake

    # -- websocket ------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        conn = self.sessions.connect(remote=str(ws.remote_address))
        self._connections += 1
        self.metrics.connections.set(self._connections)
        logger.info("connection %d from %s", conn.conn_id, conn.remote)
        try:
            await ws.send(pack(self.worker.metadata))
            prev_total_ms: float | None = None
            async for frame in ws:
                started = time.perf_counter()
                reply = await self._serve_frame(conn, frame, prev_total_ms, started)
                await ws.send(reply)
                if isinstance(reply, bytes):
                    prev_total_ms = (time.perf_counter() - started) * 1000.0
        except ConnectionClosed:
            pass
        finally:
            _forget_parser_traceback(ws)
            self._connections -= 1
            self.metrics.connections.set(self._connections)
            await self.sessions.disconnect(conn)
            logger.info("connection %d closed after %d requests", conn.conn_id, conn.requests)

    async def _serve_frame(self, conn, frame: bytes | str, prev_total_ms: float | None, started: float) -> bytes | str:
        """One request frame -> one reply frame (binary reply, or a one-line text error)."""
        conn.requests += 1
        if isinstance(frame, str):
            self.metrics.requests.labels("bad_request").inc()
            return "bad request: expected a binary msgpack frame, got a text frame"
        try:
            request = decode_request(unpack(frame, self.limits))
        except ProtocolError as exc:
            self.metrics.requests.labels("bad_request").inc()
            logger.info("connection %d: bad request: %s", conn.conn_id, exc)
            return f"bad request: {exc}"

        if request.endpoint == "reset":
            session_id = request.session_id or conn.current or conn.default_session
            async with self.sessions.lock(session_id):
                await self.sessions.reset(conn, request.session_id)
            self.metrics.requests.labels("reset").inc()
            return pack({"status": "reset successful", "session_id": session_id})

        session_id = await self.sessions.resolve(conn, request.session_id)
        async with self.sessions.lock(session_id):
            queued = time.perf_counter()
            try:
                reply = await self.worker.request(
                    {"type": "infer", "session_id": session_id, "observation": request.observation},
                    timeout=self.config.server.request_timeout_s,
                )
            except WorkerTimeout as exc:
                self.metrics.requests.labels("timeout").inc()
                return f"internal error: {exc}"
            except WorkerDied as exc:
                self.metrics.requests.labels("worker_died").inc()
                return f"internal error: {exc}; session {session_id} starts over on the next request"
        self.metrics.update_engine(reply.get("stats", []))
        if not reply["ok"]:
            return self._error_frame(reply, session_id)

        total_ms = (time.perf_counter() - started) * 1000.0
        round_trip_ms = (time.perf_counter() - queued) * 1000.0
        self.metrics.requests.labels("ok").inc()
        self.metrics.infer_seconds.observe(reply["compute_ms"] / 1000.0)
        self.metrics.request_seconds.observe(total_ms / 1000.0)
        server_timing = {
            "infer_ms": reply["compute_ms"],
            "queue_ms": max(0.0, round_trip_ms - reply["compute_ms"]),  # waiting for the worker + IPC
        }
        if prev_total_ms is not None:
            server_timing["prev_total_ms"] = prev_total_ms
        logger.info(
            "session %s call %d: infer %.0f ms, queue %.0f ms, %s",
            session_id, reply["calls"], reply["compute_ms"], server_timing["queue_ms"],
            " ".join(f"{k}={v:.0f}" for k, v in reply["timing_ms"].items()),
        )  # fmt: skip
        response: dict[str, Any] = {
            "actions": np.asarray(reply["actions"], dtype=np.float32),
            "server_timing": server_timing,
            "policy_timing": reply["timing_ms"],
            "session": {"id": session_id, "new": reply["new_session"], "calls": reply["calls"], **_jsonable(reply["info"])},
        }
        return pack(response)

    def _error_frame(self, reply: dict, session_id: str) -> str:
        kind = reply.get("kind", "policy")
        if kind == "capacity":
            self.metrics.requests.labels("capacity").inc()
            return f"server at capacity: {reply['error']}"
        self.metrics.requests.labels("policy_error").inc()
        message = f"internal error: inference failed for session {session_id} ({reply['error']}); the session was reset"
        if self.config.server.debug and reply.get("traceback"):
            message += "\n" + reply["traceback"]
        return message

    # -- engine notifications -------------------------------------------------------------

    async def _release(self, session_id: str, reason: str) -> None:
        try:
            reply = await self.worker.request({"type": "release", "session_id": session_id, "reason": reason}, timeout=60)
            self.metrics.update_engine(reply.get("stats", []))
        except (WorkerDied, WorkerTimeout):
            pass  # a restarted worker holds no sessions

    async def _detach(self, session_id: str) -> None:
        try:
            await self.worker.request({"type": "detach", "session_id": session_id}, timeout=60)
        except (WorkerDied, WorkerTimeout):
            pass

    def _on_worker_restart(self) -> None:
        self.metrics.worker_restarts.inc()
        self.metrics.worker_up.set(0)
        self.sessions.forget_all()
        asyncio.ensure_future(self._when_ready())

    async def _when_ready(self) -> None:
        while not self.worker.ready:
            await asyncio.sleep(0.1)
        self.metrics.worker_up.set(1)
        self.metrics.update_engine(self.worker.stats)


def _forget_parser_traceback(ws: ServerConnection) -> None:
    """A connection that ends without a close frame (a robot that dropped off) leaves websockets'
    ``protocol.parser_exc`` (EOFError) whose traceback holds the parser's frame: the last frame
    received (a whole request, up to max_frame_bytes) and the protocol, in a reference cycle.
    Only a full GC frees that - rare with torch loaded - so until then every dropped connection
    kept its last request alive (0.5 MB for DROID). Cut the cycle now."""
    exc = getattr(ws.protocol, "parser_exc", None)
    if exc is not None:
        exc.__traceback__ = None


def _jsonable(info: dict) -> dict:
    return {k: v for k, v in info.items() if isinstance(v, (bool, int, float, str))}
