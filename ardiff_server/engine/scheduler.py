"""The engine's scheduler: what runs next, and for whom (shaped after vLLM v1's ``Scheduler``).

It owns, in one place, the state and the decisions that decide whether one robot pays for another:
the session table (which sessions exist, least recently used first, whether a robot is on each and
whether a request of theirs waits: :class:`SessionState`), the one table of admitted requests
(:class:`Admitted`), and the rounds that change them.

* **Order.** Control requests (end, detach) run between steps, ahead of queued inference, so a
  reset never waits behind other robots. The front end never sends a session's next request
  before the previous one is answered, so only requests of *different* sessions are reordered.
* **Admission and eviction** (:meth:`Scheduler.next_round` plans, :meth:`Scheduler.make_room`
  confirms, :func:`choose_victims` picks). A new session gets a place only by ending sessions no
  robot is on: disconnected ones first, then ones their robot switched away from, least recently
  used first. Never an attached session, never one whose request waits, never another session of
  the same admission round, never one whose request arrived while the round executes
  (:meth:`Scheduler.arrived_sessions`, read when the engine ends the planned victims: such a
  victim is spared and the next choice goes instead). When nothing can go, the new session is
  refused with ``server at capacity`` naming the limit and the remedy; every existing robot carries on.
* **Deadlines** (``engine.schedule: deadline``, the default). A request may say by when its robot
  runs out of actions (:attr:`Infer.deadline`, the engine's monotonic clock); one without (a
  blocking client, a first call) is due at its arrival, that is now. A batch takes the ready
  requests earliest deadline first, and the latest wait: a request with slack never delays one
  that would otherwise miss. Ties keep arrival order. A deadline before the request's arrival
  counts as its arrival, so every request is due no later than it came, and a request that
  arrives later than another is due can never pass it: no request starves (deadlines are
  absolute times; the one it waits on only gets closer). A partial batch waiting for company
  (``engine.batch_wait_ms``) stops waiting at its members' earliest deadline.
  ``engine.schedule: arrival`` serves in arrival order (first come, first served).
* **Batches.** Up to ``max_batch`` admitted requests of distinct sessions, in the schedule's order.
  A request whose session-own work (the encodes of a first call, a prompt change, a window
  restart: :meth:`ardiff_policies.base.Policy.prepare`) runs on the engine's encoder thread is not
  ready, and does not hold the ready ones back: it joins a later batch.

Each decision is a :class:`Round`; ``SessionEngine.execute`` carries it out and reports back
(:meth:`Scheduler.opened`, :meth:`Scheduler.closed`, :meth:`Scheduler.admit`, :meth:`Scheduler.take`).
Under CFG-parallel only rank 0 schedules: it sends every round to the other rank, and both execute
the same rounds against the same tables, so both admit, evict and batch alike (``worker.py``).

Torch-free: the worker's reader thread and the in-process client's callers put requests in.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ardiff_server.engine.encoder import EncodeTiming
from ardiff_server.engine.messages import CAPACITY_PREFIX, CONTROL, Infer, Request, pickled_by_fields

# Eviction order: a robot that went away, then a session its robot switched away from. Attached: never.
EVICTABLE = {"disconnected": 0, "switched": 1}
Status = Literal["attached", "switched", "disconnected"]
Schedule = Literal["deadline", "arrival"]  # engine.schedule


@dataclass
class SessionState:
    """One row of the session table: whether a robot is on the session, and the engine's state of it
    (the policy's per-session state and the session's KV, opaque here)."""

    session_id: str
    policy_state: Any
    kv: Any  # ardiff_kv.SessionKV, or None without a KV cache
    calls: int = 0
    status: Status = "attached"
    waiting: int = 0  # admitted requests not answered yet: never evicted while > 0


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Admission:
    """One request of an admission round, as the scheduler planned it.

    ``victims``: the sessions to end so that its new session fits (``()``: it fits, or its session
    is open); None: no place can be made, it is refused. ``due``: when it must be served (its
    deadline, or its arrival)."""

    request: Infer
    queued_ms: float  # how long it waited before this round
    due: float
    victims: tuple[str, ...] | None = ()


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Round:
    """One scheduling decision: a control request alone, new requests to admit (and what to evict
    for them), or a batch to step.

    ``batch`` holds ``(request id, queued_ms)``: how long each waited in the engine so far."""

    control: Request | None = None
    admit: tuple[Admission, ...] = ()
    batch: tuple[tuple[int, float], ...] = ()  # admitted request ids, in the order they were chosen

    @property
    def request_ids(self) -> tuple[int, ...]:
        if self.control is not None:
            return (self.control.request_id,)
        return tuple(a.request.request_id for a in self.admit) + tuple(rid for rid, _ in self.batch)


@dataclass
class Admitted:
    """An admitted request waiting for its batch: its session, its session-own work, when it is due."""

    request: Infer
    session: SessionState
    new: bool  # its session was opened by its admission
    waited_s: float  # before its admission round
    due: float  # time.monotonic() it must be served by: its deadline, or its arrival
    work: Future | None = None  # the policy's prepare job on the encoder thread
    encode: EncodeTiming | None = None  # how long that job waited and ran there
    ready_at: float | None = None  # time.monotonic() its session-own work was done (or it had none); None: not ready
    behind_s: float = 0.0  # its session-own work waited this long for the encoder thread, behind other requests' work
    taken: bool = False  # in a batch now

    @property
    def ready(self) -> bool:
        return self.ready_at is not None and not self.taken

    @property
    def encode_ms(self) -> float:
        return self.encode.run_ms if self.encode is not None else 0.0


class Evictable(Protocol):
    status: str  # "attached", "switched" or "disconnected"
    waiting: int  # admitted requests of it not answered yet


def choose_victims(sessions: Mapping[str, Evictable], needed: int, protect: Iterable[str]) -> list[str] | None:
    """The ``needed`` sessions to end so that a new one fits, or None if that many cannot go.

    ``sessions`` in least-recently-used-first order. Candidates: no robot attached, no request
    waiting, not in ``protect`` (the admission round's other sessions); disconnected before
    switched-away, least recently used first within each."""
    if needed <= 0:
        return []
    keep = set(protect)
    candidates = [sid for sid, s in sessions.items() if s.status in EVICTABLE and not s.waiting and sid not in keep]
    candidates.sort(key=lambda sid: EVICTABLE[sessions[sid].status])  # stable: LRU within a class
    return candidates[:needed] if len(candidates) >= needed else None


def capacity_message(open_sessions: int, max_sessions: int, pool_sessions: int | None) -> str:
    """Why a new session was refused, with the limit that binds and what to do."""
    if pool_sessions is not None and pool_sessions < max_sessions:
        limit = f"the KV pool holds {pool_sessions} (engine.max_sessions: {max_sessions})"
        remedy = "a larger engine.kv_budget_gib / kv_memory_fraction or more engine.replicas"
    else:
        limit = f"engine.max_sessions: {max_sessions}"
        remedy = "a larger engine.max_sessions or more engine.replicas"
    return (
        f"{CAPACITY_PREFIX}{open_sessions} sessions open ({limit}) and a robot is attached to each; "
        f"retry after a robot resets or disconnects, or serve more with {remedy}"
    )


def due(request: Infer, arrived: float) -> float:
    """When ``request`` must be served: its deadline, or its arrival without one. A deadline
    before its arrival counts as its arrival (due now): no request is due before it came."""
    return arrived if request.deadline is None else max(request.deadline, arrived)


@dataclass
class Scheduler:
    """The session table, the requests waiting for one engine, and the rounds that serve them.

    ``put`` and ``prepared`` may be called from any thread; everything else from the thread that
    serves (the table changes only there, between rounds or while the engine carries one out)."""

    max_batch: int = 1
    batch_wait_s: float = 0.0  # a partial batch waits this long for more ready requests (engine.batch_wait_ms)
    schedule: Schedule = "deadline"  # engine.schedule
    max_sessions: int = 2**31  # engine.max_sessions
    kv_sessions: int | None = None  # sessions the KV cache admits (its headroom kept), if it bounds the table
    pool_sessions: int | None = None  # sessions the KV pool's pages hold (what a refusal names)
    sessions: OrderedDict[str, SessionState] = field(default_factory=OrderedDict)  # least recently used first
    _control: deque = field(default_factory=deque)  # (request, arrived)
    _arrivals: deque = field(default_factory=deque)  # (Infer, arrived): not admitted yet
    _admitted: dict[int, Admitted] = field(default_factory=dict)  # in arrival order
    _batch_until: float | None = None  # when a partial batch stops waiting for company
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def capacity(self) -> int:
        """Sessions the table may hold: engine.max_sessions, or fewer if the KV pool holds fewer."""
        return self.max_sessions if self.kv_sessions is None else min(self.max_sessions, self.kv_sessions)

    # -- intake (any thread) -----------------------------------------------------------

    def put(self, request: Request, *, waited_ms: float = 0.0) -> None:
        """Queue a request (``waited_ms``: how long it already waited elsewhere, counted as queueing)."""
        with self._cond:
            arrived = time.monotonic() - waited_ms / 1000.0
            (self._control if isinstance(request, CONTROL) else self._arrivals).append((request, arrived))
            self._cond.notify()

    def prepared(self, request_id: int, behind_ms: float = 0.0) -> None:
        """A request's session-own work finished (called from the encoder thread): it is ready.
        ``behind_ms``: how long that work waited for the encoder thread behind other requests' (queueing)."""
        with self._cond:
            entry = self._admitted.get(request_id)
            if entry is not None and entry.ready_at is None:
                entry.ready_at = time.monotonic()
                entry.behind_s = behind_ms / 1000.0
                self._cond.notify()

    def arrived_sessions(self) -> frozenset[str]:
        """Sessions with a request that reached the scheduler and is not admitted yet, read under
        the lock: the reader thread adds to them while an admission round executes, and such a
        session's robot is back (admission must not end it: :meth:`make_room`'s ``spared``)."""
        with self._cond:
            return frozenset(request.session_id for request, _ in self._arrivals)

    # -- the session table (the serving thread, carrying out a round) -------------------

    def make_room(self, admission: Admission, *, protect: Iterable[str], spared: Iterable[str] = ()) -> list[str] | None:
        """The sessions to end now so that ``admission``'s new session fits, or None: refused.

        The round's plan stands unless the table changed since it was formed: a newcomer before it
        in the round was refused (a place less is needed), or a planned victim's robot came back
        meanwhile (``spared``: the next choice goes instead). ``protect``: the round's sessions."""
        needed = len(self.sessions) + 1 - self.capacity
        if needed <= 0:
            return []
        spared = set(spared)
        planned = [sid for sid in admission.victims or () if sid in self.sessions and sid not in spared][:needed]
        rest = {sid: s for sid, s in self.sessions.items() if sid not in planned}
        more = choose_victims(rest, needed - len(planned), {*protect, *spared})
        return None if more is None else planned + more

    def refusal(self) -> str:
        """The capacity refusal for a new session that does not fit now."""
        return capacity_message(len(self.sessions), self.max_sessions, self.pool_sessions)

    def attach(self, session_id: str) -> SessionState | None:
        """An admitted request's open session (now the most recently used, its robot on it, its
        request waiting), or None if it is not open."""
        session = self.sessions.get(session_id)
        if session is not None:
            self.sessions.move_to_end(session_id)
            session.status = "attached"
            session.waiting += 1
        return session

    def opened(self, session: SessionState) -> None:
        """A new session, opened for an admitted request (which waits)."""
        session.waiting += 1
        self.sessions[session.session_id] = session

    def closed(self, session_id: str) -> SessionState | None:
        """The session ended (its row goes); None if it was not open."""
        return self.sessions.pop(session_id, None)

    def detach(self, session_id: str, status: Status) -> bool:
        """No robot is on the session now (``status``: why): it goes first when room is needed.
        A later reason never raises its rank (a disconnected session stays disconnected)."""
        session = self.sessions.get(session_id)
        if session is None:
            return False
        if EVICTABLE.get(status, 2) < EVICTABLE.get(session.status, 2):
            session.status = status
        return True

    # -- admitted requests (the serving thread) -----------------------------------------

    def admit(self, entry: Admitted, *, ready: bool) -> None:
        """An admission round let ``entry`` in; ``ready``: it has no session-own work pending (else
        :meth:`prepared` says when it is done)."""
        with self._cond:
            if ready:
                entry.ready_at = time.monotonic()
            self._admitted[entry.request.request_id] = entry

    def release(self, session: SessionState) -> None:
        """A request :meth:`attach` or :meth:`opened` counted leaves before its admission (refused
        on another CFG rank): its session stops waiting for it."""
        session.waiting -= 1

    def take(self, request_ids: Iterable[int]) -> list[Admitted]:
        """A batch's admitted requests, out of the table (their sessions stop waiting for them)."""
        with self._cond:
            taken = [self._admitted.pop(request_id) for request_id in request_ids]
        for entry in taken:
            entry.session.waiting -= 1
        return taken

    def empty(self) -> bool:
        with self._cond:
            return not (self._control or self._arrivals or self._admitted)

    # -- rounds ----------------------------------------------------------------------------

    def next_round(self, *, wait_for_prepared: bool = False, timeout_s: float | None = None) -> Round | None:
        """The next round; blocks until there is one (None after ``timeout_s``).

        ``wait_for_prepared``: form no batch while session-own work is still running (callers that
        serve a fixed set of requests and want them batched as they were given: tests, warm-up)."""
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                if self._control:
                    request, _ = self._control.popleft()
                    return Round(control=request)
                if self._arrivals:  # admit every arrival at once: they are one admission round
                    taken = [self._arrivals.popleft() for _ in range(len(self._arrivals))]
                    return Round(admit=self._plan(taken, now))
                batch = self._ready_batch()
                pending = any(e.ready_at is None for e in self._admitted.values())
                wait: float | None = None
                if batch and not (wait_for_prepared and pending):
                    if len(batch) < self.max_batch and self.batch_wait_s > 0:
                        self._batch_until = self._batch_until or now + self.batch_wait_s
                        until = self._batch_until
                        if self.schedule == "deadline":  # company is not worth a member's deadline
                            until = min([until, *(e.request.deadline for e in batch if e.request.deadline is not None)])
                        wait = until - now
                    if wait is None or wait <= 0:
                        self._batch_until = None
                        for entry in batch:
                            entry.taken = True
                        # Queueing: before its admission, behind other requests' encodes on the encoder thread,
                        # and ready but behind other steps (never its own encodes).
                        return Round(batch=tuple((e.request.request_id, (e.waited_s + e.behind_s + now - e.ready_at) * 1000.0) for e in batch))
                if give_up is not None:
                    left = give_up - now
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def _plan(self, taken: list[tuple[Infer, float]], now: float) -> tuple[Admission, ...]:
        """An admission round: for each new session, the sessions to end so that it fits (or None:
        refused), as the table stands; the round's own sessions are never victims."""
        protect = {request.session_id for request, _ in taken}
        table = dict(self.sessions)  # as it will be once the planned victims are gone
        planned: set[str] = set()  # new sessions this round opens
        plan: list[Admission] = []
        for request, arrived in taken:
            victims: tuple[str, ...] | None = ()
            sid = request.session_id
            if sid not in table and sid not in planned:
                chosen = choose_victims(table, len(table) + len(planned) + 1 - self.capacity, protect)
                if chosen is None:
                    victims = None
                else:
                    victims = tuple(chosen)
                    planned.add(sid)
                    for victim in chosen:
                        del table[victim]
            plan.append(Admission(request, (now - arrived) * 1000.0, due(request, arrived), victims))
        return tuple(plan)

    def _ready_batch(self) -> list[Admitted]:
        """Ready requests of distinct sessions, at most ``max_batch``: earliest due first (ties in
        arrival order), or in arrival order (``schedule: arrival``)."""
        firsts: dict[str, Admitted] = {}
        for entry in self._admitted.values():  # a session's later request waits for its earlier one
            firsts.setdefault(entry.request.session_id, entry)
        candidates = [e for e in firsts.values() if e.ready]
        if self.schedule == "deadline":
            candidates.sort(key=lambda e: e.due)  # stable: ties keep arrival order
        return candidates[: self.max_batch]
