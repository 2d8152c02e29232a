"""The websocket front end: the policy service (``service.py``) on one port with the ``websockets`` library.

This process never runs model code and never loads torch: observations are decoded here and
handed to the engine (``engine/client.py``). What is specific to this transport lives here:
TLS (``tls.py``), the handshake (routes, API keys, connection limits), per-connection write and
idle bounds, and shutdown that answers in-flight requests before it closes connections.
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from ardiff_server import __version__
from ardiff_server.config import AppConfig
from ardiff_server.engine.client import EngineClient
from ardiff_server.engine.replicas import ReplicaSet
from ardiff_server.frontend.service import Accept, PolicyService, TransportClosed
from ardiff_server.frontend.tls import ServerTls
from ardiff_server.net import listen_error

logger = logging.getLogger(__name__)


class BoundedConnection(ServerConnection):
    """A connection whose unsent bytes are bounded.

    websockets answers every ping with a pong on its own. A client that sends pings and never
    reads makes those pongs pile up in the transport's buffer without limit; past
    ``write_limit_bytes`` the connection is dropped instead (one log line)."""

    write_limit_bytes = 16 * 2**20
    on_abuse = None  # set per server: counts the close in /metrics

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        buffered = self.transport.get_write_buffer_size()
        if buffered > self.write_limit_bytes and not self.transport.is_closing():
            logger.warning("closing %s: %d unsent bytes (client is not reading)", self.remote_address, buffered)
            if self.on_abuse is not None:
                self.on_abuse()
            self.transport.abort()


class _WebsocketTransport:
    def __init__(self, ws: ServerConnection) -> None:
        self.ws = ws

    async def send(self, frame: bytes | str) -> None:
        try:
            await self.ws.send(frame)
        except ConnectionClosed:
            raise TransportClosed from None

    async def recv(self) -> bytes | str:
        try:
            return await self.ws.recv()
        except ConnectionClosed:
            raise TransportClosed from None

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason)


class PolicyServer:
    def __init__(self, config: AppConfig, client: EngineClient | None = None, listen_sockets: list[socket.socket] | None = None) -> None:
        """``listen_sockets``: ``net.bind_listeners``' sockets for ``server.host``/``port``, bound
        before the engine starts (``cli.py``); None binds when :meth:`start` listens."""
        self.config = config
        self._listen_sockets = listen_sockets or []
        self.engine = client if client is not None else ReplicaSet.from_config(config)
        self.service = PolicyService(config, self.engine)
        self.metrics = self.service.metrics
        self.tls = self._tls(config.server.tls_cert, config.server.tls_key)
        self._server: Server | None = None

    def _tls(self, cert: str | None, key: str | None) -> ServerTls | None:
        if cert is None:
            return None
        self.metrics.watch_tls()
        return ServerTls(
            cert,
            key,
            on_failure=lambda kind: self.metrics.tls_handshake_failures.labels(kind).inc(),
            on_reload=lambda ok: self.metrics.tls_reloads.labels("ok" if ok else "failed").inc(),
        )

    @property
    def sessions(self):
        return self.service.sessions

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine (model load + warm-up), then listen. Raises ``net.ListenError`` (one
        line) when the address cannot be listened on."""
        await self.engine.start()
        server_config = self.config.server
        # One socket is served as bound (port 0 stays the port bound); a host with several addresses
        # (localhost: 127.0.0.1 and ::1) was only probed, and asyncio binds them all again.
        where = {"sock": self._listen_sockets[0]} if len(self._listen_sockets) == 1 else {"host": server_config.host, "port": server_config.port}
        if len(self._listen_sockets) != 1:
            self._close_listen_sockets()
        connection_class = type(
            "Connection",
            (BoundedConnection,),
            {
                "write_limit_bytes": server_config.write_limit_bytes,
                "on_abuse": staticmethod(lambda: self.metrics.closed.labels("write_limit").inc()),
            },
        )
        tls = {"ssl": self.tls.context, "ssl_handshake_timeout": server_config.tls_handshake_timeout_s} if self.tls else {}
        try:
            self._server = await self._serve(connection_class, tls, **where)
        except OSError as exc:  # e.g. another server began listening on the port during the load
            self._close_listen_sockets()
            raise listen_error(server_config.host, server_config.port, exc) from None

    async def _serve(self, connection_class: type[BoundedConnection], tls: dict, **where) -> Server:
        server_config = self.config.server
        return await serve(
            self._handle,
            **where,
            process_request=self._process_request,
            create_connection=connection_class,
            # images are dense (send JPEG to shrink them); deflate burns event-loop CPU unless asked for
            compression="deflate" if server_config.compression == "deflate" else None,
            max_size=server_config.max_frame_bytes,
            # Clients send one request and wait for its reply: stop reading a connection that has
            # a second frame queued. The default (16) let one client that pipelines without
            # reading replies park ~17 x max_frame_bytes (1 GiB at 64 MiB) in this process.
            max_queue=1,
            write_limit=server_config.write_limit_bytes,
            ping_interval=server_config.ping_interval_s,
            ping_timeout=server_config.ping_timeout_s,
            server_header=f"ardiff-server/{__version__}",
            **tls,  # wss:// and https:// on the same port (frontend/tls.py)
        )

    def _close_listen_sockets(self) -> None:
        for sock in self._listen_sockets:
            sock.close()

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening; in-flight requests are answered with an error frame (the engine gets
        ``shutdown_grace_s`` to finish, then is killed); then every connection closes."""
        if self._server is not None:
            self._server.close(close_connections=False)  # stop accepting; open connections stay for now
        else:
            self._close_listen_sockets()  # the engine did not start: the port bound for it is free again
        await self.engine.stop(self.config.server.shutdown_grace_s)  # fails in-flight requests
        for _ in range(3):
            await asyncio.sleep(0)  # let the handlers send their error frames
        if self._server is not None:
            closing = [ws.close(1001, "server shutting down") for ws in list(self._server.connections)]
            await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), 5.0)
            await asyncio.wait_for(self._server.wait_closed(), 5.0)

    # -- HTTP ---------------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        remote = str(connection.remote_address)
        authorization = request.headers.get_all("Authorization")
        answer = self.service.http(request.path, authorization, remote)
        if isinstance(answer, Accept):
            connection.ardiff_key = answer.key
            return None  # a websocket handshake
        headers = Headers([("Content-Type", answer.content_type), ("Content-Length", str(len(answer.body)))])
        return Response(answer.status, http.HTTPStatus(answer.status).phrase, headers, answer.body)

    # -- websocket ------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        try:
            await self.service.serve_connection(_WebsocketTransport(ws), key=getattr(ws, "ardiff_key", None), remote=str(ws.remote_address))
        finally:
            _forget_parser_traceback(ws)


def _forget_parser_traceback(ws: ServerConnection) -> None:
    """A connection that ends without a close frame (a robot that dropped off) leaves websockets'
    ``protocol.parser_exc`` (EOFError) whose traceback holds the parser's frame: the last frame
    received (a whole request, up to max_frame_bytes) and the protocol, in a reference cycle.
    Only a full GC frees that, so until then every dropped connection kept its last request
    alive (0.5 MB for DROID). Cut the cycle now."""
    exc = getattr(ws.protocol, "parser_exc", None)
    if exc is not None:
        exc.__traceback__ = None
