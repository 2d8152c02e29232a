"""Where the front end decodes requests: never on the event loop, and within the pixel budget
(``frontend/service.py`` ``_decode``, ``wire/decode.py``, ``wire/budget.py``), through a real websocket to the in-process server."""

from __future__ import annotations

import io
import threading

import pytest
from openpi_client import msgpack_numpy
from PIL import Image
from websockets.sync.client import connect

import ardiff_server.frontend.service as service
from tests.helpers.inproc_server import InprocServer
from tests.helpers.server_harness import droid_observation, fake_config

WRIST = "observation/wrist_image_left"


def decoy_jpeg(side: int = 4096) -> bytes:
    """690 bytes whose header declares side x side (Pillow fills the scan it lacks)."""
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 30)).save(buffer, format="JPEG", quality=10)
    return buffer.getvalue()[:688] + b"\xff\xd9"


@pytest.fixture(scope="module")
def server():
    with InprocServer(fake_config()) as server:
        yield server


def ask(ws, request: dict):
    ws.send(msgpack_numpy.packb(request))
    reply = ws.recv(timeout=30)
    return reply if isinstance(reply, str) else msgpack_numpy.unpackb(reply)


def test_every_request_is_decoded_off_the_event_loop_whatever_its_size(server, monkeypatch):
    """Frames under 4 MiB used to be decoded on the event loop: a 690-byte JPEG stalled every robot for its decode."""
    threads: list[int] = []
    real = service.decode_frame
    monkeypatch.setattr(service, "decode_frame", lambda *a, **k: (threads.append(threading.get_ident()), real(*a, **k))[1])
    requests = [
        {"endpoint": "reset"},  # ~20 bytes
        droid_observation(session_id="s", size=(18, 32)),  # ~5 KiB
        {**droid_observation(session_id="s", size=(18, 32)), WRIST: [decoy_jpeg(64)] * 4},  # JPEG, ~3 KiB
        droid_observation(4, session_id="s"),  # ~2 MiB
        droid_observation(10, session_id="s"),  # ~5 MiB: the only kind that went to a thread before
    ]
    with connect(server.url, compression=None, max_size=None) as ws:
        ws.recv()  # metadata
        for request in requests:
            reply = ask(ws, request)
            assert not isinstance(reply, str), reply
    assert len(threads) == len(requests)
    assert server._thread.ident not in threads  # the event loop's thread decoded none of them


def test_the_decoy_is_refused_in_one_line_naming_the_key_and_the_budget_and_the_robot_carries_on(server):
    with connect(server.url, compression=None, max_size=None) as ws:
        ws.recv()
        assert ask(ws, droid_observation(session_id="robot"))["actions"][0, 0] == 1
        reply = ask(ws, {**droid_observation(session_id="robot"), WRIST: [decoy_jpeg()] * 4})
        # the fake policy reads 1 frame per camera (PolicyInfo's default) of DROID's 180x320 x 3 cameras, and drops none
        total, budget = 2 * 180 * 320 + 4 * 4096 * 4096, 3 * 720 * 1280
        assert reply == (
            f"bad request: {WRIST}: 4 frame(s) of 4096x4096 bring the request's images to {total} pixels, over its budget of "
            f"{budget} (server.max_request_pixels: auto, 1 frame(s) x 3 camera(s) of up to 720x1280); send fewer or smaller frames, "
            "or raise server.max_request_pixels"
        )
        assert ask(ws, droid_observation(session_id="robot"))["actions"][0, 0] == 2  # the session untouched
