"""Serve's HTTP proxy, configured for robots: frame limit, no deflate, keepalive from the config.

``configure_proxy`` runs inside the proxy process (Serve imports it through
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``); ``proxy_environment`` is what must be in that
process's environment (set before Ray starts; see docs/deploy.md for ``ray start``).
"""

from __future__ import annotations

import os
from typing import Any

from ardiff_server.config import AppConfig

PROXY_CALLBACK = "ardiff_server.ray.proxy.configure_proxy"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
WS_MAX_SIZE_ENV = "ARDIFF_WS_MAX_SIZE"
WS_PING_INTERVAL_ENV = "ARDIFF_WS_PING_INTERVAL_S"
WS_PING_TIMEOUT_ENV = "ARDIFF_WS_PING_TIMEOUT_S"


def configure_proxy() -> list:
    """Runs inside Serve's HTTP proxy (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``) before its
    uvicorn server is built. Serve gives uvicorn no websocket frame limit, so uvicorn's 16 MiB
    default would refuse larger frames (close 1009) before the ingress sees them: raise it to
    ``server.max_frame_bytes``, turn off per-message deflate (images are dense) and take the
    keepalive from the config. Returns the (no) extra middlewares Serve asks for."""
    import uvicorn  # noqa: PLC0415 - only inside the proxy

    original = uvicorn.Config.__init__
    if getattr(original, "_ardiff", False):
        return []
    settings: dict[str, Any] = {"ws_max_size": int(os.environ.get(WS_MAX_SIZE_ENV, 64 * 2**20)), "ws_per_message_deflate": False}
    for env, key in ((WS_PING_INTERVAL_ENV, "ws_ping_interval"), (WS_PING_TIMEOUT_ENV, "ws_ping_timeout")):
        if env in os.environ:
            settings[key] = None if os.environ[env] in ("", "none") else float(os.environ[env])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for key, value in settings.items():
            kwargs.setdefault(key, value)
        original(self, *args, **kwargs)

    __init__._ardiff = True
    uvicorn.Config.__init__ = __init__
    return []


def proxy_environment(config: AppConfig) -> dict[str, str]:
    """Environment the Serve proxy needs (set before Ray starts; see docs/deploy.md)."""
    server = config.server
    return {
        PROXY_CALLBACK_ENV: PROXY_CALLBACK,
        WS_MAX_SIZE_ENV: str(server.max_frame_bytes + 4096),  # the frame header on top of the payload
        WS_PING_INTERVAL_ENV: "none" if server.ping_interval_s is None else str(server.ping_interval_s),
        WS_PING_TIMEOUT_ENV: "none" if server.ping_timeout_s is None else str(server.ping_timeout_s),
    }
