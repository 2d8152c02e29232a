"""The session engine: owns every session's model and KV state (in a worker, a Ray replica or a test).

Requests of a session are applied in the order they arrive. Control requests are served one at
a time; inference requests of several sessions that are waiting together run as one batch
(:meth:`SessionEngine.serve`, ``engine.max_batch``): each request is validated and admitted on its
own, then the policy runs every admitted session in one batched step. Sessions live in an LRU
table:

* opened on a session's first request, after the policy has accepted the observation (a bad
  observation is refused before any state changes). KV admission may first evict detached
  sessions: disconnected ones first, then ones their robot switched away from, least recently
  used first; a session being served (any member of the running batch) never. A new session that
  only a member of the running batch could make room for waits for the next, smaller batch;
* ended by an :class:`~ardiff_server.engine.messages.End` request (a reset on the wire, or the
  front end's TTL expiry), by the LRU cap, under pool pressure, and when a step raises
  (transactional: the session is torn down so its next request starts a fresh window).

Every ending goes through :meth:`SessionEngine._end`, which drops the policy's state and hands
the session's KV back to the cache (every page and cross-attention slot back to the pool).

:meth:`SessionEngine.handle` turns one typed request into its typed reply and never raises; the
worker process (``worker.py``), the in-process client and Ray replicas all serve through it.
"""

from __future__ import annotations

import dataclasses
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
from policies.progress import StepProgress, frames_label

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
    def __init__(
        self, policy: Policy, cache: PagedKVCache | None, *, max_sessions: int, max_batch: int = 1, rank: int = 0, recorder=None
    ) -> None:
        self.policy = policy
        self.cache = cache
        self.max_sessions = max_sessions
        self.max_batch = max_batch  # sessions per step the serving loop hands over: engine.max_batch, policy permitting
        self.rank = rank
        self.recorder = recorder  # engine/recorder.py, when server.record_dir is set (rank 0)
        self.sessions: OrderedDict[str, SessionState] = OrderedDict()
        self.endings: Counter[str] = Counter()  # reason -> count
        self.batches: Counter[int] = Counter()  # sessions per step -> steps
        self.steps = 0
        self.failures = 0
        self.warmup_ms: dict[str, float] = {}
        self._serving: set[str] = set()  # the running batch: never evicted

    # -- typed requests -------------------------------------------------------------------

    def serve(self, items: list[tuple[Request, float]]) -> tuple[list[Reply], list[tuple[Request, float]]]:
        """Serve what the inbox handed over (``(request, queued_ms)``: one control request, or a
        batch of inference requests). Returns the replies and the requests to put back at the head
        of the inbox (new sessions that could not be admitted beside this batch's members).
        Never raises; every reply carries this rank's stats."""
        if len(items) == 1 and not isinstance(items[0][0], Infer):
            request, queued_ms = items[0]
            return [self.handle(request, queued_ms=queued_ms)], []
        return self._infer_batch(items)

    def handle(self, request: Request, *, queued_ms: float = 0.0) -> Reply:
        """Serve one request; errors become :class:`ErrorReply`. The reply carries this rank's
        stats (a CFG-parallel worker replaces them with every rank's). ``queued_ms``: how long
        the request waited for the engine (recorded with the call)."""
        if isinstance(request, Infer):
            replies, deferred = self._infer_batch([(request, queued_ms)])
            assert not deferred  # alone, nothing defers it
            return replies[0]
        try:
            if isinstance(request, End):
                reply: Reply = ControlReply(request.request_id, self.end(request.session_id, request.reason), (self.stats(),))
            elif isinstance(request, Detach):
                reply = ControlReply(request.request_id, self.detach(request.session_id, request.reason), (self.stats(),))
            else:
                raise TypeError(f"the engine cannot serve {type(request).__name__}")
        except Exception as exc:
            logger.exception("request failed (session %s)", getattr(request, "session_id", "-"))
            reply = ErrorReply(request.request_id, ErrorKind.POLICY, f"{type(exc).__name__}: {exc}", traceback.format_exc(), (self.stats(),))
        return reply

    def _infer_batch(self, items: list[tuple[Infer, float]]) -> tuple[list[Reply], list[tuple[Infer, float]]]:
        replies: list[Reply] = []
        deferred: list[tuple[Infer, float]] = []
        admitted: list[tuple[Infer, float, SessionState, bool]] = []
        for request, queued_ms in items:
            if any(request.session_id == a[0].session_id for a in admitted):  # never twice in one forward
                deferred.append((request, queued_ms))
                continue
            try:
                self.policy.check_observation(request.observation)  # before any state changes: a bad request
                session, new = self._get_or_open(request.session_id, protect={a[0].session_id for a in admitted})
            except UnsupportedObservation as exc:
                replies.append(ErrorReply(request.request_id, ErrorKind.BAD_REQUEST, str(exc)))
            except CapacityError as exc:
                if admitted:  # only a member of this batch could make room: next, smaller batch
                    deferred.append((request, queued_ms))
                else:
                    replies.append(ErrorReply(request.request_id, ErrorKind.CAPACITY, str(exc)))
            except Exception as exc:
                logger.exception("session %s could not be opened", request.session_id)
                message = f"{type(exc).__name__}: {exc}"
                replies.append(ErrorReply(request.request_id, ErrorKind.POLICY, message, traceback.format_exc()))
            else:
                admitted.append((request, queued_ms, session, new))
        if admitted:
            replies += self._step(admitted)
        stats = (self.stats(),)
        return [dataclasses.replace(r, stats=stats) for r in replies], deferred

    def _step(self, admitted: list[tuple[Infer, float, SessionState, bool]]) -> list[Reply]:
        """One batched policy step over the admitted sessions; a failed session is torn down."""
        self._serving = {request.session_id for request, *_ in admitted}
        start = time.perf_counter()
        try:
            results = self.policy.step_batch([(session.policy_state, request.observation) for request, _, session, _ in admitted])
        except Exception as exc:  # the policy's batch machinery itself failed: every member did
            results = [exc] * len(admitted)
        finally:
            self._serving = set()
        compute_ms = (time.perf_counter() - start) * 1000.0
        self.batches[len(admitted)] += 1
        replies: list[Reply] = []
        for (request, queued_ms, session, new), result in zip(admitted, results):
            if isinstance(result, BaseException):
                self.failures += 1
                logger.error("step failed (session %s): %s", request.session_id, "".join(traceback.format_exception_only(result)).strip())
                self._end(request.session_id, "failed")  # transactional: nothing half-done survives
                message = f"{type(result).__name__}: {result}"
                trace = "".join(traceback.format_exception(result))
                replies.append(ErrorReply(request.request_id, ErrorKind.POLICY, message, trace))
                continue
            session.calls += 1
            self.steps += 1
            if self.recorder is not None and result.recording is not None and request.session_id != WARMUP_SESSION:
                self._record(session, request.observation, result, compute_ms, queued_ms)
            replies.append(InferReply(
                request.request_id, request.session_id, result.actions, result.timing_ms, result.info, new, session.calls,
                compute_ms, batch_size=len(admitted), queue_ms=queued_ms,
            ))  # fmt: skip
        return replies

    def infer(self, session_id: str, observation: RobotObservation, *, queued_ms: float = 0.0) -> StepOutcome:
        """One session's call, as a batch of one (scripts, tests, warm-up). Raises what the
        request's error reply would say."""
        reply = self.handle(Infer(-1, session_id, observation), queued_ms=queued_ms)
        if isinstance(reply, ErrorReply):
            if reply.kind is ErrorKind.BAD_REQUEST:
                raise UnsupportedObservation(reply.message)
            if reply.kind is ErrorKind.CAPACITY:
                raise CapacityError(reply.message)
            raise RuntimeError(f"session {session_id}: {reply.message}")
        result = StepResult(reply.actions, reply.timing_ms, reply.info)
        return StepOutcome(result, session_id, reply.new_session, reply.calls, reply.compute_ms)

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

    def _get_or_open(self, session_id: str, protect: set[str] = frozenset()) -> tuple[SessionState, bool]:
        """The session (moved to the LRU's end), or a new one. Admission may evict detached
        sessions, never ``session_id`` itself nor one in ``protect`` (members of the batch)."""
        session = self.sessions.get(session_id)
        if session is not None:
            self.sessions.move_to_end(session_id)
            session.status = "attached"
            return session, False
        keep = {session_id, *protect}
        while len(self.sessions) >= self.max_sessions:
            if not self._evict_one("lru", keep):
                raise CapacityError(f"server at capacity: {len(self.sessions)} sessions, none idle")
        kv = None
        if self.cache is not None:
            while True:
                try:
                    kv = self.cache.open_session(session_id)
                    break
                except CapacityError as exc:
                    if not self._evict_one("pressure", keep):
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

    def _evict_one(self, reason: str, protect: set[str]) -> bool:
        """End the least recently used session not in ``protect`` nor being served: disconnected ones
        first, then switched-away ones, then attached ones."""
        candidates = [s for s in self.sessions.values() if s.session_id not in protect and s.session_id not in self._serving]
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
        progress = StepProgress("warm-up", len(observations))  # a line per call: compile time per shape, time left
        try:
            for i, observation in enumerate(observations):
                outcome = self.infer(session_id, observation)
                timings[f"call{i}_ms"] = round(outcome.compute_ms, 1)
                progress.step(frames_label(observation.cameras))
        finally:
            self._end(session_id, "warmup", count=False)  # not a real session ending
            self.steps = 0
            self.batches.clear()
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
            batches=dict(self.batches),
            kv_pages_total=kv["pages_total"],
            kv_pages_free=kv["pages_free"],
            session_capacity=kv.get("session_capacity", self.max_sessions),
            max_batch=self.max_batch,
        )
