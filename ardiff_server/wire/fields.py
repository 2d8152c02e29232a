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
