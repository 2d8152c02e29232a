"""Typed messages between the front end and an engine (they cross a process boundary).

Requests go to the engine; every request carries a ``request_id`` and gets exactly one reply
with the same id. ``Ping`` / ``Pong`` are not requests: the worker's reader thread answers a
ping at once, saying which request the engine is computing and for how long. That answer is the
progress signal: the front end's watchdog and a request's compute timeout are measured from it
(a step's own compute, never its time in the queue).

Control requests (:class:`End`, :class:`Detach`) are served between steps ahead of queued
:class:`Infer` requests: ending a session never waits behind other robots' inference.

Observation arrays may travel through shared memory (``shm.py``): then the observation's array
fields hold :class:`shm.SharedArray` references instead of numpy arrays. Nothing here is ever
sent over the websocket (that is ``wire/protocol.py``), so pickling these between our own
processes is fine (``channel.py`` frames them).
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

import numpy as np

from ardiff_policies.chunk import ChunkInfo
from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation

_T = TypeVar("_T")

# Why a session is detached: its robot moved to another session id, or its last connection closed.
DetachReason = Literal["switched", "disconnected"]


def pickled_by_fields(cls: type[_T]) -> type[_T]:
    """Pickle a slotted dataclass as ``(cls, field values)``: dataclasses' own ``__getstate__``
    for ``slots=True`` is a Python loop over ``fields()``, which cost more than the rest of a
    request's trip to the worker. Fields are positional in declaration order."""
    values = operator.attrgetter(*(f.name for f in fields(cls)))
    if len(fields(cls)) == 1:
        cls.__reduce__ = lambda self: (cls, (values(self),))
    else:
        cls.__reduce__ = lambda self: (cls, values(self))
    return cls


class ErrorKind(enum.Enum):
    BAD_REQUEST = "bad_request"  # the observation does not suit the policy; the session is untouched
    CAPACITY = "capacity"  # no session slot or KV page can be freed for a new session
    POLICY = "policy_error"  # the step raised; the session was torn down
    TIMEOUT = "timeout"  # the step ran past the step timeout; the worker was restarted
    WORKER_DIED = "worker_died"  # the worker process died mid-request; it is being restarted
    UNAVAILABLE = "unavailable"  # shutting down, or no worker could be started


CAPACITY_PREFIX = "server at capacity: "  # how every ErrorKind.CAPACITY refusal reads on the wire


def capacity_line(message: str) -> str:
    """The one-line refusal a client gets for a CAPACITY error: the prefix once (the engine's own
    message already carries it; the front end's and the KV pool's do not)."""
    return message if message.startswith(CAPACITY_PREFIX) else CAPACITY_PREFIX + message


# An engine that failed this way holds no sessions any more (it died, was killed as stuck, or is
# gone): a control request to it has nothing left to do, so callers treat it as done.
SESSIONS_GONE = frozenset({ErrorKind.WORKER_DIED, ErrorKind.TIMEOUT, ErrorKind.UNAVAILABLE})


class EngineError(RuntimeError):
    """A request the engine could not serve; ``kind`` says how the server answers it."""

    def __init__(self, kind: ErrorKind, message: str, traceback: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.traceback = traceback

    @property
    def sessions_gone(self) -> bool:
        return self.kind in SESSIONS_GONE


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class EngineStats:
    """One rank's engine state, refreshed with every reply (``/metrics``, ``/info``, Ray routing)."""

    rank: int = 0
    session_ids: tuple[str, ...] = ()  # sessions open in the engine, least recently served first
    sessions_attached: int = 0  # of those, sessions a connection is on now (not detached)
    steps: int = 0
    failures: int = 0
    endings: dict[str, int] = field(default_factory=dict)  # reason -> sessions ended that way
    batches: dict[int, int] = field(default_factory=dict)  # batch size -> steps run with that many sessions
    kv_pages_total: int = 0
    kv_pages_free: int = 0
    session_capacity: int = 0  # sessions it can hold: engine.max_sessions, or fewer if the KV pool is smaller
    max_batch: int = 0  # sessions per forward it runs: engine.max_batch, or fewer (the policy's limit, the KV pool's)
    recording_dropped: int = 0  # calls the recorder dropped, its queue full (server.record_dir; rank 0)

    @property
    def sessions(self) -> int:
        return len(self.session_ids)


# -------------------------------------------------------------------------- requests


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Infer:
    """One robot's call. ``deadline``: when its robot runs out of actions, as ``time.monotonic()``
    on the engine's host (the front end converts the wire's seconds left); None (a blocking
    client, a first call): due now. The scheduler serves earliest deadline first (``scheduler.py``)."""

    request_id: int
    session_id: str
    observation: RobotObservation
    deadline: float | None = None


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class End:
    """End a session (``reset`` on the wire, TTL expiry): its KV pages go back to the pool."""

    request_id: int
    session_id: str
    reason: str


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Detach:
    """No connection is on this session right now: evict it before others under pressure."""

    request_id: int
    session_id: str
    reason: DetachReason


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Shutdown:
    request_id: int = -1


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness and progress: answered by the worker's reader thread at once, even mid-step, with
    the request the engine is computing and since when (:class:`Pong`)."""

    request_id: int


Request = Infer | End | Detach | Shutdown
CONTROL = (End, Detach, Shutdown)


# ---------------------------------------------------------------------------- replies


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class InferReply:
    request_id: int
    session_id: str
    actions: np.ndarray  # (horizon, action_dim) float32
    timing_ms: dict[str, float]  # per phase (the reply's policy_timing)
    info: dict[str, Any]  # policy's per-call diagnostics, e.g. dit_forwards
    new_session: bool
    calls: int
    compute_ms: float
    stats: tuple[EngineStats, ...] = ()
    replica: int = 0  # which engine replica served it (set by the client that talked to it)
    batch_size: int = 1  # sessions in the forward that computed it (engine.max_batch)
    queue_ms: float = 0.0  # how long it waited in the engine behind other robots' work (steps, their encodes), not its own
    encode_ms: float = 0.0  # its session-own work on the encoder thread (a window start's encodes); 0: none
    deadline_slack_s: float | None = None  # its deadline less its step's start (negative: missed); None: it had no deadline
    chunk: ChunkInfo = field(default_factory=ChunkInfo)  # what the reply says about its chunk (StepResult.chunk)

    @property
    def deadline_missed(self) -> bool:
        """Its step started after its robot ran out of actions."""
        return self.deadline_slack_s is not None and self.deadline_slack_s < 0

    @property
    def infer_ms(self) -> float:
        """This call's compute wherever it ran: its (batched) step and its own encodes beside the batch."""
        return self.compute_ms + self.encode_ms


def scalar_info(info: dict[str, Any]) -> dict[str, Any]:
    """The entries of a reply's ``info`` that JSON and msgpack carry as they are (bool, int,
    float, str): what the reply's ``session`` map and a recording's ``timings.json`` show."""
    return {k: v for k, v in info.items() if isinstance(v, bool | int | float | str)}


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class ControlReply:
    request_id: int
    done: bool = True  # End / Detach: whether the session existed
    stats: tuple[EngineStats, ...] = ()


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class ErrorReply:
    request_id: int
    kind: ErrorKind
    message: str
    traceback: str | None = None
    stats: tuple[EngineStats, ...] = ()

    def error(self) -> EngineError:
        return EngineError(self.kind, self.message, self.traceback)


Reply = InferReply | ControlReply | ErrorReply


# ------------------------------------------------------------ worker life (process only)


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Ready:
    info: PolicyInfo
    stats: tuple[EngineStats, ...]
    warmup_ms: dict[str, float]
    startup_s: float


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class StartFailed:
    error: str
    traceback: str


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class Pong:
    request_id: int
    running: tuple[int, ...] = ()  # the requests the engine is computing (one step, or one batch)
    running_s: float = 0.0  # for how long (the front end's clock is not the worker's)
