"""Several engines behind one :class:`~ardiff_server.engine.client.EngineClient` (``engine.replicas``).

A session stays on the replica that opened it; a new session goes to the least loaded replica
(``placement.py``). A replica that dies restarts alone: only the sessions placed on it start over
(their next reply says ``session.new``); the others never notice.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ardiff_server.engine.client import EngineState, ReplicaStatus
from ardiff_server.engine.messages import DetachReason, InferReply
from ardiff_server.engine.placement import ReplicaLoad, SessionPlacement
from ardiff_server.engine.process_client import ProcessClient
from policies.info import PolicyInfo
from policies.observation import RobotObservation

logger = logging.getLogger(__name__)


class ReplicaSet:
    def __init__(self, clients: list[Any]) -> None:
        if not clients:
            raise ValueError("a ReplicaSet needs at least one engine")
        self.clients = clients
        self.placement: SessionPlacement[int] = SessionPlacement()
        for client in clients:
            if isinstance(client, ProcessClient):
                client.on_restart = self._forget_replica

    @classmethod
    def from_config(cls, config) -> ReplicaSet:
        return cls([ProcessClient(config, replica=r, devices=devices) for r, devices in enumerate(config.engine.replica_device_lists())])

    @property
    def info(self) -> PolicyInfo | None:
        return next((c.info for c in self.clients if c.info is not None), None)

    @property
    def state(self) -> EngineState:
        states = [c.state for c in self.clients]
        if any(s == "ready" for s in states):
            return "ready"
        return next((s for s in ("stuck", "unresponsive", "restarting", "starting") if s in states), "stopped")

    def replicas(self) -> list[ReplicaStatus]:
        counts = self.placement.counts()
        statuses = []
        for client in self.clients:
            for status in client.replicas():
                status.sessions_placed = counts.get(client.replica, 0)
                statuses.append(status)
        return statuses

    async def start(self) -> None:
        # One at a time: replicas loading a model at once would compete for the same disk and cores.
        for client in self.clients:
            await client.start()

    async def stop(self, grace_s: float = 3.0) -> None:
        await asyncio.gather(*(client.stop(grace_s) for client in self.clients))

    def kill_now(self) -> None:
        for client in self.clients:
            client.kill_now()

    async def infer(self, session_id: str, observation: RobotObservation) -> InferReply:
        index = self.placement.get(session_id)
        if index is None:
            index = self.placement.place(session_id, self._loads())
        return await self.clients[index].infer(session_id, observation)

    async def end(self, session_id: str, reason: str) -> None:
        index = self.placement.forget(session_id)
        if index is not None:
            await self.clients[index].end(session_id, reason)

    async def detach(self, session_id: str, reason: DetachReason) -> None:
        index = self.placement.get(session_id)
        if index is not None:
            await self.clients[index].detach(session_id, reason)

    def _loads(self) -> dict[int, ReplicaLoad]:
        counts = self.placement.counts()
        return {
            index: ReplicaLoad(
                ready=client.state == "ready",
                sessions_placed=counts.get(index, 0),
                sessions_open=client.stats[0].sessions if client.stats else 0,
                kv_pages_free=sum(s.kv_pages_free for s in client.stats),
            )
            for index, client in enumerate(self.clients)
        }

    def _forget_replica(self, client: ProcessClient) -> None:
        """A replica restarted: its sessions are gone; new requests for them are placed afresh."""
        lost = self.placement.forget_replicas(lambda index: index == client.replica)
        if lost:
            logger.warning("replica %d restarted: %d session(s) start over", client.replica, len(lost))
