"""LingBot-VA's own protocol on a connection (``wire/lingbot_va.py`` decodes it): each connection is one session.

* ``reset``: the connection's session ends (its KV pages back to the pool) and the prompt is kept for the episode,
  with the denoising steps it names (``num_inference_steps`` / ``action_num_inference_steps``, checked against the
  policy's bounds here: a reset out of bounds is refused and ends nothing); the next ``infer`` opens a fresh session,
  whose first step encodes the prompt. Reply ``{server_timing}``. Zero-WAM's reset (it says how the episode begins:
  ``use_icl``, ``icl_demo_id``, guidance) begins the fresh session at once, a step without a chunk, so a missing or
  malformed demonstration is answered at the reset, as upstream's server raises.
* ``infer``: ``{action: (channels, frames, actions per frame) float32, server_timing}`` as upstream's server replies,
  with ``chunk_id`` / ``frozen`` (and, when it carried a ``continuation``, ``continuation``: applied or why not) and the
  denoising steps it ran (``num_inference_steps``, ``action_num_inference_steps``: its own, else its reset's, else the
  embodiment's).
* ``compute_kv_cache``: ``{server_timing}``.

A bad request gets a one-line text frame naming the key (upstream's client raises on any text frame) and the
connection stays open. Replies are timed, counted and worded as OpenPI's (``replies.py``): the same
``server_timing`` (``infer_ms``, ``queue_ms``, ``encode_ms``, ``prev_total_ms``) and the same metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from ardiff_policies.episode import EpisodeCall, EpisodeStart
from ardiff_policies.inference_steps import STEP_KEYS, check_steps
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_server.engine.client import EngineClient
from ardiff_server.engine.messages import EngineError
from ardiff_server.frontend.replies import Replies, RequestClock, chunk_info
from ardiff_server.frontend.sessions import Connection, SessionTable
from ardiff_server.wire.lingbot_va import LingBotVARequest, action_reply
from ardiff_server.wire.protocol import pack


class LingBotVAHandler:
    """Answers LingBot-VA's messages, keeping the episode prompt of every connection speaking them; ``engine``: for
    the served policy's action layout (``PolicyInfo.details['action_layout']``)."""

    def __init__(self, sessions: SessionTable, replies: Replies, engine: EngineClient) -> None:
        self.sessions = sessions
        self.replies = replies
        self.engine = engine
        self.prompts: dict[int, str] = {}  # conn_id -> the prompt of its last reset
        # conn_id -> how its last reset began the episode (Zero-WAM): every call carries it, so a session the engine had
        # to end (TTL, pressure) begins again with its demonstration, never silently without it
        self.starts: dict[int, EpisodeStart] = {}
        self.steps: dict[int, dict[str, int]] = {}  # conn_id -> the denoising steps its last reset named

    def forget(self, conn: Connection) -> None:
        self.prompts.pop(conn.conn_id, None)
        self.starts.pop(conn.conn_id, None)
        self.steps.pop(conn.conn_id, None)

    async def serve(self, conn: Connection, request: LingBotVARequest, clock: RequestClock) -> bytes | str:
        session_id = self.sessions.resolve(conn, None)
        if request.kind == "reset":
            try:  # before anything ends: the episode's steps are every infer's, so a bad one is refused at once
                taken = self.engine.info.inference_steps
                for key, steps in request.inference_steps.items():
                    check_steps(key, steps, taken[key])
            except UnsupportedObservation as exc:
                return self.replies.bad_request(str(exc))
            try:
                await self.sessions.end(conn, [session_id])
            except EngineError as exc:
                return self.replies.error(exc, session_id)
            self.prompts.pop(conn.conn_id, None)
            self.starts.pop(conn.conn_id, None)
            if request.start is not None:  # Zero-WAM: the episode begins now (its demonstration read and pinned)
                return await self._begin(conn, session_id, request, clock)
            self.prompts[conn.conn_id] = request.prompt
            self.steps[conn.conn_id] = request.inference_steps
            self.replies.reset()
            return pack({"server_timing": self.replies.uncalled_timing(clock)})
        prompt = self.prompts.get(conn.conn_id)
        if prompt is None:
            return self.replies.bad_request(f"{request.kind} before reset: send {{reset: True, prompt}} first")
        observation = request.observation
        call = observation.episode
        if conn.conn_id in self.starts:
            call = dataclasses.replace(call, start=self.starts[conn.conn_id])
        steps = {key: getattr(observation, key) for key in STEP_KEYS if getattr(observation, key) is not None}
        if request.kind == "infer":
            steps = {**self.steps.get(conn.conn_id, {}), **steps}  # the infer's own, else its reset's
        observation = RobotObservation(
            cameras=observation.cameras, states={}, prompt=prompt, episode=call, continuation=observation.continuation, **steps
        )
        sent = time.perf_counter()
        try:
            reply = await self.sessions.infer(conn, session_id, observation, deadline=clock.deadline(request.actions_left_s))
        except EngineError as exc:
            return self.replies.error(exc, session_id)
        server_timing = self.replies.served(session_id, reply, clock, sent)
        if request.kind == "compute_kv_cache":
            return pack({"server_timing": server_timing})
        layout = self.engine.info.details["action_layout"]
        action = action_reply(reply.actions, layout["channels"], layout["frames"], layout["per_frame"])
        ran = {key: reply.info[key] for key in STEP_KEYS if key in reply.info}  # the steps it ran
        return pack({"action": action, "server_timing": server_timing, **chunk_info(reply), **ran})

    async def _begin(self, conn: Connection, session_id: str, request: LingBotVARequest, clock: RequestClock) -> bytes | str:
        """A reset that begins its episode in a step of its own (``EpisodeCall`` ``reset``: Zero-WAM's demonstration is
        read and pinned here, as upstream's reset does): a bad demonstration is answered now, the session ended again,
        and the connection's next infer is refused until a reset succeeds."""
        call = EpisodeCall("reset", start=request.start)
        observation = RobotObservation(cameras={}, states={}, prompt=request.prompt, episode=call)
        sent = time.perf_counter()
        try:
            reply = await self.sessions.infer(conn, session_id, observation, deadline=clock.deadline(None))
        except EngineError as exc:
            with contextlib.suppress(EngineError):
                await self.sessions.end(conn, [session_id])
            return self.replies.error(exc, session_id)
        self.prompts[conn.conn_id], self.starts[conn.conn_id] = request.prompt, request.start
        self.steps[conn.conn_id] = request.inference_steps
        self.replies.reset()
        return pack({"server_timing": self.replies.served(session_id, reply, clock, sent)})
