"""The session engine: owns every session's model and KV state (in a worker, a Ray replica or a test).

One request at a time, so requests of a session are applied in the order they arrive. Sessions
live in an LRU table:

* opened on a session's first request, after the policy has accepted the observation (a bad
  observation is refused before any state changes). KV admission may first evict idle
  sessions: disconnected ones first, then ones their robot switched away from, least recently
  used first; the session being served never;
* removed by ``release`` (explicit reset, disconnect TTL - decided by the front end), by the LRU
  cap, under pool pressure, and when a step raises (transactional: the session is torn down so
  its next request starts a fresh window).

Every removal goes through :meth:`SessionEngine._remove`, which closes the session's KV (every
page and cross-attention slot back to the pool) and drops the policy's state.

:meth:`SessionEngine.handle` turns one typed request into its typed reply and never raises; the
worker process (``proc.py``), the in-process client and Ray replicas all serve through it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ardiff_server.engine.messages import (
    CONTROL,
    ControlReply,
    Detach,
    EngineStats,
    ErrorKind,
    ErrorReply,
    Infer,
    InferReply,
    Release,
    Reply,
    Request,
)
from kv import CapacityError, PagedKVCache, SessionKV
from policies.base import Policy, StepResult
from policies.observation import RobotObservation, UnsupportedObservation

logger = logging.getLogger(__name__)

Status = Literal["active", "switched", "disconnected"]
WARMUP_SESSION = "__warmup__"  # a synthetic session: never recorded
# Eviction order: a robot that went away, then a session its robot switched away from, then the rest.
_EVICTION_RANK: dict[str, int] = {"disconnected": 0, "switched": 1, "active": 2}


@dataclass
class EngineSession:
    session_id: str
    state: Any
    kv: SessionKV | None
    calls: int = 0
    status: Status = "active"


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
        self.sessions: OrderedDict[str, EngineSession] = OrderedDict()
        self.removals: Counter[str] = Counter()  # reason -> count
        self.steps = 0
        self.failures = 0
        self._serving: str | None = None

    # -- typed requests -------------------------------------------------------------------

    def handle(self, request: Request, *, stats: Callable[[], tuple[EngineStats, ...]] | None = None, queued_ms: float = 0.0) -> Reply:
        """Serve one request; errors become :class:`ErrorReply`. ``stats`` gathers every rank's
        stats (a collective under CFG-parallel, so every rank must call handle for every request);
        ``queued_ms``: how long it waited for the engine (recorded with the call)."""
        reply: Reply
        try:
            if isinstance(request, Infer):
                outcome = self.infer(request.session_id, request.observation, queued_ms=queued_ms)
                result = outcome.result
                reply = InferReply(
                    request.request_id, request.session_id, result.actions, result.timing_ms, result.info,
                    outcome.new_session, outcome.calls, outcome.compute_ms,
                )  # fmt: skip
            elif isinstance(request, Release):
                reply = ControlReply(request.request_id, self.release(request.session_id, request.reason))
            elif isinstance(request, Detach):
                reply = ControlReply(request.request_id, self.detach(request.session_id, request.why))
            else:
                raise TypeError(f"the engine cannot serve {type(request).__name__}")
        except UnsupportedObservation as exc:
            reply = ErrorReply(request.request_id, ErrorKind.BAD_REQUEST, str(exc))
        except CapacityError as exc:
            reply = ErrorReply(request.request_id, ErrorKind.CAPACITY, str(exc))
        except Exception as exc:
            logger.exception("request failed (session %s)", getattr(request, "session_id", "-"))
            reply = ErrorReply(request.request_id, ErrorKind.POLICY, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        all_stats = stats() if stats is not None else (self.stats(),)
        return _with_stats(reply, all_stats)

    # -- requests -----------------------------------------------------------------------

    def infer(self, session_id: str, observation: RobotObservation, *, queued_ms: float = 0.0) -> StepOutcome:
        self.policy.check_observation(observation)  # before any state changes: a bad request
        session, new = self._get_or_open(session_id)
        self._serving = session_id
        start = time.perf_counter()
        try:
            result = self.policy.step(session.state, observation)
        except BaseException:
            self.failures += 1
            self._remove(session_id, "failed")  # transactional: nothing half-done survives
            raise
        finally:
            self._serving = None
        session.calls += 1
        self.steps += 1
        compute_ms = (time.perf_counter() - start) * 1000.0
        if self.recorder is not None and result.recording is not None and session_id != WARMUP_SESSION:
            self._record(session, observation, result, compute_ms, queued_ms)
        return StepOutcome(result, session_id, new, session.calls, compute_ms)

    def _record(self, session: EngineSession, observation: RobotObservation, result: StepResult, compute_ms: float, queued_ms: float) -> None:
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
        self.release_all("shutdown")
        if self.recorder is not None:
            self.recorder.close()

    def release(self, session_id: str, reason: str) -> bool:
        """End a session (explicit reset, disconnect TTL, ...). False if unknown."""
        return self._remove(session_id, reason)

    def detach(self, session_id: str, why: Status = "disconnected") -> bool:
        """No connection is on it right now: it stays (to be resumed) but is evicted first."""
        session = self.sessions.get(session_id)
        if session is None:
            return False
        if _EVICTION_RANK[why] < _EVICTION_RANK[session.status]:
            session.status = why
        return True

    def release_all(self, reason: str) -> None:
        for session_id in list(self.sessions):
            self._remove(session_id, reason)

    # -- table --------------------------------------------------------------------------

    def _get_or_open(self, session_id: str) -> tuple[EngineSession, bool]:
        session = self.sessions.get(session_id)
        if session is not None:
            self.sessions.move_to_end(session_id)
            session.status = "active"
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
            state = self.policy.start_session(session_id, kv)
        except BaseException:
            if kv is not None:
                kv.close()
            raise
        session = EngineSession(session_id, state, kv)
        self.sessions[session_id] = session
        logger.info("session %s opened (%d active)", session_id, len(self.sessions))
        return session, True

    def _evict_one(self, reason: str, protect: str) -> bool:
        """Evict the least recently used idle session: disconnected ones first, then switched-away ones."""
        candidates = [s for s in self.sessions.values() if s.session_id not in (protect, self._serving)]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: _EVICTION_RANK[s.status])  # stable: LRU within a class
        logger.warning("evicting session %s (%s; %s)", victim.session_id, reason, victim.status)
        return self._remove(victim.session_id, reason)

    def _remove(self, session_id: str, reason: str, *, count: bool = True) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        try:
            self.policy.end_session(session.state)
        finally:
            if session.kv is not None:
                session.kv.close()  # every page and cross-attention slot back to the pool
        if count:
            self.removals[reason] += 1
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
            self._remove(session_id, "warmup", count=False)  # not a real session ending
            self.steps = 0
        if self.cache is not None and self.cache.pool.num_free != free_before:
            raise RuntimeError(f"warm-up leaked KV pages: {free_before} free before, {self.cache.pool.num_free} after")
        logger.info("warm-up: %d calls %s", len(observations), timings)
        return timings

    def stats(self) -> EngineStats:
        kv = self.cache.stats() if self.cache is not None else {"pages_total": 0, "pages_free": 0}
        return EngineStats(
            rank=self.rank,
            sessions=len(self.sessions),
            sessions_attached=sum(s.status == "active" for s in self.sessions.values()),
            steps=self.steps,
            failures=self.failures,
            removals=dict(self.removals),
            kv_pages_total=kv["pages_total"],
            kv_pages_free=kv["pages_free"],
        )


def _with_stats(reply: Reply, stats: tuple[EngineStats, ...]) -> Reply:
    # Replies are frozen; rebuild with the stats attached.
    fields = {name: getattr(reply, name) for name in reply.__dataclass_fields__}
    return type(reply)(**{**fields, "stats": stats})


class RequestInbox:
    """Requests waiting for an engine: control requests first, then inference in arrival order.

    Per-session order is the front end's business (it never sends a session's next request before
    the previous one is answered), so serving resets and detaches ahead of queued inference of
    other sessions is safe, and it is what keeps a reset from waiting behind other robots.
    """

    def __init__(self) -> None:
        self._control: deque[tuple[Request, float]] = deque()
        self._infer: deque[tuple[Request, float]] = deque()
        self._ready = threading.Condition()

    def put(self, request: Request) -> None:
        with self._ready:
            (self._control if isinstance(request, CONTROL) else self._infer).append((request, time.monotonic()))
            self._ready.notify()

    def get(self) -> tuple[Request, float]:
        """The next request and how long it waited here, in ms (behind other sessions' steps)."""
        with self._ready:
            while not self._control and not self._infer:
                self._ready.wait()
            request, arrived = (self._control or self._infer).popleft()
        return request, (time.monotonic() - arrived) * 1000.0

    def empty(self) -> bool:
        with self._ready:
            return not self._control and not self._infer


# ------------------------------------------------------------------------------ building


def build_engine(config, rank: int = 0, world_size: int = 1, control=None) -> SessionEngine:
    """Policy and KV cache for one rank, sized from ``config`` (an ``AppConfig``).

    ``world_size`` 2 is CFG-parallel: ``torch.distributed`` must be initialised and ``control``
    is the group the ranks agree on the pool size over.
    """
    import torch.distributed as dist

    from policies.base import RuntimeOptions, build_policy
    from policies.guidance import Guidance

    engine_config = config.engine
    device = torch.device(engine_config.rank_device(rank))
    if device.type == "cuda":
        if device.index is None:  # "cuda": this process's current device, named explicitly
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    options = RuntimeOptions(
        device=str(device), dtype=engine_config.dtype,
        guidance=Guidance.single() if world_size == 1 else Guidance.parallel(rank),
        compile=engine_config.compile, compile_backend=engine_config.compile_backend, cuda_graphs=engine_config.cuda_graphs,
        record=config.server.record_dir is not None and rank == 0, max_sessions=engine_config.max_sessions,
        kv_budget_gib=engine_config.kv_budget_gib, kv_memory_fraction=engine_config.kv_memory_fraction,
    )  # fmt: skip
    policy = build_policy(config.policy_name, config.policy_options(), options)
    spec = policy.kv_spec()
    cache = None
    if spec is not None:
        budget = kv_budget_bytes(engine_config.kv_budget_gib, engine_config.kv_memory_fraction, device)
        pages = PagedKVCache.pages_for_budget(
            spec, budget, max_sessions=engine_config.max_sessions, num_branches=len(policy.branches)
        )
        if world_size > 1:  # both ranks must make the same admission decisions: agree on the pool size
            agreed = torch.tensor([pages])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
            pages = int(agreed)
        cache = PagedKVCache(
            spec, num_pages=pages + 1, max_sessions=engine_config.max_sessions, branches=policy.branches,
            device=device, attention_backend=engine_config.attention_backend,
        )  # fmt: skip
        logger.info(
            "KV cache: %d pages of %d tokens (%.1f MiB each), %d sessions, branches %s, %.1f MiB in all",
            cache.pool.capacity, spec.page_size, spec.page_bytes / 2**20, cache.session_capacity,
            [b.name for b in policy.branches], cache.storage_bytes / 2**20,
        )  # fmt: skip
    recorder = None
    if options.record:
        from ardiff_server.engine.recorder import Recorder

        recorder = Recorder(config.server.record_dir, max_bytes=int(config.server.record_max_gib * 2**30), decode=policy.decode_prediction)
    return SessionEngine(policy, cache, max_sessions=engine_config.max_sessions, rank=rank, recorder=recorder)


def set_threads(config, world_size: int) -> None:
    """torch intra-op threads for this engine: ``engine.threads``, else the cores split evenly."""
    processes = world_size * max(1, config.engine.replicas)
    torch.set_num_threads(config.engine.threads or max(1, (os.cpu_count() or 1) // processes))


def kv_budget_bytes(engine_budget_gib: float | None, fraction: float, device: torch.device) -> int:
    """Bytes for the KV cache: the configured budget, else a fraction of free device memory."""
    if engine_budget_gib is not None:
        return int(engine_budget_gib * 2**30)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    try:
        import psutil  # optional: precise available memory

        available = psutil.virtual_memory().available
    except ImportError:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    return int(available * fraction)
