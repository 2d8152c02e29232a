"""Asynchronous chunks that continue the one being executed (torch-free: the front end decodes it).

A robot that asks for its next chunk while it still executes the last one sends, with the
observation, a :class:`Continuation`: ``executed`` actions of its last chunk were done when the
observation was captured, ``delay`` more will be done while it waits for the reply. The policy then
freezes the new chunk's first ``delay`` actions to the last chunk's ``[executed, executed + delay)``
(re-anchored to the new state for relative action keys) and generates the rest to continue them
(real-time chunking, Black et al. 2025). The reply says how many leading actions are frozen and
which chunk it is (``chunk_id``); the next request names that id.

A continuation that cannot apply (no previous chunk in the session, a prompt change, another
``chunk_id``) is served as a fresh chunk: ``frozen`` 0 and the reason. A window restart is no such
case: the video context restarts, the last chunk's actions are still there to continue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

ContinuationMode = Literal["inpaint", "clean_prefix", "guided"]
CONTINUATION_MODES: tuple[str, ...] = ("inpaint", "clean_prefix", "guided")

# Why a requested continuation was served as a fresh chunk (the reply's ``continuation`` entry).
NO_PREVIOUS_CHUNK = "no_previous_chunk"  # first call of the session, or the session was reset / ended
PROMPT_CHANGE = "prompt_change"
UNKNOWN_CHUNK_ID = "unknown_chunk_id"
APPLIED = "applied"

# What clients read in /info (policy.continuation) and the README.
CONTRACT = {
    "request": {
        "continuation": {
            "executed": "int >= 0: actions of this session's last chunk executed when the observation was captured",
            "delay": "int >= 0: actions of it the robot executes while waiting for this reply (executed + delay <= horizon)",
            "chunk_id": "optional int: the chunk_id of the reply these count into (default: the session's last chunk)",
        }
    },
    "reply": {
        "chunk_id": "int: this chunk's id within the session (1, 2, ...); name it in the next continuation",
        "frozen": "int: leading actions equal to the last chunk's [executed, executed + frozen) as the robot executes them",
        "continuation": f"{APPLIED!r}, or why a requested continuation was served fresh: "
        f"{NO_PREVIOUS_CHUNK!r}, {PROMPT_CHANGE!r}, {UNKNOWN_CHUNK_ID!r} (a window restart still continues)",
    },
}


@dataclass(frozen=True, slots=True)
class Continuation:
    """What the robot did with its last chunk (validated bounds: the wire decoder's and the policy's)."""

    executed: int
    delay: int
    chunk_id: int | None = None

    def check(self, horizon: int) -> None:
        """Raise ValueError naming the field when the numbers do not fit a chunk of ``horizon`` actions."""
        for name in ("executed", "delay"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"continuation.{name}: expected an integer >= 0, got {value!r}")
        if self.executed + self.delay > horizon:
            raise ValueError(f"continuation.executed + continuation.delay = {self.executed} + {self.delay} is past the {horizon}-action chunk")


def decide_for(continuation: Continuation | None, last_chunk_id: int | None, events: dict[str, bool]) -> str | None:
    """Whether a requested continuation applies: :data:`APPLIED`, the reason it does not, or None (none asked).
    ``last_chunk_id``: the session's last chunk (None: none since the session began or was reset); ``events``: this
    call's ``prompt_change`` (a family without prompt changes passes none). A window restart is no reason: the
    continuation needs the last chunk's actions, not the KV window."""
    if continuation is None:
        return None
    if last_chunk_id is None:
        return NO_PREVIOUS_CHUNK
    if events.get("prompt_change"):
        return PROMPT_CHANGE
    if continuation.chunk_id is not None and continuation.chunk_id != last_chunk_id:
        return UNKNOWN_CHUNK_ID
    return APPLIED


def soft_mask(horizon: int, frozen: int, end: int) -> np.ndarray:
    """RTC's prefix weights (Black et al. 2025, eq. 5): 1 for the first ``frozen`` actions, then
    ``c (e^c - 1) / (e - 1)`` with ``c = (end - i) / (end - frozen + 1)`` decaying towards 0, and 0 from
    ``end`` (= H - s) on. ``end`` is clipped to ``[frozen, horizon]``."""
    end = min(max(end, frozen), horizon)
    weights = np.zeros(horizon, dtype=np.float64)
    weights[:frozen] = 1.0
    i = np.arange(frozen, end, dtype=np.float64)
    c = (end - i) / (end - frozen + 1)
    weights[frozen:end] = c * np.expm1(c) / (math.e - 1.0)
    return weights
