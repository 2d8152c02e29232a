"""Which replica a new session goes to, and where each session is (pure; no I/O, no torch).

One rule for both deployments: the standalone server's :class:`~ardiff_server.engine.replicas.ReplicaSet`
and the Ray Serve router (``ardiff_server/ray/router.py``). A session stays on the replica that
opened it (its model and KV state live there and nowhere else); a new session goes to the least
loaded replica, compared in this order:

1. replicas that can serve now before ones that are (re)starting;
2. fewest sessions placed there by this front end;
3. fewest sessions the replica reports holding (after a front-end restart these differ);
4. most free KV pages;
5. shortest request queue;
6. the first in the given order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # how the caller names a replica (an index, Ray's ReplicaID)


@dataclass(frozen=True)
class ReplicaLoad:
    ready: bool = True
    sessions_placed: int = 0
    sessions_open: int = 0
    kv_pages_free: int = 0
    queue_len: int = 0

    def order(self) -> tuple[int, int, int, int, int]:
        return (0 if self.ready else 1, self.sessions_placed, self.sessions_open, -self.kv_pages_free, self.queue_len)


def least_loaded(loads: Mapping[K, ReplicaLoad]) -> K:
    """The replica a new session goes to (``loads`` must not be empty; ties go to the first)."""
    if not loads:
        raise ValueError("no replica to place a session on")
    return min(loads, key=lambda replica: loads[replica].order())


class SessionPlacement(Generic[K]):
    """session id -> the replica holding it, and when it was last routed (for idle sweeps)."""

    def __init__(self) -> None:
        self._where: dict[str, K] = {}
        self._used: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._where

    def get(self, session_id: str) -> K | None:
        return self._where.get(session_id)

    def pin(self, session_id: str, replica: K, now: float = 0.0) -> None:
        self._where[session_id] = replica
        self._used[session_id] = now

    def touch(self, session_id: str, now: float) -> None:
        if session_id in self._where:
            self._used[session_id] = now

    def place(self, session_id: str, loads: Mapping[K, ReplicaLoad], now: float = 0.0) -> K:
        """Pin a new session to the least loaded replica (see the module docstring)."""
        replica = least_loaded(loads)
        self.pin(session_id, replica, now)
        return replica

    def forget(self, session_id: str) -> K | None:
        self._used.pop(session_id, None)
        return self._where.pop(session_id, None)

    def forget_replicas(self, gone: Callable[[K], bool]) -> list[str]:
        """Forget every session on a replica for which ``gone`` is true (it died or was removed);
        returns their ids. Their next request is placed afresh."""
        lost = [sid for sid, replica in self._where.items() if gone(replica)]
        for session_id in lost:
            self.forget(session_id)
        return lost

    def sweep(self, idle_s: float, now: float) -> list[str]:
        """Forget sessions not routed for ``idle_s`` seconds; returns their ids."""
        idle = [sid for sid, used in self._used.items() if now - used > idle_s]
        for session_id in idle:
            self.forget(session_id)
        return idle

    def counts(self) -> Counter[K]:
        """Sessions per replica. Safe to call from another thread (the copy of the values is one C call)."""
        return Counter(list(self._where.values()))
