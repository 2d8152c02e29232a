"""What a policy tells clients about itself (torch-free: the front end imports it).

* :func:`droid_server_config` is the metadata frame every DROID client receives on connect: exactly
  RoboArena's ``PolicyServerConfig`` fields, because RoboArena's server test and DreamZero's
  client build that dataclass with ``PolicyServerConfig(**metadata)`` and reject any other key.
  A policy serving another embodiment sends that embodiment's frame instead
  (``ardiff_policies.embodiment.metadata_frame``: cameras, state keys, action split) and sets
  ``observation_schema``, by which the server decodes its requests.
* :class:`PolicyInfo` carries it plus everything else an operator may want (action shape,
  model, checkpoint), which the server publishes at ``GET /info``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ardiff_policies.embodiment import ObservationSchema
from ardiff_policies.inference_steps import StepBounds

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
    server_config: dict[str, Any]  # the metadata frame: exactly SERVER_CONFIG_KEYS (DROID), or the embodiment's
    action_horizon: int
    action_dim: int
    model: str
    checkpoint: str | None = None
    details: dict[str, Any] = field(default_factory=dict)  # JSON-able extras for /info
    # Sessions one Policy.step_batch call can hold in one forward. 1 for a policy without a real
    # batched forward: batching steps that run one after another only adds batch-mates' compute
    # to each request's latency (and to its request_timeout_s), so the engine does not.
    max_batch: int = 1
    # None: RoboArena's DROID keys. Else the embodiment's observation/<name> keys (and server_config is its frame).
    observation_schema: ObservationSchema | None = None
    # A policy's own wire served beside OpenPI's on the same socket (``ardiff_server/wire/lingbot_va.py``): None, or
    # "lingbot_va" (LingBot-VA's reset / infer / compute_kv_cache messages, one session per connection).
    native_protocol: str | None = None
    # Continues chunks: serves a request's ``continuation`` (policies/continuation.py) and says ``chunk_id`` / ``frozen``
    # in every reply. False: the front end refuses a ``continuation`` by name (never served as a plain chunk).
    continuations: bool = False
    # Camera frames per camera one call reads at most: the default per-request pixel budget counts this many
    # (server.max_request_pixels: auto, ardiff_server/wire/budget.py).
    max_frames_per_call: int = 1
    # True: a call reads only the newest max_frames_per_call frames of a stack (DreamZero), so the front end drops
    # older ones before decoding them; False: every frame sent reaches the policy (LingBot-VA checks the count).
    keeps_newest_frames: bool = False
    # The per-request denoising steps the policy takes (``policies/inference_steps.py``): wire key -> its bounds
    # (DreamZero: num_inference_steps; LingBot-VA: num_inference_steps, its video loop, and action_num_inference_steps).
    # A key not here is refused by name by the front end.
    inference_steps: dict[str, StepBounds] = field(default_factory=dict)

    def __post_init__(self) -> None:
        keys = tuple(self.server_config)
        if self.observation_schema is not None:
            if self.server_config.get("embodiment") != self.observation_schema.embodiment:
                raise ValueError("an embodiment's metadata frame must name the embodiment its observation schema is for")
        elif sorted(keys) != sorted(SERVER_CONFIG_KEYS):
            raise ValueError(f"server_config must hold exactly RoboArena's PolicyServerConfig keys {SERVER_CONFIG_KEYS}, got {keys}")

    @property
    def camera_resolutions(self) -> tuple[tuple[int, int], ...]:
        """(height, width) a client is asked to send, per camera: the schema's, else DROID's one resolution for
        each camera the metadata frame names (exterior cameras and the wrist)."""
        if self.observation_schema is not None:
            return tuple(tuple(size) for size in self.observation_schema.resolutions)
        config = self.server_config
        cameras = int(config["n_external_cameras"]) + int(bool(config["needs_wrist_camera"]))
        return (tuple(config["image_resolution"]),) * cameras

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
            **({"native_protocol": self.native_protocol} if self.native_protocol else {}),
            # the per-request denoising steps it takes (key -> min, max and the setting that sets them)
            **({"inference_steps": {key: b.describe() for key, b in self.inference_steps.items()}} if self.inference_steps else {}),
            **self.details,
        }
