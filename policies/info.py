"""What a policy tells clients about itself (torch-free: the front end imports it).

* :func:`droid_server_config` is the metadata frame every client receives on connect: exactly
  RoboArena's ``PolicyServerConfig`` fields, because RoboArena's server test and DreamZero's
  client build that dataclass with ``PolicyServerConfig(**metadata)`` and reject any other key.
* :class:`PolicyInfo` carries it plus everything else an operator may want (action shape,
  model, checkpoint), which the server publishes at ``GET /info``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# RoboArena's PolicyServerConfig fields, in its order.
SERVER_CONFIG_KEYS = (
    "image_resolution",
    "needs_wrist_camera",
    "n_external_cameras",
    "needs_stereo_camera",
    "needs_session_id",
    "action_space",
)


def droid_server_config(image_resolution: tuple[int, int] | list[int] = (180, 320)) -> dict[str, Any]:
    """RoboArena's ``PolicyServerConfig`` for a DROID joint-position policy (the metadata frame)."""
    return {
        "image_resolution": list(image_resolution),
        "needs_wrist_camera": True,
        "n_external_cameras": 2,
        "needs_stereo_camera": False,
        "needs_session_id": True,
        "action_space": "joint_position",
    }


@dataclass(frozen=True)
class PolicyInfo:
    server_config: dict[str, Any]  # the metadata frame: exactly SERVER_CONFIG_KEYS
    action_horizon: int
    action_dim: int
    model: str
    checkpoint: str | None = None
    details: dict[str, Any] = field(default_factory=dict)  # JSON-able extras for /info
    # Sessions one Policy.step_batch call can hold in one forward. 1 for a policy without a real
    # batched forward: batching steps that run one after another only adds batch-mates' compute
    # to each request's latency (and to its request_timeout_s), so the engine does not.
    max_batch: int = 1

    def __post_init__(self) -> None:
        keys = tuple(self.server_config)
        if sorted(keys) != sorted(SERVER_CONFIG_KEYS):
            raise ValueError(f"server_config must hold exactly RoboArena's PolicyServerConfig keys {SERVER_CONFIG_KEYS}, got {keys}")

    @property
    def action_shape(self) -> list[int]:
        return [self.action_horizon, self.action_dim]

    def describe(self) -> dict[str, Any]:
        """The policy part of ``GET /info``."""
        return {
            "model": self.model,
            "checkpoint": self.checkpoint,
            "action_horizon": self.action_horizon,
            "action_dim": self.action_dim,
            "action_shape": self.action_shape,
            "server_config": self.server_config,
            **self.details,
        }
