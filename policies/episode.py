"""What one call of an episode-driven policy asks for (torch-free: the wire builds it, the policy reads it).

LingBot-VA's own protocol (``reset`` / ``infer`` / ``compute_kv_cache``) splits a chunk into two requests: ``infer``
predicts the next chunk, ``compute_kv_cache`` commits what the robot then saw (its key frames, in the observation's
camera stacks) and the actions it executed. An :class:`EpisodeCall` on a :class:`~ardiff_policies.observation.RobotObservation`
says which of the two a request is, with the options it carries. A request without one (the OpenPI / RoboArena wire)
is one whole chunk: the frames in its observation commit the session's previous chunk (when there is one), then the
next chunk is predicted; when it carries per-request options (guidance scales, or how its episode begins: an
:class:`EpisodeStart`), its call is a ``chunk``. Zero-WAM's own protocol adds ``reset``: the episode begins (its
demonstration pinned) and no chunk is predicted. Policies
that do not split their calls never see one (the wire refuses those options for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

EpisodeKind = Literal["infer", "compute_kv_cache", "chunk", "reset"]  # chunk: an OpenPI request with options


@dataclass(frozen=True)
class EpisodeStart:
    """How an episode begins besides its prompt, for a policy that takes a demonstration (Zero-WAM: upstream's reset
    keys ``use_icl``, ``icl_demo_id``, ``video_guidance_scale``, ``icl_guidance_scale``). A field that is None is the
    deployment's default; the policy checks the values (a bad one is a bad request naming the key)."""

    use_icl: bool | None = None  # None: whether a demonstration is named (the RoboTwin wire sends upstream's default, true)
    demonstration_id: str | None = None  # a relative POSIX path under the server's demonstration root, no extension
    video_guidance_scale: float | None = None  # < 0: the target text is the empty one; > 1: text guidance
    icl_guidance_scale: float | None = None  # > 1 with a demonstration: in-context guidance


@dataclass(frozen=True)
class EpisodeCall:
    kind: EpisodeKind
    # Per-request classifier-free guidance scales (LingBot-VA's RoboTwin client sends both with every infer); None:
    # the deployment's. Bounds are the policy's to check (a bad value is a bad request naming the key).
    video_guidance_scale: float | None = None
    action_guidance_scale: float | None = None
    # compute_kv_cache: the chunk's actions as the client received and executed them, in the reply's layout.
    executed_actions: np.ndarray | None = None
    # reset (Zero-WAM's own protocol: the episode begins, no chunk yet) or a session's first chunk: how it begins.
    start: EpisodeStart | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EpisodeCall):
            return NotImplemented
        same_actions = (self.executed_actions is None and other.executed_actions is None) or (
            self.executed_actions is not None and other.executed_actions is not None and np.array_equal(self.executed_actions, other.executed_actions)
        )
        return (self.kind, self.video_guidance_scale, self.action_guidance_scale, self.start) == (
            other.kind,
            other.video_guidance_scale,
            other.action_guidance_scale,
            other.start,
        ) and same_actions

    __hash__ = None  # holds an array
