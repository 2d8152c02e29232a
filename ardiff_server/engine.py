"""The session engine: runs inside the worker process and owns every session's model and KV state.

One request at a time (the worker is single threaded), so requests of a session are applied in
the order they arrive. Sessions live in an LRU table:

* opened on a session's first request (KV admission may first evict idle sessions: detached
  ones before connected ones, least recently used first; the session being served never);
* removed by ``release`` (explicit reset, session switch, disconnect TTL - decided by the front
  end), by the LRU cap, under pool pressure, and when a step raises (transactional: the
  session is torn down so its next request starts a fresh window).

Every removal goes through :meth:`SessionEngine._remove`, which closes the session's KV (every
page and cross-attention slot back to the pool) and drops the policy's state.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kv import CapacityError, PagedKVCache, SessionKV
from policies.base import Policy, StepResult
from policies.observation import RobotObservation

logger = logging.getLogger(__name__)


@dataclass
class EngineSession:
    session_id: str
    state: Any
    kv: SessionKV | None
    calls: int = 0
    attached: bool = True  # a connection is using it (detached sessions are evicted first)


@dataclass
class StepOutcome:
    result: StepResult
    session_id: str
    new_session: bool
    calls: int
    compute_ms: float


class SessionEngine:
    def __init__(self, policy: Policy, cache: PagedKVCache | None, *, max_sessions: int, rank: int = 0) -> None:
        self.policy = policy
        self.cache = cache
        self.max_sessions = max_sessions
        self.rank = rank
        self.sessions: OrderedDict[str, EngineSession] = OrderedDict()
        self.removals: Counter[str] = Counter()  # reason -> count
        self.steps = 0
        self.failures = 0
        self._serving: str | None = None

    # -- requests -----------------------------------------------------------------------

    def infer(self, session_id: str, observation: RobotObservation) -> StepOutcome:
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
        return StepOutcome(result, session_id, new, session.calls, (time.perf_counter() - start) * 1000.0)

    def release(self, session_id: str, reason: str) -> bool:
        """End a session (explicit reset, session switch, disconnect TTL, ...). False if unknown."""
        return self._remove(session_id, reason)

    def detach(self, session_id: str) -> None:
        """Its connection went away: it stays (to be resumed) but is evicted first under pressure."""
        if session_id in self.sessions:
            self.sessions[session_id].attached = False

    def release_all(self, reason: str) -> None:
        for session_id in list(self.sessions):
            self._remove(session_id, reason)

    # -- table --------------------------------------------------------------------------

    def _get_or_open(self, session_id: str) -> tuple[EngineSession, bool]:
        session = self.sessions.get(session_id)
        if session is not None:
            self.sessions.move_to_end(session_id)
            session.attached = True
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
        """Evict the least recently used idle session, detached ones first."""
        candidates = [s for s in self.sessions.values() if s.session_id not in (protect, self._serving)]
        if not candidates:
            return False
        victim = next((s for s in candidates if not s.attached), candidates[0])
        logger.warning("evicting session %s (%s; %s)", victim.session_id, reason, "detached" if not victim.attached else "idle")
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
        session_id = "__warmup__"
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

    def stats(self) -> dict[str, Any]:
        kv = self.cache.stats() if self.cache is not None else {"pages_total": 0, "pages_free": 0}
        return {
            "rank": self.rank,
            "sessions": len(self.sessions),
            "sessions_attached": sum(s.attached for s in self.sessions.values()),
            "steps": self.steps,
            "failures": self.failures,
            "removals": dict(self.removals),
            "kv_pages_total": kv["pages_total"],
            "kv_pages_free": kv["pages_free"],
        }


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
