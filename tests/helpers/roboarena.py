"""What RoboArena's (and DreamZero's) clients expect of the metadata frame, written from the protocol."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PolicyServerConfig:
    """RoboArena's metadata dataclass as its server test and DreamZero's client build it:
    exactly these six fields, so ``PolicyServerConfig(**metadata)`` raises on any other key."""

    image_resolution: tuple[int, int]
    needs_wrist_camera: bool
    n_external_cameras: int
    needs_stereo_camera: bool
    needs_session_id: bool
    action_space: str
