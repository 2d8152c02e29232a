"""Reading a recorded episode's camera videos for ``ardiff-client``: video files and folders of frames.

PyAV (``av``) or, as a fallback, ``imageio`` + ``imageio-ffmpeg`` decode video files; Pillow (or
imageio) reads folders of PNG/JPEG frames. All are optional and imported on first use; a missing one
raises ``ardiff_server.media.MissingDependency`` (one line naming what to ``pip install``). Resizing
and plotting are ``ardiff_server.media``'s, shared with the server's session recorder. Importing
this module costs only numpy (and never torch).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ardiff_server.extras import install_hint, pip_command
from ardiff_server.media import MissingDependency, optional_module, require_module

__all__ = ["IMAGE_SUFFIXES", "VIDEO_SUFFIXES", "find_camera_source", "iter_frames", "require_video_reader"]

VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def _video_packages() -> str:
    return f"reading video files needs PyAV (the viz extra): {install_hint('viz')}"


def find_camera_source(directory: str | os.PathLike, name: str) -> Path | None:
    """The video file ``<name>.<mp4|avi|mkv|mov|webm>`` or frame folder ``<name>/`` in ``directory``.

    DROID stores one video per camera (``exterior_image_1_left.mp4``, ...); exported frames
    are often a folder per camera instead. A video file wins over a folder of the same name.
    """
    directory = Path(directory)
    for suffix in VIDEO_SUFFIXES:
        path = directory / f"{name}{suffix}"
        if path.is_file():
            return path
    folder = directory / name
    if folder.is_dir() and _image_files(folder):
        return folder
    return None


def iter_frames(source: str | os.PathLike, backend: str | None = None) -> Iterator[np.ndarray]:
    """Yield the frames of a video file or image folder in order, as uint8 RGB (H, W, 3).

    Decoding is lazy (one frame at a time) so a long 720p DROID episode never sits in
    memory whole. ``backend`` forces ``"av"`` or ``"imageio"`` for video files; by default
    PyAV is used when installed (fast, exact frame order), else imageio's ffmpeg plugin.
    """
    path = Path(source)
    if path.is_dir():
        return _iter_image_folder(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such video file or frame folder: {path}")
    if backend is None:
        backend = "av" if optional_module("av") is not None else "imageio"
    if backend == "av":
        return _iter_video_av(path)
    if backend == "imageio":
        return _iter_video_imageio(path)
    raise ValueError(f"unknown video backend {backend!r}: expected 'av' or 'imageio'")


def require_video_reader(directory: str | os.PathLike) -> None:
    """Raise MissingDependency now if ``directory``'s videos or frame folders cannot be read,
    so a client fails before it connects rather than halfway through an episode."""
    entries = list(Path(directory).iterdir()) if Path(directory).is_dir() else []
    has_videos = any(p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES for p in entries)
    if has_videos and optional_module("av") is None and (optional_module("imageio") is None or optional_module("imageio_ffmpeg") is None):
        raise MissingDependency(_video_packages())
    has_folders = any(p.is_dir() and _image_files(p) for p in entries)
    if has_folders and optional_module("PIL.Image") is None and optional_module("imageio") is None:
        raise MissingDependency(f"reading image frames needs Pillow: {pip_command()} install pillow")


def _iter_video_av(path: Path) -> Iterator[np.ndarray]:
    av = require_module("av", "av", "reading video files")
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path} has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            yield frame.to_ndarray(format="rgb24")


def _iter_video_imageio(path: Path) -> Iterator[np.ndarray]:
    if optional_module("imageio") is None or optional_module("imageio_ffmpeg") is None:
        raise MissingDependency(_video_packages())
    iio = importlib.import_module("imageio.v3")
    for frame in iio.imiter(path, plugin="FFMPEG"):
        yield _as_rgb(np.asarray(frame))


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _iter_image_folder(folder: Path) -> Iterator[np.ndarray]:
    """Frames of a folder of images, in file-name order (zero-padded names sort correctly)."""
    files = _image_files(folder)
    if not files:
        raise ValueError(f"{folder} holds no {'/'.join(IMAGE_SUFFIXES)} frames")
    read = _image_reader()
    for file in files:
        yield _as_rgb(read(file))


def _image_reader():
    pil = optional_module("PIL.Image")
    if pil is not None:
        return lambda file: np.asarray(pil.open(file).convert("RGB"))
    if optional_module("imageio") is not None:
        iio = importlib.import_module("imageio.v3")
        return lambda file: np.asarray(iio.imread(file))
    raise MissingDependency(f"reading image frames needs Pillow: {pip_command()} install pillow")


def _as_rgb(frame: np.ndarray) -> np.ndarray:
    """Grayscale -> RGB, RGBA -> RGB, any integer/float range -> uint8, C-contiguous."""
    if frame.ndim == 2:
        frame = np.repeat(frame[:, :, None], 3, axis=2)
    if frame.ndim != 3 or frame.shape[2] not in (3, 4):
        raise ValueError(f"expected an (H, W, 3) RGB frame, got shape {frame.shape}")
    frame = frame[:, :, :3]
    if frame.dtype != np.uint8:
        if frame.dtype.kind == "f":
            frame = np.clip(frame * 255.0 if frame.max(initial=0) <= 1.0 else frame, 0, 255)
        elif frame.dtype == np.uint16:
            frame = frame >> 8
        frame = frame.astype(np.uint8)
    return np.ascontiguousarray(frame)
