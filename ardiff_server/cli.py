"""``ardiff-serve`` / ``python -m ardiff_server``: load a config, start the engine, serve.

Everything that can be checked without a worker (config keys and types, API keys, devices, the
checkpoint and tokenizer directories, the listening address: bound here, served once the model is
up) is checked first, and a problem is one line with the fix, exit code 2, before any process is
spawned. This module does not import torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys

from ardiff_server import __version__
from ardiff_server.config import AppConfig, ConfigError, load_config, preflight
from ardiff_server.frontend.auth import ENV_VAR, gather_api_keys
from ardiff_server.frontend.signals import exit_on_second_signal, reload_on_hangup
from ardiff_server.net import ListenError, bind_listeners

LOOPBACK = ("127.0.0.1", "localhost", "::1")  # binds that no other machine reaches


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ardiff-serve",
        description="OpenPI-compatible websocket server for autoregressive video-diffusion robot policies.",
    )
    parser.add_argument("--config", default="tiny", help="config name in configs/ or a YAML path (default: tiny)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config value, e.g. --set engine.cfg_parallel_size=2 (repeatable)",
    )
    parser.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 to serve robots on the LAN)")
    parser.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[],
        help="require 'Authorization: Api-Key <key>' or 'Bearer <key>' (repeatable; visible in the "
        f"process list: prefer --api-key-file or {ENV_VAR})",
    )
    parser.add_argument("--api-key-file", help="file with one API key per line (# comments allowed)")
    parser.add_argument(
        "--tls-cert", metavar="FILE", help="serve wss:// and https:// with this PEM certificate chain (e.g. fullchain.pem; reloaded on SIGHUP)"
    )
    parser.add_argument("--tls-key", metavar="FILE", help="the certificate's PEM private key (e.g. privkey.pem; default: in --tls-cert)")
    parser.add_argument("--record", metavar="DIR", help="record every session under DIR (rollout.mp4, actions.npz, ...; needs .[viz])")
    parser.add_argument("--ray", action="store_true", help="deploy on Ray Serve instead (pip install -e '.[ray]'; docs/deploy.md)")
    parser.add_argument("--ray-address", help="a running Ray cluster (e.g. auto or ray://head:10001); default: start a local one")
    parser.add_argument("--debug", action="store_true", help="tracebacks in error frames, debug logs")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"ardiff-server {__version__}")
    argv = sys.argv[1:] if argv is None else list(argv)
    spaced = _set_without_equals(argv)
    if spaced is not None:  # argparse would print its usage text for the value left over
        parser.exit(2, f"ardiff-serve: --set takes KEY=VALUE as one argument: write {spaced}\n")
    return parser.parse_args(argv)


def _set_without_equals(argv: list[str]) -> str | None:
    """``--set key value`` (or ``--set key``) as it should have been written, else None."""
    for index, token in enumerate(argv[:-1]):
        key = argv[index + 1]
        if token == "--set" and "=" not in key and not key.startswith("-"):
            value = argv[index + 2] if index + 2 < len(argv) and not argv[index + 2].startswith("-") else "VALUE"
            return f"--set {key}={value}"
    return None


def build_config(args: argparse.Namespace) -> AppConfig:
    """The effective config: the file, then ``--set``, then the dedicated flags. Raises ConfigError."""
    flags: list[tuple[str, str]] = []  # (override, the flag as given): errors name the flag
    if args.host is not None:
        flags.append((f"server.host={args.host}", f"--host {args.host}"))
    if args.port is not None:
        flags.append((f"server.port={args.port}", f"--port {args.port}"))
    if args.debug:
        flags.append(("server.debug=true", "--debug"))
    if args.ray_address:
        flags.append((f"ray.address={args.ray_address}", f"--ray-address {args.ray_address}"))
    if args.record:
        flags.append((f"server.record_dir={args.record}", f"--record {args.record}"))
    for option, path in (("tls_cert", args.tls_cert), ("tls_key", args.tls_key)):
        if path is not None:  # quoted: a path is never parsed as YAML
            flags.append((f"server.{option}={json.dumps(path)}", f"--{option.replace('_', '-')} {path}"))
    config = load_config(args.config, args.overrides, flags=flags)
    try:
        extra_keys = gather_api_keys(args.api_keys, args.api_key_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if extra_keys:
        try:
            config.server.api_keys = [*config.server.api_keys, *extra_keys]
        except ValueError as exc:  # pydantic: an empty or whitespace key
            raise ConfigError(f"API keys: {_first_error(exc)}") from None
    preflight(config, local=not args.ray)  # under Ray the engines run on the cluster's nodes
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = logging.DEBUG if args.debug else getattr(logging, args.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # websockets logs two INFO lines per plain HTTP request: every /healthz probe would spam the
    # log (and cost the event loop). Connections are logged by the service instead.
    logging.getLogger("websockets").setLevel(logging.INFO if args.debug else max(level, logging.WARNING))
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"ardiff-serve: {exc}", file=sys.stderr)
        return 2
    if args.ray:
        from ardiff_server.ray.run import run_ray

        return run_ray(config)
    try:  # before the model loads (minutes for the 14B): a port in use is one line now, not after
        sockets = bind_listeners(config.server.host, config.server.port)
    except ListenError as exc:
        print(f"ardiff-serve: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(config, sockets))
    except KeyboardInterrupt:
        pass
    except ListenError as exc:  # the port was taken while the model loaded; the engine is stopped
        print(f"ardiff-serve: {exc}", file=sys.stderr)
        return 2
    return 0


async def _serve(config: AppConfig, sockets: list[socket.socket] | None = None) -> None:
    from ardiff_server.engine.messages import EngineError
    from ardiff_server.frontend.server import PolicyServer

    log = logging.getLogger("ardiff_server")
    server = PolicyServer(config, listen_sockets=sockets)
    stop = asyncio.Event()
    exit_on_second_signal(stop.set, kill=server.engine.kill_now, loop=asyncio.get_running_loop())
    reload_on_hangup(server.tls.reload if server.tls is not None else None, loop=asyncio.get_running_loop())
    log.info("loading %s (policy %s) on %s ...", config.source, config.policy_name, config.engine.device)
    start = asyncio.ensure_future(server.start())
    await asyncio.wait([start, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # a signal during start-up
        start.cancel()
        await server.stop()
        return
    try:
        start.result()
    except EngineError as exc:
        log.error("%s", exc)
        await server.stop()
        raise SystemExit(1) from None
    except ListenError:
        await server.stop()  # the workers and their shared memory go first
        raise
    keys = f", {len(config.server.api_keys)} API key(s) required" if config.server.api_keys else ""
    print(f"listening on {config.server.scheme}://{config.server.host}:{server.port}{keys}", flush=True)
    if config.server.api_keys and config.server.tls_cert is None and config.server.host not in LOOPBACK:
        log.warning("API keys and camera images travel in clear text on %s: add --tls-cert/--tls-key (README, On the internet)", config.server.host)
    await stop.wait()
    log.info("shutting down")
    await server.stop()


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(str(e.get("msg", e)) for e in errors())
    return str(exc)
