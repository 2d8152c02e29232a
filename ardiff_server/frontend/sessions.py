"""The session table: which robot session is where, and every transition of a session.

Sessions are keyed by id, not by connection (``docs/design-notes.md``, "Sessions"):

* A request's session is its ``session_id``, else the connection's current one, else an id
  generated for that connection (never shared by unrelated connections).
* A new id is a fresh episode (RoboArena and DreamZero's client mint one per episode). Moving to
  another id does not end the previous session: IsaacLab-Arena interleaves one id per parallel
  environment over one connection, and each continues. A session nobody is currently on is the
  engine's first eviction candidate, and the engine hears so before the new id's request reaches
  it (that request's admission may need the old session's place).
* A session ends when it is reset (``endpoint: reset``), when its TTL runs out after the last
  connection that used it went away, or when the engine evicts it (LRU cap, pool pressure).
  A session no connection is on right now is *detached* (``switched`` away from, or
  ``disconnected``); the engine evicts detached sessions first.
* With API keys, a session belongs to the key that opened it; another key cannot touch it.
* Per-key limits (``server.max_sessions_per_key``; docs/design-notes.md, "Per-key limits"): a
  session holds one of its key's slots from its admission until it ends, here or in the engine
  (the engine's replies list the sessions it holds). A new session of a key at its limit first
  ends that key's least recently used idle session (detached; disconnected ones first, as the
  engine would); if every one has a robot on it, it is refused (``server at capacity``). With two
  or more keys the table also never lets new sessions outgrow the engine, so the engine never
  has to evict one key's session to make room for another's.

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
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from ardiff_policies.observation import RobotObservation
from ardiff_server.config import fair_share
from ardiff_server.engine.client import EngineClient
from ardiff_server.engine.messages import DetachReason, EngineError, ErrorKind, InferReply

logger = logging.getLogger(__name__)


class SessionForbidden(Exception):
    """A request for a session that belongs to another API key."""


@dataclass(frozen=True)
class KeyLimits:
    """How many sessions a key may hold (None: no limit), and whether keys share the engine (two or
    more keys: no new session may make the engine evict; ``max_sessions`` is a replica's size when
    it does not report its own). ``fair_keys``: with ``max_sessions_per_key: fair``, the number of
    keys sharing; a key's share is then also capped by what the engine really holds (its KV pool
    may hold fewer sessions than ``engine.max_sessions``)."""

    sessions_per_key: int | None = None
    shared: bool = False
    max_sessions: int = 0
    fair_keys: int = 0

    @property
    def enforced(self) -> bool:
        return self.sessions_per_key is not None or self.shared


@dataclass
class Connection:
    conn_id: int
    default_session: str
    key: str | None = None  # which API key authenticated it (an id, never the key itself)
    current: str | None = None
    batch: tuple[str, ...] = ()  # the sessions of its last request when that was a batch (all current; then current is None)
    used: set[str] = field(default_factory=set)  # sessions it used that are not ended
    remote: str = ""
    requests: int = 0


@dataclass
class _Entry:
    session_id: str
    owner: str | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # requests and transitions holding or waiting for the lock
    background: int = 0  # of them, detaches and TTL expiries: they take no other lock, and leave the session idle
    holders: set[int] = field(default_factory=set)  # open connections that used it
    current_on: set[int] = field(default_factory=set)  # connections whose current session it is
    expiry: asyncio.TimerHandle | None = None
    epoch: int = 0  # bumped whenever a TTL timer is armed or cancelled: an older timer is stale
    ended: bool = False
    counted: bool = False  # holds one of its key's slots (admitted, and not known to have ended)
    opened: bool = False  # the engine answered it: it holds state there (else its first request is in flight)
    last_used: float = 0.0  # time.monotonic() of its last request: a key's idle sessions end LRU first


class SessionTable:
    def __init__(
        self, engine: EngineClient, *, ttl_s: float, limits: KeyLimits = KeyLimits(), on_refused: Callable[[str | None], None] = lambda key: None
    ) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self.limits = limits
        self.on_refused = on_refused  # a new session of this key was refused (metrics)
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

    async def infer(self, conn: Connection, session_id: str, observation: RobotObservation, *, deadline: float | None = None) -> InferReply:
        """Serve one request of ``session_id`` on ``conn`` (under the session's lock); ``deadline``: when its robot runs
        out of actions (``time.monotonic()``; None: due now), for the engine's schedule."""
        left = [sid for sid in (conn.current, *conn.batch) if sid is not None and sid != session_id]
        conn.batch = ()
        return await self._infer(conn, session_id, observation, left=left, deadline=deadline)

    async def infer_batch(self, conn: Connection, calls: list[tuple[str, RobotObservation, float | None]]) -> list[InferReply | Exception]:
        """Serve one batch of distinct sessions on ``conn``: each call under its own session's lock, all sent to the
        engine before any is awaited (so they can meet in one forward). Every one is on the robot now: the
        connection's current sessions are the batch's (an id-less reset ends them all), the ones its previous request
        was on and this batch is not are left (switched). Per call: its reply, or the EngineError / SessionForbidden
        that refused it (the others stand). Each call carries its own deadline (None: due now)."""
        ids = [sid for sid, _, _ in calls]
        left = [sid for sid in (conn.current, *conn.batch) if sid is not None and sid not in ids]
        conn.current, conn.batch = None, tuple(ids)
        for session_id in left:  # the engine hears first (its control requests run ahead), no call waits on it
            self._leave_later(conn, session_id)

        async def one(session_id: str, observation: RobotObservation, deadline: float | None) -> InferReply | Exception:
            try:
                return await self._infer(conn, session_id, observation, left=(), single=False, deadline=deadline)
            except (EngineError, SessionForbidden) as exc:
                return exc

        return list(await asyncio.gather(*(one(*call) for call in calls)))

    def current_sessions(self, conn: Connection) -> list[str]:
        """The sessions the connection is on now: its last batch's, else its current (or generated) one."""
        return list(conn.batch) if conn.batch else [self.resolve(conn, None)]

    async def _infer(
        self,
        conn: Connection,
        session_id: str,
        observation: RobotObservation,
        *,
        left: Sequence[str],
        single: bool = True,
        deadline: float | None = None,
    ) -> InferReply:
        async with self._locked(session_id) as entry:
            self._check_owner(entry, conn)
            if entry.ended or entry.owner is None:  # a fresh (or revived) entry belongs to this key
                entry.ended, entry.owner = False, conn.key
            if not self._holds_slot(entry):
                await self._admit(entry, conn)  # raises EngineError(CAPACITY): nothing below has changed
            self._disarm(entry)
            entry.holders.add(conn.conn_id)
            entry.current_on.add(conn.conn_id)
            entry.last_used = time.monotonic()
            conn.used.add(session_id)
            if single:
                conn.current = session_id
            for previous in left:
                await self._leave(conn, previous)  # before the request: its admission may need previous's place
            try:
                reply = await self.engine.infer(session_id, observation, deadline=deadline)
            except EngineError as exc:
                if not (entry.opened and exc.kind is ErrorKind.BAD_REQUEST):  # else the engine holds it no more (or never did)
                    entry.counted = entry.opened = False
                raise
            entry.opened = True
            return reply

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
            conn.batch = tuple(sid for sid in conn.batch if sid != session_id)
        return session_ids

    def used_by(self, conn: Connection) -> list[str]:
        """Every session this connection used and that is not ended (``session_ids: None``)."""
        live = [sid for sid in conn.used if (e := self._entries.get(sid)) is not None and conn.conn_id in e.holders]
        return sorted(live)

    async def disconnect(self, conn: Connection) -> None:
        """The connection closed: its sessions stay for ``ttl_s`` after nobody uses them."""
        conn.current, conn.batch = None, ()
        for session_id in sorted(conn.used):
            entry = self._entries.get(session_id)
            if entry is None or conn.conn_id not in entry.holders:
                continue
            entry.holders.discard(conn.conn_id)
            entry.current_on.discard(conn.conn_id)
            if not entry.holders:
                self._spawn(self._detach(session_id, "disconnected"))
        conn.used.clear()

    # -- per-key limits -----------------------------------------------------------------

    def open_by_key(self) -> Counter[str | None]:
        """Sessions each key holds (``/metrics``): admitted and not ended, here or in the engine."""
        engine_sessions = self._engine_sessions()
        return Counter(e.owner for e in self._entries.values() if self._counts(e, engine_sessions))

    def _holds_slot(self, entry: _Entry) -> bool:
        if not entry.counted or entry.ended:
            return False
        if not entry.opened or not self.limits.enforced:
            return True
        # else the engine lost it (evicted, or its replica restarted): this request opens it again
        return any(r.stats and entry.session_id in r.stats[0].session_ids for r in self.engine.replicas())

    async def _admit(self, entry: _Entry, conn: Connection) -> None:
        """Give ``entry`` one of its key's slots, first ending that key's least recently used idle
        session if the key (or, with several keys, the engine) is full; else EngineError(CAPACITY)."""
        entry.counted, entry.opened = True, False  # reserved now: concurrent admissions see it
        tried: set[str] = set()
        while self.limits.enforced and (problem := self._over_limit(entry.owner)) is not None:
            victim = self._idle_session_of(entry.owner, conn, tried)
            if victim is None:
                entry.counted = False
                self.on_refused(entry.owner)
                logger.warning("session %s refused: %s", entry.session_id, problem)
                raise EngineError(ErrorKind.CAPACITY, problem)
            tried.add(victim.session_id)
            async with self._locked(victim.session_id) as locked:
                if locked is victim and self._idle(victim, conn, waiting=1):  # still idle once locked (by us)
                    logger.info("session %s ended to make room for %s's new session %s", victim.session_id, entry.owner, entry.session_id)
                    await self._end(victim, "quota")

    def sessions_per_key(self) -> tuple[int | None, str]:
        """The per-key session limit in force now and the setting it comes from (for messages and
        ``/info``). A fair share is of what the ready replicas really hold when that is less than
        the configured share (their KV pools may hold fewer than ``engine.max_sessions``)."""
        limit = self.limits.sessions_per_key
        capacity = self._engine_capacity() if self.limits.shared else None
        if self.limits.fair_keys > 1 and capacity is not None:
            share = fair_share(capacity, self.limits.fair_keys)
            if limit is None or share < limit:
                return share, f"server.max_sessions_per_key: fair, {share} of the engine's {capacity} for each of {self.limits.fair_keys} keys"
        return limit, f"server.max_sessions_per_key: {limit}"

    def _over_limit(self, key: str | None) -> str | None:
        """Why a key cannot take one more session now (its reservation included), or None."""
        engine_sessions = self._engine_sessions()
        held = Counter(e.owner for e in self._entries.values() if self._counts(e, engine_sessions))
        capacity = self._engine_capacity() if self.limits.shared else None
        limit, setting = self.sessions_per_key()
        if limit is not None and held[key] > limit:
            return f"{key} holds {held[key] - 1} sessions ({setting}) and a robot is on each; end one (reset) or retry later"
        if capacity is not None and held.total() > capacity:
            return (
                f"the engine's {capacity} sessions are taken ({held[key] - 1} by {key}, {held.total() - held[key]} by other keys) "
                f"and none of {key}'s is idle; retry when one ends"
            )
        return None

    def _idle_session_of(self, key: str | None, conn: Connection, tried: set[str]) -> _Entry | None:
        """The key's session to end first: a disconnected one (awaiting its TTL) before one its
        robot switched away from, least recently used first."""
        engine_sessions = self._engine_sessions()
        idle = [
            e
            for e in self._entries.values()
            if e.owner == key and e.session_id not in tried and self._idle(e, conn) and self._counts(e, engine_sessions)
        ]
        return min(idle, key=lambda e: (bool(e.holders), e.last_used), default=None)

    @staticmethod
    def _idle(entry: _Entry, conn: Connection, waiting: int = 0) -> bool:
        """Open in the engine, no robot on it (but ``conn``'s, which is leaving it for a new
        session, unless it is one of ``conn``'s batch), no request of anyone else holding or waiting for its lock (a detach or expiry
        may: the caller waits for it), not ended."""
        busy = entry.users - entry.background
        on_robot = entry.current_on - {conn.conn_id} or entry.session_id in conn.batch  # conn stays on its batch's
        return entry.opened and not entry.ended and busy <= waiting and not on_robot

    def _counts(self, entry: _Entry, engine_sessions: set[str]) -> bool:
        return entry.counted and not entry.ended and (not entry.opened or entry.session_id in engine_sessions)

    def _engine_sessions(self) -> set[str]:
        """Sessions the engine holds, as of each replica's last reply."""
        return {sid for r in self.engine.replicas() if r.stats for sid in r.stats[0].session_ids}

    def _engine_capacity(self) -> int | None:
        """Sessions the ready replicas can hold (their KV pool may hold fewer than engine.max_sessions);
        None while none is ready (the engine answers for itself then)."""
        ready = [r for r in self.engine.replicas() if r.state == "ready"]
        if not ready:
            return None
        return sum((r.stats[0].session_capacity if r.stats and r.stats[0].session_capacity else self.limits.max_sessions) for r in ready)

    # -- transitions (each under the session's lock) --------------------------------------

    def _leave_later(self, conn: Connection, session_id: str) -> None:
        """``conn`` moved on from ``session_id``: as :meth:`_leave`, the detach spawned (it runs before anything
        the caller sends next, and waits for no lock the caller may take)."""
        entry = self._entries.get(session_id)
        if entry is None:
            return
        entry.current_on.discard(conn.conn_id)
        if not (entry.current_on or entry.ended):
            self._spawn(self._detach(session_id, "switched"))

    async def _leave(self, conn: Connection, session_id: str) -> None:
        """``conn`` moved on from ``session_id`` (under the new session's lock). If no robot is on it
        now, the engine is told (evict it first) before the new session's request reaches it, whose
        admission may need its place. Its lock is awaited only if no request holds or waits for it
        (a detach or expiry takes no other lock); else the detach follows that request."""
        entry = self._entries.get(session_id)
        if entry is None:
            return
        entry.current_on.discard(conn.conn_id)
        if entry.current_on or entry.ended:
            return
        if entry.users > entry.background:
            self._spawn(self._detach(session_id, "switched"))
            return
        try:
            await self._detach(session_id, "switched")
        except EngineError as exc:  # only a hint: the new session's request meets the engine's state itself
            logger.warning("session %s: detach after a switch failed: %s", session_id, exc)

    async def _detach(self, session_id: str, reason: DetachReason) -> None:
        async with self._locked(session_id, background=True) as entry:
            if entry.ended:
                return
            if reason == "switched" and (entry.current_on or not entry.holders):
                return  # someone is on it again, or it is disconnected (handled there)
            if reason == "disconnected" and entry.holders:
                return  # a robot came back meanwhile
            if reason == "disconnected" and self.ttl_s <= 0:  # session_ttl_s: 0 ends it now, under this lock
                logger.info("session %s ended: its last connection went away (server.session_ttl_s: 0)", session_id)
                await self._end(entry, "ttl")
                return
            await self.engine.detach(session_id, reason)  # a hint: evict this one first under pressure
            if reason == "disconnected":
                self._arm(entry)

    def _arm(self, entry: _Entry) -> None:
        self._disarm(entry)
        entry.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._on_expiry, entry.session_id, entry.epoch)

    def _disarm(self, entry: _Entry) -> None:
        entry.epoch += 1
        if entry.expiry is not None:
            entry.expiry.cancel()
            entry.expiry = None

    def _on_expiry(self, session_id: str, epoch: int) -> None:
        self._spawn(self._expire(session_id, epoch))

    async def _expire(self, session_id: str, epoch: int) -> None:
        async with self._locked(session_id, background=True) as entry:
            # Under the lock: a robot that resumed meanwhile bumped the epoch (and holds it).
            if entry.epoch != epoch or entry.holders or entry.ended:
                return
            entry.expiry = None
            logger.info("session %s expired (%.0f s after its last connection went away)", session_id, self.ttl_s)
            await self._end(entry, "ttl")

    async def _end(self, entry: _Entry, reason: str) -> None:
        self._disarm(entry)
        entry.ended = True
        entry.counted = entry.opened = False
        entry.holders.clear()
        entry.current_on.clear()
        await self.engine.end(entry.session_id, reason)

    # -- entries and locks ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _locked(self, session_id: str, *, background: bool = False) -> AsyncIterator[_Entry]:
        """The session's entry under its lock (``background``: a detach or TTL expiry, see _Entry)."""
        entry = self._entries.get(session_id)
        if entry is None:
            entry = self._entries[session_id] = _Entry(session_id, owner=None)
        entry.users += 1
        entry.background += background
        try:
            async with entry.lock:
                yield entry
        finally:
            entry.users -= 1
            entry.background -= background
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
