"""The session table: which robot session is where, and every transition of a session.

Sessions are keyed by id, not by connection (``docs/design-notes.md``, "Sessions"):

* A request's session is its ``session_id``, else the connection's current one, else an id
  generated for that connection (never shared by unrelated connections).
* A new id is a fresh episode (RoboArena and DreamZero's client mint one per episode). Moving to
  another id does not end the previous session: IsaacLab-Arena interleaves one id per parallel
  environment over one connection, and each continues. A session nobody is currently on is the
  engine's first eviction candidate.
* A session ends when it is reset (``endpoint: reset``), when its TTL runs out after the last
  connection that used it went away, or when the engine evicts it (LRU cap, pool pressure).
  A session no connection is on right now is *detached* (``switched`` away from, or
  ``disconnected``); the engine evicts detached sessions first.
* With API keys, a session belongs to the key that opened it; another key cannot touch it.

This class is the one owner of that state. Every transition of a session (serve, reset, detach,
TTL expiry) runs under that session's lock, so requests of one session are strictly ordered and
no transition can interleave with another; the engine is told through an
:class:`~ardiff_server.engine.client.EngineClient` (``ardiff-serve``: a
:class:`~ardiff_server.engine.replicas.ReplicaSet` of ``ProcessClient`` s). Where a session
resets: :meth:`SessionTable.end` (``endpoint: reset``) and :meth:`SessionTable._expire` (TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ardiff_server.engine.client import EngineClient
from ardiff_server.engine.messages import DetachReason, InferReply
from policies.observation import RobotObservation

logger = logging.getLogger(__name__)


class SessionForbidden(Exception):
    """A request for a session that belongs to another API key."""


@dataclass
class Connection:
    conn_id: int
    default_session: str
    key: str | None = None  # which API key authenticated it (an id, never the key itself)
    current: str | None = None
    used: set[str] = field(default_factory=set)  # sessions it used that are not ended
    remote: str = ""
    requests: int = 0


@dataclass
class _Entry:
    session_id: str
    owner: str | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # requests holding or waiting for the lock
    holders: set[int] = field(default_factory=set)  # open connections that used it
    current_on: set[int] = field(default_factory=set)  # connections whose current session it is
    expiry: asyncio.TimerHandle | None = None
    epoch: int = 0  # bumped whenever a TTL timer is armed or cancelled: an older timer is stale
    ended: bool = False


class SessionTable:
    def __init__(self, engine: EngineClient, *, ttl_s: float) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self._ids = itertools.count(1)
        self._entries: dict[str, _Entry] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def tracked(self) -> int:
        """Sessions the front end is tracking (used by an open connection, locked, or awaiting their TTL)."""
        return len(self._entries)

    def connect(self, remote: str = "", key: str | None = None) -> Connection:
        conn_id = next(self._ids)
        return Connection(conn_id, default_session=f"conn{conn_id}-{uuid.uuid4().hex[:12]}", key=key, remote=remote)

    # -- requests ---------------------------------------------------------------------

    def resolve(self, conn: Connection, requested: str | None) -> str:
        return requested or conn.current or conn.default_session

    async def infer(self, conn: Connection, session_id: str, observation: RobotObservation) -> InferReply:
        """Serve one request of ``session_id`` on ``conn`` (under the session's lock)."""
        previous = conn.current if conn.current != session_id else None
        async with self._locked(session_id) as entry:
            self._check_owner(entry, conn)
            if entry.ended or entry.owner is None:  # a fresh (or revived) entry belongs to this key
                entry.ended, entry.owner = False, conn.key
            self._disarm(entry)
            entry.holders.add(conn.conn_id)
            entry.current_on.add(conn.conn_id)
            conn.used.add(session_id)
            conn.current = session_id
            if previous is not None:
                self._moved_away(conn, previous)
            return await self.engine.infer(session_id, observation)

    async def end(self, conn: Connection, session_ids: list[str]) -> list[str]:
        """End each of ``session_ids`` (``endpoint: reset``; each under its own lock): its KV pages go
        back to the pool and the next request with that id starts a fresh episode."""
        for session_id in session_ids:
            async with self._locked(session_id) as entry:
                self._check_owner(entry, conn)
                await self._end(entry, "reset")
            conn.used.discard(session_id)
            if conn.current == session_id:
                conn.current = None
        return session_ids

    def used_by(self, conn: Connection) -> list[str]:
        """Every session this connection used and that is not ended (``session_ids: None``)."""
        live = [sid for sid in conn.used if (e := self._entries.get(sid)) is not None and conn.conn_id in e.holders]
        return sorted(live)

    async def disconnect(self, conn: Connection) -> None:
        """The connection closed: its sessions stay for ``ttl_s`` after nobody uses them."""
        conn.current = None
        for session_id in sorted(conn.used):
            entry = self._entries.get(session_id)
            if entry is None or conn.conn_id not in entry.holders:
                continue
            entry.holders.discard(conn.conn_id)
            entry.current_on.discard(conn.conn_id)
            if not entry.holders:
                self._spawn(self._detach(session_id, "disconnected"))
        conn.used.clear()

    # -- transitions (each under the session's lock) --------------------------------------

    def _moved_away(self, conn: Connection, session_id: str) -> None:
        entry = self._entries.get(session_id)
        if entry is None:
            return
        entry.current_on.discard(conn.conn_id)
        if not entry.current_on:
            self._spawn(self._detach(session_id, "switched"))

    async def _detach(self, session_id: str, reason: DetachReason) -> None:
        async with self._locked(session_id) as entry:
            if entry.ended:
                return
            if reason == "switched" and (entry.current_on or not entry.holders):
                return  # someone is on it again, or it is disconnected (handled there)
            if reason == "disconnected" and entry.holders:
                return  # a robot came back meanwhile
            await self.engine.detach(session_id, reason)  # a hint: evict this one first under pressure
            if reason == "disconnected":
                self._arm(entry)

    def _arm(self, entry: _Entry) -> None:
        self._disarm(entry)
        if self.ttl_s <= 0:
            self._spawn(self._expire(entry.session_id, entry.epoch))
            return
        entry.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._on_expiry, entry.session_id, entry.epoch)

    def _disarm(self, entry: _Entry) -> None:
        entry.epoch += 1
        if entry.expiry is not None:
            entry.expiry.cancel()
            entry.expiry = None

    def _on_expiry(self, session_id: str, epoch: int) -> None:
        self._spawn(self._expire(session_id, epoch))

    async def _expire(self, session_id: str, epoch: int) -> None:
        async with self._locked(session_id) as entry:
            # Under the lock: a robot that resumed meanwhile bumped the epoch (and holds it).
            if entry.epoch != epoch or entry.holders or entry.ended:
                return
            entry.expiry = None
            logger.info("session %s expired (%.0f s after its last connection went away)", session_id, self.ttl_s)
            await self._end(entry, "ttl")

    async def _end(self, entry: _Entry, reason: str) -> None:
        self._disarm(entry)
        entry.ended = True
        entry.holders.clear()
        entry.current_on.clear()
        await self.engine.end(entry.session_id, reason)

    # -- entries and locks ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _locked(self, session_id: str) -> AsyncIterator[_Entry]:
        entry = self._entries.get(session_id)
        if entry is None:
            entry = self._entries[session_id] = _Entry(session_id, owner=None)
        entry.users += 1
        try:
            async with entry.lock:
                yield entry
        finally:
            entry.users -= 1
            self._maybe_drop(entry)

    def _maybe_drop(self, entry: _Entry) -> None:
        """Forget an entry nobody holds, waits on or will expire. While anyone waits on its lock it
        stays (ended, if so): the waiter revives it, so one id never has two locks."""
        if entry.users or entry.holders or entry.expiry is not None:
            return
        if self._entries.get(entry.session_id) is entry:
            del self._entries[entry.session_id]

    def _check_owner(self, entry: _Entry, conn: Connection) -> None:
        if not entry.ended and entry.owner is not None and entry.owner != conn.key:
            raise SessionForbidden(f"session {entry.session_id} belongs to another API key")

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("session bookkeeping failed: %s", task.exception())

    async def drain(self) -> None:
        """Wait for background transitions (tests; shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
