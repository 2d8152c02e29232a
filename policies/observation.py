"""The typed robot observation every policy receives.

The server decodes RoboArena / DROID wire dictionaries into this (see
``ardiff_server/observations.py``); policies never see raw wire keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        return {"wrist": self.wrist, "exterior_left": self.exterior_left, "exterior_right": self.exterior_right}
