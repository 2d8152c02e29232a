"""What one ``ardiff-client`` run produced: its calls, its episode, its errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Ended = Literal["calls", "video", "error", "interrupted"]


class ReplayError(RuntimeError):
    """The run cannot go on (connection, protocol, input); the message is one line."""


class ServerError(ReplayError):
    """The server answered a request with a text frame: its error message."""


@dataclass
class CallRecord:
    """What one infer call sent and got back."""

    call: int  # 1-based
    frames: int  # frames per camera sent
    rtt_ms: float  # send -> reply received, encode/decode excluded
    actions: np.ndarray  # float32 (N, D)
    joint_position: np.ndarray  # (7,) sent
    gripper_position: np.ndarray  # (1,) sent
    reply_format: Literal["dict", "array"]
    server_timing: dict[str, float] = field(default_factory=dict)
    policy_timing: dict[str, float] = field(default_factory=dict)
    session: dict[str, Any] | None = None
    state: dict[str, np.ndarray] | None = None  # an embodiment's state keys sent (None: DROID's joints + gripper)

    def to_json(self) -> dict[str, Any]:
        if self.state is not None:
            sent = {"state": {k: v.tolist() for k, v in self.state.items()}}
        else:
            sent = {"joint_position": self.joint_position.tolist(), "gripper_position": self.gripper_position.tolist()}
        return {
            "call": self.call,
            "frames": self.frames,
            "rtt_ms": self.rtt_ms,
            "actions_shape": list(self.actions.shape),
            "reply_format": self.reply_format,
            "server_timing": self.server_timing,
            "policy_timing": self.policy_timing,
            "session": jsonable(self.session),
            **sent,
        }


@dataclass
class Episode:
    url: str
    metadata: dict[str, Any]
    session_id: str
    prompt: str
    size: tuple[int, int]
    camera_keys: list[str]
    records: list[CallRecord] = field(default_factory=list)
    ended: Ended = "calls"
    error: str | None = None
    reset_reply: Any = None


def jsonable(value: Any) -> Any:
    """Decoded msgpack values (numpy arrays/scalars, bytes, nested maps) -> JSON values."""
    if isinstance(value, dict):
        return {str(k.decode(errors="replace") if isinstance(k, bytes) else k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
