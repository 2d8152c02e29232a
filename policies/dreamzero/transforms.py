"""Observation and action transforms for DreamZero, written for DROID (``oxe_droid``) and used for every embodiment.

Other embodiments (``policies/dreamzero/embodiments.py``) differ only in data: their cameras go onto a 2x2 grid
(:func:`stitch_canvas`), their state / action keys and statistics come from the checkpoint, their relative keys
are added back with :func:`to_absolute`.

DROID views: each camera frame is center-cropped to 95% and resized (bilinear, antialiased) to the
model's view size, then the three views are stitched into one 2x2 canvas::

    +-------------------------------+
    |  wrist, repeated to 2x width  |
    +---------------+---------------+
    | left exterior | right exterior|
    +---------------+---------------+

A camera that was not sent is a black view. State is the 7 joint positions + gripper, padded
to ``max_state_dim`` and q99-normalized to [-1, 1] (clamped). Actions come back in [-1, 1] and
are q99-denormalized; joints are relative to the last observed joint state, the gripper is
absolute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ardiff_policies.dreamzero.embodiments import DROID_TEMPLATE, instruction, render_prompt
from ardiff_policies.embodiment import Layout, QuantileStats

__all__ = [
    "CROP_SCALE",
    "DROID_TEMPLATE",
    "NormStats",
    "canvas_size",
    "crop_and_resize",
    "denormalize_actions",
    "droid_instruction",
    "droid_prompt",
    "normalize_state",
    "resize_like_opencv",
    "stitch_canvas",
    "stitch_views",
    "to_absolute",
    "to_absolute_joints",
]

CROP_SCALE = 0.95

# The instruction's path through upstream's DROID server (dreamzero0/dreamzero), in order:
#  1. socket_test_optimized_AR.py ``ARDroidRoboarenaPolicy._convert_observation``: ``obs["prompt"]``, or "" when the
#     key is missing, becomes ``annotation.language.action_text`` (the transform's default instruction,
#     "Perform the default behavior.", is only used when that key is absent, which this server path never does);
#  2. groot/vla/model/n1_5/sim_policy.py ``unsqueeze_dict_values``: ``np.array([prompt])`` (numpy's unicode dtype
#     drops trailing NUL characters);
#  3. groot/vla/model/dreamzero/transform/dreamzero_cotrain.py ``DreamTransform._prepare_language``: the markers
#     "<LAPA>", "<DREAM>", "<COTRAIN>" are removed (upstream then fails on the first two: they need training data);
#  4. same file, ``collate``: ``ast.literal_eval`` of the instruction; a list/tuple gives ``str`` of its first item,
#     another literal ``str`` of its value, text that is no literal stays as is; then the OXE_DROID template, the
#     instruction ``.lower()``-ed and inserted twice;
#  5. same file, ``HuggingfaceTokenizer(clean="whitespace")._clean`` on the whole templated string, right before
#     tokenizing: ``whitespace_clean(basic_clean(text))`` = ftfy.fix_text, html.unescape twice, strip, collapse
#     ``\s+`` (the ``regex`` module's) to one space, strip. The negative prompt goes through step 5 only.
# Every embodiment's prompt takes steps 3-5 with its own template (policies/dreamzero/embodiments.py, torch-free).


def droid_instruction(prompt: str | None) -> str:
    """The instruction as upstream's ``collate`` inserts it into the template (before lower-casing).

    A missing prompt (None) is the empty instruction, like upstream's server sends for an absent key.
    Raises ValueError for an empty list/tuple literal (``"[]"``), on which upstream's ``collate`` fails.
    """
    return instruction(prompt)


def droid_prompt(prompt: str | None) -> str:
    """The exact text upstream tokenizes for a DROID prompt: instruction, template, cleaning (see above)."""
    return render_prompt(DROID_TEMPLATE, prompt)


def crop_and_resize(frames: np.ndarray, size: tuple[int, int], crop_scale: float = CROP_SCALE) -> np.ndarray:
    """(T, H, W, 3) uint8 -> (T, h, w, 3) uint8: center crop to ``crop_scale``, then resize.

    Same arithmetic as torchvision's CenterCrop + Resize(antialias=True) on float [0, 1]
    frames, and the same truncating conversion back to uint8 that the reference transform uses.
    """
    _, h, w, _ = frames.shape
    crop_h, crop_w = int(h * crop_scale), int(w * crop_scale)
    top, left = round((h - crop_h) / 2.0), round((w - crop_w) / 2.0)
    x = torch.from_numpy(np.ascontiguousarray(frames[:, top : top + crop_h, left : left + crop_w]))
    x = x.permute(0, 3, 1, 2).float() / 255.0
    if (crop_h, crop_w) != tuple(size):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return (x.permute(0, 2, 3, 1) * 255.0).to(torch.uint8).numpy()


# OpenCV's fixed-point bilinear resize of uint8 images (imgproc/src/resize.cpp): 11-bit weights.
_CV_COEF_BITS = 11


def _cv_axis(src: int, dst: int, *, horizontal: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per output index along one axis: (first source index, second source index, weight of the first, of the
    second), as OpenCV computes them: ``fx = float((d + 0.5) * scale - 0.5)`` in float32, ``sx = floor(fx)``, the
    weights ``1 - fx`` and ``fx`` rounded to 11 bits. Past an edge both taps are the edge pixel; horizontally
    OpenCV also sets the weight there to (1, 0), vertically it keeps the computed pair."""
    scale = 1.0 / (dst / src)  # OpenCV: 1 / inv_scale with inv_scale = dsize / ssize, in double
    f = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    first = np.floor(f).astype(np.int64)
    f = f - first.astype(np.float32)
    if horizontal:
        f[(first < 0) | (first >= src - 1)] = 0.0
        first = np.clip(first, 0, src - 1)
    one = np.float32(1 << _CV_COEF_BITS)
    w0 = np.rint((np.float32(1.0) - f) * one).astype(np.int32)
    w1 = np.rint(f * one).astype(np.int32)
    return np.clip(first, 0, src - 1), np.clip(first + 1, 0, src - 1), w0, w1


def resize_like_opencv(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(T, H, W, C) uint8 -> (T, *size, C) uint8, bit for bit ``cv2.resize(frame, (w, h), interpolation=cv2.INTER_LINEAR)``
    (upstream's 5B server, ``eval_utils/serve_dreamzero_wan22.py``, resizes every received frame so); frames already
    at ``size`` are returned as they are.

    OpenCV does it in fixed point: a horizontal pass with 11-bit weights into int32 rows, then a vertical pass that
    (x86 SIMD, ``VResizeLinearVec_32s8u``) multiplies ``row >> 4`` by the 11-bit weight keeping the high 16 bits,
    sums the two taps and rounds off 2 more bits. An exact 2x downscale is its INTER_AREA fast path instead (the
    rounded mean of each 2x2 block). Checked against cv2 itself in ``tests/policies/test_transforms.py``."""
    h, w = frames.shape[1:3]
    out_h, out_w = size
    if (h, w) == (out_h, out_w):
        return frames
    x = frames.astype(np.int32)
    if h == 2 * out_h and w == 2 * out_w:
        block = x[:, 0::2, 0::2] + x[:, 0::2, 1::2] + x[:, 1::2, 0::2] + x[:, 1::2, 1::2]
        return ((block + 2) >> 2).astype(np.uint8)
    x0, x1, a0, a1 = _cv_axis(w, out_w, horizontal=True)
    rows = x[:, :, x0] * a0[:, None] + x[:, :, x1] * a1[:, None]  # (T, H, out_w, C), weights summing to 2048
    y0, y1, b0, b1 = _cv_axis(h, out_h, horizontal=False)
    top, bottom = rows[:, y0] >> 4, rows[:, y1] >> 4
    value = ((top * b0[:, None, None]) >> 16) + ((bottom * b1[:, None, None]) >> 16)
    return np.clip((value + 2) >> 2, 0, 255).astype(np.uint8)


def stitch_views(
    wrist: np.ndarray | None,
    left: np.ndarray | None,
    right: np.ndarray | None,
    view_size: tuple[int, int],
) -> np.ndarray:
    """Three (T, h, w, 3) views (already resized, or None for black) -> (T, 2h, 2w, 3) canvas."""
    present = [v for v in (wrist, left, right) if v is not None]
    frames = max((v.shape[0] for v in present), default=1)
    for view in present:
        if view.shape[0] != frames:
            raise ValueError(f"camera frame stacks differ in length: {[v.shape[0] for v in present]}")
    h, w = view_size
    canvas = np.zeros((frames, 2 * h, 2 * w, 3), dtype=np.uint8)
    if wrist is not None:
        canvas[:, :h] = np.repeat(wrist, 2, axis=2)
    if left is not None:
        canvas[:, h:, :w] = left
    if right is not None:
        canvas[:, h:, w:] = right
    return canvas


def canvas_size(layout: Layout, view_size: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the model's canvas for a layout of views of ``view_size``."""
    h, w = view_size
    return (h, w) if layout == "single" else (2 * h, 2 * w)


def video_size(layout: Layout, view_size: tuple[int, int], target: tuple[int, int] | None) -> tuple[int, int]:
    """(height, width) of the video the VAE and CLIP see: the checkpoint's resize target (the 5B's
    ``target_video_height/width``), else the stitched canvas."""
    return tuple(target) if target is not None else canvas_size(layout, view_size)


def stitch_canvas(layout: Layout, views: list[np.ndarray | None], view_size: tuple[int, int]) -> np.ndarray:
    """Resized (T, h, w, 3) views in the embodiment's camera order (None: black) -> the (T, H, W, 3) canvas.

    ``droid``: views are (left exterior, right exterior, wrist), see :func:`stitch_views`. ``grid`` (upstream's
    2x2 for every other embodiment): view 0 top-left, view 1 bottom-left, view 2 top-right, bottom-right black.
    ``single``: the one view is the canvas.
    """
    if layout == "droid":
        return stitch_views(views[2], views[0], views[1], view_size=view_size)
    present = [v for v in views if v is not None]
    frames = max((v.shape[0] for v in present), default=1)
    for view in present:
        if view.shape[0] != frames:
            raise ValueError(f"camera frame stacks differ in length: {[v.shape[0] for v in present]}")
    h, w = view_size
    canvas = np.zeros((frames, *canvas_size(layout, view_size), 3), dtype=np.uint8)
    for view, (row, col) in zip(views, ((0, 0), (1, 0), (0, 1)), strict=False):
        if view is not None:
            canvas[:, row * h : (row + 1) * h, col * w : (col + 1) * w] = view
    return canvas


@dataclass(frozen=True)
class NormStats:
    """q01 / q99 of the first ``len(q01)`` dims (DROID: 7 joints + gripper)."""

    q01: np.ndarray
    q99: np.ndarray

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], embodiment: str, kind: str) -> NormStats:
        """``kind`` is "action" or "state"; stats are joint_position then gripper_position."""
        try:
            stats = metadata[embodiment]["statistics"][kind]
            q01 = [*stats["joint_position"]["q01"], *stats["gripper_position"]["q01"]]
            q99 = [*stats["joint_position"]["q99"], *stats["gripper_position"]["q99"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"metadata.json has no {embodiment}.statistics.{kind} joint/gripper q01/q99 ({exc})") from None
        return cls(np.asarray(q01, dtype=np.float64), np.asarray(q99, dtype=np.float64))

    @classmethod
    def from_quantiles(cls, stats: QuantileStats) -> NormStats:
        return cls(*stats.arrays())

    @property
    def dim(self) -> int:
        return len(self.q01)


def normalize_state(state: np.ndarray, stats: NormStats, max_state_dim: int) -> np.ndarray:
    """Raw (dim,) state -> (max_state_dim,) float64 in [-1, 1]; dims with q01 == q99 pass through."""
    out = np.zeros(max_state_dim, dtype=np.float64)
    out[: state.shape[0]] = state
    span = stats.q99 - stats.q01
    valid = span != 0
    part = out[: stats.dim]
    part[valid] = 2.0 * (part[valid] - stats.q01[valid]) / span[valid] - 1.0
    out[: stats.dim] = np.clip(part, -1.0, 1.0)
    return out


def denormalize_actions(actions: np.ndarray, stats: NormStats) -> np.ndarray:
    """(H, >= dim) in [-1, 1] -> (H, dim) real units: (x + 1) / 2 * (q99 - q01) + q01."""
    return (actions[:, : stats.dim] + 1.0) / 2.0 * (stats.q99 - stats.q01) + stats.q01


def to_absolute(actions: np.ndarray, state: np.ndarray, slices: list[tuple[tuple[int, int], tuple[int, int]]]) -> np.ndarray:
    """Relative action columns + the observed state they are relative to: ``slices`` pairs an action
    column range with the state range of the same key (upstream's ``GrootSimPolicy.unapply``)."""
    out = actions.copy()
    for (a0, a1), (s0, s1) in slices:
        out[:, a0:a1] += state[s0:s1]
    return out


def to_absolute_joints(actions: np.ndarray, joint_state: np.ndarray, relative_dims: int) -> np.ndarray:
    """Relative joint targets + the last observed joint state; later dims (gripper) untouched."""
    out = actions.copy()
    out[:, :relative_dims] += joint_state[:relative_dims]
    return out


def pixels_to_model_range(pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 pixels -> [-1, 1] in ``dtype``, rounded where upstream rounds (``WANPolicyHead.lazy_joint_video_action``):
    ``/ 255`` in float32, cast to the model dtype, then ``Normalize(0.5, 0.5)`` = ``(x - 0.5) / 0.5`` in that dtype.
    (In float32 this is bit for bit ``x / 255 * 2 - 1``: scaling by 2 is exact.)"""
    video = (pixels.float() / 255.0).to(dtype)
    return (video - 0.5) / 0.5


def resize_video(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, C, T, *size): upstream's 5B resize (``WANPolicyHead.lazy_joint_video_action``), bilinear
    without antialiasing on the [-1, 1] video in the model dtype. Upstream groups the B*C*T planes as (B*T, C) images
    without moving the time axis; each plane is interpolated on its own, so that grouping changes nothing."""
    b, c, t, h, w = video.shape
    out = F.interpolate(video.reshape(b * t, c, h, w), size=size, mode="bilinear", align_corners=False)
    return out.reshape(b, c, t, *size)
