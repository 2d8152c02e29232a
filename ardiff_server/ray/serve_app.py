"""``ardiff-serve --ray``: the same OpenPI endpoint as a Ray Serve application (docs/deploy.md).

Two deployments:

``Ingress``        one replica, a FastAPI app behind Serve's HTTP proxy: the websocket on every
                   path that :class:`~ardiff_server.frontend.service.PolicyService` accepts (``/``,
                   ``/v1/realtime/robot/openpi``) and its HTTP routes (``/healthz``, ``/metrics``,
                   ``/info``). The protocol, decoding, session table (ids, switch, reset, TTL,
                   key ownership) and error frames are the standalone server's own code: only the
                   transport (Starlette's WebSocket instead of ``websockets``) and the engine
                   client (:class:`RayEngineClient`) differ.
``EngineReplica``  the model: each replica owns one engine in its own process (the Ray actor),
                   served by :class:`~ardiff_server.engine.client.InprocClient` (one thread,
                   control requests first). CFG-parallel (``engine.cfg_parallel_size: 2``) needs
                   two processes, one per GPU: that replica runs the standalone server's worker
                   pair through :class:`~ardiff_server.engine.client.ProcessClient` (the only
                   case where a replica spawns processes).

Session affinity is Ray Serve's own routing: the ingress calls the model deployment with
``handle.options(session_id=...)`` and :class:`~ardiff_server.ray.router.SessionAffinityRouter`
pins each session to the replica that opened it (new sessions to the least-loaded replica).
When a replica dies Serve starts a new one; the router forgets the dead replica's sessions, so
their next request opens a fresh session elsewhere (``session.new``) and no other session is
touched.

Neither torch nor Ray is imported here at module level: ``run_ray`` says in one line how to
install Ray when it is missing, and the ingress process never loads torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from ardiff_server.config import AppConfig, ConfigError, validate_config
from ardiff_server.engine.client import EngineState, ReplicaStatus
from ardiff_server.engine.messages import ControlReply, EngineError, EngineStats, ErrorKind, ErrorReply, InferReply
from policies.info import PolicyInfo
from policies.observation import RobotObservation

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e '.[ray]'"
MIN_RAY = (2, 56)  # DeploymentHandle.options(session_id=...) reaches request routers from 2.56 on
MODEL_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
PROXY_CALLBACK = "ardiff_server.ray.serve_app.configure_proxy"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
WS_MAX_SIZE_ENV = "ARDIFF_WS_MAX_SIZE"
WS_PING_INTERVAL_ENV = "ARDIFF_WS_PING_INTERVAL_S"
WS_PING_TIMEOUT_ENV = "ARDIFF_WS_PING_TIMEOUT_S"
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve asks each replica for its sessions and KV stats
HEALTH_CHECK_PERIOD_S = 2.0
_LOGGERS = ("ardiff_server", "policies", "kv")


# ----------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class DeploymentPlan:
    """How the model deployment is placed, derived from the config (no Ray needed)."""

    num_replicas: int | None  # fixed count, or None with autoscaling
    min_replicas: int | None
    max_replicas: int | None
    num_gpus: float  # per replica
    num_cpus: float  # per replica
    world_size: int  # engine processes per replica (2: CFG-parallel)
    threads: int  # torch threads per engine process
    max_ongoing_requests: int

    @property
    def autoscaling(self) -> bool:
        return self.num_replicas is None

    @property
    def initial_replicas(self) -> int:
        return self.num_replicas if self.num_replicas is not None else max(1, self.min_replicas or 0)

    def describe(self) -> str:
        if self.autoscaling:
            return f"{self.min_replicas}-{self.max_replicas} replicas, autoscaling"
        return f"{self.num_replicas} replica{'s' if self.num_replicas != 1 else ''}"

    def model_options(self) -> dict[str, Any]:
        """Keyword arguments for the model deployment (``serve.deployment(...).options``)."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_gpus": self.num_gpus, "num_cpus": self.num_cpus},
        }
        if self.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "initial_replicas": self.initial_replicas,
            }
        else:
            options["num_replicas"] = self.num_replicas
        return options


def uses_cuda(config: AppConfig) -> bool:
    engine = config.engine
    devices = [engine.device, *(engine.devices or []), *(d for ds in engine.replica_devices or [] for d in ds)]
    return any(d.startswith("cuda") for d in devices)


def plan_deployment(config: AppConfig) -> DeploymentPlan:
    """The model deployment's placement (replicas, autoscaling bounds, resources per replica).

    Raises ConfigError naming the key when the combination cannot work."""
    ray_config, engine = config.ray, config.engine
    world = engine.cfg_parallel_size
    cuda = uses_cuda(config)
    num_gpus = ray_config.num_gpus if ray_config.num_gpus is not None else (float(world) if cuda else 0.0)
    if cuda and num_gpus == 0:
        raise ConfigError(f"{config.source}: engine.device is CUDA but ray.num_gpus is 0; set ray.num_gpus (GPUs per replica) or engine.device=cpu")
    if not cuda and num_gpus > 0:
        raise ConfigError(
            f"{config.source}: ray.num_gpus={num_gpus:g} but the engine runs on {engine.device}; set engine.device=cuda (Ray assigns each replica its GPUs)"
        )
    if cuda and world > 1 and 1 <= num_gpus < world:
        raise ConfigError(
            f"{config.source}: engine.cfg_parallel_size={world} needs ray.num_gpus={world} per replica (one GPU per CFG rank), got {num_gpus:g}"
        )
    if ray_config.min_replicas is not None:
        fixed, low, high = None, ray_config.min_replicas, ray_config.max_replicas
    else:
        fixed, low, high = ray_config.num_replicas or engine.replicas, None, None
    threads = engine.threads or max(1, int(ray_config.num_cpus // world))
    return DeploymentPlan(fixed, low, high, float(num_gpus), float(ray_config.num_cpus), world, threads, ray_config.max_ongoing_requests)


def replica_config(config: AppConfig, plan: DeploymentPlan) -> AppConfig:
    """The config one replica's engine runs with. Ray gives each replica its own GPUs through
    ``CUDA_VISIBLE_DEVICES``, so they are ``cuda:0`` (and ``cuda:1`` for the second CFG rank);
    the standalone server's multi-replica device lists do not apply."""
    raw = config.model_dump(mode="json")
    engine = raw["engine"]
    engine.update(replicas=1, replica_devices=None, threads=plan.threads)
    if uses_cuda(config):
        world = plan.world_size
        engine["device"] = "cuda:0"
        engine["devices"] = [f"cuda:{k if plan.num_gpus >= world else 0}" for k in range(world)] if world > 1 else None
    else:
        engine["devices"] = None
    return validate_config(raw, source=config.source)


# ------------------------------------------------------------------------ proxy callback


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


# ------------------------------------------------------------------------ model replica


class EngineReplica:
    """The model deployment: one engine per replica (see the module docstring).

    Every method returns the engine's typed reply (errors as :class:`ErrorReply`, never raised,
    so nothing depends on how Ray wraps exceptions) together with this replica's identity."""

    async def __init__(self, raw_config: dict[str, Any], log_level: int = logging.INFO) -> None:
        from ray import serve  # noqa: PLC0415

        _setup_logging(log_level)
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        self.incarnation = uuid.uuid4().hex[:8]  # this process
        self.version = 0  # requests handled: orders replies and routing stats (the newer one wins)
        config = validate_config(raw_config, source=raw_config.get("source", "<config>"))
        self.plan = plan_deployment(config)
        self.config = replica_config(config, self.plan)
        self.devices = _device_names(self.config)
        self._recent: OrderedDict[str, None] = OrderedDict()  # sessions served (ProcessClient: no direct view)
        started = time.perf_counter()
        label = self._rank()
        if self.plan.world_size > 1:
            from ardiff_server.engine.client import ProcessClient  # noqa: PLC0415

            self.engine = None
            self.client: Any = ProcessClient(self.config, replica=label, devices=self.config_devices())
            await self.client.start()
        else:
            self.engine = await asyncio.to_thread(_build_engine, self.config)
            from ardiff_server.engine.client import InprocClient  # noqa: PLC0415

            self.client = InprocClient(self.engine, replica=label, devices=self.devices, step_timeout_s=self.config.server.request_timeout_s)
            await self.client.start()
        logger.info(
            "model replica %s (rank %s, pid %d) ready in %.1f s on %s",
            self.replica_id, self._rank(), os.getpid(), time.perf_counter() - started, ", ".join(self.devices),
        )  # fmt: skip

    def config_devices(self) -> list[str]:
        return [self.config.engine.rank_device(k) for k in range(self.plan.world_size)]

    # -- requests -----------------------------------------------------------------------

    async def infer(self, session_id: str, observation: RobotObservation) -> tuple[Any, dict[str, Any]]:
        self.version += 1
        try:
            reply = await self.client.infer(session_id, observation)
        except EngineError as exc:
            return self._error(exc)
        self._note_session(session_id)
        # The robot's reply says which replica served it: ``session.replica`` (the index /info and
        # /metrics use) and ``session.replica_id`` (Serve's id, new for every replacement).
        reply = dataclasses.replace(reply, replica=self._rank(), info={**reply.info, "replica_id": self.replica_id})
        return reply, self.identity()

    async def release(self, session_id: str, reason: str) -> tuple[Any, dict[str, Any]]:
        self.version += 1
        self._recent.pop(session_id, None)
        try:
            await self.client.release(session_id, reason)
        except EngineError as exc:
            return self._error(exc)
        return ControlReply(-1, True, self._stats()), self.identity()

    async def detach(self, session_id: str, why: Literal["switched", "disconnected"]) -> tuple[Any, dict[str, Any]]:
        self.version += 1
        try:
            await self.client.detach(session_id, why)
        except EngineError as exc:
            return self._error(exc)
        return ControlReply(-1, True, self._stats()), self.identity()

    async def describe(self) -> dict[str, Any]:
        return {"info": self.client.info, "identity": self.identity(), "stats": self._stats()}

    # -- Serve hooks ----------------------------------------------------------------------

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve every ROUTING_STATS_PERIOD_S; the router places new sessions by
        ``num_sessions`` and finds a session's holder in ``sessions``; the ingress shows the rest."""
        sessions = self._sessions()
        stats = self._stats()
        return {
            "num_sessions": stats[0].sessions if stats else len(sessions),
            "sessions": sessions,
            "identity": self.identity(),
            "stats": [dataclasses.asdict(s) for s in stats],
        }

    async def check_health(self) -> None:
        """Serve replaces a replica whose check fails: the in-process engine cannot be interrupted,
        so a step running past ``server.request_timeout_s`` (InprocClient's ``stuck``) or a dead
        engine thread (``stopped``) ends this replica. (A CFG-parallel replica's ProcessClient
        restarts its own stuck workers.)"""
        state = self.client.state
        if state in ("stuck", "stopped"):
            raise RuntimeError(f"the engine is {state} (server.request_timeout_s={self.config.server.request_timeout_s:.0f})")

    # -- helpers ----------------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        client = self.client
        pids = list(getattr(client, "pids", None) or [os.getpid()])
        ident = {
            "replica_id": self.replica_id, "rank": self._rank(), "incarnation": self.incarnation, "pid": os.getpid(),
            "pids": pids, "devices": self.devices, "state": client.state, "restarts": getattr(client, "restarts", 0),
            "last_restart_s": getattr(client, "last_restart_s", 0.0), "version": self.version,
        }  # fmt: skip
        return ident

    def _stats(self) -> tuple[EngineStats, ...]:
        return tuple(self.client.stats)

    def _rank(self) -> int:
        """This replica's index among the deployment's (0..N-1). Serve reuses a dead replica's rank
        for its replacement and may renumber replicas when the set changes, so it is read each time."""
        from ray import serve  # noqa: PLC0415

        rank = getattr(serve.get_replica_context(), "rank", None)
        rank = getattr(rank, "rank", rank)  # Ray 2.60: a ReplicaRank
        return rank if isinstance(rank, int) else 0

    def _error(self, exc: EngineError) -> tuple[ErrorReply, dict[str, Any]]:
        return ErrorReply(-1, exc.kind, str(exc), exc.traceback, self._stats()), self.identity()

    def _note_session(self, session_id: str) -> None:
        self._recent[session_id] = None
        self._recent.move_to_end(session_id)
        while len(self._recent) > self.config.engine.max_sessions:
            self._recent.popitem(last=False)

    def _sessions(self) -> list[str]:
        if self.engine is not None:
            return list(self.engine.sessions)  # one C-level copy: safe against the engine thread
        return list(self._recent)


def _build_engine(config: AppConfig) -> Any:
    import torch  # noqa: PLC0415

    from ardiff_server.engine.core import build_engine  # noqa: PLC0415

    torch.set_num_threads(config.engine.threads or 1)
    engine = build_engine(config)
    if config.engine.warmup:
        engine.warmup()
    return engine


def _device_names(config: AppConfig) -> list[str]:
    """Where this replica runs, for /info: the node and, on GPU, the physical GPU ids Ray assigned."""
    import ray  # noqa: PLC0415

    node = ray.util.get_node_ip_address()
    if not uses_cuda(config):
        return [f"{node}/cpu"]
    return [f"{node}/gpu{g}" for g in ray.get_gpu_ids()]


def _setup_logging(level: int) -> None:
    for name in _LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(level)
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            log.addHandler(handler)
            log.propagate = False


# --------------------------------------------------------------------- engine client


@dataclass(frozen=True)
class _Seen:
    """What a replica last told us about itself (a reply, or Serve's routing-stats poll)."""

    identity: dict[str, Any]
    stats: tuple[EngineStats, ...]

    @property
    def version(self) -> int:
        return int(self.identity.get("version", 0))


class RayEngineClient:
    """The :class:`~ardiff_server.engine.client.EngineClient` the ingress's PolicyService uses:
    each call goes through the model deployment's handle tagged with the session id, so the
    session-affinity router sends it to the replica holding that session.

    A replica that died (or became unreachable) fails the call with ``WORKER_DIED``: the robot
    gets "internal error: ...; session X starts over on the next request", and that next
    request is placed on a live replica (the router forgot the dead one)."""

    def __init__(self, handle: Any, *, app_name: str, expected_replicas: int) -> None:
        self.handle = handle
        self.app_name = app_name
        self.expected_replicas = expected_replicas  # fixed count (or autoscaling minimum): missing ones show as restarting
        self.info: PolicyInfo | None = None
        self._state: EngineState = "starting"
        self._seen: dict[str, _Seen] = {}  # replica id -> newest identity + stats
        self._order: dict[str, int] = {}  # replica id -> index if Serve gives replicas no rank (older Ray)
        self._incarnations: dict[int, str] = {}  # index -> replica id serving it now
        self._restarts: dict[int, int] = {}
        self._lost_at: dict[int, float] = {}
        self._last_restart_s: dict[int, float] = {}

    # -- EngineClient --------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        if self._state != "ready":
            return self._state
        statuses = self.replicas()
        if not statuses or any(s.state == "ready" for s in statuses):
            return "ready"  # before the router reports (start-up) the describe call proved a replica
        return "restarting"

    async def start(self) -> None:
        """Wait for a model replica to answer (Serve queues the call until one runs)."""
        delay = 0.5
        while True:
            try:
                described = await self.handle.options(method_name="describe").remote()
                break
            except Exception as exc:  # a replica died while starting: Serve replaces it
                if _engine_error(exc).kind is not ErrorKind.WORKER_DIED:
                    raise
                logger.warning("model replica unavailable during start-up (%s); retrying", type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        self.info = described["info"]
        self._note(described["identity"], described["stats"])
        self._state = "ready"

    async def infer(self, session_id: str, observation: RobotObservation) -> InferReply:
        return await self._call("infer", session_id, session_id, observation)

    async def release(self, session_id: str, reason: str) -> None:
        await self._control("release", session_id, session_id, reason)

    async def detach(self, session_id: str, why: Literal["switched", "disconnected"]) -> None:
        await self._control("detach", session_id, session_id, why)

    async def stop(self, grace_s: float = 3.0) -> None:
        self._state = "stopped"

    def kill_now(self) -> None:
        pass  # no engine process here: Ray owns the replicas

    async def wait_described(self, count: int, timeout_s: float) -> None:
        """Until ``count`` replicas have told us who they are (their first routing-stats poll)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(1 for s in self.replicas() if s.pids) >= count:
                return
            await asyncio.sleep(0.2)

    def replicas(self) -> list[ReplicaStatus]:
        from ardiff_server.ray.router import router_view  # noqa: PLC0415 - imports Ray

        views = router_view(self.app_name, MODEL_DEPLOYMENT)
        if views is None:  # no call has gone through the handle yet
            return []
        live = {view.replica_id for view in views}
        for replica_id in [r for r in self._seen if r not in live]:
            del self._seen[replica_id]
        now = time.monotonic()
        statuses: dict[int, ReplicaStatus] = {}
        unknown = []
        for view in views:
            seen = self._newest(view.replica_id, view.routing_stats)
            rank = seen.identity.get("rank") if seen is not None else None
            index = rank if isinstance(rank, int) else self._order.setdefault(view.replica_id, len(self._order))
            if seen is None:  # just started; Serve has not polled it yet
                unknown.append(view)
                continue
            if self._incarnations.get(index) not in (None, view.replica_id):  # Serve replaced this replica
                self._restarts[index] = self._restarts.get(index, 0) + 1
                if index in self._lost_at:
                    self._last_restart_s[index] = now - self._lost_at.pop(index)
            self._incarnations[index] = view.replica_id
            self._lost_at.pop(index, None)
            ident = seen.identity
            statuses[index] = ReplicaStatus(
                index=index, devices=list(ident.get("devices", [])), state=ident.get("state", "ready"),
                pids=list(ident.get("pids", [])), stats=seen.stats,
                restarts=self._restarts.get(index, 0) + int(ident.get("restarts", 0)),
                last_restart_s=self._last_restart_s.get(index, float(ident.get("last_restart_s", 0.0))),
                sessions_placed=view.sessions_placed,
            )  # fmt: skip
        for index in range(self.expected_replicas):  # a fixed-size deployment's missing replicas are being replaced
            if index not in statuses and not unknown and self._state != "starting":
                self._lost_at.setdefault(index, now)
                statuses[index] = ReplicaStatus(index, [], "restarting", restarts=self._restarts.get(index, 0))
        free = (i for i in itertools.count() if i not in statuses)
        for view in unknown:  # Serve routes only to running replicas: ready, details follow within a second
            statuses[next(free)] = ReplicaStatus(0, [], "ready", sessions_placed=view.sessions_placed)
        return [dataclasses.replace(statuses[i], index=i) for i in sorted(statuses)]

    # -- calls --------------------------------------------------------------------------

    async def _call(self, method: str, session_id: str, *args: Any) -> Any:
        if self._state == "stopped":
            raise EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        try:
            reply, identity = await self.handle.options(method_name=method, session_id=session_id).remote(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = _engine_error(exc)
            logger.warning("session %s: %s failed: %s", session_id, method, error)
            raise error from None
        self._note(identity, reply.stats)
        if isinstance(reply, ErrorReply):
            raise reply.error()
        return reply

    async def _control(self, method: str, session_id: str, *args: Any) -> None:
        """Like ProcessClient: a dead replica holds no sessions, so there is nothing to end."""
        try:
            await self._call(method, session_id, *args)
        except EngineError as exc:
            if exc.kind not in (ErrorKind.WORKER_DIED, ErrorKind.TIMEOUT, ErrorKind.UNAVAILABLE):
                raise

    # -- replica bookkeeping --------------------------------------------------------------

    def _note(self, identity: dict[str, Any], stats: tuple[EngineStats, ...]) -> None:
        seen = _Seen(identity, tuple(stats))
        current = self._seen.get(identity["replica_id"])
        if current is None or seen.version >= current.version:
            self._seen[identity["replica_id"]] = seen

    def _newest(self, replica_id: str, routing_stats: dict[str, Any]) -> _Seen | None:
        """The newer of the replica's last reply and Serve's last poll of its routing stats."""
        seen = self._seen.get(replica_id)
        identity = routing_stats.get("identity")
        if isinstance(identity, dict):
            polled = _Seen(identity, tuple(EngineStats(**s) for s in routing_stats.get("stats", [])))
            if seen is None or polled.version > seen.version:
                return polled
        return seen


def _engine_error(exc: BaseException) -> EngineError:
    """A failed Ray call as the engine error the service turns into a text frame."""
    import ray.exceptions as rex  # noqa: PLC0415
    import ray.serve.exceptions as sex  # noqa: PLC0415

    def kinds(*names: str, module: Any = rex) -> tuple[type, ...]:
        return tuple(t for n in names if isinstance(t := getattr(module, n, None), type))

    name = type(exc).__name__
    if isinstance(exc, kinds("BackPressureError", module=sex)):
        return EngineError(ErrorKind.CAPACITY, "every model replica's queue is full")
    died = kinds("RayActorError", "WorkerCrashedError", "NodeDiedError", "ObjectLostError") + kinds("ReplicaUnavailableError", module=sex)
    if isinstance(exc, died):
        return EngineError(
            ErrorKind.WORKER_DIED, f"the model replica holding this session died or became unreachable ({name}); Ray Serve is replacing it"
        )
    if isinstance(exc, kinds("RequestCancelledError", "DeploymentUnavailableError", module=sex)):
        return EngineError(ErrorKind.UNAVAILABLE, f"the model deployment is unavailable ({name})")
    return EngineError(ErrorKind.UNAVAILABLE, f"model replica call failed: {name}: {exc}")


# ---------------------------------------------------------------------------- ingress


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

    def __init__(self, model: Any, raw_config: dict[str, Any], expected_replicas: int, log_level: int = logging.INFO) -> None:
        from ardiff_server.frontend.service import PolicyService  # noqa: PLC0415

        _setup_logging(log_level)
        self.config = validate_config(raw_config, source=raw_config.get("source", "<config>"))
        self.engine = RayEngineClient(model, app_name=self.config.ray.app_name, expected_replicas=expected_replicas)
        self.service = PolicyService(self.config, self.engine)
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


# ------------------------------------------------------------------------------- app


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


def build_app(config: AppConfig, plan: DeploymentPlan, *, log_level: int = logging.INFO) -> Any:
    """The Serve application: ``Ingress`` bound to the ``EngineReplica`` deployment."""
    from ray import serve  # noqa: PLC0415
    from ray.serve.config import RequestRouterConfig  # noqa: PLC0415

    raw = config.model_dump(mode="json")
    server = config.server
    idle = None if server.idle_timeout_s is None else server.idle_timeout_s + server.session_ttl_s + server.request_timeout_s + 60
    model = serve.deployment(EngineReplica, name=MODEL_DEPLOYMENT).options(
        **plan.model_options(),
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
    return ingress.bind(model.bind(raw, log_level), raw, plan.initial_replicas if not plan.autoscaling else (plan.min_replicas or 0), log_level)


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
    ardiff_server.ray.serve_app:app_builder`` with ``args: {config: NAME_OR_PATH, set: [key=value,
    ...]}``. The HTTP host/port and the proxy's environment then come from that Serve config
    and the cluster (docs/deploy.md), not from ``server.host``/``server.port``."""
    from ardiff_server.config import load_config  # noqa: PLC0415

    problem = ray_version_problem()
    if problem is not None:
        raise RuntimeError(problem)
    config = load_config(args.get("config", "tiny"), [str(o) for o in args.get("set") or []])
    return build_app(config, plan_deployment(config))


# ---------------------------------------------------------------------------- run_ray


def run_ray(config: AppConfig) -> int:
    """``ardiff-serve --ray``: deploy on Ray Serve, print the banner once a model replica
    answers, serve until SIGINT/SIGTERM, then take the application down. Returns the exit code."""
    try:
        import fastapi  # noqa: F401, PLC0415
        import ray  # noqa: PLC0415
        from ray import serve  # noqa: PLC0415
    except ImportError as exc:
        print(f"ardiff-serve: --ray needs Ray Serve ({exc.name or exc} is not installed): {INSTALL_HINT}", file=sys.stderr)
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
    port = server.port or _free_port(server.host)
    local = config.ray.address in (None, "local")
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
    _on_signals(stop, log)
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
        serve.start(proxy_location="HeadOnly", http_options={"host": server.host, "port": port})
        handle = _deploy(serve, build_app(config, plan, log_level=logging.getLogger().getEffectiveLevel()), config, stop)
        if handle is None:
            return 1 if not stop.is_set() else 0
        handle.ready.remote().result(timeout_s=config.engine.startup_timeout_s)
        keys = f", {len(server.api_keys)} API key(s) required" if server.api_keys else ""
        print(f"listening on ws://{server.host}:{port} (Ray Serve, {plan.describe()}){keys}", flush=True)
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
    print(f"ardiff-serve: the model replicas were not running after {config.engine.startup_timeout_s:.0f} s "
          f"(engine.startup_timeout_s): {_status_message(serve, config.ray.app_name)}", file=sys.stderr)  # fmt: skip
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


def _on_signals(stop: threading.Event, log: logging.Logger) -> None:
    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            log.warning("second signal: exiting now")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]
