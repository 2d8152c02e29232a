"""Frame and chunk helpers both sides use: resizing frames and plotting action chunks (torch-free).

The engine's session recorder (``ardiff_server.engine.recorder``) and the client (``ardiff_client``:
its cameras and ``--plot``) both call these. They live here, not in the client, because the server
never imports the client package; the client may import this module (it loads numpy only).
Everything is stateless and safe from any thread: plots are drawn on a private
``matplotlib.figure.Figure`` (never pyplot's global figure manager).

Heavy dependencies are optional and imported on first use (Pillow for bilinear resizing, matplotlib
for plots); a missing one raises :class:`MissingDependency` whose message is one line naming what to
``pip install``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from ardiff_server.extras import install_hint

__all__ = ["MissingDependency", "optional_module", "plot_actions", "require_module", "require_plotting", "resize_frame"]

# DROID's action layout: 7 absolute joint positions, then the gripper.
_DROID_LABELS = (*(f"joint {i}" for i in range(7)), "gripper")


class MissingDependency(RuntimeError):
    """An optional package is not installed; the message is one line saying what to pip install."""


def require_module(module: str, pip_name: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise MissingDependency naming the pip package that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"{purpose} needs {pip_name} (the viz extra): {install_hint('viz')}") from None


def optional_module(module: str) -> ModuleType | None:
    """``module`` imported, or None when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def resize_frame(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Stretch an (H, W, 3) uint8 frame to ``size`` = (height, width), as the RoboArena
    evaluator does (no crop, no padding).

    Bilinear through Pillow when it is installed (it comes with matplotlib), else nearest
    neighbour in numpy; both are deterministic, so replays are repeatable on one machine.
    """
    height, width = size
    if frame.shape[:2] == (height, width):
        return frame
    pil = optional_module("PIL.Image")
    if pil is not None:
        return np.asarray(pil.fromarray(frame).resize((width, height), pil.Resampling.BILINEAR))
    rows = (np.arange(height) * frame.shape[0] // height).clip(0, frame.shape[0] - 1)
    cols = (np.arange(width) * frame.shape[1] // width).clip(0, frame.shape[1] - 1)
    return np.ascontiguousarray(frame[rows[:, None], cols[None, :]])


def require_plotting() -> None:
    """Raise MissingDependency now if plot_actions could not run (matplotlib missing)."""
    require_module("matplotlib.figure", "matplotlib", "plotting actions")


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

    figure_module = require_module("matplotlib.figure", "matplotlib", "plotting actions")
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
