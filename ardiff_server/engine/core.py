"""The session engine: owns every session's model and KV state (in a worker, a Ray replica or a test).

One request at a time, so requests of a session are applied in the order they arrive. Sessions
live in an LRU table:

* opened on a session's first request, after the policy has accepted the observation (a bad
  observation is refused before any state changes). KV admission may first evict detached
  sessions: disconnected ones first, then ones their robot switched away from, least recently
  used first; the session being served never;
* ended by an :class:`~ardiff_server.engine.messages.End` request (a reset on the wire, or the
  front end's TTL expiry), by the LRU cap, under pool pressure, and when a step raises
  (transactional: the session is torn down so its next request starts a fresh window).

Every ending goes through :meth:`SessionEngine._end`, which drops the policy's state and hands
the session's KV back to the cache (every page and cross-attention slot back to the pool).

:meth:`SessionEngine.handle` turns one typed request into its typed reply and never raises; the
worker process (``worker.py``), the in-process client and Ray replicas all serve through it.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from ardiff_server.engine.messages import (
    ControlReply,
    Detach,
    DetachReason,
    End,
    EngineStats,
    ErrorKind,
    ErrorReply,
    Infer,
    InferReply,
    Reply,
    Request,
)
from kv import CapacityError, PagedKVCache, SessionKV
from policies.base import Policy, StepResult
from policies.observation import RobotObservation, UnsupportedObservation

logger = logging.getLogger(__name__)

Status = Literal["attached", "switched", "disconnected"]
WARMUP_SESSION = "__warmup__"  # a synthetic session: never recorded
# Eviction order: a robot that went away, then a session its robot switched away from, then the rest.
_EVICTION_RANK: dict[str, int] = {"disconnected": 0, "switched": 1, "attached": 2}


@dataclass
class SessionState:
    """One session in the engine: the policy's per-session state and the session's KV."""

    session_id: str
    policy_state: Any
    kv: SessionKV | None
    calls: int = 0
    status: Status = "attached"


@dataclass
class StepOutcome:
    result: StepResult
    session_id: str
    new_session: bool
    calls: int
    compute_ms: float


class SessionEngine:
    def __init__(self, policy: Policy, cache: PagedKVCache | None, *, max_sessions: int, rank: int = 0, recorder=None) -> None:
        self.policy = policy
        self.cache = cache
        self.max_sessions = max_sessions
        self.rank = rank
        self.recorder = recorder  # engine/recorder.py, when server.record_dir is set (rank 0)
        self.sessions: OrderedDict[str, SessionState] = OrderedDict()
        self.endings: Counter[str] = Counter()  # reason -> count
        self.steps = 0
        self.failures = 0
        self.warmup_ms: dict[str, float] = {}
        self._serving: str | None = None

    # -- typed requests -------------------------------------------------------------------

    def handle(self, request: Request, *, queued_ms: float = 0.0) -> Reply:
        """Serve one request; errors become :class:`ErrorReply`. The reply carries this rank's
        stats (a CFG-parallel worker replaces them with every rank's). ``queued_ms``: how long
        the request waited for the engine (recorded with the call)."""
        reply: Reply
        try:
            if isinstance(request, Infer):
                outcome = self.infer(request.session_id, request.observation, queued_ms=queued_ms)
                result = outcome.result
                reply = InferReply(
                    request.request_id, request.session_id, result.actions, result.timing_ms, result.info,
                    outcome.new_session, outcome.calls, outcome.compute_ms, (self.stats(),),
                )  # fmt: skip
            elif isinstance(request, End):
                reply = ControlReply(request.request_id, self.end(request.session_id, request.reason), (self.stats(),))
            elif isinstance(request, Detach):
                reply = ControlReply(request.request_id, self.detach(request.session_id, request.reason), (self.stats(),))
            else:
                raise TypeError(f"the engine cannot serve {type(request).__name__}")
        except UnsupportedObservation as exc:
            reply = ErrorReply(request.request_id, ErrorKind.BAD_REQUEST, str(exc), stats=(self.stats(),))
        except CapacityError as exc:
            reply = ErrorReply(request.request_id, ErrorKind.CAPACITY, str(exc), stats=(self.stats(),))
        except Exception as exc:
            logger.exception("request failed (session %s)", getattr(request, "session_id", "-"))
            message = f"{type(exc).__name__}: {exc}"
            reply = ErrorReply(request.request_id, ErrorKind.POLICY, message, traceback.format_exc(), (self.stats(),))
        return reply

    # -- requests -----------------------------------------------------------------------

    def infer(self, session_id: str, observation: RobotObservation, *, queued_ms: float = 0.0) -> StepOutcome:
        self.policy.check_observation(observation)  # before any state changes: a bad request
        session, new = self._get_or_open(session_id)
        self._serving = session_id
        start = time.perf_counter()
        try:
            result = self.policy.step(session.policy_state, observation)
        except BaseException:
            self.failures += 1
            self._end(session_id, "failed")  # transactional: nothing half-done survives
            raise
        finally:
            self._serving = None
        session.calls += 1
        self.steps += 1
        compute_ms = (time.perf_counter() - start) * 1000.0
        if self.recorder is not None and result.recording is not None and session_id != WARMUP_SESSION:
            self._record(session, observation, result, compute_ms, queued_ms)
        return StepOutcome(result, session_id, new, session.calls, compute_ms)

    def _record(self, session: SessionState, observation: RobotObservation, result: StepResult, compute_ms: float, queued_ms: float) -> None:
        from ardiff_server.engine.recorder import Chunk

        rec = result.recording
        self.recorder.add(session.session_id, Chunk(
            call=session.calls, prompt=observation.prompt, canvas=rec.canvas, predicted=rec.predicted,
            actions=result.actions, raw_actions=rec.raw_actions, state=rec.state, policy_timing=dict(result.timing_ms),
            compute_ms=compute_ms, queue_ms=queued_ms, info=dict(result.info),
        ))  # fmt: skip

    def idle_work(self) -> bool:
        """Background work between requests (recording); False when there is none."""
        return self.recorder is not None and self.recorder.idle_work()

    def close(self) -> None:
        """End every session and finish background work (shutdown)."""
        self.end_all("shutdown")
        if self.recorder is not None:
            self.recorder.close()

    def end(self, session_id: str, reason: str) -> bool:
        """End a session (a reset, the TTL, ...): its KV goes back to the pool. False if unknown."""
        return self._end(session_id, reason)

    def detach(self, session_id: str, reason: DetachReason = "disconnected") -> bool:
        """No connection is on it right now: it stays (to be resumed) but is evicted first."""
        session = self.sessions.get(session_id)
        if session is None:
            return False
        if _EVICTION_RANK[reason] < _EVICTION_RANK[session.status]:
            session.status = reason
        return True

    def end_all(self, reason: str) -> None:
        for session_id in list(self.sessions):
            self._end(session_id, reason)

    # -- table --------------------------------------------------------------------------

    def _get_or_open(self, session_id: str) -> tuple[SessionState, bool]:
        session = self.sessions.get(session_id)
        if session is not None:
            self.sessions.move_to_end(session_id)
            session.status = "attached"
            return session, False
        while len(self.sessions) >= self.max_sessions:
            if not self._evict_one("lru", session_id):
                raise CapacityError(f"server at capacity: {len(self.sessions)} sessions, none idle")
        kv = None
        if self.cache is not None:
            while True:
                try:
                    kv = self.cache.open_session(session_id)
                    break
                except CapacityError as exc:
                    if not self._evict_one("pressure", session_id):
                        raise CapacityError(
                            f"server at capacity: {len(self.sessions)} sessions hold the KV cache and none is idle ({exc})"
                        ) from None
        try:
            policy_state = self.policy.start_session(session_id, kv)
        except BaseException:
            if kv is not None:
                self.cache.end_session(kv)
            raise
        session = SessionState(session_id, policy_state, kv)
        self.sessions[session_id] = session
        logger.info("session %s opened (%d open)", session_id, len(self.sessions))
        return session, True

    def _evict_one(self, reason: str, protect: str) -> bool:
        """End the least recently used detached session: disconnected ones first, then switched-away ones."""
        candidates = [s for s in self.sessions.values() if s.session_id not in (protect, self._serving)]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: _EVICTION_RANK[s.status])  # stable: LRU within a class
        logger.warning("evicting session %s (%s; %s)", victim.session_id, reason, victim.status)
        return self._end(victim.session_id, reason)

    def _end(self, session_id: str, reason: str, *, count: bool = True) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        try:
            self.policy.end_session(session.policy_state)
        finally:
            if session.kv is not None:
                self.cache.end_session(session.kv)  # every page and cross-attention slot back to the pool
        if count:
            self.endings[reason] += 1
        if self.recorder is not None and session_id != WARMUP_SESSION:
            self.recorder.end(session_id, reason)
        logger.info("session %s ended (%s) after %d calls", session_id, reason, session.calls)
        return True

    # -- warm-up and stats --------------------------------------------------------------

    def warmup(self) -> dict[str, float]:
        """Walk a synthetic session through one full window and a restart, so every shape is
        compiled/captured before the first robot; then restore the pool exactly."""
        observations = list(self.policy.warmup_observations())
        if not observations:
            return {}
        free_before = self.cache.pool.num_free if self.cache else 0
        session_id = WARMUP_SESSION
        timings: dict[str, float] = {}
        try:
            for i, observation in enumerate(observations):
                outcome = self.infer(session_id, observation)
                timings[f"call{i}_ms"] = round(outcome.compute_ms, 1)
        finally:
            self._end(session_id, "warmup", count=False)  # not a real session ending
            self.steps = 0
        if self.cache is not None and self.cache.pool.num_free != free_before:
            raise RuntimeError(f"warm-up leaked KV pages: {free_before} free before, {self.cache.pool.num_free} after")
        logger.info("warm-up: %d calls %s", len(observations), timings)
        self.warmup_ms = timings
        return timings

    def stats(self) -> EngineStats:
        kv = self.cache.stats() if self.cache is not None else {"pages_total": 0, "pages_free": 0}
        return EngineStats(
            rank=self.rank,
            session_ids=tuple(self.sessions),
            sessions_attached=sum(s.status == "attached" for s in self.sessions.values()),
            steps=self.steps,
            failures=self.failures,
            endings=dict(self.endings),
            kv_pages_total=kv["pages_total"],
            kv_pages_free=kv["pages_free"],
            session_capacity=kv.get("session_capacity", self.max_sessions),
        )
