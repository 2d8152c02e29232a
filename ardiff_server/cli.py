"""``ardiff-serve`` / ``python -m ardiff_server``: load a config, start the worker, serve."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from ardiff_server import __version__
from ardiff_server.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ardiff-serve",
        description="OpenPI-compatible websocket server for autoregressive video-diffusion robot policies.",
    )
    parser.add_argument("--config", default="tiny", help="config name in configs/ or a YAML path (default: tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config value, e.g. --set engine.cfg_parallel_size=2 (repeatable)")  # fmt: skip
    parser.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 to serve robots on the LAN)")
    parser.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--api-key", dest="api_keys", action="append", default=[],
                        help="require 'Authorization: Api-Key <key>' (repeatable)")  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="tracebacks in error frames, debug logs")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"ardiff-server {__version__}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = logging.DEBUG if args.debug else getattr(logging, args.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    if args.host is not None:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    if args.debug:
        overrides.append("server.debug=true")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"ardiff-serve: {exc}", file=sys.stderr)
        return 2
    if args.api_keys:
        config.server.api_keys = [*config.server.api_keys, *args.api_keys]
    try:
        asyncio.run(_serve(config))
    except KeyboardInterrupt:
        pass
    return 0


async def _serve(config) -> None:
    from ardiff_server.server import PolicyServer
    from ardiff_server.worker import WorkerStartError

    log = logging.getLogger("ardiff_server")
    server = PolicyServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("loading %s (policy %s) on %s ...", config.source, config.policy_name, config.engine.device)
    try:
        await server.start()
    except WorkerStartError as exc:
        log.error("%s", exc)
        raise SystemExit(1) from None
    keys = f", {len(config.server.api_keys)} API key(s) required" if config.server.api_keys else ""
    print(f"listening on ws://{config.server.host}:{server.port}{keys}", flush=True)
    await stop.wait()
    log.info("shutting down")
    await server.stop()
