"""Which session each connection is in, and when a session ends (front-end bookkeeping).

* Session id = the request's ``session_id``, else the connection's current one, else an id
  generated for that connection (never shared by unrelated connections).
* A different ``session_id`` on a connection ends its previous session (reset by switching
  session, as RoboArena does between episodes); ``endpoint: reset`` ends it explicitly.
* A disconnect does not end a session at once: a client reconnecting with the same id within
  ``ttl_s`` continues it; after that it is released ("ttl").
* Requests of one session are served strictly in order (one at a time), even across connections.

The engine is told through ``release(session_id, reason)`` / ``detach(session_id)`` callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

Release = Callable[[str, str], Awaitable[None]]
Detach = Callable[[str], Awaitable[None]]


@dataclass
class Connection:
    conn_id: int
    default_session: str
    current: str | None = None
    remote: str = ""
    requests: int = 0


@dataclass
class _SessionEntry:
    holders: set[int] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # requests holding or waiting for the lock (lock.locked() misses waiters)
    expiry: asyncio.TimerHandle | None = None


class SessionRegistry:
    def __init__(self, *, ttl_s: float, release: Release, detach: Detach) -> None:
        self.ttl_s = ttl_s
        self._release = release
        self._detach = detach
        self._ids = itertools.count(1)
        self._sessions: dict[str, _SessionEntry] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def active(self) -> int:
        """Sessions the front end is tracking (held by a connection, locked, or awaiting their TTL)."""
        return len(self._sessions)

    def connect(self, remote: str = "") -> Connection:
        conn_id = next(self._ids)
        return Connection(conn_id, default_session=f"conn{conn_id}-{uuid.uuid4().hex[:12]}", remote=remote)

    async def resolve(self, conn: Connection, requested: str | None) -> str:
        """The session this request belongs to; switching ends the connection's previous one."""
        session_id = requested or conn.current or conn.default_session
        if conn.current is not None and conn.current != session_id:
            previous = conn.current
            self._unhold(conn, previous)
            if not self._sessions[previous].holders:
                logger.info("connection %d switched %s -> %s: ending %s", conn.conn_id, previous, session_id, previous)
                await self._end(previous, "session switch")
        entry = self._sessions.setdefault(session_id, _SessionEntry())
        if entry.expiry is not None:  # a robot came back within the TTL
            entry.expiry.cancel()
            entry.expiry = None
            logger.info("session %s resumed by connection %d", session_id, conn.conn_id)
        entry.holders.add(conn.conn_id)
        conn.current = session_id
        return session_id

    async def reset(self, conn: Connection, requested: str | None) -> str:
        """``endpoint: reset``: end the named (or current) session; the next request starts fresh."""
        session_id = requested or conn.current or conn.default_session
        if conn.current == session_id:
            conn.current = None
        entry = self._sessions.get(session_id)
        if entry is not None:
            entry.holders.discard(conn.conn_id)
        await self._end(session_id, "reset")
        return session_id

    @contextlib.asynccontextmanager
    async def lock(self, session_id: str) -> AsyncIterator[None]:
        """One request of a session at a time. An entry nobody holds is dropped on the way out:
        a reset ends its session under this lock, so ``_end`` cannot drop it itself."""
        entry = self._sessions.setdefault(session_id, _SessionEntry())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if self._sessions.get(session_id) is entry and not entry.holders and not entry.users and entry.expiry is None:
                del self._sessions[session_id]

    async def disconnect(self, conn: Connection) -> None:
        session_id = conn.current
        conn.current = None
        if session_id is None or session_id not in self._sessions:
            return
        self._unhold(conn, session_id)
        entry = self._sessions[session_id]
        if entry.holders:
            return
        await self._detach(session_id)
        # The detach was a round trip to the worker: meanwhile the robot may have come back (a
        # timer set now would later end its session early) or the entry may be gone.
        if self._sessions.get(session_id) is not entry or entry.holders:
            return
        if self.ttl_s <= 0:
            await self._end(session_id, "ttl")
            return
        if entry.expiry is not None:
            entry.expiry.cancel()
        entry.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, session_id)

    def _expire(self, session_id: str) -> None:
        entry = self._sessions.get(session_id)
        if entry is None or entry.holders:
            return
        logger.info("session %s expired (%.0f s after its connection went away)", session_id, self.ttl_s)
        task = asyncio.ensure_future(self._end(session_id, "ttl"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _unhold(self, conn: Connection, session_id: str) -> None:
        entry = self._sessions.get(session_id)
        if entry is not None:
            entry.holders.discard(conn.conn_id)

    async def _end(self, session_id: str, reason: str) -> None:
        entry = self._sessions.get(session_id)
        if entry is not None and entry.expiry is not None:
            entry.expiry.cancel()
            entry.expiry = None
        if entry is not None and not entry.holders and not entry.users:
            del self._sessions[session_id]
        await self._release(session_id, reason)

    def forget_all(self) -> None:
        """The worker restarted: every session is gone on the engine side; keep only who holds what."""
        for entry in self._sessions.values():
            if entry.expiry is not None:
                entry.expiry.cancel()
                entry.expiry = None
        self._sessions = {sid: e for sid, e in self._sessions.items() if e.holders}
