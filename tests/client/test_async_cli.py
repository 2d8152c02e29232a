"""``ardiff-client --async`` (ardiff_client.replay, async_runner, chunk_reply, async_report)
against a small in-test server that answers each infer with a scripted reply: malformed replies are one line
and exit 1, a run that got no chunk exits 1, progress while it runs, a summary with units."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from websockets.sync.server import ServerConnection, serve

from ardiff_client import replay
from ardiff_client.async_runner import EpisodeReport
from ardiff_server.wire.protocol import pack, unpack

METADATA = {
    "image_resolution": [12, 16],
    "needs_wrist_camera": True,
    "n_external_cameras": 2,
    "needs_stereo_camera": False,
    "needs_session_id": True,
    "action_space": "joint_position",
}
MAX_CHUNK_ID = 2**63 - 1  # the server's bound on continuation.chunk_id (wire/decode.py)
ACTIONS = np.linspace(0, 1, 24)[:, None] * np.ones((24, 8))
# The summary's keys under --json (what scripts read): unchanged by the text summary's rewrite.
SUMMARY_KEYS = [
    "mode",
    "steps",
    "idle_steps",
    "idle_steps_per_chunk",
    "steady_idle_per_chunk",
    "latency_p50_ms",
    "latency_p99_ms",
    "seam_jump",
    "median_inner_step",
    "seam_ratio",
    "old_step_at_seam",
    "chunks",
    "chunks_per_s",
    "asking",
    "calls_per_chunk",
    "asked_left_median",
    "fresh",
]


class ScriptedServer:
    """Metadata first; the n-th infer (1-based) is answered with ``reply(n, request)`` packed (a str is
    sent packed too: a msgpack string, not a text frame), after ``delay_s``; a reset gets a map."""

    def __init__(self, reply: Callable[[int, dict], Any], delay_s: float = 0.0) -> None:
        self.reply, self.delay_s, self.requests = reply, delay_s, []
        self._server = serve(self._handle, "127.0.0.1", 0, compression=None, max_size=None)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _handle(self, ws: ServerConnection) -> None:
        ws.send(pack(METADATA))
        calls = 0
        for frame in ws:
            request = unpack(frame)
            self.requests.append(request)
            if request.get("endpoint") == "reset":
                ws.send(pack({"reset": True}))
                continue
            calls += 1
            time.sleep(self.delay_s)
            ws.send(pack(self.reply(calls, request)))

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(10)


@pytest.fixture
def scripted():
    servers: list[ScriptedServer] = []

    def start(reply, delay_s: float = 0.0) -> ScriptedServer:
        servers.append(ScriptedServer(reply, delay_s))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _good(calls: int, request: dict) -> dict:
    delay = (request.get("continuation") or {}).get("delay", 0)
    return {"actions": ACTIONS + calls, "chunk_id": calls, "frozen": delay}


def run_async(capsys, server: ScriptedServer, *extra: str, steps: int = 30) -> tuple[int, str, str]:
    status = replay.main(["--port", str(server.port), "--async", "--control-hz", "60", "--steps", str(steps), *extra])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ({"status": "ok"}, "reply 2: no 'actions' in the reply (its keys: ['status'])"),
        ({"actions": np.zeros((0, 8))}, "reply 2: the reply holds no actions (shape (0, 8))"),
        ({"actions": ACTIONS, "chunk_id": "abc"}, f"reply 2: chunk_id: expected an integer in [0, {MAX_CHUNK_ID}], got 'abc'"),
        ({"actions": ACTIONS, "chunk_id": 1.5}, f"reply 2: chunk_id: expected an integer in [0, {MAX_CHUNK_ID}], got 1.5"),
        ({"actions": ACTIONS, "frozen": "3"}, "reply 2: frozen: expected an integer in [0, 24] (the chunk's actions), got '3'"),
        ({"actions": ACTIONS, "frozen": 30}, "reply 2: frozen: 30 is past the chunk's 24 actions"),
        (
            {"actions": ACTIONS, "chunk_id": 2**64 - 1},
            f"reply 2: chunk_id: {2**64 - 1} is past the largest chunk_id a continuation can name back (2**63 - 1 = {MAX_CHUNK_ID})",
        ),
        ("hello", "reply 2: expected a map with 'actions' or a bare (N, D) array, got str 'hello'"),
        ({"actions": "nope"}, "reply 2: 'actions' is not a numeric array, got str 'nope'"),
    ],
)
def test_a_malformed_reply_is_one_line_and_exit_1(scripted, capsys, bad, needle):
    server = scripted(lambda calls, request: _good(calls, request) if calls == 1 else bad)
    status, out, err = run_async(capsys, server, "--quiet", steps=60)  # 1 s: the second reply arrives well within it
    assert status == 1 and out == ""
    assert err.strip().splitlines() == [f"ardiff-client: error: {needle}"], err
    assert server.requests[-1]["endpoint"] == "reset"  # the session is still ended


def test_a_run_that_got_no_chunk_exits_1_in_one_line(scripted, capsys):
    server = scripted(_good, delay_s=2.0)  # the first reply takes 2 s, the run lasts 0.5 s
    status, out, err = run_async(capsys, server, "--quiet", "--json", steps=30)
    assert status == 1
    assert json.loads(out)["chunks"] == 0  # --json still prints the summary
    assert err.strip().splitlines() == [
        "ardiff-client: error: no chunk arrived in 30 control steps (0.5 s at 60 Hz): the first reply took longer; raise --steps or check the server"
    ]


def test_progress_while_it_runs_and_json_unchanged_in_content(scripted, capsys):
    server = scripted(_good)
    status, out, err = run_async(capsys, server, "--json")
    assert status == 0, err
    summary = json.loads(out)
    assert list(summary) == SUMMARY_KEYS == list(EpisodeReport("continuation", 15).summary())
    progress = [line for line in err.splitlines() if line.startswith("chunk ")]
    assert len(progress) == summary["chunks"] >= 2, err
    assert progress[0].startswith("chunk 1 at step ") and " ms, " in progress[0] and "24 actions" in progress[0]
    assert "frozen" in progress[1] and "left to execute" in progress[1]
    _, _, quiet = run_async(capsys, server, "--json", "--quiet")
    assert quiet == ""


def test_the_summary_has_units_steady_idle_the_seam_ratio_and_explains_fresh_chunks(scripted, capsys):
    def refreshing(calls: int, request: dict) -> dict:
        reply = _good(calls, request)
        if request.get("continuation") is not None and calls % 2:
            reply.update(frozen=0, continuation="unknown_chunk_id")
        elif request.get("continuation") is not None:
            reply["continuation"] = "applied"
        return reply

    server = scripted(refreshing)
    status, out, err = run_async(capsys, server, "--quiet", steps=60)
    assert status == 0, err
    text = out.splitlines()
    assert text[0].startswith("continuation at 60 Hz: 60 control steps (1.0 s), ")
    by_name = {line[2:24].strip(): line[24:] for line in text[1:] if line.startswith("  ")}
    assert by_name["steady idle / chunk"].startswith("0.00 steps per chunk after the first")
    assert " ms" in by_name["latency"] and "p50" in by_name["latency"] and "p99" in by_name["latency"]
    assert "x the median step inside a chunk" in by_name["seam"] and "1x" in by_name["seam"]
    assert "steps" in by_name["idle"] and " s)" in by_name["idle"]
    fresh = by_name["fresh chunks"]
    assert "unknown_chunk_id" in fresh and "not the session's last chunk" in fresh and " of " in fresh and "continuations asked" in fresh


def test_parse_chunk_reply_accepts_what_servers_send():
    from ardiff_client import chunk_reply
    from ardiff_client.chunk_reply import ReplyError, parse_chunk_reply

    assert chunk_reply.MAX_CHUNK_ID == MAX_CHUNK_ID
    reply = parse_chunk_reply({"actions": ACTIONS.astype(np.float32), "chunk_id": np.int64(3), "frozen": 2, "continuation": "applied"}, 1)
    assert reply.actions.dtype == np.float64 and reply.actions.shape == (24, 8)
    assert (reply.chunk_id, reply.frozen, reply.continuation) == (3, 2, "applied") and type(reply.chunk_id) is int
    bare = parse_chunk_reply(np.ones((6, 8), np.float32), 2)  # DreamZero's server: a bare array
    assert (bare.chunk_id, bare.frozen, bare.continuation) == (None, 0, None)
    with pytest.raises(ReplyError, match=r"reply 4: frozen: expected an integer in \[0, 24\]"):
        parse_chunk_reply({"actions": ACTIONS, "frozen": True}, 4)
    with pytest.raises(ReplyError, match=r"reply 1: expected actions of shape \(N, D\), got \(8,\)"):
        parse_chunk_reply({"actions": np.zeros(8)}, 1)
