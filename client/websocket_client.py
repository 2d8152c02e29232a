"""One websocket connection to a policy server, spoken the way the clients in the wild do (docs/spec.md §3).

Connect with openpi's client options (optional ``Authorization: Api-Key <key>``), read the metadata frame,
then strictly one request -> one reply. :class:`PolicyClient` is the connection; :class:`WebsocketPolicy`
wraps it as the ``infer(request) -> reply`` callable that ``ardiff_client.async_runner.AsyncChunkRunner``
runs in a thread. Torch-free: numpy, msgpack (through the codec) and websockets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from ardiff_client.records import ReplayError, ServerError, jsonable
from ardiff_server.wire.protocol import DecodeLimits, ProtocolError, pack, unpack

RESET_TIMEOUT_S = 10.0  # DreamZero's server may not answer a reset at all
# Replies come from the server we chose to talk to, not from an untrusted robot: decode them with
# room for large extras (debug arrays, predicted frames, long lists) the server-side limits refuse.
REPLY_LIMITS = DecodeLimits(max_message_bytes=1 << 30, max_array_bytes=1 << 30, max_list_len=1 << 20, max_map_len=1 << 16, max_items=1 << 22)
# DreamZero's client keepalive: its server may hold the event loop while it computes a chunk.
PING_INTERVAL_S, PING_TIMEOUT_S = 60.0, 600.0


def server_url(host: str, port: int, path: str) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6 literal
    return f"ws://{host}:{port}/{path.lstrip('/')}"


def _connect(url: str, api_key: str | None) -> ClientConnection:
    """Open the websocket with openpi's client options; handshake failures -> ReplayError."""
    headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
    try:
        return connect(
            url,
            compression=None,
            max_size=None,
            additional_headers=headers,
            ping_interval=PING_INTERVAL_S,
            ping_timeout=PING_TIMEOUT_S,
        )
    except InvalidStatus as exc:
        status = exc.response.status_code
        body = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
        raise ReplayError(f"{url} refused the connection: HTTP {status} {body}".rstrip()) from None
    except (OSError, InvalidHandshake, TimeoutError) as exc:
        raise ReplayError(f"cannot connect to {url}: {exc}") from None


@contextmanager
def open_client(url: str, api_key: str | None = None, timeout: float | None = None) -> Iterator[PolicyClient]:
    """Connect, read the metadata frame, and close the connection on exit."""
    with _connect(url, api_key) as ws:
        yield PolicyClient(ws, timeout)


class PolicyClient:
    """One websocket connection: the metadata frame, then strictly one request -> one reply."""

    def __init__(self, ws: ClientConnection, timeout: float | None = None) -> None:
        self.ws, self.timeout, self.in_flight = ws, timeout, False
        self.metadata = self._read_metadata()

    def _read_metadata(self) -> dict[str, Any]:
        metadata = decode_frame(self.ws.recv(self.timeout), "the metadata frame")
        if not isinstance(metadata, dict):
            raise ReplayError(f"metadata frame is a {type(metadata).__name__}, expected a map")
        return metadata

    def request(self, message: Mapping[str, Any], timeout: float | None = None) -> tuple[bytes | str, float]:
        """Send one request and wait for its reply; returns (reply frame, round trip ms)."""
        data = pack(dict(message))
        started = time.perf_counter()
        self.in_flight = True
        self.ws.send(data)
        reply = self.ws.recv(timeout if timeout is not None else self.timeout)
        self.in_flight = False
        return reply, (time.perf_counter() - started) * 1000.0


def decode_frame(frame: bytes | str, what: str) -> Any:
    """A server frame decoded; a text frame (the server's one-line error) raises ServerError."""
    if isinstance(frame, str):
        raise ServerError(f"{what}: server error: {frame}")
    try:
        return unpack(frame, REPLY_LIMITS)
    except ProtocolError as exc:
        raise ReplayError(f"{what}: cannot decode the frame: {exc}") from None


def infer(client: PolicyClient, request: Mapping[str, Any]) -> Any:
    """One infer request's decoded reply, a bare array wrapped as ``{"actions": array}`` (DreamZero's own server);
    anything else is left for the caller to name (``ardiff_client.chunk_reply``)."""
    reply, _ = client.request(request)
    decoded = decode_frame(reply, "infer")
    return {"actions": decoded} if isinstance(decoded, np.ndarray) else decoded


def reset_session(client: PolicyClient, session_id: str) -> Any:
    """End the episode's session; any answer is accepted (docs/spec.md §3: servers differ here)."""
    if client.in_flight:  # interrupted while waiting: the next frame would be the old reply
        return "(not sent: a request was still in flight; the server expires the session)"
    try:
        reply, _ = client.request({"endpoint": "reset", "session_id": session_id}, timeout=RESET_TIMEOUT_S)
    except TimeoutError:
        return f"(no reply within {RESET_TIMEOUT_S:.0f} s)"
    except ConnectionClosed:
        return "(the connection closed)"
    if isinstance(reply, str):
        return reply
    try:
        return jsonable(unpack(reply, REPLY_LIMITS))
    except ProtocolError:
        return f"(undecodable {len(reply)}-byte reply)"


class WebsocketPolicy:
    """``infer(request) -> reply`` over one websocket connection (the metadata frame read on connect)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float | None = None) -> None:
        self.url, self.api_key, self.timeout = url, api_key, timeout
        self._context = None
        self.client = None

    def __enter__(self) -> WebsocketPolicy:
        self._context = open_client(self.url, self.api_key, self.timeout)
        self.client = self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.client.metadata

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        return infer(self.client, request)

    def reset(self, session_id: str) -> None:
        reset_session(self.client, session_id)
