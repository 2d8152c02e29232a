"""A DreamZero robot session: what the policy keeps for it between calls (its KV is the engine's).

Its own module so that the policy, its per-call inputs (``inputs.py``) and the batch machinery
(``batch.py``) all import it, none of them importing another for the type.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ardiff_kv import SessionKV
from ardiff_policies.dreamzero.continuation import LastChunk
from ardiff_policies.observation import RobotObservation

FRAMES_PER_CALL = 4  # frames a robot sends per call after the first (DreamZero's client contract)


@dataclass
class Prepared:
    """A call's session-own work, done before its batch on the engine's encoder thread."""

    observation: RobotObservation  # the call it was made for
    prompt: str
    canvas: np.ndarray  # (T, H, W, 3) uint8: the call's stitched frames
    prompt_embeds: torch.Tensor | None  # the prompt's text embeddings, if the call needs them
    image: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None  # (clip_feature, ys, first_latent) at a window start
    timing_ms: dict[str, float]


@dataclass
class DreamZeroSession:
    session_id: str
    kv: SessionKV
    frames: deque = field(default_factory=lambda: deque(maxlen=FRAMES_PER_CALL))  # stitched canvases
    calls: int = 0
    prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    current_start_frame: int = 0
    clip_feature: torch.Tensor | None = None
    ys: torch.Tensor | None = None  # (1, 4 + z, latent frames, h, w) image conditioning (14B only)
    first_latent: torch.Tensor | None = None  # (1, z, 1, h, w) the window's first frame
    prepared: Prepared | None = None  # what the encoder thread made for the next call (DreamZeroPolicy.prepare)
    chunks: int = 0  # chunks served: the last one's chunk_id
    last_chunk: LastChunk | None = None  # what a continuation continues
