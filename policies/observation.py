"""The typed robot observation every policy receives (torch-free).

The server decodes wire dictionaries into this (``ardiff_server/wire/decode.py``): RoboArena / DROID
keys, or any embodiment's ``observation/<camera>`` and ``observation/<state key>`` keys
(``policies/embodiment.py``). Policies never see raw wire keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ardiff_policies.continuation import Continuation
from ardiff_policies.episode import EpisodeCall

# The DROID names (RoboArena's wire): cameras and state vectors, in this order.
CAMERAS = ("wrist", "exterior_left", "exterior_right")
STATES = ("joint_position", "gripper_position", "cartesian_position")
# Fields pickled only when set (the engine's seam).
_OPTIONAL = ("episode", "continuation", "wire_keys", "num_inference_steps", "action_num_inference_steps")


class UnsupportedObservation(ValueError):
    """An observation the configured policy cannot take (e.g. a 1-pixel image). The server
    answers ``bad request`` with this message and the session is untouched."""


class RobotObservation:
    """One observation: camera frame stacks and state vectors by name, plus the prompt.

    Images are uint8 RGB frame stacks of shape (T, H, W, 3) with T >= 1 (a single frame
    arrives as T == 1). Any H, W: policies resize themselves. State vectors are float32 (dim,).
    A camera or state the client did not send is ``None`` (DreamZero renders a missing camera
    as a black view). ``prompt`` is None when the client sent none (an embodiment then uses its
    default instruction; the DROID wire decodes a missing prompt to "").

    ``RobotObservation(cameras={...}, states={...}, prompt=...)`` is the general form; the DROID
    names also work as keywords and attributes (``RobotObservation(wrist=..., joint_position=...)``,
    ``observation.wrist``), so a DROID observation always carries all six names. Camera and state
    names never collide (an embodiment refuses that at start-up), so :meth:`arrays` is one flat map.

    ``episode`` (None unless the request was one of LingBot-VA's split calls) says whether it predicts a chunk or
    commits what the robot saw, with its options (``policies/episode.py``).

    ``continuation`` (None unless the client sent one) says what the robot did with its last chunk
    (``policies/continuation.py``); it travels with the observation so the engine needs no field of its own.

    ``num_inference_steps`` / ``action_num_inference_steps`` (None unless the client sent one) ask this call to denoise
    with that many steps instead of the configured number (``policies/inference_steps.py``: DreamZero takes the first,
    LingBot-VA both, its video and its action loop; ``PolicyInfo.inference_steps`` gives the bounds a policy takes).

    ``wire_keys`` maps a camera or state name to the request key the client sent it under (the
    DROID wire has two camera index conventions: ``exterior_left`` is ``_0_left`` or ``_1_left``),
    so that a policy's error names the client's own keys (:meth:`wire_key`). It is not part of the
    observation's value (equality ignores it).
    """

    __slots__ = ("action_num_inference_steps", "cameras", "continuation", "episode", "num_inference_steps", "prompt", "states", "wire_keys")

    def __init__(
        self,
        cameras: Mapping[str, Any] | None = None,
        states: Mapping[str, Any] | None = None,
        prompt: str | None = "",
        episode: EpisodeCall | None = None,
        continuation: Continuation | None = None,
        wire_keys: Mapping[str, str] | None = None,
        num_inference_steps: int | None = None,
        action_num_inference_steps: int | None = None,
        **droid: Any,
    ) -> None:
        unknown = set(droid) - set(CAMERAS) - set(STATES)
        if unknown:
            raise TypeError(f"RobotObservation: unknown keyword(s) {sorted(unknown)}; pass cameras={{...}} / states={{...}}")
        if droid or (cameras is None and states is None):  # the DROID form: all six names present
            cameras = {**{name: droid.get(name) for name in CAMERAS}, **(cameras or {})}
            states = {**{name: droid.get(name) for name in STATES}, **(states or {})}
        object.__setattr__(self, "cameras", dict(cameras or {}))
        object.__setattr__(self, "states", dict(states or {}))
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "episode", episode)
        object.__setattr__(self, "continuation", continuation)
        object.__setattr__(self, "wire_keys", dict(wire_keys or {}))
        object.__setattr__(self, "num_inference_steps", num_inference_steps)
        object.__setattr__(self, "action_num_inference_steps", action_num_inference_steps)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("RobotObservation is immutable; use with_arrays()")

    def __getattr__(self, name: str) -> Any:  # the DROID names as attributes
        if name in RobotObservation.__slots__:  # not set yet (during unpickling)
            raise AttributeError(name)
        if name in CAMERAS:
            return self.cameras.get(name)
        if name in STATES:
            return self.states.get(name)
        raise AttributeError(name)

    @property
    def __dict__(self) -> dict[str, Any]:  # dataclass-like: RobotObservation(**obs.__dict__) copies
        return {
            "cameras": self.cameras,
            "states": self.states,
            "prompt": self.prompt,
            "episode": self.episode,
            "continuation": self.continuation,
            "wire_keys": self.wire_keys,
            "num_inference_steps": self.num_inference_steps,
            "action_num_inference_steps": self.action_num_inference_steps,
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RobotObservation):
            return NotImplemented
        mine = (self.cameras, self.states, self.prompt, self.episode, self.continuation, self.num_inference_steps, self.action_num_inference_steps)
        return mine == (
            other.cameras,
            other.states,
            other.prompt,
            other.episode,
            other.continuation,
            other.num_inference_steps,
            other.action_num_inference_steps,
        )

    __hash__ = None  # holds arrays

    def __repr__(self) -> str:
        def shape(v: Any) -> Any:
            return getattr(v, "shape", v)

        cameras = {k: shape(v) for k, v in self.cameras.items()}
        states = {k: shape(v) for k, v in self.states.items()}
        tail = f", episode={self.episode.kind!r}" if self.episode is not None else ""
        tail += f", continuation={self.continuation!r}" if self.continuation is not None else ""
        for name in ("num_inference_steps", "action_num_inference_steps"):
            tail += f", {name}={getattr(self, name)!r}" if getattr(self, name) is not None else ""
        return f"RobotObservation(cameras={cameras}, states={states}, prompt={self.prompt!r}{tail})"

    def __reduce__(self):  # pickles as its fields (the engine's seam); optional ones only when set
        extras = {name: getattr(self, name) for name in _OPTIONAL if getattr(self, name)}
        return (_restore, (self.cameras, self.states, self.prompt, extras) if extras else (self.cameras, self.states, self.prompt))

    def wire_key(self, name: str) -> str | None:
        """The request key the client sent camera or state ``name`` under, if the decoder recorded it."""
        return self.wire_keys.get(name)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every camera and state array that is set, by name."""
        return {name: v for part in (self.cameras, self.states) for name, v in part.items() if isinstance(v, np.ndarray)}

    def values(self) -> dict[str, Any]:
        """Every camera and state value that is set (arrays, or transport references), by name."""
        return {name: v for part in (self.cameras, self.states) for name, v in part.items() if v is not None}

    def with_arrays(self, arrays: Mapping[str, Any]) -> RobotObservation:
        """A copy with the named cameras / states replaced."""
        cameras = {name: arrays.get(name, value) for name, value in self.cameras.items()}
        states = {name: arrays.get(name, value) for name, value in self.states.items()}
        unknown = set(arrays) - set(cameras) - set(states)
        if unknown:
            raise KeyError(f"no camera or state named {sorted(unknown)}")
        return RobotObservation(
            cameras=cameras,
            states=states,
            prompt=self.prompt,
            episode=self.episode,
            continuation=self.continuation,
            wire_keys=self.wire_keys,
            num_inference_steps=self.num_inference_steps,
            action_num_inference_steps=self.action_num_inference_steps,
        )


def _restore(cameras: dict, states: dict, prompt: str | None, extras: dict | None = None) -> RobotObservation:
    return RobotObservation(cameras=cameras, states=states, prompt=prompt, **(extras or {}))
