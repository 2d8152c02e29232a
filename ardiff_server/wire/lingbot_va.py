"""LingBot-VA's own wire: the messages of its RoboTwin client, decoded into typed requests.

Upstream's server (``wan_va/wan_va_server.py`` behind openpi's websocket server) holds one robot; its client
(``evaluation/robotwin/eval_polict_client_openpi.py``) sends, on one connection, msgpack-numpy maps:

* ``{reset: True, prompt, save_visualization}``: a new episode with this prompt;
* ``{obs: {<camera key>: (H, W, 3) uint8, observation.state, task}, prompt, save_visualization,
  video_guidance_scale, action_guidance_scale}``: predict the next chunk (only the first chunk's ``obs`` is read:
  later observations reach the model through ``compute_kv_cache``);
* ``{obs: [key frame maps], compute_kv_cache: True, imagine, save_visualization, state: (channels, F, N)}``: commit
  the frames the robot saw and the actions it executed.

Zero-WAM's RoboTwin client (jianwenli96/Zero-WAM ``evaluation/robotwin/eval_policy_client_openpi.py``) speaks the same
messages; its reset adds ``use_icl``, ``icl_demo_id``, ``video_guidance_scale`` and ``icl_guidance_scale`` (read when
the policy advertises ``demonstration``: ``decode_lingbot_va(..., demonstrations=True)``), and its infer's guidance
scales are the reset's concern (sent, not read).

Here each connection is its own session. ``save_visualization`` / ``imagine`` / ``observation.state`` / ``task`` are
accepted and unused (upstream's server does not read them either); ``prompt`` on an infer is the reset's (upstream
reads the reset's). An infer may carry ``continuation`` (this server's real-time chunking, the OpenPI wire's field:
``{executed, delay, chunk_id}``, ``ardiff_policies.continuation``); its reply then says ``chunk_id`` / ``frozen`` /
``continuation`` beside ``action``; a commit carrying one is refused by name (a commit continues nothing). An infer may
carry ``num_inference_steps`` / ``action_num_inference_steps`` (this server's per-request denoising steps, the OpenPI
wire's keys: ``ardiff_policies.inference_steps``), and so may a reset, for every infer of its episode that names
none; a commit carrying one is refused by name (it denoises nothing). A message is LingBot-VA's when it holds ``reset``, ``compute_kv_cache`` or ``obs`` and no OpenPI
``observation/...`` key (:func:`is_lingbot_va_message`, asked by ``decode.py`` for a policy whose
``PolicyInfo.native_protocol`` is ``lingbot_va``); anything else is decoded as OpenPI's (``openpi.py``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from ardiff_policies.continuation import Continuation
from ardiff_policies.episode import EpisodeCall, EpisodeStart
from ardiff_policies.observation import RobotObservation
from ardiff_server.wire.budget import PixelBudget
from ardiff_server.wire.fields import (
    CONTINUATION_KEY,
    check_prompt_length,
    decode_actions_left,
    decode_continuation,
    decode_episode_start,
    decode_guidance_scale,
    decode_inference_steps,
    refuse_demonstration_keys,
)
from ardiff_server.wire.images import MAX_FRAMES, MAX_IMAGE_SIDE
from ardiff_server.wire.protocol import RequestError, short_repr

CAMERA_PREFIX = "observation.images."  # upstream's camera keys: observation.images.<camera>
MARKER_KEYS = ("reset", "compute_kv_cache", "obs")


@dataclass(frozen=True)
class LingBotVARequest:
    """One of LingBot-VA's messages: a reset with the episode's prompt, an inference, or a commit of what the robot saw."""

    protocol: ClassVar[Literal["lingbot_va"]] = "lingbot_va"
    kind: Literal["reset", "infer", "compute_kv_cache"]
    prompt: str | None = None  # reset: the episode's prompt
    start: EpisodeStart | None = None  # reset, for a policy that takes a demonstration (Zero-WAM): how the episode begins
    observation: RobotObservation | None = None  # infer / compute_kv_cache (its prompt is filled in from the reset)
    actions_left_s: float | None = None  # infer: its continuation's seconds of actions left (the engine's deadline)
    # reset: the episode's denoising steps (num_inference_steps / action_num_inference_steps), for each infer that names none
    inference_steps: dict[str, int] = field(default_factory=dict)


def is_lingbot_va_message(payload: Any) -> bool:
    return (
        isinstance(payload, dict)
        and any(key in payload for key in MARKER_KEYS)
        and not any(isinstance(key, str) and key.startswith("observation/") for key in payload)
        and "endpoint" not in payload
    )


def decode_lingbot_va(
    payload: dict[str, Any],
    cameras: tuple[str, ...],
    budget: PixelBudget | None = None,
    inference_steps: Collection[str] = (),
    *,
    demonstrations: bool = False,
) -> LingBotVARequest:
    """One of LingBot-VA's messages; ``cameras``: the served cameras' short names (``cam_high``, ...); ``budget``: the
    server's per-request pixel budget (``budget.py``; the frames of every camera counted before any is stacked);
    ``inference_steps``: the per-request denoising step keys the policy takes (``PolicyInfo.inference_steps``);
    ``demonstrations``: Zero-WAM's variant of the protocol (upstream's jianwenli96/Zero-WAM client): a reset also says
    how the episode begins (``use_icl``, default true as upstream's server, ``icl_demo_id``, ``video_guidance_scale``,
    ``icl_guidance_scale``), and a commit's ``state`` is optional (upstream's Zero-WAM server never reads it)."""
    steps = decode_inference_steps(payload, inference_steps)
    if _flag(payload, "reset"):
        prompt = payload.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(f"prompt: a reset needs the episode's prompt (a string), got {short_repr(prompt)}")
        if not demonstrations:
            refuse_demonstration_keys(payload)
        start = decode_episode_start(payload, use_icl_default=True) if demonstrations else None
        return LingBotVARequest("reset", prompt=check_prompt_length(prompt), start=start, inference_steps=steps)
    if "obs" not in payload:
        raise RequestError(f"obs: missing; expected the observation (or key frames) under 'obs', got keys {short_repr(sorted(payload)[:8])}")
    if _flag(payload, "compute_kv_cache"):
        if payload.get(CONTINUATION_KEY) is not None:
            raise RequestError(f"{CONTINUATION_KEY}: a compute_kv_cache commits what the robot saw and continues nothing; send it with the infer")
        if steps:
            raise RequestError(f"{next(iter(steps))}: a compute_kv_cache denoises nothing; send it with the infer (or the reset, for the episode)")
        state = payload.get("state")
        if state is None and demonstrations:
            call = EpisodeCall("compute_kv_cache")
            return LingBotVARequest("compute_kv_cache", observation=_observation(payload["obs"], cameras, call, budget))
        if not isinstance(state, np.ndarray) or state.dtype.kind not in "fiu" or state.ndim != 3:
            raise RequestError(f"state: expected the chunk's actions as a (channels, frames, actions per frame) array, got {short_repr(state)}")
        call = EpisodeCall("compute_kv_cache", executed_actions=np.array(state, dtype=np.float32))
        return LingBotVARequest("compute_kv_cache", observation=_observation(payload["obs"], cameras, call, budget))
    call = EpisodeCall(
        "infer",
        decode_guidance_scale(payload, "video_guidance_scale"),
        decode_guidance_scale(payload, "action_guidance_scale"),
    )
    continuation = decode_continuation(payload.get(CONTINUATION_KEY))
    observation = _observation(payload["obs"], cameras, call, budget, continuation, steps)
    return LingBotVARequest("infer", observation=observation, actions_left_s=decode_actions_left(payload.get(CONTINUATION_KEY)))


def _flag(payload: dict[str, Any], key: str) -> bool:
    value = payload.get(key, False)
    if value is None:
        return False
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(f"{key}: expected true or false, got {short_repr(value)}")
    return bool(value)


def _observation(
    obs: Any,
    cameras: tuple[str, ...],
    call: EpisodeCall,
    budget: PixelBudget | None,
    continuation: Continuation | None = None,
    steps: dict[str, int] | None = None,
) -> RobotObservation:
    """``obs`` (one frame map, or a list of them) -> one (T, H, W, 3) stack per camera."""
    frames = obs if isinstance(obs, list) else [obs]
    if not frames:
        raise RequestError("obs: expected at least one frame")
    if len(frames) > MAX_FRAMES:
        raise RequestError(f"obs: expected at most {MAX_FRAMES} frames, got {len(frames)}")
    images: dict[str, list[np.ndarray]] = {}
    for name in cameras:
        key = CAMERA_PREFIX + name
        images[key] = []
        for i, frame in enumerate(frames):
            where = f"obs[{i}].{key}" if isinstance(obs, list) else f"obs.{key}"
            if not isinstance(frame, dict):
                raise RequestError(f"obs[{i}]: expected a map of camera images, got {short_repr(frame)}")
            images[key].append(_image(where, frame.get(key)))
        if len({image.shape for image in images[key]}) != 1:
            raise RequestError(f"obs: the frames of {key} differ in shape ({sorted({image.shape for image in images[key]})})")
    if budget is not None:  # before any stack is copied
        budget.check((key, len(stack), *stack[0].shape[:2]) for key, stack in images.items())
    stacks = {name: np.stack(images[CAMERA_PREFIX + name]) for name in cameras}
    return RobotObservation(cameras=stacks, states={}, prompt=None, episode=call, continuation=continuation, **(steps or {}))


def _image(key: str, value: Any) -> np.ndarray:
    expected = "a uint8 RGB image array (H, W, 3)"
    if value is None:
        raise RequestError(f"{key}: missing; expected {expected}")
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.ndim != 3 or value.shape[-1] != 3:
        raise RequestError(
            f"{key}: expected {expected}, got {short_repr(value) if not isinstance(value, np.ndarray) else f'{value.dtype} {value.shape}'}"
        )
    if not (1 <= value.shape[0] <= MAX_IMAGE_SIDE and 1 <= value.shape[1] <= MAX_IMAGE_SIDE):
        raise RequestError(f"{key}: expected height and width of 1 to {MAX_IMAGE_SIDE} pixels, got {value.shape}")
    return value


def action_reply(actions: np.ndarray, channels: int, frames: int, per_frame: int) -> np.ndarray:
    """The engine's time-major (frames x per_frame, channels) actions as upstream's (channels, frames, per_frame)."""
    return np.ascontiguousarray(np.asarray(actions, dtype=np.float32).T.reshape(channels, frames, per_frame))
