"""LingBot-VA's own protocol on a connection (``wire/lingbot_va.py`` decodes it): each connection is one session.

* ``reset``: the connection's session ends (its KV pages back to the pool) and the prompt is kept for the episode;
  the next ``infer`` opens a fresh session, whose first step encodes the prompt. Reply ``{server_timing}``.
* ``infer``: ``{action: (channels, frames, actions per frame) float32, server_timing}`` as upstream's server replies.
* ``compute_kv_cache``: ``{server_timing}``.

A bad request gets a one-line text frame naming the key (upstream's client raises on any text frame) and the
connection stays open.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.messages import EngineError
from ardiff_server.frontend.sessions import Connection
from ardiff_server.wire.lingbot_va import LingBotVARequest, action_reply
from ardiff_server.wire.protocol import pack

if TYPE_CHECKING:
    from ardiff_server.frontend.service import PolicyService


class LingBotVAConnections:
    """The episode prompt of every connection speaking LingBot-VA's protocol."""

    def __init__(self, service: PolicyService) -> None:
        self.service = service
        self.prompts: dict[int, str] = {}  # conn_id -> the prompt of its last reset

    def forget(self, conn: Connection) -> None:
        self.prompts.pop(conn.conn_id, None)

    async def serve(self, conn: Connection, request: LingBotVARequest, prev_total_ms: float | None, started: float) -> bytes | str:
        service = self.service
        session_id = service.sessions.resolve(conn, None)
        if request.kind == "reset":
            try:
                await service.sessions.end(conn, [session_id])
            except EngineError as exc:
                return service._error_frame(exc, session_id)
            self.prompts[conn.conn_id] = request.prompt
            service.metrics.requests.labels("reset").inc()
            return pack({"server_timing": _timing(started, None, prev_total_ms)})
        prompt = self.prompts.get(conn.conn_id)
        if prompt is None:
            service.metrics.requests.labels("bad_request").inc()
            return f"bad request: {request.kind} before reset: send {{reset: True, prompt}} first"
        observation = request.observation
        observation = RobotObservation(cameras=observation.cameras, states={}, prompt=prompt, episode=observation.episode)
        try:
            reply = await service.sessions.infer(conn, session_id, observation)
        except EngineError as exc:
            return service._error_frame(exc, session_id)
        service.metrics.requests.labels("ok").inc()
        service.metrics.infer_seconds.observe(reply.infer_ms / 1000.0)
        service.metrics.observe_deadline(reply)
        out: dict[str, Any] = {}
        if request.kind == "infer":
            layout = service.engine.info.details["action_layout"]
            out["action"] = action_reply(reply.actions, layout["channels"], layout["frames"], layout["per_frame"])
        out["server_timing"] = _timing(started, reply.infer_ms, prev_total_ms)  # its step and its own encodes
        return pack(out)


def _timing(started: float, compute_ms: float | None, prev_total_ms: float | None) -> dict[str, float]:
    timing = {"infer_ms": compute_ms if compute_ms is not None else (time.perf_counter() - started) * 1000.0}
    if prev_total_ms is not None:
        timing["prev_total_ms"] = prev_total_ms
    return timing
