"""The real PolicyServer in this process, its engine in-process too (no worker spawn): fast server
tests. The server runs its own event loop in a thread so synchronous clients can talk to it."""

from __future__ import annotations

import asyncio
import ssl
import threading
import urllib.request
from typing import Any

import numpy as np
from openpi_client import msgpack_numpy
from websockets.sync.client import connect

from ardiff_server.config import AppConfig, validate_config
from ardiff_server.engine.builder import build_engine
from ardiff_server.engine.inproc_client import InprocClient
from ardiff_server.frontend.server import PolicyServer

# A DROID request at the tiny policies' 48x80 views (blank frames, one per camera).
DROID = {
    "observation/exterior_image_0_left": np.zeros((48, 80, 3), np.uint8),
    "observation/exterior_image_1_left": np.zeros((48, 80, 3), np.uint8),
    "observation/wrist_image_left": np.zeros((48, 80, 3), np.uint8),
    "observation/joint_position": np.zeros(7),
    "observation/gripper_position": np.zeros(1),
    "prompt": "pick up the cup",
}
# A DreamZero policy section that serves in seconds on a CPU: the tiny checkpoint, 48x80 views, two denoising steps.
TINY_DREAMZERO = {"name": "dreamzero", "view_size": [48, 80], "image_resolution": [48, 80], "num_inference_steps": 2, "dit_step_cache": "off"}


def app_config(raw: dict[str, Any]) -> AppConfig:
    return validate_config({**raw, "server": {"port": 0, **raw.get("server", {})}}, source="<test>")


class InprocServer:
    def __init__(self, config: AppConfig | dict, engine=None, client_ssl: ssl.SSLContext | None = None) -> None:
        self.config = config if isinstance(config, AppConfig) else app_config(config)
        self.client_ssl = client_ssl  # what http() trusts when the server has server.tls_cert
        self.engine = engine if engine is not None else build_engine(self.config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="inproc-server", daemon=True)
        self._thread.start()
        client = InprocClient(self.engine)
        self.server = PolicyServer(self.config, client=client)
        self._call(self.server.start())

    def _call(self, coroutine, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"{self.config.server.scheme}://127.0.0.1:{self.port}"

    def http(self, path: str, headers: dict | None = None) -> tuple[int, str]:
        scheme = "https" if self.config.server.scheme == "wss" else "http"
        request = urllib.request.Request(f"{scheme}://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.client_ssl) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def exchange(self, requests: list[dict]) -> list:
        """Each request's reply on one connection: the unpacked reply, or the text of an error frame."""
        out = []
        with connect(self.url, max_size=None) as ws:
            ws.recv()  # the metadata frame
            for request in requests:
                ws.send(msgpack_numpy.packb(request))
                reply = ws.recv()
                out.append(reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply))
        return out

    def close(self) -> None:
        self._call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def __enter__(self) -> InprocServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
