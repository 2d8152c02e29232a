"""The robot never waits: a control loop that asks for its next chunk while it executes this one.

Robot code (openpi-client style: you bring ``observe`` and ``act``, the runner does the rest)::

    from ardiff_client.async_runner import AsyncChunkRunner
    from ardiff_client.websocket_client import WebsocketPolicy

    with WebsocketPolicy("ws://robot-server:8000") as policy:
        runner = AsyncChunkRunner(policy, control_hz=15, prompt="put the cup in the bowl")
        report = runner.run(observe=my_robot.observation, act=my_robot.command, steps=600)
    print(report.summary())

Every control tick (``control_hz``) the runner executes the next action of its queue. When the actions
left reach a threshold it captures an observation and sends it in a background thread with ``continuation =
{"chunk_id": the chunk being executed, "executed": actions of it already done, "delay": the actions it expects
to do while waiting, "actions_left_s": the seconds of actions it has left (the server's deadline for it)}``. The
server freezes that many leading actions of the new chunk to the ones the robot executes meanwhile and generates
the rest to continue them. When the reply arrives after ``n`` executed actions, the queue becomes the new chunk
from index ``n`` (the splice); ``frozen >= n`` means the splice is seamless by construction.

When to ask (``asking``):

* ``adaptive`` (the default): as late as is safe. The server's reply says what the session's next call is expected
  to take at the current load (``server_timing.next_call_p90_ms``, docs/spec.md); the runner asks when the actions
  left reach ``ceil(that x rate)`` (or its own measured p90 latency, if more) ``+ margin_steps + blend_steps``.
  ``blend_steps`` old actions past the frozen ones are what the server's soft mask continues (RTC's execution
  horizon ends there, ``docs/design-notes.md``): the seam's room, spent only while the ask stays later than half
  a chunk (a slow call that needs half the chunk asks at ``delay + margin_steps``, never earlier than ``half``
  would). Before a reply carries an estimate (the first call, a server that sends none) it asks as ``half`` does.
* ``half``: when ``overlap`` of the chunk is left (0.5: LeRobot's ``chunk_size_threshold``), or the measured
  ``ceil(p90 latency x rate) + margin_steps`` if that is more. A robot whose latency is under half a chunk asks
  about twice as often as it must: on a shared server those calls are other robots' latency.

Modes: ``continuation`` (the above), ``async`` (asks early but sends no continuation: LeRobot's async
inference, DreamZero's clients), ``blocking`` (asks when the queue is empty and stands still until the
reply, what every client did before).

Per episode it reports control steps the robot stood still, latency p50/p99, the seam jump (joint change
across each splice) against the median step inside a chunk, and chunks used.

Time and transport are injectable: :class:`ThreadedRequester` (real clock, a background thread) serves
robots; ``scripts/bench_async.py`` drives the same runner on a simulated clock with injected latency.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from ardiff_client.chunk_reply import parse_chunk_reply

Mode = Literal["continuation", "async", "blocking"]
MODES: tuple[str, ...] = ("continuation", "async", "blocking")
Asking = Literal["adaptive", "half"]
ASKING: tuple[str, ...] = ("adaptive", "half")


class Requester(Protocol):
    """Sends one request at a time and hands its reply back when it has arrived."""

    def submit(self, request: dict[str, Any]) -> None: ...

    def poll(self) -> tuple[dict[str, Any], float] | None:
        """(reply, latency in seconds) once the reply of the submitted request arrived, else None."""


class ThreadedRequester:
    """Runs ``infer(request) -> reply`` in a background thread (one request at a time)."""

    def __init__(self, infer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.infer = infer
        self._replies: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, request: dict[str, Any]) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a request is already in flight")

        def work() -> None:
            started = time.perf_counter()
            try:
                reply: Any = self.infer(request)
            except Exception as exc:  # handed to the control loop, which raises it there
                reply = exc
            self._replies.put((reply, time.perf_counter() - started))

        self._thread = threading.Thread(target=work, name="ardiff-infer", daemon=True)
        self._thread.start()

    def poll(self) -> tuple[dict[str, Any], float] | None:
        try:
            reply, latency = self._replies.get_nowait()
        except queue.Empty:
            return None
        if isinstance(reply, BaseException):
            raise reply
        return reply, latency


class SimulatedClock:
    """Virtual time for benchmarks and tests: ``sleep`` advances it, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class DelayedRequester:
    """Computes each reply at once (``infer``) and hands it over ``latency_s`` later on ``clock``: a policy
    of any speed behaves like one of exactly that latency (``scripts/bench_async.py``)."""

    def __init__(self, infer: Callable[[dict[str, Any]], dict[str, Any]], clock: SimulatedClock, latency_s: float) -> None:
        self.infer, self.clock, self.latency_s = infer, clock, latency_s
        self._pending: tuple[dict[str, Any], float] | None = None

    def submit(self, request: dict[str, Any]) -> None:
        if self._pending is not None:
            raise RuntimeError("a request is already in flight")
        self._pending = (self.infer(request), self.clock() + self.latency_s)

    def poll(self) -> tuple[dict[str, Any], float] | None:
        if self._pending is None or self.clock() < self._pending[1] - 1e-9:
            return None
        reply, self._pending = self._pending[0], None
        return reply, self.latency_s


@dataclass
class EpisodeReport:
    """What one episode looked like from the robot."""

    mode: str
    control_hz: float
    asking: str = "half"  # when it asked (AsyncChunkRunner's asking)
    steps: int = 0  # control ticks
    idle_steps: int = 0  # ticks with no action to execute (the robot stood still)
    idle_per_chunk: list[int] = field(default_factory=list)  # per reply: idle ticks since the previous one arrived
    latencies_s: list[float] = field(default_factory=list)
    chunks: int = 0
    frozen: list[int] = field(default_factory=list)  # per reply: leading actions the server froze
    seam_jumps: list[float] = field(default_factory=list)  # per splice: |first new action - last executed|
    inner_steps: list[float] = field(default_factory=list)  # |a[i+1] - a[i]| for consecutive actions of one chunk
    # per splice: |next action of the old chunk - last executed|, the step the old plan itself took there (what a
    # continuation that follows it exactly would show as its seam)
    old_steps: list[float] = field(default_factory=list)
    fresh_reasons: dict[str, int] = field(default_factory=dict)  # why asked continuations were not applied
    continuations_asked: int = 0  # replies to requests that carried a continuation (what fresh_reasons count in)
    asked_left: list[int] = field(default_factory=list)  # per request after the first: actions left when it was asked
    horizon: int = 0  # actions per chunk (the last reply's)

    def summary(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies_s) * 1000.0
        inner = float(np.median(self.inner_steps)) if self.inner_steps else float("nan")
        seam = float(np.median(self.seam_jumps)) if self.seam_jumps else float("nan")
        return {
            "mode": self.mode,
            "steps": self.steps,
            "idle_steps": self.idle_steps,
            "idle_steps_per_chunk": float(np.mean(self.idle_per_chunk)) if self.idle_per_chunk else 0.0,
            # steady state: after the first chunk, which every mode waits for
            "steady_idle_per_chunk": float(np.mean(self.idle_per_chunk[1:])) if len(self.idle_per_chunk) > 1 else 0.0,
            "latency_p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
            "latency_p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
            "seam_jump": seam,
            "median_inner_step": inner,
            "seam_ratio": seam / inner if inner > 0 else float("nan"),
            "old_step_at_seam": float(np.median(self.old_steps)) if self.old_steps else float("nan"),
            "chunks": self.chunks,
            "chunks_per_s": self.chunks / (self.steps / self.control_hz) if self.steps else 0.0,
            # calls per chunk's worth of actions executed: 1 asks once per chunk, half-chunk asking about 2
            "asking": self.asking,
            "calls_per_chunk": self.chunks * self.horizon / self.steps if self.steps else 0.0,
            "asked_left_median": float(np.median(self.asked_left)) if self.asked_left else float("nan"),
            "fresh": dict(self.fresh_reasons),
        }


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """A reply just spliced in (``AsyncChunkRunner(on_chunk=...)``: progress while a run goes on)."""

    number: int  # 1-based
    step: int  # control ticks done when it arrived
    latency_s: float
    actions: int  # the chunk's actions
    frozen: int  # leading actions the server froze
    skipped: int  # actions of it done meanwhile (the splice starts past them)
    idle_steps: int  # ticks the robot stood still so far
    continuation: str | None  # "applied", why a requested continuation was served fresh, or None

    @property
    def left(self) -> int:
        """Actions of the chunk left to execute from the splice on."""
        return self.actions - self.skipped


@dataclass
class _Chunk:
    actions: np.ndarray
    chunk_id: int | None
    index: int = 0  # next action to execute

    @property
    def remaining(self) -> int:
        return len(self.actions) - self.index


@dataclass
class _InFlight:
    executed_at_capture: int  # the runner's executed-action counter when the observation was captured
    continued: bool  # the request carried a continuation


class AsyncChunkRunner:
    """Executes actions at ``control_hz`` and keeps the next chunk coming (see the module docstring).

    ``policy``: a :class:`Requester`, or any ``infer(request) -> reply`` callable (run in a thread).
    ``joint_columns``: action columns whose jump across a splice is reported (default: all).
    ``asking``: ``adaptive`` (ask as late as the server's estimate allows, keeping ``blend_steps`` old actions past the
    delay and ``margin_steps``) or ``half``. ``overlap``: in ``half`` asking (and ``adaptive`` before an estimate), ask
    no later than when this fraction of a chunk is left (0: only as the latency requires). ``on_chunk``: called with
    a :class:`ChunkEvent` for every reply spliced in.
    A reply that cannot be executed raises ``chunk_reply.ReplyError`` (one line naming the field).
    """

    def __init__(
        self,
        policy: Requester | Callable[[dict[str, Any]], dict[str, Any]],
        *,
        control_hz: float,
        prompt: str = "",
        mode: Mode = "continuation",
        asking: Asking = "adaptive",
        margin_steps: int = 1,
        blend_steps: int = 3,
        overlap: float = 0.5,
        latency_window: int = 8,
        session_id: str | None = None,
        joint_columns: slice | list[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        drain_timeout_s: float = 60.0,
        on_chunk: Callable[[ChunkEvent], None] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if control_hz <= 0:
            raise ValueError(f"control_hz must be > 0, got {control_hz}")
        if not 0.0 <= overlap < 1.0:
            raise ValueError(f"overlap must be in [0, 1), got {overlap}")
        if asking not in ASKING:
            raise ValueError(f"asking: expected one of {ASKING}, got {asking!r}")
        if margin_steps < 0 or blend_steps < 0:
            raise ValueError(f"margin_steps and blend_steps must be >= 0, got {margin_steps} and {blend_steps}")
        self.requester: Requester = policy if hasattr(policy, "submit") else ThreadedRequester(policy)  # type: ignore[assignment]
        self.control_hz, self.prompt, self.mode = control_hz, prompt, mode
        self.asking, self.blend_steps = asking, blend_steps
        self.margin_steps, self.overlap, self.latency_window = margin_steps, overlap, latency_window
        self.server_estimate_s: float | None = None  # the last reply's next_call_p90_ms, in seconds
        self.session_id = session_id or f"async-{uuid.uuid4()}"
        self.joint_columns = joint_columns if joint_columns is not None else slice(None)
        self.clock, self.sleep, self.drain_timeout_s = clock, sleep, drain_timeout_s
        self.on_chunk = on_chunk

    # -- the latency model --------------------------------------------------------------------

    def expected_delay_steps(self, latencies: list[float]) -> int:
        """Control steps a reply is expected to take: the p90 of the recent latencies, rounded up."""
        recent = latencies[-self.latency_window :]
        if not recent:
            return 0
        return math.ceil(float(np.percentile(recent, 90)) * self.control_hz)

    def threshold(self, latencies: list[float], chunk_size: int) -> int:
        """Ask for the next chunk when this many actions of a ``chunk_size``-action chunk are left (the module
        docstring): ``adaptive`` with the server's estimate, else ``half``'s."""
        delay = self.expected_delay_steps(latencies)
        if self.asking == "adaptive" and self.server_estimate_s is not None:
            latest = max(delay, math.ceil(self.server_estimate_s * self.control_hz - 1e-9)) + self.margin_steps
            # the blend rows are spent only while the ask stays later than half a chunk: never more calls than half's
            return max(latest, min(latest + self.blend_steps, math.ceil(chunk_size / 2)))
        return max(delay + self.margin_steps, math.ceil(self.overlap * chunk_size))

    # -- the loop -----------------------------------------------------------------------------

    def run(self, observe: Callable[[], dict[str, Any]], act: Callable[[np.ndarray], None], steps: int) -> EpisodeReport:
        """``steps`` control ticks: ``observe()`` gives the observation keys of a request, ``act(action)`` executes one."""
        report = EpisodeReport(self.mode, self.control_hz, self.asking)
        chunk: _Chunk | None = None
        in_flight: _InFlight | None = None
        executed = 0  # actions executed so far (all chunks)
        last_action: np.ndarray | None = None
        period = 1.0 / self.control_hz
        next_tick = self.clock()
        for _ in range(steps):
            arrived = self.requester.poll() if in_flight is not None else None
            if arrived is not None:
                reply, latency = arrived
                chunk = self._splice(reply, latency, in_flight, executed, chunk, last_action, report)
                in_flight = None
            empty = chunk is None or chunk.remaining == 0
            early = not empty and self.mode != "blocking" and chunk.remaining <= self.threshold(report.latencies_s, len(chunk.actions))
            if in_flight is None and (empty or early):
                in_flight = self._ask(observe(), chunk, executed, report)
            if chunk is None or chunk.remaining == 0:
                report.idle_steps += 1
            else:
                action = chunk.actions[chunk.index]
                if last_action is not None and chunk.index > 0:
                    report.inner_steps.append(self._distance(action, chunk.actions[chunk.index - 1]))
                act(action)
                chunk.index += 1
                executed += 1
                last_action = action
            report.steps += 1
            next_tick += period
            self.sleep(max(0.0, next_tick - self.clock()))
        if in_flight is not None:  # the connection is free again (for a reset) once the last reply is in
            deadline = self.clock() + self.drain_timeout_s
            while self.requester.poll() is None and self.clock() < deadline:
                self.sleep(period / 4)
        return report

    def _ask(self, observation: dict[str, Any], chunk: _Chunk | None, executed: int, report: EpisodeReport) -> _InFlight:
        request = {**observation, "prompt": self.prompt, "session_id": self.session_id, "endpoint": "infer"}
        if report.chunks:
            report.asked_left.append(chunk.remaining if chunk is not None else 0)
        if self.mode == "continuation" and chunk is not None:
            delay = min(self.expected_delay_steps(report.latencies_s), chunk.remaining)
            # actions_left_s: this tick's action is still to come, so the robot runs dry remaining ticks from now
            continuation: dict[str, Any] = {"executed": chunk.index, "delay": delay, "actions_left_s": chunk.remaining / self.control_hz}
            if chunk.chunk_id is not None:
                continuation["chunk_id"] = chunk.chunk_id
            request["continuation"] = continuation
        self.requester.submit(request)
        return _InFlight(executed, "continuation" in request)

    def _splice(
        self,
        reply: Any,
        latency: float,
        in_flight: _InFlight,
        executed: int,
        old: _Chunk | None,
        last_action: np.ndarray | None,
        report: EpisodeReport,
    ) -> _Chunk:
        parsed = parse_chunk_reply(reply, report.chunks + 1)
        actions = parsed.actions
        if parsed.next_call_s is not None:
            self.server_estimate_s = parsed.next_call_s
        report.horizon = len(actions)
        report.latencies_s.append(latency)
        report.idle_per_chunk.append(report.idle_steps - sum(report.idle_per_chunk))
        report.chunks += 1
        report.frozen.append(parsed.frozen)
        report.continuations_asked += int(in_flight.continued)
        reason = parsed.continuation
        if reason is not None and reason != "applied":
            report.fresh_reasons[reason] = report.fresh_reasons.get(reason, 0) + 1
        # The new chunk starts where the robot was when the observation was captured; skip what it did since.
        start = executed - in_flight.executed_at_capture if old is not None else 0
        start = min(start, len(actions) - 1)
        if last_action is not None and old is not None:
            report.seam_jumps.append(self._distance(actions[start], last_action))
            if old.remaining > 0:
                report.old_steps.append(self._distance(old.actions[old.index], last_action))
        if self.on_chunk is not None:
            self.on_chunk(ChunkEvent(report.chunks, report.steps, latency, len(actions), parsed.frozen, start, report.idle_steps, reason))
        return _Chunk(actions, parsed.chunk_id, start)

    def _distance(self, a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(np.asarray(a)[self.joint_columns] - np.asarray(b)[self.joint_columns]))


def joint_columns(metadata: Mapping[str, Any]) -> list[int]:
    """The action columns whose jump is reported: every key but grippers (an embodiment's ``actions.split``),
    DROID's 7 joints otherwise."""
    split = (metadata.get("actions") or {}).get("split") if isinstance(metadata.get("actions"), Mapping) else None
    if not split:
        return list(range(7))
    columns = [c for s in split if "gripper" not in str(s.get("name", "")) for c in range(int(s["start"]), int(s["stop"]))]
    return columns or [c for s in split for c in range(int(s["start"]), int(s["stop"]))]
