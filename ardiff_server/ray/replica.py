"""The model deployment: each Ray Serve replica owns one engine.

A replica runs its engine in its own process (the Ray actor), served by
:class:`~ardiff_server.engine.inproc_client.InprocClient` (one thread, control requests first).
CFG-parallel (``engine.cfg_parallel_size: 2``) needs two processes, one per GPU: that replica runs
the standalone server's worker pair through
:class:`~ardiff_server.engine.process_client.ProcessClient` (the only case where a replica spawns
processes). Each replica reports the sessions its engine holds (``record_routing_stats``), which
the session-affinity router (``router.py``) reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from typing import Any

from ardiff_policies.observation import RobotObservation
from ardiff_server.config import AppConfig, validate_config
from ardiff_server.engine.messages import ControlReply, DetachReason, EngineError, EngineStats, ErrorReply
from ardiff_server.ray.plan import plan_deployment, replica_config, uses_cuda

logger = logging.getLogger(__name__)

_LOGGERS = ("ardiff_server", "ardiff_policies", "ardiff_kv")


class EngineReplica:
    """The model deployment: one engine per replica (see the module docstring).

    Every method returns the engine's typed reply (errors as :class:`ErrorReply`, never raised,
    so nothing depends on how Ray wraps exceptions) together with this replica's identity."""

    async def __init__(self, raw_config: dict[str, Any], log_level: int = logging.INFO) -> None:
        from ray import serve  # noqa: PLC0415

        setup_logging(log_level)
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        self.incarnation = uuid.uuid4().hex[:8]  # this process
        self.version = 0  # requests handled: orders replies and routing stats (the newer one wins)
        config = validate_config(raw_config, source=raw_config.get("source", "<config>"))
        self.plan = plan_deployment(config)
        self.config = replica_config(config, self.plan)
        self.devices = _device_names(self.config)
        started = time.perf_counter()
        index = self._index()
        if self.plan.world_size > 1:
            from ardiff_server.engine.process_client import ProcessClient  # noqa: PLC0415

            self.client: Any = ProcessClient(self.config, replica=index, devices=self.config_devices())
        else:
            from ardiff_server.engine.builder import start_engine  # noqa: PLC0415 - torch
            from ardiff_server.engine.inproc_client import InprocClient  # noqa: PLC0415

            engine = await asyncio.to_thread(start_engine, self.config, warmup=self.config.engine.warmup)
            self.client = InprocClient(engine, replica=index, devices=self.devices, step_timeout_s=self.config.server.request_timeout_s)
        await self.client.start()
        logger.info(
            "model replica %s (index %s, pid %d) ready in %.1f s on %s",
            self.replica_id,
            index,
            os.getpid(),
            time.perf_counter() - started,
            ", ".join(self.devices),
        )

    def config_devices(self) -> list[str]:
        return [self.config.engine.rank_device(k) for k in range(self.plan.world_size)]

    # -- requests -----------------------------------------------------------------------

    async def infer(self, session_id: str, observation: RobotObservation, left_s: float | None = None) -> tuple[Any, dict[str, Any]]:
        """``left_s``: seconds until the robot runs out of actions (a deadline on this host's clock)."""
        self.version += 1
        try:
            reply = await self.client.infer(session_id, observation, deadline=None if left_s is None else time.monotonic() + left_s)
        except EngineError as exc:
            return self._error(exc)
        # The robot's reply says which replica served it: ``session.replica`` (the index /info and
        # /metrics use) and ``session.replica_id`` (Serve's id, new for every replacement).
        reply = dataclasses.replace(reply, replica=self._index(), info={**reply.info, "replica_id": self.replica_id})
        return reply, self.identity()

    async def end(self, session_id: str, reason: str) -> tuple[Any, dict[str, Any]]:
        self.version += 1
        try:
            await self.client.end(session_id, reason)
        except EngineError as exc:
            return self._error(exc)
        return ControlReply(-1, True, self._stats()), self.identity()

    async def detach(self, session_id: str, reason: DetachReason) -> tuple[Any, dict[str, Any]]:
        self.version += 1
        try:
            await self.client.detach(session_id, reason)
        except EngineError as exc:
            return self._error(exc)
        return ControlReply(-1, True, self._stats()), self.identity()

    async def describe(self) -> dict[str, Any]:
        return {"info": self.client.info, "identity": self.identity(), "stats": self._stats()}

    # -- Serve hooks ----------------------------------------------------------------------

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve every ROUTING_STATS_PERIOD_S. The sessions are the engine's own list (its
        stats, as of the last request it served): the router places new sessions by their count and
        finds a session's holder among them; the ingress shows the rest."""
        stats = self._stats()
        sessions = list(stats[0].session_ids) if stats else []
        return {
            "num_sessions": len(sessions),
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
            "replica_id": self.replica_id,
            "index": self._index(),
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "pids": pids,
            "devices": self.devices,
            "state": client.state,
            "restarts": getattr(client, "restarts", 0),
            "last_restart_s": getattr(client, "last_restart_s", 0.0),
            "version": self.version,
        }
        return ident

    def _stats(self) -> tuple[EngineStats, ...]:
        return tuple(self.client.stats)

    def _index(self) -> int:
        """This replica's index among the deployment's (0..N-1; Serve calls it the replica's "rank",
        not to be confused with a CFG rank). Serve reuses a dead replica's index for its replacement
        and may renumber replicas when the set changes, so it is read each time."""
        from ray import serve  # noqa: PLC0415

        index = getattr(serve.get_replica_context(), "rank", None)
        index = getattr(index, "rank", index)  # Ray 2.60: a ReplicaRank
        return index if isinstance(index, int) else 0

    def _error(self, exc: EngineError) -> tuple[ErrorReply, dict[str, Any]]:
        return ErrorReply(-1, exc.kind, str(exc), exc.traceback, self._stats()), self.identity()


def _device_names(config: AppConfig) -> list[str]:
    """Where this replica runs, for /info: the node and, on GPU, the physical GPU ids Ray assigned."""
    import ray  # noqa: PLC0415

    node = ray.util.get_node_ip_address()
    if not uses_cuda(config):
        return [f"{node}/cpu"]
    return [f"{node}/gpu{g}" for g in ray.get_gpu_ids()]


def setup_logging(level: int) -> None:
    """Ray workers start without our log format; the engine's and policy's loggers get one."""
    for name in _LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(level)
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            log.addHandler(handler)
            log.propagate = False
