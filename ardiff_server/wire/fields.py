"""Request fields both protocols read, one rule each: OpenPI's requests (``openpi.py``) and LingBot-VA's messages
(``lingbot_va.py``) check a prompt, a guidance scale and a ``continuation`` key the same way, with the same message."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ardiff_server.wire.protocol import RequestError, short_repr

MAX_PROMPT_CHARS = 4096

PROMPT_KEY = "prompt"
CONTINUATION_KEY = "continuation"  # this server's real-time chunking (OpenPI's requests; refused by LingBot-VA's)
ACTIONS_LEFT_KEY = "actions_left_s"  # in ``continuation``: seconds of actions the robot had left when it took the observation
# No chunk lasts this long at any control rate a robot runs (DROID's: 1.6 s): a larger value is a client's bug (milliseconds
# sent as seconds, a clock read as a duration), and as a deadline it would let every other robot pass this one for an hour.
MAX_ACTIONS_LEFT_S = 600.0


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
