"""Several engines behind one :class:`~ardiff_server.engine.client.EngineClient` (``engine.replicas``).

A session stays on the replica that opened it; a new session goes to the least loaded replica
(``placement.py``). A replica that dies restarts alone: only the sessions placed on it start over
(their next reply says ``session.new``); the others never notice.

Replicas start one after another. Once the first is up, what it holds in this machine's RAM (the
encoders placed on the CPU: UMT5-XXL is 10.6 GiB per process) is measured, and the others start
only if the host has that much for each of them: a shortfall is one line at start-up, not a replica
killed by the kernel's OOM killer minutes later, or every replica checking the host alone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.client import EngineState, ReplicaStatus
from ardiff_server.engine.messages import DetachReason, EngineError, ErrorKind, InferReply
from ardiff_server.engine.placement import ReplicaLoad, SessionPlacement
from ardiff_server.engine.process_client import ProcessClient

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
        for index, client in enumerate(self.clients):
            await client.start()
            if index == 0:
                self._check_host_room()

    def _check_host_room(self) -> None:
        """Before replicas 1.. load: the host RAM the first one holds (its processes' anonymous
        memory), once for each of them. Only replicas on CUDA devices: a CPU replica's KV pool is sized
        from what is free when it starts, so the first one's size says nothing about the next."""
        first, rest = self.clients[0], self.clients[1:]
        devices = [d for client in self.clients for d in getattr(client, "devices", None) or ["?"]]
        if not rest or not all(d.startswith("cuda") for d in devices):
            return
        held = sum(process_anonymous_bytes(pid) for pid in getattr(first, "pids", []))
        available = host_available_bytes()
        if held == 0 or available is None or len(rest) * held <= available:
            return
        fit = 1 + available // held
        raise EngineError(
            ErrorKind.UNAVAILABLE,
            f"host memory: replica 0 holds {held / 2**30:.1f} GiB of this machine's RAM (encoders on the CPU, the process itself); "
            f"{len(rest)} more replica(s) need {len(rest) * held / 2**30:.1f} GiB and {available / 2**30:.1f} GiB is available: "
            f"set engine.replicas={fit}, or run the encoders on the GPUs (policy.text_encoder_device / image_encoder_device: engine)",
        )

    async def stop(self, grace_s: float = 3.0) -> None:
        await asyncio.gather(*(client.stop(grace_s) for client in self.clients))

    def kill_now(self) -> None:
        for client in self.clients:
            client.kill_now()

    async def infer(self, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        index = self.placement.get(session_id)
        if index is None:
            index = self.placement.place(session_id, self._loads())
        return await self.clients[index].infer(session_id, observation, deadline=deadline)

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


def process_anonymous_bytes(pid: int) -> int:
    """Resident anonymous memory of a process (its tensors, heap; not shared libraries or page
    cache, which further replicas share): ``RssAnon`` of /proc/<pid>/status; 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_available_bytes() -> int | None:
    """The host's available RAM (/proc/meminfo MemAvailable), None where unknown (torch-free)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
