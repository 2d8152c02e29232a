"""Session recordings: what the cameras saw next to what the model imagined, per call.

``server.record_dir: DIR`` (``--record DIR``) gives every session a folder ``DIR/<session>/``:

* ``rollout.mp4``: per call, the stitched camera canvas the model saw next to the model's decoded
  prediction of the chunk (the VAE decode of the denoised latents), with the call number and the
  prompt burned in;
* ``actions.npz``: ``actions`` (calls, horizon, dim) denormalized, ``state`` (calls, state dim),
  ``raw_actions`` (calls, horizon, model dim) before denormalization, ``calls``; a call that returned fewer
  actions than the longest (LingBot-VA's ``compute_kv_cache`` returns none) is NaN-padded, and ``horizons``
  says how many rows each call returned;
* ``timings.json``: per call ``policy_timing``, ``server_timing`` (as the engine measures it:
  ``infer_ms``, the step and the call's own encodes, also as ``encode_ms`` when it had any, and
  ``queue_ms``, the time the request waited for the engine behind other sessions' steps and
  encodes; the reply's ``queue_ms`` also counts the trip to the engine), window resets
  and prompt changes, the call's ``info`` (LingBot-VA: ``call``, the kind of call); once the session
  ends, ``ended``: why (``reset``, ``ttl``, ``failed``, ...);
* ``actions.png``: joint and gripper trajectories over the session (written when it ends).

Off the critical path: a step only keeps references to what it produced, and the engine thread only
queues them. The VAE decode of the prediction, the video encoding and the file writes run on the
recorder's own thread (at the lowest CPU priority; on a GPU the decode runs on that thread's own CUDA
stream, with a decode cache of its own, so it waits for neither the steps nor their encodes). The
queue is bounded (``MAX_PENDING_CHUNKS`` calls): when it is full (a disk or decode slower than the
robots) a call is dropped, never waited for, with a WARNING once per session, the counter
``ardiff_recording_dropped_calls_total``, and ``dropped_calls`` in the session's ``timings.json``.
At shutdown the calls still queued are written at once without their decode. Files are written incrementally - the MP4 is fragmented with
one fragment per call, the npz and json are replaced atomically after every call - so a crash
loses at most the last call. A session's files are finalised when it ends (reset, TTL expiry,
eviction, failure, shutdown). A session id used again after its session ended (a robot's next
episode after a reset) records into ``<id>.2``, ``<id>.3``, ...: an episode never overwrites another. The folder's size is bounded by ``server.record_max_gib``: the
oldest finished sessions are pruned first, with a log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ardiff_server.engine.messages import scalar_info

logger = logging.getLogger(__name__)

FPS = 4  # one call spans 4 camera frames at DROID's ~15 Hz control / 4x frame skip


def session_folder(root: Path, session_id: str) -> Path:
    """``root/<safe id>``: only [A-Za-z0-9._-], never "." or "..", a hash suffix where anything was
    replaced or cut (so distinct ids never share a folder); no id can point outside ``root``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", session_id)[:80].strip(".") or "session"
    if safe != session_id:
        safe += "-" + hashlib.sha256(session_id.encode()).hexdigest()[:10]
    return root / safe


@dataclass
class Chunk:
    """One call, as the engine hands it over (references only; decoded and written later)."""

    call: int
    prompt: str
    canvas: np.ndarray  # (T, H, W, 3) uint8: what the model saw
    predicted: Any  # the policy's prediction, decoded by ``decode`` in the engine's thread
    actions: np.ndarray  # (horizon, dim) denormalized
    raw_actions: np.ndarray  # (horizon, model dim)
    state: np.ndarray  # (state dim,)
    policy_timing: dict[str, float]
    compute_ms: float
    queue_ms: float = 0.0  # waiting for the engine, behind other sessions' work
    encode_ms: float = 0.0  # its session-own encodes on the engine's encoder thread (part of its compute)
    info: dict[str, Any] = field(default_factory=dict)
    wall_time: float = field(default_factory=time.time)


# Calls waiting for the recorder's thread (decode and disk), each holding its frames and latents; past this many a
# call is dropped (WARNING, a counter): a slow disk or decode never blocks the engine nor grows memory without bound.
MAX_PENDING_CHUNKS = 32


@dataclass(frozen=True)
class _End:
    reason: str
    dropped: tuple[int, ...]  # the session's calls the recorder had no room for


class Recorder:
    """Session recordings, off the engine's critical path: the engine thread only queues references
    (:meth:`add`, :meth:`end`: never blocking); one thread decodes the predictions and writes the files,
    at the lowest CPU priority."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        max_bytes: int,
        decode: Callable[[Any], np.ndarray | None],
        max_pending: int = MAX_PENDING_CHUNKS,
    ) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.decode = decode
        self.max_pending = max_pending
        self.dropped = 0  # calls dropped because the queue was full (EngineStats.recording_dropped)
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, Chunk | _End] | None] = deque()  # None: stop
        self._chunks = 0  # chunks queued or being decoded and written: the bound
        self._unfinished = 0  # items queued or in hand: flush() waits for none
        self._dropped: dict[str, list[int]] = {}  # session -> its calls dropped since it began (engine thread)
        self._closing = False  # shutdown: queued calls are written without their decode
        self._sessions: dict[str, _SessionFiles] = {}  # recorder thread only
        self._thread = threading.Thread(target=self._run, name="ardiff-recorder", daemon=True)
        self._thread.start()

    # -- engine thread --------------------------------------------------------------------

    def add(self, session_id: str, chunk: Chunk) -> bool:
        """Queue one call for decoding and writing; False (dropped, with a WARNING once per session) if the
        queue is full. Never blocks."""
        with self._cond:
            if self._chunks >= self.max_pending:
                self.dropped += 1
                calls = self._dropped.setdefault(session_id, [])
                calls.append(chunk.call)
            else:
                self._chunks += 1
                self._put((session_id, chunk))
                return True
        if len(calls) == 1:
            logger.warning(
                "recording: dropped call %d of session %s: %d calls already wait for the recorder's decode and disk "
                "(%d dropped in all; the session's timings.json lists its dropped_calls)",
                chunk.call,
                session_id,
                self.max_pending,
                self.dropped,
            )
        return False

    def end(self, session_id: str, reason: str) -> None:
        """The session ended: its files are finalised once its queued calls are written."""
        with self._cond:
            self._put((session_id, _End(reason, tuple(self._dropped.pop(session_id, ())))))

    def _put(self, item: tuple[str, Chunk | _End] | None) -> None:
        self._unfinished += 1
        self._queue.append(item)
        self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued so far is decoded and written; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unfinished == 0, timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write everything queued (shutdown) without waiting for decodes: the calls not decoded yet get a black
        prediction (``prediction_decoded`` false), so their actions and timings are kept and shutdown stays within
        ``server.shutdown_grace_s``. Then finalise every open session and stop the thread."""
        with self._cond:
            self._closing = True
            self._put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("recording: %d calls not written after %.0f s at shutdown; their recordings lack them", self._chunks, timeout_s)

    # -- recorder thread ------------------------------------------------------------------

    def _run(self) -> None:
        _lower_priority()
        written = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                item = self._queue.popleft()
            try:
                if item is None:
                    with self._cond:
                        dropped = {sid: tuple(calls) for sid, calls in self._dropped.items()}
                    for session_id, files in self._sessions.items():
                        files.finish("shutdown", dropped.get(session_id, ()))
                    self._sessions.clear()
                    return
                session_id, payload = item
                if isinstance(payload, Chunk):
                    self._write(session_id, payload)
                    written += 1
                    if written % 8 == 1:
                        self._prune()
                else:
                    files = self._sessions.pop(session_id, None)
                    if files is not None:
                        files.finish(payload.reason, payload.dropped)
            except Exception:
                logger.exception("recording session %s failed; its recording may be incomplete", item[0] if item else "-")
            finally:
                with self._cond:
                    self._unfinished -= 1
                    if item is not None and isinstance(item[1], Chunk):
                        self._chunks -= 1
                    self._cond.notify_all()

    def _write(self, session_id: str, chunk: Chunk) -> None:
        if self._closing:
            chunk.predicted = None
        else:
            try:
                chunk.predicted = self.decode(chunk.predicted)
            except Exception:
                logger.exception("recording: decoding the prediction of session %s failed", session_id)
                chunk.predicted = None
        files = self._sessions.get(session_id)
        if files is None:
            files = self._sessions[session_id] = _SessionFiles(_fresh_folder(session_folder(self.root, session_id)), session_id)
        files.add(chunk)

    def _prune(self) -> None:
        """Delete the oldest finished session folders while the tree is over ``max_bytes``."""
        open_folders = {f.folder for f in self._sessions.values()}
        folders = [p for p in self.root.iterdir() if p.is_dir()]
        sizes = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in folders}
        total = sum(sizes.values())
        for folder in sorted(folders, key=lambda p: p.stat().st_mtime):
            if total <= self.max_bytes:
                break
            if folder in open_folders:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            total -= sizes[folder]
            logger.warning("recording: pruned %s (%.1f MiB) to stay under server.record_max_gib", folder.name, sizes[folder] / 2**20)


class _SessionFiles:
    """One session's recording, owned by the recorder thread."""

    def __init__(self, folder: Path, session_id: str) -> None:
        self.folder = folder
        self.session_id = session_id
        folder.mkdir(parents=True, exist_ok=True)
        self.video = None
        self.stream = None
        self.calls: list[int] = []
        self.actions: list[np.ndarray] = []
        self.raw_actions: list[np.ndarray] = []
        self.states: list[np.ndarray] = []
        self.timings: list[dict[str, Any]] = []
        self.ended: str | None = None
        self.dropped: list[int] = []  # calls never recorded: the queue was full

    def add(self, chunk: Chunk) -> None:
        self._add_video(chunk)
        self.calls.append(chunk.call)
        self.actions.append(chunk.actions)
        self.raw_actions.append(chunk.raw_actions)
        self.states.append(chunk.state)
        self.timings.append(
            {
                "call": chunk.call,
                "time": chunk.wall_time,
                "prompt": chunk.prompt,
                "policy_timing": chunk.policy_timing,
                "server_timing": _server_timing(chunk),
                "prediction_decoded": chunk.predicted is not None,  # false: decode failed, shutdown, or no video predicted
                "window_restart": bool(chunk.info.get("window_restart", False)),
                "prompt_change": bool(chunk.info.get("prompt_change", False)),
                # deprecated names of the two above, kept for one release
                "window_reset": bool(chunk.info.get("window_restart", False)),
                "prompt_changed": bool(chunk.info.get("prompt_change", False)),
                "info": scalar_info(chunk.info),
            }
        )
        self._write_arrays()
        self._write_timings()

    def _write_timings(self) -> None:
        out = {"session_id": self.session_id, "calls": self.timings, **({"ended": self.ended} if self.ended else {})}
        if self.dropped:
            out["dropped_calls"] = self.dropped
        _atomic_write(self.folder / "timings.json", json.dumps(out, indent=1).encode())

    def finish(self, reason: str, dropped: tuple[int, ...] = ()) -> None:
        self.ended = reason
        self.dropped = list(dropped)
        if dropped:
            logger.warning("recording of session %s lacks %d calls the recorder had no room for: %s", self.session_id, len(dropped), list(dropped))
        if self.timings:
            self._write_timings()
        if self.video is not None:
            for packet in self.stream.encode():
                self.video.mux(packet)
            self.video.close()
            self.video = None
        chunks = [(a, state) for a, state in zip(self.actions, self.states) if len(a)]  # calls that returned actions
        if chunks:
            from ardiff_server.media import plot_actions

            states = np.stack([state for _, state in chunks])
            try:
                plot_actions(
                    _pad([a for a, _ in chunks]),
                    self.folder / "actions.png",
                    state=states if states.size else None,
                    title=f"session {self.session_id} ({len(chunks)} chunks in {len(self.actions)} calls, ended: {reason})",
                )
            except Exception:
                logger.exception("recording: plotting session %s failed", self.session_id)
        logger.info("recording of session %s finished (%s): %d calls in %s", self.session_id, reason, len(self.actions), self.folder)

    def _write_arrays(self) -> None:
        path = self.folder / "actions.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            calls=np.asarray(self.calls),
            actions=_pad(self.actions),
            raw_actions=_pad(self.raw_actions),
            state=np.stack(self.states),
            horizons=np.asarray([len(a) for a in self.actions]),
        )
        os.replace(tmp, path)

    def _add_video(self, chunk: Chunk) -> None:
        frames = _side_by_side(chunk.canvas, chunk.predicted)
        label = f"call {chunk.call}  {chunk.prompt}"[:120]
        if self.video is None:
            import av

            height, width = frames.shape[1:3]
            # Fragmented MP4, one fragment per call (a key frame starts each call), flushed as it
            # is written: everything but the call being written survives a crash.
            self.video = av.open(
                str(self.folder / "rollout.mp4"), "w", options={"movflags": "frag_keyframe+empty_moov+default_base_moof", "flush_packets": "1"}
            )
            codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
            self.stream = self.video.add_stream(codec, rate=FPS, options={"tune": "zerolatency", "preset": "veryfast"} if codec == "libx264" else {})
            self.stream.width, self.stream.height, self.stream.pix_fmt = width - width % 2, height - height % 2, "yuv420p"
            self.stream.metadata["title"] = f"ardiff-server session {self.session_id}"
        import av

        for index, frame in enumerate(frames):
            image = _burn_label(frame[: self.stream.height, : self.stream.width], label)
            video_frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if index == 0:
                video_frame.pict_type = av.video.frame.PictureType.I
            for packet in self.stream.encode(video_frame):
                self.video.mux(packet)


def _server_timing(chunk: Chunk) -> dict[str, float]:
    """As the reply's (docs/spec.md §3), measured in the engine: ``infer_ms`` counts the call's own encodes."""
    timing = {"infer_ms": chunk.compute_ms + chunk.encode_ms, "queue_ms": chunk.queue_ms}
    if chunk.encode_ms:
        timing["encode_ms"] = chunk.encode_ms
    return timing


def _lower_priority() -> None:
    """Linux: this thread (and the codec and torch threads it starts, which inherit it) at the lowest CPU priority
    (nice 19), so the recording gets only the cores the engine's steps leave. Measured on the tiny model with a robot
    calling back to back (docs/performance.md): nice 0 slowed its p50 1.65x, nice 10 1.32x, nice 19 1.08x. Per thread
    on Linux only (elsewhere it would be the whole process)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError as exc:
            logger.info("recording: could not lower the recorder thread's priority (%s)", exc)


def _fresh_folder(folder: Path) -> Path:
    """``folder``, or ``folder.2``, ``folder.3``, ... if it is taken (an earlier episode of the same session id)."""
    candidate, n = folder, 1
    while candidate.exists():
        n += 1
        candidate = folder.with_name(f"{folder.name}.{n}")
    return candidate


def _pad(rows: list[np.ndarray]) -> np.ndarray:
    """(calls, horizon, dim): calls of fewer rows NaN-padded to the longest (float32)."""
    horizon = max(len(r) for r in rows)
    if all(len(r) == horizon for r in rows):
        return np.stack(rows)
    out = np.full((len(rows), horizon, rows[0].shape[1]), np.nan, np.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _side_by_side(canvas: np.ndarray, predicted: np.ndarray | None) -> np.ndarray:
    """(T, H, W, 3) seen | (T', H, W, 3) predicted -> (max(T, T'), H, 2W, 3); the shorter repeats
    its last frame. No prediction (decode failed): a black right half."""
    if predicted is None:
        predicted = np.zeros_like(canvas[:1])
    if predicted.shape[1:3] != canvas.shape[1:3]:
        predicted = _resize(predicted, canvas.shape[1:3])
    count = max(len(canvas), len(predicted))
    seen = canvas[np.minimum(np.arange(count), len(canvas) - 1)]
    imagined = predicted[np.minimum(np.arange(count), len(predicted) - 1)]
    return np.concatenate([seen, imagined], axis=2)


def _resize(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    from ardiff_server.media import resize_frame

    return np.stack([resize_frame(f, size) for f in frames])


def _burn_label(frame: np.ndarray, text: str) -> np.ndarray:
    from PIL import Image, ImageDraw

    image = Image.fromarray(np.ascontiguousarray(frame))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, image.width, 12), fill=(0, 0, 0))
    draw.text((2, 1), text, fill=(255, 255, 255))
    return np.asarray(image)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
