"""One ``ardiff-client`` episode of blocking calls: send a request, wait for its chunk, feed the robot's next state
back, until the calls or the videos run out; then reset the session. What completed is kept in the ``Episode``
even after an error or Ctrl-C, so it is still reported."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed

from ardiff_client.cameras import Camera, embodiment_schema, frames_for_call, take_frames
from ardiff_client.infer_request import (
    READY_JOINTS,
    build_embodiment_request,
    build_request,
    initial_embodiment_state,
    next_embodiment_state,
    next_state,
)
from ardiff_client.records import CallRecord, Episode, ReplayError
from ardiff_client.report import Progress
from ardiff_client.websocket_client import PolicyClient, decode_frame, reset_session


def parse_reply(reply: bytes | str, call: int) -> CallRecord:
    """Decode an infer reply: a map with ``actions`` (+ timings) or a bare (N, D) array.

    The returned record's call-side fields (frames, rtt, states) are left for the caller.
    """
    obj = decode_frame(reply, f"call {call}")
    if isinstance(obj, dict) and "actions" in obj:
        actions, reply_format = obj["actions"], "dict"
    elif isinstance(obj, np.ndarray):
        actions, reply_format, obj = obj, "array", {}
    else:
        got = f"a map with keys {sorted(map(str, obj))}" if isinstance(obj, dict) else type(obj).__name__
        raise ReplayError(f"call {call}: expected a map with 'actions' or a bare (N, 8) array, got {got}")
    try:
        actions = np.asarray(actions, dtype=np.float32)
    except (TypeError, ValueError):
        raise ReplayError(f"call {call}: 'actions' is not a numeric array") from None
    if actions.ndim != 2 or 0 in actions.shape:
        raise ReplayError(f"call {call}: expected actions of shape (N, 8), got {actions.shape}")
    session = obj.get("session")
    return CallRecord(
        call=call,
        frames=0,
        rtt_ms=0.0,
        actions=actions,
        joint_position=np.zeros(7),
        gripper_position=np.zeros(1),
        reply_format=reply_format,
        server_timing=_numbers(obj.get("server_timing")),
        policy_timing=_numbers(obj.get("policy_timing")),
        session=session if isinstance(session, dict) else None,
    )


def run_episode(client: PolicyClient, cameras: Mapping[str, Camera], episode: Episode, args: argparse.Namespace, progress: Progress) -> None:
    """Run the infer calls of one episode, then reset its session; fills ``episode`` in place
    (so what completed before an error or Ctrl-C is still reported)."""
    joints, gripper = READY_JOINTS.copy(), np.zeros(1)
    schema = embodiment_schema(episode.metadata)
    state = None if schema is None else initial_embodiment_state(schema)
    try:
        while args.calls is None or len(episode.records) < args.calls:
            count = frames_for_call(episode.metadata, len(episode.records) + 1, args.frames_per_call)
            images = take_frames(cameras, count)
            if images is None:
                episode.ended = "video"
                break
            call = len(episode.records) + 1
            if state is None:
                request = build_request(images, joints, gripper, args.prompt, episode.session_id)
            else:
                request = build_embodiment_request(schema, images, state, args.prompt, episode.session_id)
            reply, rtt_ms = client.request(request)
            record = parse_reply(reply, call)
            record.frames, record.rtt_ms = count, rtt_ms
            if state is None:
                record.joint_position, record.gripper_position = joints, gripper
                joints, gripper = next_state(record.actions, args.feedback, joints, gripper)
            else:
                record.joint_position, record.gripper_position, record.state = np.zeros(0), np.zeros(0), state
                state = next_embodiment_state(record.actions, args.feedback, state, episode.metadata)
            episode.records.append(record)
            progress.update(record)
    except KeyboardInterrupt:
        episode.ended = "interrupted"
    except ConnectionClosed as exc:
        episode.ended, episode.error = "error", f"the server closed the connection ({exc})"
        return
    except TimeoutError:
        episode.ended, episode.error = "error", f"no reply within --timeout {args.timeout} s"
        return
    except ReplayError as exc:
        episode.ended, episode.error = "error", str(exc)
    finally:
        progress.close()
    episode.reset_reply = reset_session(client, episode.session_id)


def _numbers(value: Any) -> dict[str, float]:
    """The numeric entries of a timing map (other entries and non-maps are ignored)."""
    if not isinstance(value, dict):
        return {}
    return {
        str(k): float(v) for k, v in value.items() if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    }
