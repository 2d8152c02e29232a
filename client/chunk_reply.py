"""One reply of the asynchronous chunk loop (``ardiff_client.async_runner``), checked before the robot executes it.

A reply is a map with ``actions`` (N, D) and, from servers that continue chunks (docs/spec.md),
``chunk_id``, ``frozen`` and ``continuation`` (and in ``server_timing``, ``next_call_p90_ms``: the server's estimate of
the next call's latency, which adaptive asking reads); or a bare (N, D) array (DreamZero's own server). A reply
the loop cannot execute is a :class:`ReplyError` whose message is one line naming the field, what it
must be and what came, so ``ardiff-client --async`` reports it instead of a traceback.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ardiff_client.records import ReplayError
from ardiff_server.wire.decode import MAX_CHUNK_ID
from ardiff_server.wire.protocol import short_repr

__all__ = ["MAX_CHUNK_ID", "NEXT_CALL_KEY", "ChunkReply", "ReplyError", "parse_chunk_reply"]

NEXT_CALL_KEY = "next_call_p90_ms"  # server_timing: the server's estimate of this session's next call's latency


class ReplyError(ReplayError):
    """A reply the loop cannot execute; the message is one line."""


@dataclass(frozen=True, slots=True)
class ChunkReply:
    actions: np.ndarray  # float64 (N, D), N >= 1
    chunk_id: int | None  # None: the server numbers no chunks
    frozen: int  # leading actions equal to the old chunk's, 0..N
    continuation: str | None  # "applied", why a requested continuation was served fresh, or None
    next_call_s: float | None = None  # server_timing.next_call_p90_ms in seconds; None: the server sends no estimate


def parse_chunk_reply(reply: Any, number: int) -> ChunkReply:
    """``reply`` (decoded) -> :class:`ChunkReply`; ``number``: the reply's 1-based count, for the message."""
    where = f"reply {number}"
    if isinstance(reply, np.ndarray):
        reply = {"actions": reply}
    if not isinstance(reply, Mapping):
        raise ReplyError(f"{where}: expected a map with 'actions' or a bare (N, D) array, got {_described(reply)}")
    if "actions" not in reply:
        raise ReplyError(f"{where}: no 'actions' in the reply (its keys: {short_repr(sorted(map(str, reply)))})")
    actions = reply["actions"]
    if isinstance(actions, str | bytes | Mapping):  # numpy would make a 0-d array of a string
        raise ReplyError(f"{where}: 'actions' is not a numeric array, got {_described(actions)}")
    try:
        actions = np.asarray(actions, dtype=np.float64)
    except (TypeError, ValueError):
        raise ReplyError(f"{where}: 'actions' is not a numeric array, got {_described(actions)}") from None
    if actions.ndim != 2:
        raise ReplyError(f"{where}: expected actions of shape (N, D), got {actions.shape}")
    if 0 in actions.shape:
        raise ReplyError(f"{where}: the reply holds no actions (shape {actions.shape})")
    chunk_id = reply.get("chunk_id")
    if chunk_id is not None:
        # the bound the server accepts back in continuation.chunk_id: a larger id could never be named
        chunk_id = _integer(
            chunk_id, f"{where}: chunk_id", MAX_CHUNK_ID, "", "the largest chunk_id a continuation can name back (2**63 - 1 = {bound})"
        )
    frozen = reply.get("frozen")
    frozen = 0 if frozen is None else _integer(frozen, f"{where}: frozen", len(actions), " (the chunk's actions)", "the chunk's {bound} actions")
    continuation = reply.get("continuation")
    return ChunkReply(actions, chunk_id, frozen, continuation if isinstance(continuation, str) else None, _next_call_s(reply, where))


def _next_call_s(reply: Mapping[str, Any], where: str) -> float | None:
    timing = reply.get("server_timing")
    value = timing.get(NEXT_CALL_KEY) if isinstance(timing, Mapping) else None
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating) or not math.isfinite(value) or value < 0:
        raise ReplyError(f"{where}: server_timing.{NEXT_CALL_KEY}: expected a finite number of milliseconds >= 0, got {short_repr(value)}")
    return float(value) / 1000.0


def _integer(value: Any, what: str, bound: int, meaning: str, past: str) -> int:
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) or value < 0:
        raise ReplyError(f"{what}: expected an integer in [0, {bound}]{meaning}, got {short_repr(value)}")
    if value > bound:
        raise ReplyError(f"{what}: {int(value)} is past {past.format(bound=bound)}")
    return int(value)


def _described(value: Any) -> str:
    return f"{type(value).__name__} {short_repr(value)}"
