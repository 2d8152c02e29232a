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

Off the critical path: a step only keeps references to what it produced. The expensive VAE
decode runs in the engine's thread when no request is waiting (``idle_work``), and encoding and
file writes run in a writer thread. Files are written incrementally - the MP4 is fragmented with
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
import queue
import re
import shutil
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


class Recorder:
    def __init__(self, root: str | os.PathLike, *, max_bytes: int, decode: Callable[[Any], np.ndarray]) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.decode = decode
        self._pending: deque[tuple[str, Chunk | str]] = deque()  # (session, chunk or end reason)
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="ardiff-recorder", daemon=True)
        self._writer.start()
        self._sessions: dict[str, _SessionFiles] = {}  # writer thread only

    # -- engine thread --------------------------------------------------------------------

    def add(self, session_id: str, chunk: Chunk) -> None:
        self._pending.append((session_id, chunk))

    def end(self, session_id: str, reason: str) -> None:
        self._pending.append((session_id, reason))

    @property
    def has_work(self) -> bool:
        return bool(self._pending)

    def idle_work(self) -> bool:
        """Decode one pending chunk (or pass on one ending) to the writer. False if nothing to do."""
        if not self._pending:
            return False
        session_id, item = self._pending.popleft()
        if isinstance(item, Chunk):
            try:
                predicted = self.decode(item.predicted)
            except Exception:
                logger.exception("recording: decoding the prediction of session %s failed", session_id)
                predicted = None
            item.predicted = predicted
        self._writes.put((session_id, item))
        return True

    def close(self) -> None:
        """Finish everything pending (shutdown): decode, write, finalise every open session."""
        while self.idle_work():
            pass
        self._writes.put(None)
        self._writer.join(timeout=60)

    # -- writer thread --------------------------------------------------------------------

    def _write_loop(self) -> None:
        written = 0
        while True:
            item = self._writes.get()
            if item is None:
                for files in self._sessions.values():
                    files.finish("shutdown")
                self._sessions.clear()
                return
            session_id, payload = item
            try:
                if isinstance(payload, Chunk):
                    files = self._sessions.get(session_id)
                    if files is None:
                        files = self._sessions[session_id] = _SessionFiles(_fresh_folder(session_folder(self.root, session_id)), session_id)
                    files.add(payload)
                    written += 1
                    if written % 8 == 1:
                        self._prune()
                else:
                    files = self._sessions.pop(session_id, None)
                    if files is not None:
                        files.finish(payload)
            except Exception:
                logger.exception("recording session %s failed; its recording may be incomplete", session_id)

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
    """One session's recording, owned by the writer thread."""

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

    def add(self, chunk: Chunk) -> None:
        self._add_video(chunk)
        self.calls.append(chunk.call)
        self.actions.append(chunk.actions)
        self.raw_actions.append(chunk.raw_actions)
        self.states.append(chunk.state)
        self.timings.append({
            "call": chunk.call,
            "time": chunk.wall_time,
            "prompt": chunk.prompt,
            "policy_timing": chunk.policy_timing,
            "server_timing": _server_timing(chunk),
            "window_restart": bool(chunk.info.get("window_restart", False)),
            "prompt_change": bool(chunk.info.get("prompt_change", False)),
            # deprecated names of the two above, kept for one release
            "window_reset": bool(chunk.info.get("window_restart", False)),
            "prompt_changed": bool(chunk.info.get("prompt_change", False)),
            "info": scalar_info(chunk.info),
        })  # fmt: skip
        self._write_arrays()
        self._write_timings()

    def _write_timings(self) -> None:
        out = {"session_id": self.session_id, "calls": self.timings, **({"ended": self.ended} if self.ended else {})}
        _atomic_write(self.folder / "timings.json", json.dumps(out, indent=1).encode())

    def finish(self, reason: str) -> None:
        self.ended = reason
        if self.timings:
            self._write_timings()
        if self.video is not None:
            for packet in self.stream.encode():
                self.video.mux(packet)
            self.video.close()
            self.video = None
        chunks = [(a, state) for a, state in zip(self.actions, self.states) if len(a)]  # calls that returned actions
        if chunks:
            from ardiff_server.tools.media import plot_actions

            states = np.stack([state for _, state in chunks])
            try:
                plot_actions(_pad([a for a, _ in chunks]), self.folder / "actions.png", state=states if states.size else None,
                             title=f"session {self.session_id} ({len(chunks)} chunks in {len(self.actions)} calls, ended: {reason})")  # fmt: skip
            except Exception:
                logger.exception("recording: plotting session %s failed", self.session_id)
        logger.info("recording of session %s finished (%s): %d calls in %s", self.session_id, reason, len(self.actions), self.folder)

    def _write_arrays(self) -> None:
        path = self.folder / "actions.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez(
            tmp, calls=np.asarray(self.calls), actions=_pad(self.actions), raw_actions=_pad(self.raw_actions),
            state=np.stack(self.states), horizons=np.asarray([len(a) for a in self.actions]),
        )  # fmt: skip
        os.replace(tmp, path)

    def _add_video(self, chunk: Chunk) -> None:
        frames = _side_by_side(chunk.canvas, chunk.predicted)
        label = f"call {chunk.call}  {chunk.prompt}"[:120]
        if self.video is None:
            import av

            height, width = frames.shape[1:3]
            # Fragmented MP4, one fragment per call (a key frame starts each call), flushed as it
            # is written: everything but the call being written survives a crash.
            self.video = av.open(str(self.folder / "rollout.mp4"), "w",
                                 options={"movflags": "frag_keyframe+empty_moov+default_base_moof", "flush_packets": "1"})  # fmt: skip
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
    from ardiff_server.tools.media import resize_frame

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
