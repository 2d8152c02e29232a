"""Shared helpers for looking at episodes: reading camera videos and plotting action chunks.

Used by the replay client (``ardiff_server/tools/replay.py``) and meant for a server-side recorder,
so everything here is stateless and safe to call from any thread: plots are drawn on a
private ``matplotlib.figure.Figure`` (never pyplot's global figure manager).

All heavy dependencies are optional and imported on first use: PyAV (``av``) or, as a
fallback, ``imageio`` + ``imageio-ffmpeg`` for video files; Pillow (or imageio) for
directories of PNG/JPEG frames and for bilinear resizing; matplotlib for plots. A missing
one raises :class:`MissingDependency` whose message is one line naming what to
``pip install``. Importing this module costs only numpy (and never torch).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from ardiff_server.extras import install_hint, pip_command

__all__ = [
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "MissingDependency",
    "find_camera_source",
    "iter_frames",
    "plot_actions",
    "require_plotting",
    "require_video_reader",
    "resize_frame",
]

VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def _video_packages() -> str:
    return f"reading video files needs PyAV (the viz extra): {install_hint('viz')}"


# DROID's action layout: 7 absolute joint positions, then the gripper.
_DROID_LABELS = (*(f"joint {i}" for i in range(7)), "gripper")


class MissingDependency(RuntimeError):
    """An optional package is not installed; the message is one line saying what to pip install."""


def _require(module: str, pip_name: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise MissingDependency naming the pip package that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"{purpose} needs {pip_name} (the viz extra): {install_hint('viz')}") from None


def _optional(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------
# Reading frames
# ---------------------------------------------------------------------------------------


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
        backend = "av" if _optional("av") is not None else "imageio"
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
    if has_videos and _optional("av") is None and (_optional("imageio") is None or _optional("imageio_ffmpeg") is None):
        raise MissingDependency(_video_packages())
    has_folders = any(p.is_dir() and _image_files(p) for p in entries)
    if has_folders and _optional("PIL.Image") is None and _optional("imageio") is None:
        raise MissingDependency(f"reading image frames needs Pillow: {pip_command()} install pillow")


def require_plotting() -> None:
    """Raise MissingDependency now if plot_actions could not run (matplotlib missing)."""
    _require("matplotlib.figure", "matplotlib", "plotting actions")


def _iter_video_av(path: Path) -> Iterator[np.ndarray]:
    av = _require("av", "av", "reading video files")
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path} has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            yield frame.to_ndarray(format="rgb24")


def _iter_video_imageio(path: Path) -> Iterator[np.ndarray]:
    if _optional("imageio") is None or _optional("imageio_ffmpeg") is None:
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
    pil = _optional("PIL.Image")
    if pil is not None:
        return lambda file: np.asarray(pil.open(file).convert("RGB"))
    if _optional("imageio") is not None:
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


def resize_frame(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Stretch an (H, W, 3) uint8 frame to ``size`` = (height, width), as the RoboArena
    evaluator does (no crop, no padding).

    Bilinear through Pillow when it is installed (it comes with matplotlib), else nearest
    neighbour in numpy; both are deterministic, so replays are repeatable on one machine.
    """
    height, width = size
    if frame.shape[:2] == (height, width):
        return frame
    pil = _optional("PIL.Image")
    if pil is not None:
        return np.asarray(pil.fromarray(frame).resize((width, height), pil.Resampling.BILINEAR))
    rows = (np.arange(height) * frame.shape[0] // height).clip(0, frame.shape[0] - 1)
    cols = (np.arange(width) * frame.shape[1] // width).clip(0, frame.shape[1] - 1)
    return np.ascontiguousarray(frame[rows[:, None], cols[None, :]])


# ---------------------------------------------------------------------------------------
# Plotting
# ---------------------------------------------------------------------------------------


def plot_actions(
    actions: np.ndarray,
    path: str | os.PathLike,
    state: np.ndarray | None = None,
    title: str = "",
    labels: Sequence[str] | None = None,
) -> Path:
    """Plot an episode's action chunks, one subplot per action dimension, and save a PNG.

    ``actions``: (calls, horizon, dim), the chunk each call returned (a single (T, dim)
    trajectory is one chunk). Rows of NaN are skipped, so ragged chunks can be NaN-padded.
    The x axis is the action step, ``call * horizon + t``: chunk ``c`` starts at
    ``c * horizon``. Chunks alternate in colour and are separated by dotted lines, so a jump
    between the end of one chunk and the start of the next is visible.
    ``state``: optional (calls, k) state sent with each call (k <= dim; DROID: 7 joints +
    gripper), drawn as black dots at the start of the chunk it produced.
    ``labels``: subplot titles; default DROID's ``joint 0..6, gripper`` for dim 8.
    Returns the written path.
    """
    actions = _as_chunks(actions)
    calls, horizon, dim = actions.shape
    if state is not None:
        state = np.asarray(state, dtype=np.float64)
        state = state[:, None] if state.ndim == 1 else state
        if state.ndim != 2 or state.shape[0] != calls:
            raise ValueError(f"plot_actions: state must be (calls={calls}, k), got shape {state.shape}")
    if labels is None:
        labels = _DROID_LABELS if dim == len(_DROID_LABELS) else tuple(f"dim {i}" for i in range(dim))
    if len(labels) != dim:
        raise ValueError(f"plot_actions: {len(labels)} labels for {dim} action dimensions")

    figure_module = _require("matplotlib.figure", "matplotlib", "plotting actions")
    figure = figure_module.Figure(figsize=(12, 1.9 * ((dim + 1) // 2) + 0.6), dpi=100, layout="constrained")
    axes = figure.subplots((dim + 1) // 2, 2, sharex=True, squeeze=False).ravel()
    steps = np.arange(horizon)
    for d, ax in enumerate(axes[:dim]):
        for c in range(calls):
            ax.plot(c * horizon + steps, actions[c, :, d], color=f"C{c % 2}", linewidth=1.2, label="action chunk" if c == 0 else None)
        if state is not None and d < state.shape[1]:
            ax.plot(np.arange(calls) * horizon, state[:, d], "k.", markersize=4, label="state sent")
        if 1 < calls <= 200:  # past that the alternating colours alone separate chunks
            for c in range(1, calls):
                ax.axvline(c * horizon - 0.5, color="0.8", linewidth=0.6, linestyle=":", zorder=0)
        ax.set_title(labels[d], fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.25)
    for ax in axes[dim:]:
        ax.set_visible(False)
    for ax in axes[max(0, dim - 2) : dim]:
        ax.set_xlabel("action step (call x horizon + t)", fontsize=8)
    axes[0].legend(fontsize=7, loc="best")
    figure.suptitle(title or f"{calls} action chunks of {horizon} steps", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def _as_chunks(actions: np.ndarray) -> np.ndarray:
    """Validate ``actions`` and return it as float64 (calls, horizon, dim)."""
    actions = np.asarray(actions, dtype=np.float64)
    if actions.ndim == 2:
        actions = actions[None]
    if actions.ndim != 3 or 0 in actions.shape:
        raise ValueError(f"plot_actions: expected actions of shape (calls, horizon, dim), got {actions.shape}")
    return actions
