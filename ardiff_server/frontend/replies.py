"""How every protocol's handler answers (``openpi.py``, ``lingbot_va.py``): one place times a call, counts it in the
metrics, logs it and words an engine error, so both protocols report the same timings and the same metrics.

A call's ``server_timing`` (docs/spec.md §3): ``infer_ms``, its compute wherever it ran (its batched step and its own
encodes on the engine's encoder thread, also as ``encode_ms`` when it had any); ``queue_ms``, the rest of the round
trip to the engine, waiting behind other robots' work (and the trip itself); ``prev_total_ms``, the connection's
previous request, from its frame's arrival to its reply; ``deadline_slack_ms``, for a request with a deadline, that
deadline less its step's start (negative: missed); ``next_call_p90_ms``, the server's estimate of the session's next
call's latency at the current load (``latency.py``: each answered call feeds it here). A reply that ran no policy call
(LingBot-VA's reset) reports its own time as ``infer_ms``, as upstream's server does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ardiff_policies.safety import rejected_check
from ardiff_server.engine.messages import EngineError, ErrorKind, InferReply, capacity_line
from ardiff_server.frontend.latency import ServiceTimes
from ardiff_server.frontend.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestClock:
    """When a request's frame arrived (``perf_counter``) and how long the connection's previous request took."""

    started: float
    prev_total_ms: float | None = None

    def deadline(self, actions_left_s: float | None) -> float | None:
        """The engine's deadline of a request whose robot had ``actions_left_s`` of actions left: the frame's arrival
        plus that, as ``time.monotonic()`` (the engine's clock on this host); None (no such field): due now."""
        if actions_left_s is None:
            return None
        return time.monotonic() - (time.perf_counter() - self.started) + actions_left_s


class Replies:
    """The reply helper both protocols' handlers share: ``metrics`` counted, tracebacks in errors only with ``debug``."""

    def __init__(self, metrics: Metrics, *, debug: bool = False) -> None:
        self.metrics = metrics
        self.debug = debug
        self.service_times = ServiceTimes()

    def served(self, session_id: str, reply: InferReply, clock: RequestClock, sent: float) -> dict[str, float]:
        """An answered call (``sent``: when it went to the engine) counted and logged; its ``server_timing``."""
        now = time.perf_counter()
        round_trip_ms = (now - sent) * 1000.0
        self.metrics.requests.labels("ok").inc()
        self.metrics.infer_seconds.observe(reply.infer_ms / 1000.0)
        self.metrics.queue_seconds.observe(reply.queue_ms / 1000.0)
        self.metrics.request_seconds.observe(now - clock.started)
        self.metrics.observe_deadline(reply)
        self.service_times.record(reply.batch_size, now - clock.started)
        for check in (reply.info.get("safety") or {}).get("clamped", ()):  # the gate's report (policy.safety): once per check
            self.metrics.safety_clamps.labels(check).inc()
        timing = {"infer_ms": reply.infer_ms, "queue_ms": max(0.0, round_trip_ms - reply.infer_ms)}
        if reply.encode_ms:
            timing["encode_ms"] = reply.encode_ms
        if reply.deadline_slack_s is not None:  # the request had a deadline (negative: its step started after it)
            timing["deadline_slack_ms"] = reply.deadline_slack_s * 1000.0
        if clock.prev_total_ms is not None:
            timing["prev_total_ms"] = clock.prev_total_ms
        expected = self.service_times.estimate(reply.batch_size)  # this call's own time included
        if expected is not None:
            timing["next_call_p90_ms"] = expected * 1000.0
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "session %s call %d: infer %.0f ms (encode %.0f), queue %.0f ms, %s",
                session_id,
                reply.calls,
                reply.infer_ms,
                reply.encode_ms,
                timing["queue_ms"],
                " ".join(f"{k}={v:.0f}" for k, v in reply.timing_ms.items()),
            )
        return timing

    def reset(self) -> None:
        """A reset served (its sessions ended), counted."""
        self.metrics.requests.labels("reset").inc()

    def uncalled_timing(self, clock: RequestClock) -> dict[str, float]:
        """The ``server_timing`` of a reply that ran no policy call: its own time as ``infer_ms``."""
        timing = {"infer_ms": (time.perf_counter() - clock.started) * 1000.0}
        if clock.prev_total_ms is not None:
            timing["prev_total_ms"] = clock.prev_total_ms
        return timing

    def forbidden(self, message: str) -> str:
        """A request for another API key's session, counted: the one-line text frame."""
        self.metrics.requests.labels("forbidden").inc()
        return f"forbidden: {message}"

    def batch(self, elements: int) -> None:
        """A batched frame answered (each of its ``elements`` counted by its own outcome besides)."""
        self.metrics.batch_elements.observe(elements)

    def bad_request(self, message: str) -> str:
        """A request refused by the front end (not the engine), counted: the one-line text frame."""
        self.metrics.requests.labels("bad_request").inc()
        return f"bad request: {message}"

    def error(self, exc: EngineError, session_id: str) -> str:
        """An engine error about ``session_id`` (or several, comma-separated), counted by its kind: the text frame."""
        self.metrics.requests.labels(exc.kind.value).inc()
        if exc.kind is ErrorKind.BAD_REQUEST:
            if (check := rejected_check(str(exc))) is not None:  # a safety gate reject (policy.safety, mode reject)
                self.metrics.safety_rejects.labels(check).inc()
            return f"bad request: {exc}"
        if exc.kind is ErrorKind.CAPACITY:
            return capacity_line(str(exc))
        if exc.kind is ErrorKind.POLICY:
            message = f"internal error: inference failed for session {session_id} ({exc}); the session was reset"
        elif exc.kind is ErrorKind.WORKER_DIED:
            message = f"internal error: {exc}; session {session_id} starts over on the next request"
        else:
            message = f"internal error: {exc}"
        if self.debug and exc.traceback:
            message += "\n" + exc.traceback
        return message


def chunk_info(reply: InferReply) -> dict[str, Any]:
    """The policy's chunk facts as top-level keys of a dict reply, for both protocols' handlers: ``chunk_id`` and
    ``frozen`` (and, when the request asked for a continuation, ``continuation``: applied or why not;
    ``ardiff_policies.continuation``). Every scalar fact (``call``, ``execute_from``, ...) goes in the ``session`` map."""
    chunk = reply.chunk
    top = {"chunk_id": chunk.chunk_id, "frozen": chunk.frozen, "continuation": chunk.continuation}
    return {key: value for key, value in top.items() if value is not None}
