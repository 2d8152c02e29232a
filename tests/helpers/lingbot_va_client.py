"""A LingBot-VA RoboTwin client for tests, written from the protocol (docs/lingbot-va.md "Wire protocol"): openpi's
msgpack-numpy frames over a websocket, the server's metadata frame first, then one reply per message; a text frame
is an error. Its episode loop is the RoboTwin evaluation's: ``reset`` with the prompt; per chunk ``infer`` (the
first chunk's first frame of actions is skipped), a key frame every 4 executed actions, then ``compute_kv_cache`` with
those frames and the action array as received."""

from __future__ import annotations

import numpy as np
import websockets.sync.client
from openpi_client import msgpack_numpy

CAMERAS = ("observation.images.cam_high", "observation.images.cam_left_wrist", "observation.images.cam_right_wrist")


class ServerError(RuntimeError):
    """The server answered with a text frame."""


class LingBotVAClient:
    def __init__(self, url: str) -> None:
        self.ws = websockets.sync.client.connect(url, compression=None, max_size=None, ping_interval=None, close_timeout=10)
        self.metadata = msgpack_numpy.unpackb(self.ws.recv())

    def call(self, message: dict) -> dict:
        self.ws.send(msgpack_numpy.packb(message))
        reply = self.ws.recv()
        if isinstance(reply, str):
            raise ServerError(reply)
        return msgpack_numpy.unpackb(reply)

    def close(self) -> None:
        self.ws.close()

    def __enter__(self) -> LingBotVAClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def robotwin_frame(rng: np.random.Generator, height: int, width: int, prompt: str) -> dict:
    """One RoboTwin observation as the client formats it (every camera at the head camera's size, as the simulator
    renders them; the server resizes)."""
    frame = {camera: rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for camera in CAMERAS}
    return {**frame, "observation.state": rng.uniform(-1, 1, 14), "task": prompt}


def run_episode(client: LingBotVAClient, prompt: str, chunks: int, *, seed: int, size: tuple[int, int], guidance=(5.0, 1.0)) -> tuple[list, list]:
    """reset, then ``chunks`` x (infer, execute, compute_kv_cache). Returns the actions of every chunk and the frames
    the 'robot' saw, in the order a per-chunk OpenPI client would send them ([first frame], key frames of each chunk)."""
    rng = np.random.default_rng(seed)
    assert client.call({"reset": True, "prompt": prompt, "save_visualization": True}).keys() == {"server_timing"}
    first = robotwin_frame(rng, *size, prompt)
    actions, sent = [], [[first]]
    for chunk in range(chunks):
        reply = client.call(
            {
                "obs": first,
                "prompt": prompt,
                "save_visualization": True,
                "video_guidance_scale": guidance[0],
                "action_guidance_scale": guidance[1],
            }
        )
        action = reply["action"]
        actions.append(action)
        per_frame = action.shape[2] // 4  # a key frame every action_per_frame / 4 actions
        key_frames = []
        for _frame in range(1 if chunk == 0 else 0, action.shape[1]):
            for j in range(action.shape[2]):
                if (j + 1) % per_frame == 0:
                    key_frames.append(robotwin_frame(rng, *size, prompt))
        sent.append(key_frames)
        reply = client.call({"obs": key_frames, "compute_kv_cache": True, "imagine": False, "save_visualization": True, "state": action})
        assert set(reply) == {"server_timing"}
    return actions, sent
