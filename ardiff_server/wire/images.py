"""A request's camera images: read (checked, sizes known), counted against the pixel budget, then decoded.

Two steps, so that nothing is decoded or copied before the whole request's pixels are counted
(``budget.py``): :func:`read_image` validates a value and learns its size (a raw array's shape, each JPEG's
header) and drops the frames the policy would drop (older than the newest ``PixelBudget.keep_frames``: not
decoded, not even their headers read); :func:`decode_images` checks the request's total, then decodes.

- Images are uint8 numpy arrays (H, W, 3) or frame stacks (T, H, W, 3), normalized to C-contiguous
  (T, H, W, 3) (views of the frame where possible: the engine client copies them once, into shared
  memory). Any size within :data:`MAX_IMAGE_SIDE` / :data:`MAX_FRAMES` is accepted: policies resize,
  the declared resolution is a hint (docs/spec.md §4).
- An image may also arrive JPEG-encoded: bytes (one frame) or a list of bytes (a frame stack of one size),
  decoded with Pillow (``jpeg.py``) straight into the stack, one frame at a time; corrupt = the key named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ardiff_server.wire.budget import PixelBudget
from ardiff_server.wire.jpeg import JpegError, JpegFrame, read_jpeg
from ardiff_server.wire.protocol import RequestError, describe

# Bounds on one image. A (64, 4096, 4096, 3) stack would be 3 GiB, but the codec's frame limit (64 MiB)
# bounds raw arrays, and the pixel budget every request, long before these do; these reject nonsense
# shapes with a message about the key rather than about bytes.
MAX_IMAGE_SIDE = 4096  # pixels, height and width
MAX_FRAMES = 64  # frames in one (T, H, W, 3) stack; DreamZero sends 1 or 4
IMAGE_EXPECTED = "a uint8 RGB image array (H, W, 3) or frame stack (T, H, W, 3), or JPEG bytes (a list of them for a stack)"
_BYTES = (bytes, bytearray, memoryview)


@dataclass(frozen=True)
class ArrayImage:
    """A raw uint8 (T, H, W, 3) stack: the frames that reach the policy, a view of the request's array."""

    key: str
    frames: np.ndarray

    @property
    def size(self) -> tuple[int, int, int]:
        return self.frames.shape[:3]

    def decode(self) -> np.ndarray:
        return self.frames if self.frames.flags.c_contiguous else np.ascontiguousarray(self.frames)


@dataclass(frozen=True)
class JpegImage:
    """JPEG frames of one size whose headers are read; ``where``: each one's name in errors (``key[i]``)."""

    key: str
    frames: tuple[JpegFrame, ...]
    where: tuple[str, ...]

    @property
    def size(self) -> tuple[int, int, int]:
        return len(self.frames), self.frames[0].height, self.frames[0].width

    def decode(self) -> np.ndarray:
        stack = np.empty((*self.size, 3), dtype=np.uint8)
        for out, frame, where in zip(stack, self.frames, self.where, strict=True):
            try:
                frame.decode_into(out)
            except JpegError as exc:
                raise RequestError(f"{where}: expected {IMAGE_EXPECTED}, got {exc}") from None
        return stack


CameraImage = ArrayImage | JpegImage


def read_image(key: str, value: Any, budget: PixelBudget | None = None) -> CameraImage | None:
    """A camera value checked and its size known, older frames than the policy keeps dropped; None if absent."""
    if value is None:
        return None
    keep: Callable[[int], int] = budget.kept if budget is not None else (lambda frames: frames)
    if isinstance(value, _BYTES) or (isinstance(value, list | tuple) and value and all(isinstance(v, _BYTES) for v in value)):
        return _read_jpeg_frames(key, value, keep)
    expected = IMAGE_EXPECTED
    if not isinstance(value, np.ndarray):
        raise RequestError(f"{key}: expected {expected} (images must be numpy arrays, not lists), got {describe(value)}")
    if value.dtype != np.uint8:
        raise RequestError(f"{key}: expected {expected}, got dtype {value.dtype}")
    if value.ndim not in (3, 4):
        raise RequestError(f"{key}: expected {expected}, got shape {value.shape}")
    if value.shape[-1] != 3:
        raise RequestError(f"{key}: expected 3 color channels last (RGB), got shape {value.shape}")
    frames = value if value.ndim == 4 else value[np.newaxis]
    num_frames, height, width, _ = frames.shape
    if not 1 <= num_frames <= MAX_FRAMES:
        raise RequestError(f"{key}: expected 1 to {MAX_FRAMES} frames, got shape {value.shape}")
    if not (1 <= height <= MAX_IMAGE_SIDE and 1 <= width <= MAX_IMAGE_SIDE):
        raise RequestError(f"{key}: expected height and width of 1 to {MAX_IMAGE_SIDE} pixels, got shape {value.shape}")
    return ArrayImage(key, frames[num_frames - keep(num_frames) :])


def _read_jpeg_frames(key: str, value: Any, keep: Callable[[int], int]) -> JpegImage:
    """JPEG bytes, or a list of them: the headers of the frames that reach the policy."""
    items = [value] if isinstance(value, _BYTES) else list(value)
    if not 1 <= len(items) <= MAX_FRAMES:
        raise RequestError(f"{key}: expected 1 to {MAX_FRAMES} JPEG frames, got {len(items)}")
    first = len(items) - keep(len(items))
    frames, where = [], []
    for i in range(first, len(items)):
        name = key if isinstance(value, _BYTES) else f"{key}[{i}]"
        try:
            frame = read_jpeg(items[i], MAX_IMAGE_SIDE)
        except JpegError as exc:
            raise RequestError(f"{name}: expected {IMAGE_EXPECTED}, got {exc}") from None
        if frames and (frame.height, frame.width) != (frames[0].height, frames[0].width):
            raise RequestError(
                f"{name}: frames of a stack must share one size, got {(frames[0].height, frames[0].width)} and {(frame.height, frame.width)}"
            )
        frames.append(frame)
        where.append(name)
    return JpegImage(key, tuple(frames), tuple(where))


def decode_images(images: dict[str, CameraImage | None], budget: PixelBudget | None = None) -> dict[str, np.ndarray | None]:
    """Every image of one request: first their declared pixels against ``budget`` (nothing decoded if over), then
    their pixels, as C-contiguous (T, H, W, 3) uint8 (raw arrays: views of the request where they can be)."""
    if budget is not None:
        budget.check((image.key, *image.size) for image in images.values() if image is not None)
    return {name: None if image is None else image.decode() for name, image in images.items()}
