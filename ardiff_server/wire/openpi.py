"""OpenPI's requests: a RoboArena / DROID request dictionary -> :class:`OpenPIRequest`.

``decode.py`` decides a message is OpenPI's and calls :func:`decode_openpi`. docs/spec.md §4 fixes the keys.
Another embodiment's requests are decoded by the policy's
:class:`ardiff_policies.embodiment.ObservationSchema` (``decode_openpi(payload, schema)``): every
``observation/<camera>`` and ``observation/<state key>`` it names is required, images and state
vectors obey the rules below, other keys are ignored. The rules this module applies:

- Unknown keys are ignored (clients send extras, e.g. ``_right`` stereo images); a known
  key with a bad value is a :class:`RequestError` naming the key, what was expected
  and what arrived. A known key whose value is ``None`` (msgpack nil) counts as absent.
- ``endpoint`` absent -> ``"infer"``. A ``"reset"`` request reads only ``session_id`` /
  ``session_ids``: its other keys are client reset info, never observations, and never fail a
  reset. ``session_ids: [...]`` names sessions, ``session_ids: None`` means every session the
  connection used (IsaacLab-Arena sends both), neither means the connection's current one.
- Session ids come as str, bytes, ints, numpy scalars or 1-element arrays (RoboArena's server
  docs declare ``session_id: (1,)``) and are canonicalised to one string: ``17``,
  ``np.int32(17)``, ``np.array([17])`` and ``"17"`` are the same session.
- Exterior cameras come in two index conventions: ``_0_left`` present -> 0-indexed
  (``_0_left``, ``_1_left``); else ``_2_left`` present -> 1-indexed (``_1_left``,
  ``_2_left``); a lone ``_1_left`` is the first exterior camera.
- Images (raw uint8 arrays or JPEG bytes) are read by ``images.py``: every camera of a request is
  read and its declared pixels counted against the server's :class:`~ardiff_server.wire.budget.PixelBudget`
  (``budget=``; None: no budget) before any is decoded, and frames older than the policy keeps are
  dropped unread.
- ``continuation`` (optional): ``{"executed": e, "delay": d, "chunk_id": c, "actions_left_s": t}``, integers >= 0
  (``chunk_id`` optional), see ``ardiff_policies.continuation``; absent or None = an ordinary request.
  ``actions_left_s`` (optional, a number of seconds in [0, 600]): the actions the robot had left when it took
  the observation; the front end makes it the request's deadline (:attr:`OpenPIRequest.actions_left_s`).
  The policy checks ``e + d`` against its chunk. A server that serves none (``continuation_refused``: its
  policy does not continue chunks, or its reply cannot say ``chunk_id`` / ``frozen``) refuses it by name.
- ``num_inference_steps`` / ``action_num_inference_steps`` (optional, integers >= 1): this call's denoising steps,
  for a policy that takes the key per request (``PolicyInfo.inference_steps``: DreamZero the first, LingBot-VA both;
  ``ardiff_policies.inference_steps``; the policy checks the bounds); refused by name for any other.
- ``video_guidance_scale`` / ``action_guidance_scale`` (optional, finite numbers): per-request
  classifier-free guidance, for a policy that advertises ``guidance`` in its metadata (LingBot-VA;
  the policy checks the bounds); refused by name for any other.
- ``icl_demo_id`` (optional, a relative path without extension, at most 512 characters), ``use_icl`` (optional,
  true or false: absent, whether ``icl_demo_id`` is sent), ``video_guidance_scale`` / ``icl_guidance_scale``
  (optional, finite numbers): how a session's episode begins, read on its first call (later calls may repeat them,
  not change them), for a policy that advertises ``demonstration`` in its metadata (Zero-WAM: the demonstration
  is read from the server's own root by id, never uploaded; the policy checks the values); ``icl_video_path`` /
  ``icl_latent_path`` (upstream's server-side paths) are refused by name, and so are the keys for any other policy.
- State vectors are numeric arrays or msgpack lists, returned as finite float32 1-D arrays. A
  leading batch axis of one is accepted ((1, 7): DreamZero's sim_evals client forwards the
  simulator's per-environment arrays), a real batch ((2, 7)) is not.
- A DROID inference request must carry ``observation/joint_position``: DROID's action space is
  joint positions, which DreamZero predicts relative to the observed ones (read as zeros, a missing
  vector gave actions near 0: the arm told to fold up). Every DROID client sends it. So must it carry
  ``observation/gripper_position``: it is part of the model's state (read as 0 it told the model the
  gripper was open whatever it was), upstream's server reads it unconditionally, and RoboArena,
  openpi's DROID example and DreamZero's sim_evals client send it.
- The observation records the key each camera and state came under (``RobotObservation.wire_keys``),
  so a policy's error about it names the client's own key (``_0_left`` or ``_1_left``).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from ardiff_policies.embodiment import ObservationSchema
from ardiff_policies.episode import EpisodeCall
from ardiff_policies.observation import RobotObservation
from ardiff_server.wire.budget import PixelBudget
from ardiff_server.wire.fields import (
    CONTINUATION_KEY,
    PATH_KEYS,
    PROMPT_KEY,
    START_KEYS,
    check_prompt_length,
    decode_actions_left,
    decode_continuation,
    decode_episode_start,
    decode_guidance_scale,
    decode_inference_steps,
    refuse_demonstration_keys,
)
from ardiff_server.wire.images import IMAGE_EXPECTED, decode_images, read_image
from ardiff_server.wire.protocol import RequestError, short_repr
from ardiff_server.wire.protocol import describe as _describe

MAX_SESSION_ID_CHARS = 256

ENDPOINT_KEY = "endpoint"
SESSION_ID_KEY = "session_id"
SESSION_IDS_KEY = "session_ids"
GUIDANCE_KEYS = ("video_guidance_scale", "action_guidance_scale")  # per request, policies that take them (LingBot-VA)
MAX_RESET_IDS = 256
_FLOAT32_MAX = float(np.finfo(np.float32).max)
WRIST_IMAGE_KEY = "observation/wrist_image_left"
# (key, length) of the proprioceptive state vectors, in RobotObservation field order.
STATE_KEYS = {
    "joint_position": ("observation/joint_position", 7),
    "gripper_position": ("observation/gripper_position", 1),
    "cartesian_position": ("observation/cartesian_position", 6),
}


def exterior_image_key(index: int) -> str:
    return f"observation/exterior_image_{index}_left"


@dataclass(frozen=True)
class OpenPIRequest:
    """One OpenPI request: an inference with its observation, or a reset naming the sessions it ends."""

    protocol: ClassVar[Literal["openpi"]] = "openpi"
    endpoint: Literal["infer", "reset"]
    session_id: str | None
    observation: RobotObservation | None  # None for reset
    # reset only: "named" (session_id / session_ids), "all" (session_ids: None), "current" (neither)
    reset_scope: Literal["named", "all", "current"] = "current"
    session_ids: tuple[str, ...] = ()
    # infer only: seconds of actions its robot had left when it took the observation (``continuation.actions_left_s``);
    # None: due now (a blocking client, a first call)
    actions_left_s: float | None = None


def decode_openpi(
    payload: Any,
    schema: ObservationSchema | None = None,
    *,
    guidance: bool = False,
    budget: PixelBudget | None = None,
    continuation_refused: str | None = None,
    inference_steps: Collection[str] = (),
    demonstrations: bool = False,
) -> OpenPIRequest:
    """Validate one decoded wire message and turn it into a typed request (``schema``: the served
    embodiment's keys; None: RoboArena's DROID keys; ``guidance``: the policy takes per-request
    ``video_guidance_scale`` / ``action_guidance_scale``, else they are refused by name; ``budget``: the
    server's per-request pixel budget and the frames the policy keeps, None: neither;
    ``continuation_refused``: why this server serves no ``continuation``, None: it does; ``inference_steps``: the
    per-request step keys the policy takes, any other is refused by name; ``demonstrations``: the policy
    begins an episode with a demonstration (Zero-WAM): ``use_icl`` / ``icl_demo_id`` / ``video_guidance_scale`` /
    ``icl_guidance_scale`` say how, else the first three are refused by name)."""
    request = _require_request_map(payload)
    endpoint = _decode_endpoint(request.get(ENDPOINT_KEY))
    session_id = decode_session_id(request.get(SESSION_ID_KEY))
    if endpoint == "reset":
        named = (session_id,) if session_id else ()
        if SESSION_IDS_KEY in request and request[SESSION_IDS_KEY] is None:
            return OpenPIRequest("reset", session_id, None, reset_scope="all", session_ids=named)
        listed = _decode_session_ids(request.get(SESSION_IDS_KEY))
        if listed is not None:
            ids = tuple(dict.fromkeys((*named, *listed)))  # unique, in order
            return OpenPIRequest("reset", session_id, None, reset_scope="named", session_ids=ids)
        return OpenPIRequest("reset", session_id, None, reset_scope="named" if named else "current", session_ids=named)
    if continuation_refused is not None and request.get(CONTINUATION_KEY) is not None:
        raise RequestError(f"{CONTINUATION_KEY}: {continuation_refused}")
    observation = _decode_observation(request, budget) if schema is None else _decode_embodiment_observation(request, schema, budget)
    continuation = decode_continuation(request.get(CONTINUATION_KEY))
    actions_left_s = decode_actions_left(request.get(CONTINUATION_KEY))
    call = _decode_start(request) if demonstrations else _decode_guidance(request, guidance)
    steps = decode_inference_steps(request, inference_steps)
    if continuation is not None or call is not None or steps:
        observation = RobotObservation(
            cameras=observation.cameras,
            states=observation.states,
            prompt=observation.prompt,
            episode=call,
            continuation=continuation,
            wire_keys=observation.wire_keys,
            **steps,
        )
    return OpenPIRequest(endpoint="infer", session_id=session_id, observation=observation, actions_left_s=actions_left_s)


def _decode_start(request: dict[str, Any]) -> EpisodeCall | None:
    """How a session's episode begins (Zero-WAM: ``icl_demo_id`` and its keys, read on the session's first call) as a
    ``chunk`` call; ``action_guidance_scale`` is refused by name (its actions have no guidance)."""
    if request.get("action_guidance_scale") is not None:
        raise RequestError("action_guidance_scale: this server's policy takes no action guidance; leave it out")
    if not any(request.get(key) is not None for key in (*START_KEYS, *PATH_KEYS)):
        return None
    return EpisodeCall("chunk", start=decode_episode_start(request, use_icl_default=None))


def _decode_guidance(request: dict[str, Any], accepted: bool) -> EpisodeCall | None:
    """``video_guidance_scale`` / ``action_guidance_scale`` of an OpenPI request (LingBot-VA) as a ``chunk`` call."""
    refuse_demonstration_keys(request)
    present = [key for key in GUIDANCE_KEYS if request.get(key) is not None]
    if not present:
        return None
    if not accepted:
        raise RequestError(f"{present[0]}: this server's policy takes no per-request guidance; leave it out")
    return EpisodeCall("chunk", *(decode_guidance_scale(request, key) for key in GUIDANCE_KEYS))


def _require_request_map(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise RequestError(f"request must be a map of observation keys, got {_describe(payload)}")
    for key in payload:
        if not isinstance(key, str):
            raise RequestError(f"request keys must be strings, got a key of type {type(key).__name__}: {short_repr(key)}")
    return payload


def _decode_endpoint(value: Any) -> Literal["infer", "reset"]:
    if value is None:
        return "infer"  # plain openpi clients send no endpoint
    if isinstance(value, str) and value in ("infer", "reset"):
        return value  # type: ignore[return-value]
    raise RequestError(f"{ENDPOINT_KEY}: expected 'infer' or 'reset', got {short_repr(value)}")


def decode_session_id(value: Any, key: str = SESSION_ID_KEY) -> str | None:
    """One canonical string for a session id in any form clients send; None if absent."""
    if value is None:
        return None
    expected = "a string or integer (or a 1-element array of one)"
    if isinstance(value, list | tuple) or (isinstance(value, np.ndarray) and value.ndim > 0):
        if len(value) != 1 or (isinstance(value, np.ndarray) and value.ndim != 1):
            raise RequestError(f"{key}: expected {expected}, got {_describe(value)}")
        value = _element(value, 0, key)
        if isinstance(value, np.ndarray | list | tuple | dict):
            raise RequestError(f"{key}: expected {expected}, got a nested {type(value).__name__}")
    if isinstance(value, np.ndarray):  # 0-d
        value = _element(value, (), key)
    if isinstance(value, bool | np.bool_):
        raise RequestError(f"{key}: expected {expected}, got a bool")
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, bytes | np.bytes_):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{key}: bytes must be UTF-8, got {short_repr(value)}") from None
    if isinstance(value, np.str_):
        value = str(value)
    if not isinstance(value, str):
        raise RequestError(f"{key}: expected {expected}, got {_describe(value)}")
    session_id = value.strip()
    if not session_id:
        raise RequestError(f"{key}: expected a non-empty string, got {short_repr(value)}")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise RequestError(f"{key}: expected at most {MAX_SESSION_ID_CHARS} characters, got {len(session_id)}")
    if not session_id.isprintable():
        raise RequestError(f"{key}: expected printable characters, got {short_repr(session_id)}")
    # Surrounding whitespace never distinguishes sessions; the stripped id is the session's.
    return session_id


def _element(container: Any, index: Any, key: str) -> Any:
    try:
        return container[index]
    except (ValueError, UnicodeError) as exc:  # e.g. a U-array holding an invalid code point
        raise RequestError(f"{key}: unreadable value ({exc})") from None


def _decode_session_ids(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = list(value)
    if not isinstance(value, list | tuple):
        raise RequestError(f"{SESSION_IDS_KEY}: expected a list of session ids or null, got {_describe(value)}")
    if len(value) > MAX_RESET_IDS:
        raise RequestError(f"{SESSION_IDS_KEY}: expected at most {MAX_RESET_IDS} ids, got {len(value)}")
    ids = [decode_session_id(item, f"{SESSION_IDS_KEY}[{i}]") for i, item in enumerate(value)]
    return [sid for sid in ids if sid is not None]


def _decode_prompt(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RequestError(f"{PROMPT_KEY}: expected a string, got {_describe(value)}")
    return check_prompt_length(value)


def _decode_observation(request: dict[str, Any], budget: PixelBudget | None) -> RobotObservation:
    left_key, right_key = _exterior_camera_keys(request)
    states = {field: _decode_state(key, request.get(key), length) for field, (key, length) in STATE_KEYS.items()}
    images = decode_images(
        {
            "exterior_left": read_image(left_key, request.get(left_key), budget),
            "exterior_right": read_image(right_key, request.get(right_key), budget) if right_key else None,
            "wrist": read_image(WRIST_IMAGE_KEY, request.get(WRIST_IMAGE_KEY), budget),
        },
        budget,
    )
    wire_keys = {"exterior_left": left_key, "wrist": WRIST_IMAGE_KEY, **{field: key for field, (key, _) in STATE_KEYS.items()}}
    if right_key is not None:
        wire_keys["exterior_right"] = right_key
    observation = RobotObservation(**images, prompt=_decode_prompt(request.get(PROMPT_KEY)), wire_keys=wire_keys, **states)
    if not observation.arrays():  # a map of unrelated keys (or garbage that happens to be a map)
        raise RequestError(
            f"no observation in the request: expected images ({exterior_image_key(0)}, {WRIST_IMAGE_KEY}, ...) "
            f"and/or state ({STATE_KEYS['joint_position'][0]}, ...), got keys {short_repr(sorted(request)[:8])}"
        )
    if observation.joint_position is None:
        key, length = STATE_KEYS["joint_position"]
        raise RequestError(
            f"{key}: missing; expected {_state_expected(length)}, the arm's joint positions (DROID actions are joint positions relative to them)"
        )
    if observation.gripper_position is None:
        key, length = STATE_KEYS["gripper_position"]
        raise RequestError(
            f"{key}: missing; expected {_state_expected(length)}, the gripper's position (0 open, 1 closed; part of the model's state)"
        )
    return observation


def _decode_embodiment_observation(request: dict[str, Any], schema: ObservationSchema, budget: PixelBudget | None) -> RobotObservation:
    """An embodiment's ``observation/<name>`` keys: every camera and state the schema names is required."""
    images, states = {}, {}
    for name in schema.cameras:
        key = schema.key(name)
        value = request.get(key)
        if value is None:
            raise RequestError(f"{key}: missing; expected {IMAGE_EXPECTED}{_unknown_keys(request, schema)}")
        images[name] = read_image(key, value, budget)
    cameras = decode_images(images, budget)
    for part in schema.states:
        key = schema.key(part.name)
        value = request.get(key)
        if value is None:
            raise RequestError(f"{key}: missing; expected {_state_expected(part.dim)}{_unknown_keys(request, schema)}")
        states[part.name] = _decode_state(key, value, part.dim)
    prompt = request.get(PROMPT_KEY)
    wire_keys = {name: schema.key(name) for name in (*cameras, *states)}
    return RobotObservation(cameras=cameras, states=states, prompt=None if prompt is None else _decode_prompt(prompt), wire_keys=wire_keys)


def _unknown_keys(request: dict[str, Any], schema: ObservationSchema) -> str:
    """A hint naming the request's observation keys the schema does not know (a typo, another robot's keys)."""
    known = {schema.key(name) for name in (*schema.cameras, *(p.name for p in schema.states))}
    unknown = sorted(k for k in request if k.startswith("observation/") and k not in known)
    return f" (this server serves embodiment {schema.embodiment}; unknown keys {short_repr(unknown[:4])})" if unknown else ""


def _exterior_camera_keys(request: dict[str, Any]) -> tuple[str, str | None]:
    """(first, second) exterior camera keys under the convention the client uses."""
    if request.get(exterior_image_key(0)) is not None:
        return exterior_image_key(0), exterior_image_key(1)
    if request.get(exterior_image_key(2)) is not None:
        return exterior_image_key(1), exterior_image_key(2)
    # Neither 0 nor 2: a lone _1_left (or nothing) is the first camera. There is no second.
    return exterior_image_key(1), None


def _state_expected(length: int) -> str:
    return f"{length} numbers (float array or list)" if length > 1 else "1 number (float, float array or list)"


def _decode_state(key: str, value: Any, length: int) -> np.ndarray | None:
    """A numeric array or list of ``length`` numbers -> finite float32 (length,); None if absent.
    A leading batch axis of one, ``(1, length)``, is accepted: one environment's state."""
    if value is None:
        return None
    expected = _state_expected(length)
    if length == 1 and _is_number(value):  # a bare gripper scalar
        value = [value]
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], (list, tuple)):
        value = value[0]  # [[...]]: a batch of one
    if isinstance(value, (list, tuple)):
        if len(value) != length:
            raise RequestError(f"{key}: expected {expected}, got a list of {len(value)}")
        value = np.array([_list_number(key, item, expected) for item in value], dtype=np.float64)
    if not isinstance(value, np.ndarray):
        raise RequestError(f"{key}: expected {expected}, got {_describe(value)}")
    if value.dtype.kind not in "fiu":
        raise RequestError(f"{key}: expected {expected}, got array of dtype {value.dtype}")
    if value.shape != (length,) and value.shape != (1, length) and not (length == 1 and value.shape == ()):
        raise RequestError(f"{key}: expected {expected}, got shape {value.shape}")
    # Checked in float64 before the cast: beyond float32's range would become inf (and an
    # np.errstate() around the cast costs more than the rest of the decode).
    wide = value.astype(np.float64, copy=False).reshape(length)
    if not (np.isfinite(wide).all() and np.abs(wide).max() <= _FLOAT32_MAX):
        raise RequestError(f"{key}: expected finite numbers within float32's range, got {wide.tolist()}")
    return wide.astype(np.float32)


def _list_number(key: str, item: Any, expected: str) -> float:
    if not _is_number(item):
        raise RequestError(f"{key}: expected {expected}, got a list containing {_describe(item)}")
    try:
        return float(item)
    except OverflowError:  # an int beyond float64; the finiteness check rejects it
        return math.inf


def _is_number(value: Any) -> bool:
    # bool is an int subclass but no joint reading (np.bool_ is no np.integer either).
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
