"""The engine client of the Ray Serve ingress: calls into the model deployment, tagged by session.

Each call goes through the model deployment's handle with ``options(session_id=...)``, so the
session-affinity router (``router.py``) sends it to the replica holding that session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.client import EngineState, ReplicaStatus, done_if_sessions_gone
from ardiff_server.engine.messages import DetachReason, EngineError, EngineStats, ErrorKind, ErrorReply, InferReply
from ardiff_server.ray.plan import MODEL_DEPLOYMENT

logger = logging.getLogger(__name__)


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
        self._order: dict[str, int] = {}  # replica id -> index if Serve gives replicas none (older Ray)
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

    async def infer(self, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        left_s = None if deadline is None else deadline - time.monotonic()  # another host's monotonic clock is another clock
        return await self._call("infer", session_id, session_id, observation, left_s)

    async def end(self, session_id: str, reason: str) -> None:
        await self._control("end", session_id, session_id, reason)

    async def detach(self, session_id: str, reason: DetachReason) -> None:
        await self._control("detach", session_id, session_id, reason)

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
            reported = seen.identity.get("index") if seen is not None else None
            index = reported if isinstance(reported, int) else self._order.setdefault(view.replica_id, len(self._order))
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
                index=index,
                devices=list(ident.get("devices", [])),
                state=ident.get("state", "ready"),
                pids=list(ident.get("pids", [])),
                stats=seen.stats,
                restarts=self._restarts.get(index, 0) + int(ident.get("restarts", 0)),
                last_restart_s=self._last_restart_s.get(index, float(ident.get("last_restart_s", 0.0))),
                sessions_placed=view.sessions_placed,
            )
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
        with done_if_sessions_gone():
            await self._call(method, session_id, *args)

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
