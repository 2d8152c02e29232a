"""The typed robot observation every policy receives (torch-free).

The server decodes RoboArena / DROID wire dictionaries into this (``ardiff_server/wire/decode.py``);
policies never see raw wire keys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

CAMERAS = ("wrist", "exterior_left", "exterior_right")
STATES = ("joint_position", "gripper_position", "cartesian_position")


class UnsupportedObservation(ValueError):
    """An observation the configured policy cannot take (e.g. a 1-pixel image). The server
    answers ``bad request`` with this message and the session is untouched."""


@dataclass(frozen=True)
class RobotObservation:
    """One DROID-style observation.

    Images are uint8 RGB frame stacks of shape (T, H, W, 3) with T >= 1 (a single frame
    arrives as T == 1). Any H, W: policies resize themselves. A camera the client did not
    send is ``None`` (DreamZero renders it as a black view).
    """

    exterior_left: np.ndarray | None = None
    exterior_right: np.ndarray | None = None
    wrist: np.ndarray | None = None
    joint_position: np.ndarray | None = None  # (7,) float32
    gripper_position: np.ndarray | None = None  # (1,) float32
    cartesian_position: np.ndarray | None = None  # (6,) float32
    prompt: str = ""

    @property
    def cameras(self) -> dict[str, np.ndarray | None]:
        return {name: getattr(self, name) for name in CAMERAS}

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array field that is set, by field name."""
        return {name: v for name in CAMERAS + STATES if isinstance(v := getattr(self, name), np.ndarray)}

    def with_arrays(self, arrays: dict[str, Any]) -> RobotObservation:
        return replace(self, **arrays)
