"""OpenPI's batched requests on a connection (``wire/batch.py`` decodes them): many environments in one frame.

``{"batch": [request, ...]}`` is answered by ``{"batch": [reply, ...]}`` in the same order. Each slot holds what that
element alone would get: the reply of ``openpi.py`` (the dict, or the bare actions under ``server.reply_format:
array``), or, for an element refused alone, ``{"error": <the one-line text a single request would get>, "outcome":
<its ardiff_requests outcome>}``; the other elements are served and their sessions go on. An element's session is its
``session_id``, else one derived from its index on this connection (:func:`element_session_id`): a harness sends
environment ``i`` in slot ``i`` every call, so slot ``i`` keeps its episode. Every element is counted by its outcome
(``ardiff_requests``), and the frame's size in ``ardiff_request_batch_elements``.

All elements go to the engine before any reply is awaited (``SessionTable.infer_batch``), so ready ones can meet in
one forward, up to ``engine.max_batch`` (their ``session.batch_size`` says how many met). They go one message each:
under ``engine.batch_wait_ms: 0`` an idle engine may start on the first before the rest arrive (docs/spec.md §3).
"""

from __future__ import annotations

import time
from typing import Any

from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.messages import EngineError, InferReply
from ardiff_server.frontend.openpi import OpenPIHandler
from ardiff_server.frontend.replies import Replies, RequestClock
from ardiff_server.frontend.sessions import Connection, SessionTable
from ardiff_server.wire.batch import BATCH_KEY, BatchRequest, RefusedElement
from ardiff_server.wire.openpi import SESSION_ID_KEY
from ardiff_server.wire.protocol import pack, short_repr


def element_session_id(conn: Connection, index: int) -> str:
    """The session of a batch element that names none: its index on this connection (never another connection's)."""
    return f"{conn.default_session}-batch{index}"


def error_slot(text: str, outcome: str) -> dict[str, str]:
    """A refused element's slot: the text frame a single request would get, and its ``ardiff_requests`` outcome."""
    return {"error": text, "outcome": outcome}


class OpenPIBatchHandler:
    """Answers OpenPI's ``{"batch": [...]}`` frames; ``single``: the handler whose reply each slot holds."""

    def __init__(self, sessions: SessionTable, replies: Replies, single: OpenPIHandler) -> None:
        self.sessions = sessions
        self.replies = replies
        self.single = single

    def forget(self, conn: Connection) -> None:
        """Nothing of a connection is kept here: its sessions are the session table's."""

    async def serve(self, conn: Connection, request: BatchRequest, clock: RequestClock) -> bytes:
        slots: list[Any] = [None] * len(request.elements)
        calls: list[tuple[int, str, RobotObservation, float | None]] = []
        named: dict[str, int] = {}
        for index, element in enumerate(request.elements):
            if isinstance(element, RefusedElement):
                slots[index] = error_slot(self.replies.bad_request(element.message), "bad_request")
                continue
            session_id = element.session_id or element_session_id(conn, index)
            if session_id in named:  # an explicit id equal to another element's derived one
                message = f"{SESSION_ID_KEY}: {short_repr(session_id)} is element {named[session_id]}'s too; each element is its own session"
                slots[index] = error_slot(self.replies.bad_request(message), "bad_request")
                continue
            named[session_id] = index
            calls.append((index, session_id, element.observation, clock.deadline(element.actions_left_s)))
        sent = time.perf_counter()
        results = await self.sessions.infer_batch(conn, [call[1:] for call in calls]) if calls else []
        for (index, session_id, _, _), result in zip(calls, results, strict=True):
            if isinstance(result, InferReply):
                slots[index] = self.single.answer(session_id, result, clock, sent)
            elif isinstance(result, EngineError):
                slots[index] = error_slot(self.replies.error(result, session_id), result.kind.value)
            else:  # SessionForbidden: another key's session
                slots[index] = error_slot(self.replies.forbidden(str(result)), "forbidden")
        self.replies.batch(len(slots))
        return pack({BATCH_KEY: slots})
