"""The per-request pixel budget: how many camera pixels one request may make the server hold.

Each frame is bounded (``MAX_IMAGE_SIDE``, ``MAX_FRAMES``), a request was not: 64 frames x 3 cameras of a
690-byte JPEG whose header claims 4096x4096 decode to ~9 GiB. So the front end counts the pixels every image
of a request declares (a JPEG's header, a raw array's shape), after dropping the frames the policy would
drop, and refuses the request (one line naming the key and the budget) before any of them is decoded or
copied. docs/spec.md §4.

``server.max_request_pixels: auto`` (the default) derives the budget from the policy: the frames it reads per
call per camera (``PolicyInfo.max_frames_per_call``) times the resolution it asks each camera for, scaled by
:data:`AUTO_SIDE_SCALE` per side (clients may send larger images; policies resize). DreamZero-DROID: 4 frames
x 3 cameras of up to 720x1280 (11,059,200 pixels, 32 MiB as uint8 RGB).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ardiff_policies.info import PolicyInfo
from ardiff_server.wire.protocol import RequestError

SETTING = "server.max_request_pixels"
AUTO_SIDE_SCALE = 4  # auto: each frame may be 4x the advertised height and width (720x1280 for DROID's 180x320)


@dataclass(frozen=True)
class PixelBudget:
    """At most ``max_pixels`` declared pixels per request; ``keep_frames``: a stack's newest frames that reach
    the policy (older ones are dropped unread; None: every frame); ``origin``: how it was set, for the error."""

    max_pixels: int
    keep_frames: int | None = None
    origin: str = SETTING

    def kept(self, frames: int) -> int:
        """How many of a stack's ``frames`` (the newest) reach the policy."""
        return frames if self.keep_frames is None else min(frames, self.keep_frames)

    def check(self, images: Iterable[tuple[str, int, int, int]]) -> None:
        """``(key, frames, height, width)`` of each image in request order (kept frames only): a RequestError
        naming the key that brings the request over the budget."""
        total = 0
        for key, frames, height, width in images:
            total += frames * height * width
            if total > self.max_pixels:
                raise RequestError(
                    f"{key}: {frames} frame(s) of {height}x{width} bring the request's images to {total} pixels, over its budget "
                    f"of {self.max_pixels} ({self.origin}); send fewer or smaller frames, or raise {SETTING}"
                )


def request_budget(setting: int | Literal["auto"], info: PolicyInfo | None) -> PixelBudget | None:
    """The budget a server applies: ``setting`` (``server.max_request_pixels``) for the served policy ``info``
    (None before a policy is known: no budget, nothing is decoded then anyway)."""
    if info is None:
        return None
    keep = info.max_frames_per_call if info.keeps_newest_frames else None
    if setting != "auto":
        return PixelBudget(int(setting), keep)
    resolutions = info.camera_resolutions
    frames = info.max_frames_per_call
    pixels = frames * sum(h * w for h, w in resolutions) * AUTO_SIDE_SCALE**2
    sizes = sorted({f"{h * AUTO_SIDE_SCALE}x{w * AUTO_SIDE_SCALE}" for h, w in resolutions})
    origin = f"{SETTING}: auto, {frames} frame(s) x {len(resolutions)} camera(s) of up to {'/'.join(sizes)}"
    return PixelBudget(pixels, keep, origin)
