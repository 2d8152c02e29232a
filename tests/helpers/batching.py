"""The tiny DreamZero behind a real SessionEngine for the batching tests: an engine, observations, one session alone."""

from __future__ import annotations

import numpy as np

from ardiff_kv import PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.dreamzero.config import DreamZeroConfig
from ardiff_policies.dreamzero.policy import DreamZeroPolicy
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.core import SessionEngine
from ardiff_server.engine.messages import ErrorReply, Infer, InferReply
from tests.helpers.dreamzero import droid_observation

TINY = {"view_size": (48, 80), "image_resolution": (48, 80)}
ATOL = 1e-5


def make_engine(tiny_model, *, max_sessions: int = 6, max_batch: int = 4, pool_sessions: int | None = None, **overrides) -> SessionEngine:
    policy = DreamZeroPolicy(DreamZeroConfig(**{**TINY, **overrides}), RuntimeOptions(), model=tiny_model)
    spec = policy.kv_spec()
    pages = (pool_sessions or max_sessions) * len(policy.branches) * spec.pages_per_branch + 1
    cache = PagedKVCache(spec, num_pages=pages, max_sessions=max_sessions, branches=policy.branches, max_batch=max_batch)
    return SessionEngine(policy, cache, max_sessions=max_sessions, max_batch=max_batch)


def observation(rng: np.random.Generator, first: bool, prompt: str = "pick up the cup") -> RobotObservation:
    return droid_observation(rng, 1 if first else 4, size=(48, 80), prompt=prompt)


def serve(engine: SessionEngine, requests: list[Infer]) -> dict[str, InferReply | ErrorReply]:
    replies = engine.run(requests)
    by_id = {r.request_id: r.session_id for r in requests}
    return {by_id[reply.request_id]: reply for reply in replies}


def alone(engine: SessionEngine, session_id: str, episode: list[RobotObservation | None]) -> list[np.ndarray]:
    """The session's calls one at a time (None in the episode: the session is ended there)."""
    actions = []
    for i, obs in enumerate(episode):
        if obs is None:
            engine.end(session_id, "reset")
            continue
        reply = serve(engine, [Infer(i, session_id, obs)])[session_id]
        assert isinstance(reply, InferReply) and reply.batch_size == 1
        actions.append(reply.actions)
    engine.end(session_id, "done")
    return actions
