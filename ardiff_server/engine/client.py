"""What the front end talks to: the :class:`EngineClient` protocol, and what it reports.

Implementations, by where the engine runs:

* :class:`~ardiff_server.engine.process_client.ProcessClient`: in worker process(es) it spawns
  and restarts (the standalone server; one per replica);
* :class:`~ardiff_server.engine.inproc_client.InprocClient`: in this process, on one thread
  (tests, scripts, Ray model replicas, which are processes already);
* :class:`~ardiff_server.engine.replicas.ReplicaSet`: several of the above, each session pinned
  to one (``engine.replicas``; what ``ardiff-serve`` runs, even with one replica);
* :class:`~ardiff_server.ray.client.RayEngineClient`: model replicas of a Ray Serve deployment.

Torch-free: the front end process never loads torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.messages import DetachReason, EngineError, EngineStats, InferReply

EngineState = Literal["starting", "ready", "restarting", "stuck", "unresponsive", "stopped"]


class EngineClient(Protocol):
    """The engine as the front end sees it. Every method may raise :class:`EngineError`."""

    info: PolicyInfo | None

    @property
    def state(self) -> EngineState: ...

    async def start(self) -> None: ...

    async def infer(self, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        """One call; ``deadline``: when the robot runs out of actions, as ``time.monotonic()`` here
        (None: due now). The engine serves earliest deadline first (``engine/scheduler.py``)."""

    async def end(self, session_id: str, reason: str) -> None:
        """End a session: its KV pages go back to the pool (a no-op for an unknown session)."""

    async def detach(self, session_id: str, reason: DetachReason) -> None:
        """No connection is on the session now: the engine evicts it first under pressure."""

    async def stop(self, grace_s: float = 3.0) -> None: ...

    def kill_now(self) -> None:
        """SIGKILL every engine process at once (a second Ctrl-C): no waiting, no cleanup."""

    def replicas(self) -> list[ReplicaStatus]: ...


@dataclass
class ReplicaStatus:
    """One engine replica as ``/metrics`` and ``/info`` show it."""

    index: int
    devices: list[str]
    state: EngineState
    pids: list[int] = field(default_factory=list)
    stats: tuple[EngineStats, ...] = ()  # one per CFG rank
    restarts: int = 0
    last_restart_s: float = 0.0
    sessions_placed: int = 0  # sessions the front end routes here


@contextlib.contextmanager
def done_if_sessions_gone() -> Iterator[None]:
    """Around a control request (end, detach): an engine that died, got stuck or is gone holds no
    sessions, so there is nothing left to end or detach and the request is simply done."""
    try:
        yield
    except EngineError as exc:
        if not exc.sessions_gone:
            raise
