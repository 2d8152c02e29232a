"""The session engine: owns every session's model and KV state (in a worker, a Ray replica or a test).

It carries out the rounds its :class:`~ardiff_server.engine.scheduler.Scheduler` decides
(:meth:`SessionEngine.execute`; the one serving loop is ``loop.py``). The scheduler owns the
session table and the admitted requests; the engine owns what is in them (policy state, KV) and
tells the scheduler what it did:

* a control request: end or detach a session;
* an admission round: each new request is checked (a bad observation is refused before any
  state changes), the sessions the round says to end for a new one are ended (less any whose
  robot came back meanwhile: :meth:`~ardiff_server.engine.scheduler.Scheduler.make_room`), its
  session found or opened, and the session-own work of its call
  (:meth:`ardiff_policies.base.Policy.prepare`: text, image conditioning) started on the encoder
  thread, beside other robots' batched steps;
* a batch: the policy steps its sessions in one batched call. A failed batched phase is retried
  member by member inside the policy; a session whose own call fails is ended (transactional:
  its next request starts a fresh window) and the others get their normal replies.

Every ending goes through :meth:`SessionEngine._end`, which drops the policy's state and hands
the session's KV back to the cache (every page and cross-attention slot back to the pool).

:meth:`SessionEngine.handle` turns one typed request into its typed reply and never raises.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
import traceback
from collections import Counter, OrderedDict
from concurrent.futures import Future, wait
from dataclasses import dataclass

from ardiff_kv import CapacityError, PagedKVCache
from ardiff_policies.base import Policy, StepResult
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_policies.progress import StepProgress, frames_label
from ardiff_server.engine.encoder import EncoderThread
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
from ardiff_server.engine.scheduler import Admission, Admitted, Round, Schedule, Scheduler, SessionState

logger = logging.getLogger(__name__)

WARMUP_SESSION = "__warmup__"  # a synthetic session: never recorded


@dataclass
class StepOutcome:
    result: StepResult
    session_id: str
    new_session: bool
    calls: int
    compute_ms: float
    deadline_slack_s: float | None = None  # as InferReply's


class SessionEngine:
    def __init__(
        self,
        policy: Policy,
        cache: PagedKVCache | None,
        *,
        max_sessions: int,
        max_batch: int = 1,
        batch_wait_s: float = 0.0,
        schedule: Schedule = "deadline",
        rank: int = 0,
        recorder=None,
        warmup_batches: int = 1,
    ) -> None:
        self.policy = policy
        self.cache = cache
        self.max_sessions = max_sessions
        self.max_batch = max_batch  # sessions per step: engine.max_batch, policy and KV pool permitting
        self.rank = rank
        self.recorder = recorder  # engine/recorder.py, when server.record_dir is set (rank 0)
        self.warmup_batches = warmup_batches  # batch shapes warm-up walks (all of them when shapes compile)
        self.scheduler = Scheduler(
            max_batch=max_batch,
            batch_wait_s=batch_wait_s,
            schedule=schedule,
            max_sessions=max_sessions,
            kv_sessions=cache.session_capacity if cache is not None else None,
            pool_sessions=cache.pool.capacity // cache.reservation_per_session if cache is not None else None,
        )
        self.endings: Counter[str] = Counter()  # reason -> count
        self.batches: Counter[int] = Counter()  # sessions per step -> steps
        self.steps = 0
        self.failures = 0
        self.warmup_ms: dict[str, float] = {}
        self._encoder = EncoderThread()  # session-own work, beside the batched steps

    @property
    def sessions(self) -> OrderedDict[str, SessionState]:
        """The session table (the scheduler's), least recently served first."""
        return self.scheduler.sessions

    # -- typed requests -------------------------------------------------------------------

    def execute(self, round: Round) -> list[Reply]:
        """Carry out one scheduling round; every reply carries this rank's stats. Never raises."""
        if round.control is not None:
            return [self.handle(round.control)]
        replies = self._admit(round.admit) if round.admit else []
        if round.batch:
            replies += self._step(round.batch)
        stats = (self.stats(),)
        return [dataclasses.replace(r, stats=stats) for r in replies]

    def run(self, requests: list[Request], *, waited_ms: float = 0.0) -> list[Reply]:
        """Serve these requests to the end in this thread, batched as the scheduler forms batches
        (waiting for session-own work, so requests given together are stepped together): tests,
        scripts, warm-up. Replies in the order they were made."""
        for request in requests:
            self.scheduler.put(request, waited_ms=waited_ms)
        wanted = {r.request_id for r in requests}
        replies: list[Reply] = []
        while wanted:
            round = self.scheduler.next_round(wait_for_prepared=True)
            for reply in self.execute(round):
                wanted.discard(reply.request_id)
                replies.append(reply)
        return replies

    def handle(self, request: Request, *, queued_ms: float = 0.0) -> Reply:
        """Serve one request; errors become :class:`ErrorReply`. The reply carries this rank's
        stats (a CFG-parallel worker replaces them with every rank's)."""
        if isinstance(request, Infer):
            (reply,) = self.run([request], waited_ms=queued_ms)
            return reply
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

    def _admit(self, admissions: tuple[Admission, ...]) -> list[Reply]:
        """Check each new request, end what the round says to end for a new session, find or open
        its session, start its session-own work. A refused request is answered now; the others wait
        for a batch. Under CFG-parallel the ranks agree: a request refused on one rank is refused on both."""
        protect = {a.request.session_id for a in admissions}
        table = list(self.sessions)  # as the round found it: the same on every CFG rank
        errors: list[ErrorReply | None] = []
        opened: list[tuple[SessionState, bool] | None] = []
        for admission in admissions:
            request, error, entry = admission.request, None, None
            # read as late as may be: a session whose robot came back since the round was planned is spared
            spared = self._arrived(table) if admission.victims != () else set()
            try:
                self.policy.check_observation(request.observation)  # before any state changes: a bad request
                entry = self._attach_or_open(admission, protect, spared)
            except UnsupportedObservation as exc:
                error = ErrorReply(request.request_id, ErrorKind.BAD_REQUEST, str(exc))
            except CapacityError as exc:
                error = ErrorReply(request.request_id, ErrorKind.CAPACITY, str(exc))
            except Exception as exc:
                logger.exception("session %s could not be opened", request.session_id)
                error = ErrorReply(request.request_id, ErrorKind.POLICY, f"{type(exc).__name__}: {exc}", traceback.format_exc())
            errors.append(error)
            opened.append(entry)
        agreed = self.policy.agree([e is not None for e in errors])
        replies: list[Reply] = []
        for admission, error, entry, failed in zip(admissions, errors, opened, agreed):
            request = admission.request
            if failed:
                if entry is not None:  # refused on another CFG rank: undo what this one did
                    self.scheduler.release(entry[0])
                    if entry[1]:
                        self._end(request.session_id, "failed")
                replies.append(error or ErrorReply(request.request_id, ErrorKind.POLICY, "refused on the other CFG-parallel rank (see its log)"))
                continue
            session, new = entry
            admitted = Admitted(request, session, new, admission.queued_ms / 1000.0, admission.due)
            job = self._prepare_job(session, request)
            if job is not None:
                admitted.work, admitted.encode = self._encoder.submit(job)
            self.scheduler.admit(admitted, ready=job is None)
            if job is not None:  # after admit: the callback may run at once
                admitted.work.add_done_callback(functools.partial(self._prepared, admitted))
        return replies

    def _prepare_job(self, session: SessionState, request: Infer):
        try:
            return self.policy.prepare(session.policy_state, request.observation)
        except Exception:  # the step computes it inline, and fails there if it must
            logger.exception("session %s: preparing its call failed", request.session_id)
            return None

    def _prepared(self, admitted: Admitted, work: Future) -> None:
        """The encoder thread finished a request's session-own work: it may join a batch."""
        request = admitted.request
        if not work.cancelled() and work.exception() is not None:
            logger.warning("session %s: its encodes failed beside the batch (%s); its step does them itself", request.session_id, work.exception())
        self.scheduler.prepared(request.request_id, admitted.encode.behind_ms)

    def _step(self, batch: tuple[tuple[int, float], ...]) -> list[Reply]:
        """One batched policy step over admitted requests; a session whose call failed is ended."""
        members: list[tuple[Admitted, float]] = []
        replies: list[Reply] = []
        for admitted, (_, queued_ms) in zip(self.scheduler.take(rid for rid, _ in batch), batch):
            if admitted.work is not None:
                wait([admitted.work])  # the encoder thread's part (CFG rank 1 may still be at it)
            request = admitted.request
            if self.sessions.get(request.session_id) is not admitted.session:  # ended while it waited
                replies.append(ErrorReply(request.request_id, ErrorKind.POLICY, f"session {request.session_id} was ended while this request waited"))
                continue
            members.append((admitted, queued_ms))
        if not members:
            return replies
        started = time.monotonic()  # the engine clock deadlines are on
        start = time.perf_counter()
        try:
            results = self.policy.step_batch([(a.session.policy_state, a.request.observation) for a, _ in members])
        except Exception as exc:  # the policy's batch machinery itself failed: every member did
            results = [exc] * len(members)
        compute_ms = (time.perf_counter() - start) * 1000.0
        self.batches[len(members)] += 1
        for (admitted, queued_ms), result in zip(members, results):
            request, session, new = admitted.request, admitted.session, admitted.new
            if isinstance(result, UnsupportedObservation):  # refused before the session changed: a bad request, the session stays
                replies.append(ErrorReply(request.request_id, ErrorKind.BAD_REQUEST, str(result)))
                continue
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
            if self.recorder is not None and result.recording is not None and not request.session_id.startswith(WARMUP_SESSION):
                self._record(session, request.observation, result, compute_ms, queued_ms, admitted.encode_ms)
            replies.append(
                InferReply(
                    request.request_id,
                    request.session_id,
                    result.actions,
                    result.timing_ms,
                    result.info,
                    new,
                    session.calls,
                    compute_ms,
                    batch_size=len(members),
                    queue_ms=queued_ms,
                    encode_ms=admitted.encode_ms,
                    deadline_slack_s=None if request.deadline is None else request.deadline - started,
                    chunk=result.chunk,
                )
            )
        return replies

    def infer(self, session_id: str, observation: RobotObservation, *, queued_ms: float = 0.0, deadline: float | None = None) -> StepOutcome:
        """One session's call, as a batch of one (scripts, tests, warm-up). Raises what the
        request's error reply would say."""
        reply = self.handle(Infer(-1, session_id, observation, deadline), queued_ms=queued_ms)
        if isinstance(reply, ErrorReply):
            if reply.kind is ErrorKind.BAD_REQUEST:
                raise UnsupportedObservation(reply.message)
            if reply.kind is ErrorKind.CAPACITY:
                raise CapacityError(reply.message)
            raise RuntimeError(f"session {session_id}: {reply.message}")
        result = StepResult(reply.actions, reply.timing_ms, reply.info, chunk=reply.chunk)
        return StepOutcome(result, session_id, reply.new_session, reply.calls, reply.compute_ms, reply.deadline_slack_s)

    def _record(
        self,
        session: SessionState,
        observation: RobotObservation,
        result: StepResult,
        compute_ms: float,
        queued_ms: float,
        encode_ms: float,
    ) -> None:
        from ardiff_server.engine.recorder import Chunk

        rec = result.recording
        self.recorder.add(
            session.session_id,
            Chunk(
                call=session.calls,
                prompt=observation.prompt,
                canvas=rec.canvas,
                predicted=rec.predicted,
                actions=result.actions,
                raw_actions=rec.raw_actions,
                state=rec.state,
                policy_timing=dict(result.timing_ms),
                compute_ms=compute_ms,
                queue_ms=queued_ms,
                encode_ms=encode_ms,
                info={**result.info, **result.chunk.set_fields()},
            ),
        )

    def close(self) -> None:
        """End every session and finish background work (shutdown)."""
        self.end_all("shutdown")
        self._encoder.shutdown()
        if self.recorder is not None:
            self.recorder.close()

    def end(self, session_id: str, reason: str) -> bool:
        """End a session (a reset, the TTL, ...): its KV goes back to the pool. False if unknown."""
        return self._end(session_id, reason)

    def detach(self, session_id: str, reason: DetachReason = "disconnected") -> bool:
        """No connection is on it right now: it stays (to be resumed) but is evicted first."""
        return self.scheduler.detach(session_id, reason)

    def end_all(self, reason: str) -> None:
        for session_id in list(self.sessions):
            self._end(session_id, reason)

    # -- table --------------------------------------------------------------------------

    def _attach_or_open(self, admission: Admission, protect: set[str], spared: set[str]) -> tuple[SessionState, bool]:
        """The request's session (attached, its request waiting), or a new one in a place the
        scheduler makes (ending the sessions it names first). Raises CapacityError when it has none."""
        session_id = admission.request.session_id
        session = self.scheduler.attach(session_id)
        if session is not None:
            return session, False
        victims = self.scheduler.make_room(admission, protect=protect, spared=spared)
        if victims is None:
            raise CapacityError(self.scheduler.refusal())
        for victim in victims:
            reason = "lru" if len(self.sessions) >= self.max_sessions else "pressure"
            logger.warning("evicting session %s (%s; %s) for new session %s", victim, reason, self.sessions[victim].status, session_id)
            self._end(victim, reason)
        kv = self.cache.open_session(session_id) if self.cache is not None else None
        try:
            policy_state = self.policy.start_session(session_id, kv)
        except BaseException:
            if kv is not None:
                self.cache.end_session(kv)
            raise
        session = SessionState(session_id, policy_state, kv)
        self.scheduler.opened(session)
        logger.info("session %s opened (%d open)", session_id, len(self.sessions))
        return session, True

    def _arrived(self, table: list[str]) -> set[str]:
        """The sessions of ``table`` whose robot is back: a request of theirs reached the scheduler
        after the round was formed (read under its lock now, while the round executes). Only rank 0's scheduler takes requests, so under CFG-parallel the ranks
        agree (``Policy.agree``: an any-rank OR) and spare the same ones."""
        arrived = self.scheduler.arrived_sessions()
        flags = self.policy.agree([sid in arrived for sid in table])
        return {sid for sid, flag in zip(table, flags) if flag}

    def _end(self, session_id: str, reason: str, *, count: bool = True) -> bool:
        session = self.scheduler.closed(session_id)
        if session is None:
            return False
        try:
            self.policy.end_session(session.policy_state)
        finally:
            if session.kv is not None:
                self.cache.end_session(session.kv)  # every page and cross-attention slot back to the pool
        if count:
            self.endings[reason] += 1
        if self.recorder is not None and not session_id.startswith(WARMUP_SESSION):
            self.recorder.end(session_id, reason)
        logger.info("session %s ended (%s) after %d calls", session_id, reason, session.calls)
        return True

    # -- warm-up and stats --------------------------------------------------------------

    def warmup(self) -> dict[str, float]:
        """Walk a synthetic session through one full window and a restart, so every shape is
        compiled/captured before the first robot; with ``warmup_batches`` > 1 (compiled shapes),
        as many sessions in lockstep for every batch size up to it. Then restore the pool exactly."""
        observations = list(self.policy.warmup_observations())
        if not observations:
            return {}
        free_before = self.cache.pool.num_free if self.cache else 0
        capacity = self.cache.session_capacity if self.cache is not None else self.max_sessions
        sizes = range(1, max(1, min(self.warmup_batches, capacity, self.max_sessions)) + 1)
        timings: dict[str, float] = {}
        ids = itertools.count(-1, -1)
        progress = StepProgress("warm-up", len(sizes) * len(observations))  # a line per call: compile time per shape, time left
        for size in sizes:
            members = [WARMUP_SESSION if k == 0 else f"{WARMUP_SESSION}{k}" for k in range(size)]
            try:
                for i, observation in enumerate(observations, 1):
                    started = time.perf_counter()
                    replies = self.run([Infer(next(ids), sid, observation) for sid in members])
                    for reply in replies:
                        if isinstance(reply, ErrorReply):
                            raise RuntimeError(f"warm-up call {i} (batch of {size}) failed: {reply.message}")
                    # the call's wall time (encodes, compile and capture included), numbered as the progress line numbers it
                    took_ms = (time.perf_counter() - started) * 1000.0
                    timings[f"call{i}_ms" if size == 1 else f"batch{size}_call{i}_ms"] = round(took_ms, 1)
                    label = frames_label(observation.cameras)
                    progress.step(label if len(sizes) == 1 else f"batch of {size}, {label}", took_ms=took_ms)
            finally:
                for sid in members:
                    self._end(sid, "warmup", count=False)  # not a real session ending
                self.steps = 0
                self.batches.clear()
        if self.cache is not None and self.cache.pool.num_free != free_before:
            raise RuntimeError(f"warm-up leaked KV pages: {free_before} free before, {self.cache.pool.num_free} after")
        logger.info("warm-up: %d calls per batch size %s: %s", len(observations), list(sizes), timings)
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
            recording_dropped=self.recorder.dropped if self.recorder is not None else 0,
        )
