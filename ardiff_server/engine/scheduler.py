"""The engine's scheduler: what runs next, and for whom (shaped after vLLM v1's ``Scheduler``).

It owns, in one place, the decisions that decide whether one robot pays for another:

* **Order.** Control requests (end, detach) run between steps, ahead of queued inference, so a
  reset never waits behind other robots. The front end never sends a session's next request
  before the previous one is answered, so only requests of *different* sessions are reordered.
* **Admission and eviction** (:func:`choose_victims`). A new session gets a place only by ending
  sessions no robot is on: disconnected ones first, then ones their robot switched away from,
  least recently used first. Never an attached session, never one whose request waits, never
  another session of the same admission round, never one whose request arrived while the round
  executes (:meth:`Scheduler.arrived_sessions`, read when the victims are chosen). When nothing can go, the new session is refused
  with ``server at capacity`` naming the limit and the remedy; every existing robot carries on.
* **Batches.** Up to ``max_batch`` admitted requests of distinct sessions, in arrival order. A
  request whose session-own work (the encodes of a first call, a prompt change, a window restart:
  :meth:`policies.base.Policy.prepare`) runs on the engine's encoder thread is not ready, and
  does not hold the ready ones back: it joins a later batch.

Each decision is a :class:`Round`; ``SessionEngine.execute`` carries it out. Under CFG-parallel
only rank 0 schedules: it sends every round to the other rank, and both execute the same rounds,
so both admit, evict and batch alike (``worker.py``).

Torch-free: the worker's reader thread and the in-process client's callers put requests in.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ardiff_server.engine.messages import CAPACITY_PREFIX, CONTROL, Infer, Request, pickled_by_fields

# Eviction order: a robot that went away, then a session its robot switched away from. Attached: never.
EVICTABLE = {"disconnected": 0, "switched": 1}


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Round:
    """One scheduling decision: a control request alone, new requests to admit, or a batch to step.

    ``admit`` and ``batch`` hold ``(request, queued_ms)``: how long each waited in the engine so far."""

    control: Request | None = None
    admit: tuple[tuple[Infer, float], ...] = ()
    batch: tuple[tuple[int, float], ...] = ()  # admitted request ids

    @property
    def request_ids(self) -> tuple[int, ...]:
        if self.control is not None:
            return (self.control.request_id,)
        return tuple(r.request_id for r, _ in self.admit) + tuple(rid for rid, _ in self.batch)


class Evictable(Protocol):
    status: str  # "attached", "switched" or "disconnected"
    waiting: bool  # an admitted request of it is not answered yet


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


@dataclass
class _Admitted:
    request: Infer
    waited_s: float  # before its admission round
    ready_at: float | None = None  # time.monotonic() its session-own work was done (or it had none); None: not ready
    behind_s: float = 0.0  # its session-own work waited this long for the encoder thread, behind other requests' work
    taken: bool = False  # in a batch now

    @property
    def ready(self) -> bool:
        return self.ready_at is not None and not self.taken


@dataclass
class Scheduler:
    """Requests waiting for one engine, and the rounds that serve them.

    ``put`` may be called from any thread; everything else from the thread that serves."""

    max_batch: int = 1
    batch_wait_s: float = 0.0  # a partial batch waits this long for more ready requests (engine.batch_wait_ms)
    _control: deque = field(default_factory=deque)  # (request, arrived)
    _arrivals: deque = field(default_factory=deque)  # (Infer, arrived): not admitted yet
    _admitted: dict[int, _Admitted] = field(default_factory=dict)  # in arrival order
    _deadline: float | None = None  # when a partial batch stops waiting
    _cond: threading.Condition = field(default_factory=threading.Condition)

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

    # -- the serving thread ------------------------------------------------------------

    def admitted(self, request: Infer, waited_ms: float, *, ready: bool) -> None:
        """An admission round let ``request`` in (it had waited ``waited_ms`` for it); ``ready``:
        it has no session-own work pending (else :meth:`prepared` says when it is done)."""
        with self._cond:
            entry = self._admitted.get(request.request_id)
            if entry is None:  # rank 1 learns of requests only through rounds
                self._admitted[request.request_id] = entry = _Admitted(request, waited_ms / 1000.0)
            if ready and entry.ready_at is None:
                entry.ready_at = time.monotonic()

    def done(self, request_ids: Iterable[int]) -> None:
        """These admitted requests were answered (stepped, or failed)."""
        with self._cond:
            for request_id in request_ids:
                self._admitted.pop(request_id, None)

    def empty(self) -> bool:
        with self._cond:
            return not (self._control or self._arrivals or self._admitted)

    def arrived_sessions(self) -> frozenset[str]:
        """Sessions with a request that reached the scheduler and is not admitted yet, read under
        the lock: the reader thread adds to them while an admission round executes, and such a
        session's robot is back (admission must not end it: :func:`choose_victims`'s ``protect``)."""
        with self._cond:
            return frozenset(request.session_id for request, _ in self._arrivals)

    def next_round(self, *, wait_for_prepared: bool = False, timeout_s: float | None = None) -> Round | None:
        """The next round; blocks until there is one (None after ``timeout_s``).

        ``wait_for_prepared``: form no batch while session-own work is still running (callers that
        serve a fixed set of requests and want them batched as they were given: tests, warm-up)."""
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                if self._control:
                    request, arrived = self._control.popleft()
                    return Round(control=request)
                if self._arrivals:  # admit every arrival at once: they are one admission round
                    taken = [self._arrivals.popleft() for _ in range(len(self._arrivals))]
                    for request, arrived in taken:
                        self._admitted[request.request_id] = _Admitted(request, now - arrived)
                    return Round(admit=tuple((request, (now - arrived) * 1000.0) for request, arrived in taken))
                batch = self._ready_batch()
                pending = any(e.ready_at is None for e in self._admitted.values())
                wait: float | None = None
                if batch and not (wait_for_prepared and pending):
                    if len(batch) < self.max_batch and self.batch_wait_s > 0:
                        self._deadline = self._deadline or now + self.batch_wait_s
                        wait = self._deadline - now
                    if wait is None or wait <= 0:
                        self._deadline = None
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

    def _ready_batch(self) -> list[_Admitted]:
        """Ready requests of distinct sessions in arrival order, at most ``max_batch``."""
        batch: list[_Admitted] = []
        seen: set[str] = set()
        for entry in self._admitted.values():
            sid = entry.request.session_id
            # A session's later request waits for its earlier one (never twice in one forward).
            if entry.ready and sid not in seen:
                batch.append(entry)
                if len(batch) == self.max_batch:
                    break
            seen.add(sid)
        return batch
