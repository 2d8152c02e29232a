"""Who serves a request's ``continuation`` (policies/continuation.py): a policy that continues chunks, under the dict
reply that says ``chunk_id`` / ``frozen``. Anywhere else it is refused by name (``frontend/continuations.py``), never
served as a plain chunk that silently drops it; ``GET /info`` says which."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.inproc_server import DROID, TINY_DREAMZERO, InprocServer

CONTINUATION = {"executed": 2, "delay": 3}  # e + d inside either policy's chunk


def test_a_policy_that_does_not_continue_chunks_refuses_a_continuation_by_name():
    with InprocServer({"engine": {"warmup": False}, "policy": {"name": "noop"}}) as server:
        before, refused, after = server.exchange(
            [
                {**DROID, "session_id": "s"},
                {**DROID, "session_id": "s", "continuation": CONTINUATION},
                {**DROID, "session_id": "s"},
            ],
        )
        assert refused == "bad request: continuation: policy noop does not continue chunks (its replies carry no chunk_id/frozen); leave it out"
        assert before["session"]["calls"] == 1 and after["session"]["calls"] == 2  # the session went on
        status, body = server.http("/info")
        assert status == 200 and json.loads(body)["continuations"] == {"accepted": False, "why": refused.removeprefix("bad request: continuation: ")}


@pytest.fixture(scope="module")
def dreamzero_array():
    with InprocServer({"server": {"reply_format": "array"}, "engine": {"warmup": False}, "policy": TINY_DREAMZERO}) as server:
        yield server


def test_the_bare_array_reply_refuses_a_continuation_it_could_not_say_is_frozen(dreamzero_array):
    """``server.reply_format: array`` (DreamZero's own client, which asks for no continuation) has no room for
    ``chunk_id`` / ``frozen``: a continuation there is refused per request naming the setting; plain requests are served
    as bare arrays, so DreamZero's client still runs."""
    first, refused, second = dreamzero_array.exchange(
        [
            {**DROID, "session_id": "a"},
            {**DROID, "session_id": "a", "continuation": CONTINUATION},
            {**DROID, "session_id": "a"},
        ],
    )
    assert isinstance(first, np.ndarray) and first.shape == (24, 8) and isinstance(second, np.ndarray)
    assert refused.startswith("bad request: continuation: server.reply_format is array") and "reply_format=dict" in refused
    status, body = dreamzero_array.http("/info")
    info = json.loads(body)
    assert status == 200
    assert info["continuations"] == {"accepted": False, "why": refused.removeprefix("bad request: continuation: ")}
    assert info["policy"]["continuation"]["mode"] == "inpaint"  # the policy's contract, for a dict-reply server


def test_a_dict_reply_from_a_policy_that_continues_chunks_accepts_them():
    with InprocServer({"engine": {"warmup": False}, "policy": TINY_DREAMZERO}) as server:
        first, continued = server.exchange(
            [{**DROID, "session_id": "c"}, {**DROID, "session_id": "c", "continuation": {**CONTINUATION, "chunk_id": 1}}]
        )
        assert (first["chunk_id"], continued["chunk_id"], continued["frozen"], continued["continuation"]) == (1, 2, 3, "applied")
        assert json.loads(server.http("/info")[1])["continuations"] == {"accepted": True}
