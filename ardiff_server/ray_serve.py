"""Deprecated import path (until 0.3): the Ray Serve deployment now lives in ``ardiff_server/ray/``.

Kept so that Serve configs written for 0.1 (KubeRay ``serveConfigV2`` with ``import_path:
ardiff_server.ray_serve:app_builder``, ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=
ardiff_server.ray_serve.configure_proxy``) keep working. New configs use
``ardiff_server.ray.run:app_builder`` and ``ardiff_server.ray.proxy.configure_proxy``.
"""

from ardiff_server.ray.proxy import configure_proxy
from ardiff_server.ray.run import app_builder

__all__ = ["app_builder", "configure_proxy"]
