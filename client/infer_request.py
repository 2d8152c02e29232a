"""What ``ardiff-client`` sends on an infer call: the request of a DROID robot or of another embodiment (its
advertised schema), and the state a simulated robot that follows the returned chunks reports next (``--feedback``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

# Franka Panda's "ready" pose (libfranka's examples): a plausible start state for a DROID arm.
READY_JOINTS = np.array([0.0, -math.pi / 4, 0.0, -3 * math.pi / 4, 0.0, math.pi / 2, math.pi / 4])

Feedback = Literal["end", "first", "hold"]


def initial_embodiment_state(schema: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Zeros under every state key an embodiment's schema advertises (its robot's start state)."""
    return {str(p["name"]): np.zeros(int(p["dim"])) for p in schema["state"]}


def build_request(images: Mapping[str, np.ndarray], joints: np.ndarray, gripper: np.ndarray, prompt: str, session_id: str) -> dict[str, Any]:
    return {
        **images,
        "observation/joint_position": joints,
        "observation/gripper_position": gripper,
        "prompt": prompt,
        "session_id": session_id,
        "endpoint": "infer",
    }


def build_embodiment_request(
    schema: Mapping[str, Any], images: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray], prompt: str, session_id: str
) -> dict[str, Any]:
    """An embodiment's request: its images (already under their keys) and each state key under its advertised key."""
    keys = {str(p["name"]): str(p["key"]) for p in schema["state"]}
    return {**images, **{keys[name]: value for name, value in state.items()}, "prompt": prompt, "session_id": session_id, "endpoint": "infer"}


def next_embodiment_state(
    actions: np.ndarray, feedback: Feedback, state: Mapping[str, np.ndarray], metadata: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """The state a robot following ``actions`` reports next: each state key takes the reply's columns of the
    action key of the same name (the metadata frame's ``actions.split``); other keys stay as they are."""
    if feedback == "hold":
        return dict(state)
    row = np.asarray(actions[-1] if feedback == "end" else actions[0], dtype=np.float64)
    split = (metadata.get("actions") or {}).get("split") or []
    columns = {str(s["name"]): (int(s["start"]), int(s["stop"])) for s in split if isinstance(s, Mapping)}
    out = dict(state)
    for name, value in state.items():
        start, stop = columns.get(name, (0, 0))
        if stop - start == value.size and stop <= row.size:
            out[name] = row[start:stop].copy()
    return out


def next_state(actions: np.ndarray, feedback: Feedback, joints: np.ndarray, gripper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The state a robot following ``actions`` reports next (see ``--feedback``).

    Joints are columns 0-6 and the gripper column 7 (DROID's absolute joint-position action
    space), fed back verbatim; a chunk with fewer columns leaves the rest of the state as is.
    """
    if feedback == "hold":
        return joints, gripper
    row = np.asarray(actions[-1] if feedback == "end" else actions[0], dtype=np.float64)
    joints = row[:7].copy() if row.size >= 7 else joints
    gripper = row[7:8].copy() if row.size >= 8 else gripper
    return joints, gripper
