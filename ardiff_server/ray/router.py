"""Session affinity for the Ray Serve deployment: a Ray Serve ``RequestRouter`` keyed on the session id.

Ray Serve instantiates this router inside every process that holds a handle to the model
deployment (here: the ingress replica) and asks it, per request, which replica to send it to.
The ingress tags each call with ``handle.options(session_id=...)``; Serve hands that id to the
router in ``pending_request.metadata.session_id``.

* A session already placed on a live replica always goes there. If that replica is at
  ``max_ongoing_requests`` the request waits (backoff) instead of spilling to another replica:
  the session's model and KV state live on exactly one replica.
* A new session goes to the least-loaded replica by the standalone server's own rule
  (``ardiff_server/engine/placement.py``: sessions placed by this router, sessions the replicas
  report in ``EngineReplica.record_routing_stats``, free KV pages, queue length). A session that
  a replica reports holding (this router restarted with the ingress, or forgot an idle entry)
  goes back to that replica.
* A replica that dies or is removed (scale-down) is forgotten with all its sessions: their next
  request is placed afresh and the engine there opens a new session (the robot's reply says
  ``session.new``). An ``end`` call (reset, TTL expiry) forgets its session once routed.
* Calls without a session id (``describe``) go to the shortest queue.

:func:`router_view` lets the ingress read the live replicas and their reported stats for
``/info``, ``/metrics`` and ``/healthz`` (same process, read-only).

This module imports Ray at import time: only Ray workers and ``ray_serve.py`` (lazily) load it.
Serve ships the router class *by value* (cloudpickle) to the processes holding a handle, so
module-level state must not be referenced from the class directly: the registry below is reached
through a real import at run time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ardiff_server.engine.placement import ReplicaLoad, SessionPlacement

logger = logging.getLogger(__name__)

END_METHOD = "end"  # the model deployment's method that ends a session
PLACING_METHOD = "infer"  # only an inference request places an unknown session


@dataclass(frozen=True)
class ReplicaView:
    """One live replica as the router sees it (for the ingress's /info and /metrics)."""

    replica_id: str
    routing_stats: dict[str, Any]
    sessions_placed: int


_ROUTERS: dict[str, Any] = {}  # router_key -> this process's router (dict get/set are atomic)


def router_key(app_name: str, deployment_name: str) -> str:
    return f"{app_name}/{deployment_name}"


def router_view(app_name: str, deployment_name: str) -> list[ReplicaView] | None:
    """The live replicas of a deployment as this process's router sees them; None before the
    router exists (it is created by the first handle call)."""
    router = _ROUTERS.get(router_key(app_name, deployment_name))
    return router.view() if router is not None else None


class SessionAffinityRouter(RequestRouter):
    def initialize_state(self, idle_ttl_s: float | None = None, **kwargs: Any) -> None:
        """Called once by Serve with ``RequestRouterConfig.request_router_kwargs``.

        ``idle_ttl_s``: forget a session nobody sent anything for this long (None: never). The
        ingress ends sessions itself (reset, TTL); this only bounds the map if it cannot.
        """
        self._idle_ttl_s = idle_ttl_s
        self._placement: SessionPlacement[ReplicaID] = SessionPlacement()
        self._last_sweep = time.monotonic()
        from ardiff_server.ray import router  # the real module, not this class's pickled copy

        deployment = self._deployment_id
        router._ROUTERS[router.router_key(deployment.app_name, deployment.name)] = self

    def _state(self) -> None:
        if not hasattr(self, "_placement"):  # Serve calls initialize_state first; be safe regardless
            self.initialize_state()

    # -- routing ----------------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        self._state()
        if not candidate_replicas:
            return []
        metadata = pending_request.metadata if pending_request is not None else None
        if pending_request is not None:
            # Every answer here is final for this attempt: when no replica it names can take the
            # request now (full, or slow to report its queue), Serve must back off before asking
            # again, not spin (a spinning router floods the replicas with queue-length probes).
            # For a session this is also strict affinity: wait for its replica, never spill.
            pending_request.routing_context.should_backoff = True
        session_id = metadata.session_id if metadata is not None else ""
        if not session_id:
            return [sorted(candidate_replicas, key=self._queue_len)]
        now = time.monotonic()
        by_id = {r.replica_id: r for r in candidate_replicas}
        placed = self._placement.get(session_id)
        if placed is not None:
            replica = by_id.get(placed)
            if replica is not None:
                self._placement.touch(session_id, now)
                return [[replica]]
            logger.info("session %s: replica %s is gone; placing it afresh", session_id, placed.unique_id)
            self._placement.forget(session_id)
        self._sweep(now)
        holder = next((r for r in candidate_replicas if session_id in _reported_sessions(r)), None)
        if holder is None and metadata.call_method != PLACING_METHOD:
            # end/detach of a session no replica holds: any replica answers "unknown"
            return [sorted(candidate_replicas, key=self._queue_len)]
        if holder is not None:  # no await since the lookup: atomic for this loop
            self._placement.pin(session_id, holder.replica_id, now)
            return [[holder]]
        chosen = self._placement.place(session_id, self._loads(candidate_replicas), now)
        return [[by_id[chosen]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._state()
        metadata = pending_request.metadata
        if metadata.session_id and metadata.call_method == END_METHOD:
            self._placement.forget(metadata.session_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if hasattr(self, "_placement"):
            live = {r.replica_id for r in replicas}
            self._forget_replicas(lambda rid: rid not in live, "removed")

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "_placement"):
            self._forget_replicas(lambda rid: rid == replica_id, "died")

    # -- helpers ------------------------------------------------------------------------------

    def _queue_len(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, ReplicaLoad]:
        counts = self._placement.counts()
        loads = {}
        for replica in replicas:
            stats = replica.routing_stats or {}
            reported = stats.get("num_sessions")
            free = sum(int(s.get("kv_pages_free", 0)) for s in stats.get("stats", []) if isinstance(s, dict))
            loads[replica.replica_id] = ReplicaLoad(
                sessions_placed=counts.get(replica.replica_id, 0),
                sessions_open=reported if isinstance(reported, int) else 0,
                kv_pages_free=free,
                queue_len=self._queue_len(replica),
            )
        return loads

    def _forget_replicas(self, gone, why: str) -> None:
        lost = self._placement.forget_replicas(gone)
        if lost:
            logger.warning("a model replica was %s: %d session(s) start over on their next request", why, len(lost))

    def _sweep(self, now: float) -> None:
        if self._idle_ttl_s is None or now - self._last_sweep < 60.0:
            return
        self._last_sweep = now
        self._placement.sweep(self._idle_ttl_s, now)

    def view(self) -> list[ReplicaView]:
        """Read from another thread (the ingress's event loop): only atomic copies here."""
        if not hasattr(self, "_placement"):
            return []
        replicas = list(self._replicas.values())  # one C-level copy (the router thread mutates it)
        counts = self._placement.counts()
        return [ReplicaView(r.replica_id.unique_id, dict(r.routing_stats or {}), counts.get(r.replica_id, 0)) for r in replicas]


def _reported_sessions(replica: RunningReplica) -> tuple[str, ...]:
    sessions = (replica.routing_stats or {}).get("sessions")
    return tuple(sessions) if isinstance(sessions, list | tuple) else ()
