"""The ingress deployment: the OpenPI websocket and HTTP routes, served by the standalone server's own code.

One replica, a FastAPI app behind Serve's HTTP proxy: the websocket on every path that
:class:`~ardiff_server.frontend.service.PolicyService` accepts (``/``,
``/v1/realtime/robot/openpi``) and its HTTP routes (``/healthz``, ``/metrics``, ``/info``). The
protocol, decoding, session table and error frames are the standalone server's; only the
transport (Starlette's WebSocket instead of ``websockets``) and the engine client
(:class:`~ardiff_server.ray.client.RayEngineClient`) differ. The ingress process never loads torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ardiff_server.config import validate_config
from ardiff_server.ray.client import RayEngineClient
from ardiff_server.ray.plan import ROUTING_STATS_PERIOD_S
from ardiff_server.ray.replica import setup_logging

logger = logging.getLogger(__name__)


class StarletteTransport:
    """A Starlette (FastAPI) WebSocket as :class:`~ardiff_server.frontend.service.Transport`."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, frame: bytes | str) -> None:
        from ardiff_server.frontend.service import TransportClosed  # noqa: PLC0415

        try:
            if isinstance(frame, str):
                await self.ws.send_text(frame)
            else:
                await self.ws.send_bytes(frame)
        except Exception as exc:  # the client went away (Starlette, uvicorn and Serve raise different ones)
            logger.debug("send failed: %r", exc)
            raise TransportClosed from None

    async def recv(self) -> bytes | str:
        from ardiff_server.frontend.service import TransportClosed  # noqa: PLC0415

        try:
            message = await self.ws.receive()
        except Exception:  # receive after a disconnect
            raise TransportClosed from None
        if message["type"] == "websocket.disconnect":
            raise TransportClosed
        data = message.get("bytes")
        return data if data is not None else (message.get("text") or "")

    async def close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):  # already closed
            await self.ws.close(code, reason)


class IngressCore:
    """The ingress deployment's state and handlers (routes are bound in :func:`build_app`)."""

    def __init__(
        self, model: Any, raw_config: dict[str, Any], expected_replicas: int, log_level: int = logging.INFO, most_replicas: int | None = None
    ) -> None:
        from ardiff_server.frontend.service import PolicyService  # noqa: PLC0415

        setup_logging(log_level)
        self.config = validate_config(raw_config, source=raw_config.get("source", "<config>"))
        self.engine = RayEngineClient(model, app_name=self.config.ray.app_name, expected_replicas=expected_replicas)
        self.service = PolicyService(self.config, self.engine, replicas=most_replicas)  # fair shares: of ray.num_replicas, not engine.replicas
        self._start: asyncio.Future | None = None
        try:
            asyncio.get_running_loop()
            self._start = asyncio.ensure_future(self.engine.start())  # Serve runs constructors on the replica's loop
        except RuntimeError:
            pass

    async def started(self) -> None:
        if self._start is None:
            self._start = asyncio.ensure_future(self.engine.start())
        await asyncio.shield(self._start)

    async def ready(self) -> dict[str, Any]:
        """For ``run_ray``: returns once a model replica answered."""
        await self.started()
        await self.engine.wait_described(self.engine.expected_replicas, timeout_s=10 * ROUTING_STATS_PERIOD_S)
        return {"replicas": len(self.engine.replicas()), "model": self.engine.info.model if self.engine.info else None}

    async def serve_websocket(self, ws: Any) -> None:
        from starlette.responses import Response  # noqa: PLC0415

        from ardiff_server.frontend.service import Accept, HttpResponse  # noqa: PLC0415

        remote = _remote(ws.client)
        answer = self.service.http(ws.url.path, ws.headers.getlist("authorization"), remote)
        if isinstance(answer, Accept) and self.engine.info is None:
            answer = HttpResponse(503, b"starting: the model replicas are loading\n")
        if not isinstance(answer, Accept):
            response = Response(answer.body, answer.status, headers={"content-type": answer.content_type})
            try:
                await ws.send_denial_response(response)
            except Exception:  # the server lacks the denial-response extension: a bare close
                await ws.close(1008 if answer.status in (401, 403) else 1013)
            return
        await ws.accept()
        await self.service.serve_connection(StarletteTransport(ws), key=answer.key, remote=remote)

    async def serve_http(self, request: Any) -> Any:
        from starlette.responses import Response  # noqa: PLC0415

        from ardiff_server.frontend.service import Accept  # noqa: PLC0415

        answer = self.service.http(request.url.path, request.headers.getlist("authorization"), _remote(request.client))
        if isinstance(answer, Accept):
            return Response(b"this is a websocket endpoint: connect with an openpi client\n", 426, headers={"upgrade": "websocket"})
        return Response(answer.body, answer.status, headers={"content-type": answer.content_type})


def _remote(client: Any) -> str:
    return f"{client.host}:{client.port}" if client is not None else "?"


def ingress_asgi_app() -> Any:
    """The ingress's FastAPI app, built in the ingress replica: one websocket route and one HTTP
    route for every path, both handed to :class:`PolicyService` (which answers unknown paths 404)."""
    from fastapi import FastAPI, Request, WebSocket  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    def core() -> IngressCore:
        return serve.get_replica_context().servable_object

    async def websocket(ws, path):
        await core().serve_websocket(ws)

    async def http(request, path):
        return await core().serve_http(request)

    # FastAPI reads parameter types when a route is added; postponed annotations could not
    # resolve these local names, so they are given as objects.
    websocket.__annotations__ = {"ws": WebSocket, "path": str, "return": None}
    http.__annotations__ = {"request": Request, "path": str}
    app.add_api_websocket_route("/{path:path}", websocket)
    app.add_api_route("/{path:path}", http, methods=["GET", "HEAD"])
    return app
