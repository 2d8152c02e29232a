"""``ardiff-serve --ray``: build the Serve application and run it until a signal.

Two deployments: ``Ingress`` (``ingress.py``) bound to ``EngineReplica`` (``replica.py``), the
latter routed by :class:`~ardiff_server.ray.router.SessionAffinityRouter`. ``app_builder`` is the
same application for declarative deployments (KubeRay, ``serve deploy``). Ray is imported lazily:
``run_ray`` says in one line how to install it when it is missing.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ardiff_server.config import AppConfig, ConfigError, check_tls
from ardiff_server.extras import install_hint
from ardiff_server.frontend.signals import exit_on_second_signal
from ardiff_server.net import free_port
from ardiff_server.ray.ingress import IngressCore, ingress_asgi_app
from ardiff_server.ray.plan import (
    HEALTH_CHECK_PERIOD_S,
    INGRESS_DEPLOYMENT,
    MODEL_DEPLOYMENT,
    ROUTING_STATS_PERIOD_S,
    DeploymentPlan,
    hub_environment,
    plan_deployment,
)
from ardiff_server.ray.proxy import proxy_environment
from ardiff_server.ray.replica import EngineReplica

MIN_RAY = (2, 56)  # DeploymentHandle.options(session_id=...) reaches request routers from 2.56 on
SIGHUP_IGNORED = "SIGHUP ignored under --ray: Serve's proxy loads the certificate once; redeploy to use a renewed one (docs/deploy.md)"


def build_app(config: AppConfig, plan: DeploymentPlan, *, log_level: int = logging.INFO) -> Any:
    """The Serve application: ``Ingress`` bound to the ``EngineReplica`` deployment."""
    from ray import serve  # noqa: PLC0415
    from ray.serve.config import RequestRouterConfig  # noqa: PLC0415

    raw = config.model_dump(mode="json")
    server = config.server
    idle = None if server.idle_timeout_s is None else server.idle_timeout_s + server.session_ttl_s + server.request_timeout_s + 60
    model = serve.deployment(EngineReplica, name=MODEL_DEPLOYMENT).options(
        **plan.model_options(hub_environment()),  # replicas resolve Hub ids with the driver's token, cache, offline mode
        request_router_config=RequestRouterConfig(
            request_router_class="ardiff_server.ray.router:SessionAffinityRouter",
            request_router_kwargs={"idle_ttl_s": idle},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=server.shutdown_grace_s + 2.0,
    )

    # The ASGI app is built inside the replica (a builder function): a FastAPI app does not
    # always pickle, and its routes reach this replica's IngressCore through Serve's context.
    ingress = serve.deployment(serve.ingress(ingress_asgi_app)(IngressCore), name=INGRESS_DEPLOYMENT).options(
        num_replicas=1,  # one session table and one router: a session's requests stay ordered and pinned
        max_ongoing_requests=server.max_connections + 32,  # every open websocket is one ongoing request
        ray_actor_options={"num_cpus": 0},  # asyncio and msgpack decoding; the models hold the CPUs/GPUs
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=server.shutdown_grace_s + 1.0,
    )
    expected = plan.initial_replicas if not plan.autoscaling else (plan.min_replicas or 0)
    return ingress.bind(model.bind(raw, log_level), raw, expected, log_level, plan.most_replicas)


def ray_version_problem() -> str | None:
    """Why the installed Ray cannot serve this application (one line), or None."""
    import inspect  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from ray.serve.handle import DeploymentHandle  # noqa: PLC0415

    if "session_id" in inspect.signature(DeploymentHandle.options).parameters:
        return None
    wanted = ".".join(map(str, MIN_RAY))
    return f"--ray needs Ray Serve >= {wanted} (session-aware request routing); this is Ray {ray.__version__}: pip install -U 'ray[serve]>={wanted}'"


def app_builder(args: dict[str, Any]) -> Any:
    """A Serve application builder for declarative deployments (KubeRay ``RayService``
    ``serveConfigV2``, ``serve run``/``serve deploy``): ``import_path:
    ardiff_server.ray.run:app_builder`` with ``args: {config: NAME_OR_PATH, set: [key=value,
    ...]}``. The HTTP host/port and the proxy's environment then come from that Serve config
    and the cluster (docs/deploy.md), not from ``server.host``/``server.port``."""
    from ardiff_server.config import load_config  # noqa: PLC0415

    problem = ray_version_problem()
    if problem is not None:
        raise RuntimeError(problem)
    config = load_config(args.get("config", "tiny"), [str(o) for o in args.get("set") or []])
    return build_app(config, plan_deployment(config))


def run_ray(config: AppConfig) -> int:
    """``ardiff-serve --ray``: deploy on Ray Serve, print the banner once a model replica
    answers, serve until SIGINT/SIGTERM, then take the application down. Returns the exit code."""
    try:
        import fastapi  # noqa: F401, PLC0415
        import ray  # noqa: PLC0415
        from ray import serve  # noqa: PLC0415
    except ImportError as exc:
        print(f"ardiff-serve: --ray needs Ray Serve ({exc.name or exc} is not installed): {install_hint('ray')}", file=sys.stderr)
        return 2
    problem = ray_version_problem()
    if problem is not None:
        print(f"ardiff-serve: {problem}", file=sys.stderr)
        return 2
    log = logging.getLogger("ardiff_server")
    try:
        plan = plan_deployment(config)
    except ConfigError as exc:
        print(f"ardiff-serve: {exc}", file=sys.stderr)
        return 2
    server = config.server
    port = server.port or free_port(server.host)
    local = config.ray.address in (None, "local")
    if local and server.tls_cert is not None:  # the proxy runs here: its files must load (else it would die quietly)
        try:
            check_tls(config)
        except ConfigError as exc:
            print(f"ardiff-serve: {exc}", file=sys.stderr)
            return 2
    environment = proxy_environment(config)
    os.environ.update(environment)  # a local cluster's proxy inherits it (see docs/deploy.md for `ray start`)
    init: dict[str, Any] = {"address": config.ray.address or "local", "log_to_driver": True}
    if local:
        needed = math.ceil(plan.num_cpus * (plan.max_replicas or plan.initial_replicas))
        init.update(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
    else:
        init["runtime_env"] = {"env_vars": environment}
    stop = threading.Event()
    try:
        ray.init(**init)
    except Exception as exc:
        hint = (
            "" if local else " (a cluster with token authentication needs RAY_AUTH_MODE=token and its token in ~/.ray/auth_token or RAY_AUTH_TOKEN)"
        )
        print(f"ardiff-serve: cannot start or reach the Ray cluster at {init['address']}: {exc}{hint}", file=sys.stderr)
        return 1
    exit_on_second_signal(stop.set)
    ignore_sighup(log)
    code = 1
    try:
        # Ray would keep a replica that no node can hold pending forever: refuse a GPU request the
        # cluster cannot meet (a local cluster cannot grow; a remote one may autoscale, but not from zero GPUs).
        gpus = float(ray.cluster_resources().get("GPU", 0))
        needed_gpus = plan.num_gpus * plan.initial_replicas if local else (plan.num_gpus if gpus == 0 else 0)
        if plan.num_gpus > 0 and gpus < needed_gpus:
            print(
                f"ardiff-serve: {plan.initial_replicas if local else 1} model replica(s) need {needed_gpus:g} GPU(s) "
                f"(ray.num_gpus={plan.num_gpus:g} each) and the Ray cluster has {gpus:g}; "
                "add GPU nodes, lower ray.num_replicas, or serve on CPU with --set engine.device=cpu",
                file=sys.stderr,
            )
            return 2
        log.info("deploying %s on Ray Serve (%s, %g GPU / %g CPU each) ...", config.source, plan.describe(), plan.num_gpus, plan.num_cpus)
        # One proxy, on the head node: the one URL robots and RoboArena use (docs/deploy.md).
        serve.start(proxy_location="HeadOnly", http_options=http_options(config, port))
        handle = _deploy(serve, build_app(config, plan, log_level=logging.getLogger().getEffectiveLevel()), config, stop)
        if handle is None:
            return 1 if not stop.is_set() else 0
        handle.ready.remote().result(timeout_s=config.engine.startup_timeout_s)
        keys = f", {len(server.api_keys)} API key(s) required" if server.api_keys else ""
        print(f"listening on {server.scheme}://{server.host}:{port} (Ray Serve, {plan.describe()}){keys}", flush=True)
        stop.wait()
        log.info("shutting down")
        code = 0
    except KeyboardInterrupt:
        code = 0
    except Exception as exc:
        log.error("Ray Serve deployment failed: %s", exc)
    finally:
        _shutdown(serve, ray, config, local, log)
    return code


def ignore_sighup(log: logging.Logger) -> None:
    """A certbot deploy hook's ``kill -HUP`` (README, "On the internet") must not take a Serve
    deployment down: its default action would end the driver without ``serve.shutdown()``."""
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: log.warning(SIGHUP_IGNORED))


def http_options(config: AppConfig, port: int) -> dict[str, Any]:
    """Serve's proxy options: the bind address and, with ``server.tls_cert``, TLS (its uvicorn loads
    the files; Python's defaults: TLS 1.2 or newer). A renewed certificate takes effect when the
    proxy restarts (docs/deploy.md)."""
    options: dict[str, Any] = {"host": config.server.host, "port": port}
    if config.server.tls_cert is not None:
        # Absolute and ~-expanded, as the start-up check read them (uvicorn takes paths as given).
        cert = str(Path(config.server.tls_cert).expanduser().resolve())
        key = str(Path(config.server.tls_key).expanduser().resolve()) if config.server.tls_key else cert
        options.update(ssl_certfile=cert, ssl_keyfile=key)
    return options


def _deploy(serve: Any, app: Any, config: AppConfig, stop: threading.Event) -> Any:
    """``serve.run`` with a deadline (``engine.startup_timeout_s``) and a clear reason when the
    replicas cannot start (e.g. no node has the GPUs a replica asks for)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["handle"] = serve.run(app, name=config.ray.app_name, route_prefix="/")
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="ardiff-serve-deploy", daemon=True)
    thread.start()
    deadline = time.monotonic() + config.engine.startup_timeout_s
    while thread.is_alive() and not stop.is_set() and time.monotonic() < deadline:
        thread.join(0.5)
    if "handle" in outcome:
        return outcome["handle"]
    if stop.is_set():
        return None
    if "error" in outcome:
        print(f"ardiff-serve: the Ray Serve application failed to start: {outcome['error']}", file=sys.stderr)
        return None
    print(
        f"ardiff-serve: the model replicas were not running after {config.engine.startup_timeout_s:.0f} s "
        f"(engine.startup_timeout_s): {_status_message(serve, config.ray.app_name)}",
        file=sys.stderr,
    )
    return None


def _status_message(serve: Any, app_name: str) -> str:
    try:
        app = serve.status().applications[app_name]
        return "; ".join(f"{name}: {d.status} {d.message}".strip() for name, d in app.deployments.items()) or app.message
    except Exception as exc:  # noqa: BLE001
        return f"(no status: {exc})"


def _shutdown(serve: Any, ray: Any, config: AppConfig, local: bool, log: logging.Logger) -> None:
    try:
        if local:
            serve.shutdown()
        else:  # someone else's cluster: take down only this application
            serve.delete(config.ray.app_name)
    except Exception as exc:  # noqa: BLE001
        log.warning("Ray Serve shutdown: %s", exc)
    finally:
        ray.shutdown()
