"""OpenPI's requests on a connection (``wire/openpi.py`` decodes them), a session per ``session_id``.

* ``endpoint: reset``: the named sessions end (``session_ids: None``: every session the connection used; neither:
  its current one, or every session of its last batch). Reply ``{status: "reset successful", session_ids[, session_id]}``.
* ``infer``: the session's next chunk. Reply the bare actions (``server.reply_format: array``) or
  ``{actions, server_timing, policy_timing, session, chunk_id, frozen[, continuation]}`` (docs/spec.md §3).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ardiff_server.engine.messages import EngineError, InferReply, scalar_info
from ardiff_server.frontend.replies import Replies, RequestClock, chunk_info
from ardiff_server.frontend.sessions import Connection, SessionTable
from ardiff_server.wire.openpi import OpenPIRequest
from ardiff_server.wire.protocol import pack

# Old names of the reply's ``session`` flags (before the glossary), still sent for one release.
DEPRECATED_SESSION_KEYS = {"window_reset": "window_restart", "session_reset": "prompt_change"}


class OpenPIHandler:
    """Answers OpenPI's resets and inferences; ``reply_format``: ``server.reply_format`` (``dict`` or ``array``)."""

    def __init__(self, sessions: SessionTable, replies: Replies, *, reply_format: str) -> None:
        self.sessions = sessions
        self.replies = replies
        self.reply_format = reply_format

    def forget(self, conn: Connection) -> None:
        """Nothing of a connection is kept here: its sessions are the session table's."""

    async def serve(self, conn: Connection, request: OpenPIRequest, clock: RequestClock) -> bytes | str:
        if request.endpoint == "reset":
            return await self._reset(conn, request)
        return await self._infer(conn, request, clock)

    async def _reset(self, conn: Connection, request: OpenPIRequest) -> bytes | str:
        if request.reset_scope == "all":
            ids = sorted({*self.sessions.used_by(conn), *request.session_ids})
        elif request.reset_scope == "named":
            ids = list(request.session_ids)
        else:  # DreamZero's reset({}): the connection's current session (every one of its last batch)
            ids = self.sessions.current_sessions(conn)
        try:
            await self.sessions.end(conn, ids)
        except EngineError as exc:
            return self.replies.error(exc, ", ".join(ids))
        self.replies.reset()
        reply: dict[str, Any] = {"status": "reset successful", "session_ids": ids}
        if request.session_id is not None and ids == [request.session_id]:
            reply["session_id"] = request.session_id
        return pack(reply)

    async def _infer(self, conn: Connection, request: OpenPIRequest, clock: RequestClock) -> bytes | str:
        session_id = self.sessions.resolve(conn, request.session_id)
        sent = time.perf_counter()
        try:
            reply = await self.sessions.infer(conn, session_id, request.observation, deadline=clock.deadline(request.actions_left_s))
        except EngineError as exc:
            return self.replies.error(exc, session_id)
        return pack(self.answer(session_id, reply, clock, sent))

    def answer(self, session_id: str, reply: InferReply, clock: RequestClock, sent: float) -> Any:
        """An answered call counted (``sent``: when it went to the engine) and its reply, unpacked: the bare actions
        (``server.reply_format: array``) or the dict (a batch's slot holds the same)."""
        server_timing = self.replies.served(session_id, reply, clock, sent)
        actions = np.asarray(reply.actions, dtype=np.float32)
        if self.reply_format == "array":
            return actions
        return {
            "actions": actions,
            "server_timing": server_timing,
            "policy_timing": reply.timing_ms,
            "session": session_info(session_id, reply),
            **chunk_info(reply),
            **({"safety": reply.info["safety"]} if reply.info.get("safety") else {}),  # the gate clamped (policy.safety)
        }


def session_info(session_id: str, reply: InferReply) -> dict[str, Any]:
    """The reply's ``session`` map: the engine's facts about the call, then the policy's scalar ones and its chunk's."""
    said = {**scalar_info(reply.info), **reply.chunk.set_fields()}
    extra = {k: v for k, v in said.items() if k not in ("id", "new", "calls", "replica", "batch_size")}
    extra.update({old: extra[new] for old, new in DEPRECATED_SESSION_KEYS.items() if new in extra})
    return {"id": session_id, "new": reply.new_session, "calls": reply.calls, "replica": reply.replica, "batch_size": reply.batch_size, **extra}
