"""Request fields both protocols read, one rule each: OpenPI's requests (``openpi.py``) and LingBot-VA's messages
(``lingbot_va.py``) check a prompt, a guidance scale, the per-request denoising steps and a ``continuation`` key the same
way, with the same message."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import numpy as np

from ardiff_policies.continuation import Continuation
from ardiff_policies.episode import EpisodeStart
from ardiff_policies.inference_steps import STEP_KEYS
from ardiff_server.wire.protocol import RequestError, describe, short_repr

MAX_PROMPT_CHARS = 4096

PROMPT_KEY = "prompt"
CONTINUATION_KEY = "continuation"  # this server's real-time chunking (OpenPI's requests; refused by LingBot-VA's)
ACTIONS_LEFT_KEY = "actions_left_s"  # in ``continuation``: seconds of actions the robot had left when it took the observation
# No chunk lasts this long at any control rate a robot runs (DROID's: 1.6 s): a larger value is a client's bug (milliseconds
# sent as seconds, a clock read as a duration), and as a deadline it would let every other robot pass this one for an hour.
MAX_ACTIONS_LEFT_S = 600.0
CONTINUATION_FIELDS = ("executed", "delay", "chunk_id")  # the policy's (ardiff_policies.continuation.Continuation)
MAX_CHUNK_ID = 2**63 - 1  # the largest continuation.chunk_id a request may name (the client checks replies against it)


# How an episode begins, for a policy that takes a demonstration (Zero-WAM; it advertises ``demonstration`` in its
# metadata): upstream's reset keys, also an OpenPI session's first call's.
USE_ICL_KEY = "use_icl"
DEMONSTRATION_KEY = "icl_demo_id"
START_KEYS = (USE_ICL_KEY, DEMONSTRATION_KEY, "video_guidance_scale", "icl_guidance_scale")
# Upstream's older reset keys: server-side file paths chosen by the client. Refused by name: a client names a
# demonstration by id, under the root the server was given.
PATH_KEYS = ("icl_video_path", "icl_latent_path")
MAX_DEMONSTRATION_ID_CHARS = 512


def decode_episode_start(payload: dict[str, Any], *, use_icl_default: bool | None) -> EpisodeStart:
    """``use_icl``, ``icl_demo_id``, ``video_guidance_scale``, ``icl_guidance_scale`` as an
    :class:`~ardiff_policies.episode.EpisodeStart` (``use_icl`` absent: ``use_icl_default``); their types and the id's
    length are checked here, their values by the policy."""
    for key in PATH_KEYS:
        if payload.get(key):
            raise RequestError(
                f"{key}: server-side paths are not taken; name the demonstration by {DEMONSTRATION_KEY} (under the server's demonstration root)"
            )
    use_icl = payload.get(USE_ICL_KEY)
    if use_icl is None:
        use_icl = use_icl_default
    elif not isinstance(use_icl, (bool, np.bool_)):
        raise RequestError(f"{USE_ICL_KEY}: expected true or false, got {short_repr(use_icl)}")
    demo = payload.get(DEMONSTRATION_KEY)
    if demo is not None:
        if not isinstance(demo, str) or not demo:
            raise RequestError(f"{DEMONSTRATION_KEY}: expected a demonstration's id (a relative path without extension), got {short_repr(demo)}")
        if len(demo) > MAX_DEMONSTRATION_ID_CHARS:
            raise RequestError(f"{DEMONSTRATION_KEY}: expected at most {MAX_DEMONSTRATION_ID_CHARS} characters, got {len(demo)}")
    return EpisodeStart(
        None if use_icl is None else bool(use_icl),
        demo,
        decode_guidance_scale(payload, "video_guidance_scale"),
        decode_guidance_scale(payload, "icl_guidance_scale"),
    )


def refuse_demonstration_keys(payload: dict[str, Any]) -> None:
    """A request to a policy that takes no demonstration: its demonstration keys are refused by name, never ignored."""
    for key in (USE_ICL_KEY, DEMONSTRATION_KEY, "icl_guidance_scale", *PATH_KEYS):
        if payload.get(key) is not None:
            raise RequestError(f"{key}: this server's policy takes no demonstration; leave it out")


def check_prompt_length(prompt: str) -> str:
    """``prompt`` unchanged (a changed prompt resets the session, so it stays exact) if within the bound."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestError(f"{PROMPT_KEY}: expected at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}")
    return prompt


def decode_guidance_scale(payload: dict[str, Any], key: str) -> float | None:
    """A per-request guidance scale: a finite number, or None if absent (its bounds are the policy's to check)."""
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RequestError(f"{key}: expected a number, got {short_repr(value)}")
    if not math.isfinite(float(value)):
        raise RequestError(f"{key}: expected a finite number, got {value}")
    return float(value)


def decode_inference_steps(payload: dict[str, Any], accepted: Collection[str]) -> dict[str, int]:
    """A request's per-request denoising steps (``num_inference_steps``, ``action_num_inference_steps``:
    ``ardiff_policies.inference_steps``), each an integer >= 1, by key; absent keys left out. ``accepted``: the keys
    the served policy takes (``PolicyInfo.inference_steps``); any other is refused by name (the bounds are the
    policy's to check)."""
    steps = {}
    for key in STEP_KEYS:
        value = payload.get(key)
        if value is None:
            continue
        if key not in accepted:
            takes = f" (it takes {', '.join(sorted(accepted))})" if accepted else ""
            raise RequestError(f"{key}: this server's policy takes no per-request {_STEP_NAMES[key]}{takes}; leave it out")
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) or int(value) < 1:
            raise RequestError(f"{key}: expected an integer >= 1, got {short_repr(value)}")
        steps[key] = int(value)
    return steps


_STEP_NAMES = {"num_inference_steps": "denoising steps", "action_num_inference_steps": "action denoising steps"}


def decode_actions_left(continuation: Any) -> float | None:
    """``continuation.actions_left_s``: the seconds of actions the robot had left when it took the observation (a
    finite number in [0, MAX_ACTIONS_LEFT_S]); None if absent (the request is due now). The front end makes it the
    engine's deadline (``frontend/replies.RequestClock.deadline``)."""
    if not isinstance(continuation, dict):
        return None  # not a map: the continuation's own decoder refuses it by name
    value = continuation.get(ACTIONS_LEFT_KEY)
    if value is None:
        return None
    where = f"{CONTINUATION_KEY}.{ACTIONS_LEFT_KEY}"
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RequestError(f"{where}: expected the seconds of actions left (a number >= 0), got {short_repr(value)}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise RequestError(f"{where}: expected a finite number of seconds >= 0, got {value}")
    if seconds > MAX_ACTIONS_LEFT_S:
        raise RequestError(f"{where}: expected at most {MAX_ACTIONS_LEFT_S:g} s of actions left, got {seconds:g} (seconds, not milliseconds)")
    return seconds


def decode_continuation(value: Any) -> Continuation | None:
    """``{"executed": e, "delay": d[, "chunk_id": c]}`` -> :class:`Continuation`; None if absent. Its
    ``actions_left_s`` is the front end's, not the policy's (``fields.decode_actions_left``)."""
    if value is None:
        return None
    expected = 'a map {"executed": int, "delay": int, "chunk_id": int (optional), "actions_left_s": seconds (optional)}'
    if not isinstance(value, dict):
        raise RequestError(f"{CONTINUATION_KEY}: expected {expected}, got {describe(value)}")
    unknown = sorted(str(k) for k in value if k not in CONTINUATION_FIELDS and k != ACTIONS_LEFT_KEY)
    if unknown:
        raise RequestError(f"{CONTINUATION_KEY}: unknown field(s) {short_repr(unknown)}; expected {expected}")
    numbers: dict[str, int | None] = {}
    for name in CONTINUATION_FIELDS:
        item = value.get(name)
        if item is None:
            if name != "chunk_id":
                raise RequestError(f"{CONTINUATION_KEY}.{name}: missing; expected {expected}")
            numbers[name] = None
            continue
        if isinstance(item, np.ndarray) and item.ndim == 0:
            item = item.item()
        if isinstance(item, bool | np.bool_) or not isinstance(item, int | np.integer):
            raise RequestError(f"{CONTINUATION_KEY}.{name}: expected an integer >= 0, got {short_repr(item)}")
        if int(item) < 0:
            raise RequestError(f"{CONTINUATION_KEY}.{name}: expected an integer >= 0, got {int(item)}")
        if int(item) > MAX_CHUNK_ID:
            raise RequestError(f"{CONTINUATION_KEY}.{name}: expected an integer in [0, 2**63 - 1 = {MAX_CHUNK_ID}], got {int(item)}")
        numbers[name] = int(item)
    return Continuation(executed=numbers["executed"], delay=numbers["delay"], chunk_id=numbers["chunk_id"])
