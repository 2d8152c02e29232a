"""Zero-WAM's RoboTwin wire in the front end (frontend/lingbot_va.py), in process: every call of a connection carries
how its reset began the episode, so a session the engine had to end (its TTL, pool pressure) begins again with its
demonstration on the connection's next infer, never silently without it; a failed reset leaves nothing begun."""

from __future__ import annotations

import numpy as np
from openpi_client import msgpack_numpy
from websockets.sync.client import connect

from ardiff_kv import Branch
from tests.helpers.inproc_server import InprocServer
from tests.helpers.lingbot_va_client import robotwin_frame

RESET = {"reset": True, "prompt": "grab the white mug", "use_icl": True, "icl_demo_id": "tiny/wave", "icl_guidance_scale": 5.0}
CONFIG = {"policy": {"name": "zero_wam", "demonstration_root": "builtin:tiny"}, "engine": {"kv_budget_gib": 0.05, "warmup": False}}


def test_an_ended_session_begins_again_with_its_demonstration_and_a_failed_reset_begins_nothing():
    frame = robotwin_frame(np.random.default_rng(0), 32, 64, "x")
    with InprocServer(CONFIG) as server, connect(server.url, max_size=None) as ws:
        ws.recv()  # the metadata frame

        def call(message: dict):
            ws.send(msgpack_numpy.packb(message))
            reply = ws.recv()
            return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)

        engine = server.engine
        call(RESET)
        assert "action" in call({"obs": frame})
        (first,) = engine.sessions
        assert engine.end(first, "ttl")  # as the TTL would, between two calls of the connection
        assert "action" in call({"obs": frame})  # a fresh session, begun from the reset the connection kept
        (session_id,) = engine.sessions
        assert len(engine.sessions[session_id].kv.branch(Branch.COND).pinned) == 2
        assert call({**RESET, "icl_demo_id": "missing"}).startswith("bad request: icl_demo_id 'missing'")
        assert call({"obs": frame}).startswith("bad request: infer before reset")
        assert engine.sessions == {} or all(not s.kv.pages_held for s in engine.sessions.values())
