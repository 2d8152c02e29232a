"""Where ``ardiff-client`` (``ardiff_client.replay``) takes its frames from: videos of a recorded episode, or
a synthetic moving pattern per camera; and which wire key each camera's frames go under."""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ardiff_client.records import ReplayError
from ardiff_client.video import find_camera_source, iter_frames
from ardiff_server.media import MissingDependency, resize_frame


class Camera(Protocol):
    def take(self, count: int) -> list[np.ndarray] | None:
        """The next ``count`` uint8 (H, W, 3) frames, or None once the source has run out."""


class SyntheticCamera:
    """A smooth moving pattern: drifting colour waves plus a blob on a Lissajous path.

    Smooth so a video model sees plausible motion rather than noise, and a pure function of
    (seed, camera, frame index) so two runs with one seed send identical frames. Every term
    is separable in (y, x) and built from outer products of 1-D vectors: about 1 ms per
    180x320 frame, so frame generation never dominates a replay.
    """

    def __init__(self, size: tuple[int, int], seed: int, camera: int, stride: int = 1) -> None:
        rng = np.random.default_rng([seed, camera])
        self._y = np.linspace(0.0, 1.0, size[0], dtype=np.float32)
        self._x = np.linspace(0.0, 1.0, size[1], dtype=np.float32)
        self._waves = rng.uniform(0.5, 2.5, size=(3, 2))  # cycles across the frame, per channel (y, x)
        self._phase = rng.uniform(0, 2 * math.pi, size=3)
        self._speed = rng.uniform(0.02, 0.06, size=3)  # cycles per frame
        self._orbit = rng.uniform(0.01, 0.04, size=2)  # blob path frequencies, cycles per frame
        self._colour = rng.uniform(0.2, 1.0, size=3)
        self._stride = stride
        self._t = 0

    def frame(self, t: int) -> np.ndarray:
        cy = 0.5 + 0.3 * math.sin(2 * math.pi * self._orbit[0] * t)
        cx = 0.5 + 0.35 * math.cos(2 * math.pi * self._orbit[1] * t)
        blob = np.outer(np.exp(-((self._y - cy) ** 2) / 0.01), np.exp(-((self._x - cx) ** 2) / 0.01))
        image = np.empty((self._y.size, self._x.size, 3), dtype=np.float32)
        for c, ((fy, fx), speed, phase, colour) in enumerate(zip(self._waves, self._speed, self._phase, self._colour, strict=True)):
            ay = 2 * math.pi * fy * self._y
            bx = 2 * math.pi * (fx * self._x + speed * t) + phase
            wave = np.outer(np.sin(ay), np.cos(bx)) + np.outer(np.cos(ay), np.sin(bx))  # sin(ay + bx)
            image[:, :, c] = 0.45 + 0.3 * wave + (0.5 * colour) * blob
        return (np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)

    def take(self, count: int) -> list[np.ndarray]:
        frames = [self.frame(self._t + i * self._stride) for i in range(count)]
        self._t += count * self._stride
        return frames


class VideoCamera:
    """Frames of one camera's video file or frame folder, decoded lazily and stretched to ``size``."""

    def __init__(self, source: Path, size: tuple[int, int], stride: int = 1, loop: bool = False) -> None:
        self.source, self._size, self._stride, self._loop = source, size, stride, loop
        self._frames = self._open()
        self._delivered = 0

    def _open(self) -> Iterator[np.ndarray]:
        return itertools.islice(iter_frames(self.source), 0, None, self._stride)

    def _next(self) -> np.ndarray | None:
        try:
            frame = next(self._frames, None)
            if frame is None and self._loop and self._delivered:
                self._frames = self._open()
                frame = next(self._frames, None)
        except MissingDependency:
            raise
        except Exception as exc:  # noqa: BLE001  av/imageio/PIL raise their own types; one line each
            raise ReplayError(f"cannot read {self.source}: {type(exc).__name__}: {exc}") from None
        if frame is None and not self._delivered:
            raise ReplayError(f"{self.source} holds no frames")
        if frame is not None:
            self._delivered += 1
            frame = resize_frame(frame, self._size)
        return frame

    def take(self, count: int) -> list[np.ndarray] | None:
        frames = []
        for _ in range(count):
            frame = self._next()
            if frame is None:
                return None
            frames.append(frame)
        return frames


def embodiment_schema(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``observation`` part of a non-DROID embodiment's metadata frame (None: a RoboArena / DROID server)."""
    observation = metadata.get("observation") if "embodiment" in metadata else None
    if isinstance(observation, Mapping) and isinstance(observation.get("cameras"), list) and isinstance(observation.get("state"), list):
        return dict(observation)
    return None


def frames_for_call(metadata: Mapping[str, Any], call: int, asked: int | None) -> int:
    """Frames per camera on the ``call``-th infer call (1-based): ``--frames-per-call`` where given, else the
    server's advertised ``frames_per_call`` ({first, later} and, for LingBot-VA, ``after_first_chunk``: 1, 4, 8),
    else DreamZero's contract (1, then 4)."""
    advertised = metadata.get("frames_per_call")
    advertised = advertised if isinstance(advertised, Mapping) else {}
    if call == 1:
        return int(advertised.get("first", 1))
    if asked is not None:
        return asked
    key = "after_first_chunk" if call == 2 and "after_first_chunk" in advertised else "later"
    return int(advertised.get(key, 4))


def camera_keys(metadata: Mapping[str, Any], camera_index: int) -> dict[str, str]:
    """Camera name -> request key for the cameras the server asks for (an embodiment's schema, or DROID's).

    The names are DROID's file names (1-indexed exterior cameras); the request keys follow
    ``--camera-index``. Without metadata, two exterior cameras and the wrist camera are sent.
    """
    schema = embodiment_schema(metadata)
    if schema is not None:
        return {str(c["name"]): str(c["key"]) for c in schema["cameras"]}
    n_external = metadata.get("n_external_cameras", 2)
    n_external = n_external if isinstance(n_external, int) and not isinstance(n_external, bool) else 2
    keys = {f"exterior_image_{i + 1}_left": f"observation/exterior_image_{i + camera_index}_left" for i in range(n_external)}
    if metadata.get("needs_wrist_camera", True) is not False:
        keys["wrist_image_left"] = "observation/wrist_image_left"
    return keys


def open_cameras(keys: Mapping[str, str], size: tuple[int, int], args: argparse.Namespace, warn: Callable[[str], None]) -> dict[str, Camera]:
    """Request key -> frame source. A camera missing from --video-dir is left out (the server
    renders it black) with a warning, since DROID episodes sometimes lack a view."""
    if args.video_dir is None:
        return {key: SyntheticCamera(size, args.seed, i, args.frame_stride) for i, key in enumerate(keys.values())}
    if not args.video_dir.is_dir():
        raise ReplayError(f"--video-dir {args.video_dir} is not a directory")
    offset = 0 if find_camera_source(args.video_dir, "exterior_image_0_left") else 1  # 0-indexed file names
    cameras: dict[str, Camera] = {}
    for name, key in keys.items():
        file_name = name
        if name.startswith("exterior_image_"):
            file_name = f"exterior_image_{int(name.split('_')[2]) - 1 + offset}_left"
        source = find_camera_source(args.video_dir, file_name)
        if source is None:
            warn(f"no {file_name}.mp4/.avi/.mkv or frame folder in {args.video_dir}: {key} is not sent")
            continue
        cameras[key] = VideoCamera(source, size, args.frame_stride, args.loop)
    if not cameras:
        wanted = ", ".join(f"{name}.mp4" for name in keys)
        raise ReplayError(f"no camera videos in {args.video_dir}: expected {wanted} (or .avi/.mkv, or frame folders)")
    return cameras


def take_frames(cameras: Mapping[str, Camera], count: int) -> dict[str, np.ndarray] | None:
    """One image value per camera: (H, W, 3) for one frame, (T, H, W, 3) for a stack."""
    images = {}
    for key, camera in cameras.items():
        frames = camera.take(count)
        if frames is None:
            return None
        images[key] = frames[0] if count == 1 else np.stack(frames)
    return images
