"""``ardiff-client`` / ``python -m ardiff_client``: replay one episode against a policy server (the command line).

It speaks the wire protocol of docs/spec.md §3 the way the clients in the wild do, so it can drive
this server, openpi-style servers, DreamZero's own server and vLLM-Omni's (``--path
/v1/realtime/robot/openpi``) alike, and report what a robot would see:

1. connect (optional ``Authorization: Api-Key <key>``) and read the metadata frame, RoboArena's
   ``PolicyServerConfig``: its ``image_resolution`` is the default frame size, its
   ``n_external_cameras`` / ``needs_wrist_camera`` choose the cameras sent;
2. one episode under a fresh ``session_id`` (a new id per episode is how RoboArena and
   DreamZero's client start an episode): the first call sends one (H, W, 3) frame per
   camera, each later call the next ``--frames-per-call`` frames as a (T, H, W, 3) stack
   (DreamZero's client contract: T = 4), plus the joint and gripper state of a simulated
   robot that follows the returned chunks (``--feedback``);
3. ``{"endpoint": "reset", "session_id": ...}`` at the end; whatever comes back (a map, text,
   nothing within 10 s) is reported, never treated as a failure;
4. a latency table (round trip, the server's ``server_timing`` and ``policy_timing``), or one
   JSON object with ``--json``; ``--record`` saves the arrays, ``--plot`` the trajectories.

Another embodiment (a metadata frame with ``embodiment`` and ``observation``, see
``ardiff_policies.embodiment``) is driven from its advertised schema: synthetic frames at each
camera's advertised resolution under its ``observation/<camera>`` key, every state key under
``observation/<state key>`` (zeros at first, then, with ``--feedback``, the action columns of the
same name from the previous chunk), so a lab can smoke-test a checkpoint before the robot is
connected.

Frames come from ``--video-dir`` (DROID layout: ``exterior_image_1_left.mp4``,
``exterior_image_2_left.mp4``, ``wrist_image_left.mp4``; .avi/.mkv/.mov/.webm, or a folder of
PNG/JPEG frames per camera) or are synthetic: a smooth moving pattern per camera, the same
for the same ``--seed``. Video frames are used in order, every ``--frame-stride``-th one,
stretched to the frame size; when the shortest camera runs out the episode ends there
(default) or, with ``--loop``, every video starts over.

Replies are either a map (``actions`` plus timings: this server, openpi) or a bare float32
(N, 8) array (DreamZero's server; then there are no server timings). A text frame in reply
to an infer request is the server's error message: it is printed and the run stops with exit
status 1; so does, under ``--async``, a reply the robot loop cannot execute (``ardiff_client.chunk_reply``) or a
run in which no chunk arrived. Exit status: 0 done, 1 server or connection error, 2 usage error or a missing
optional package, 130 interrupted.

The jobs live in their own modules: the connection (``websocket_client``), the requests and the state fed
back (``infer_request``), the blocking episode (``episode``), the ``--async`` robot loop (``async_runner``),
the frames (``cameras``, ``video``) and the outputs (``report``, ``async_report``); this module is the
command line that wires them. Torch-free: numpy, msgpack (through the codec) and websockets; video
reading and plotting load their optional packages (``ardiff_client.video``, ``ardiff_server.media``) on use.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed

from ardiff_client.async_report import progress_line, summary_lines
from ardiff_client.async_runner import ASKING, AsyncChunkRunner, ChunkEvent, joint_columns
from ardiff_client.cameras import Camera, camera_keys, embodiment_schema, frames_for_call, open_cameras, take_frames
from ardiff_client.episode import run_episode
from ardiff_client.infer_request import (
    READY_JOINTS,
    build_embodiment_request,
    build_request,
    initial_embodiment_state,
    next_embodiment_state,
    next_state,
)
from ardiff_client.records import Episode, ReplayError, jsonable
from ardiff_client.report import Progress, episode_json, plot_episode, print_report, save_record
from ardiff_client.video import require_video_reader
from ardiff_client.websocket_client import PolicyClient, infer, open_client, reset_session, server_url
from ardiff_server import __version__
from ardiff_server.media import MissingDependency, require_plotting

__all__ = ["main", "parse_args"]

DEFAULT_SIZE = (180, 320)  # DROID / DreamZero-DROID, when the metadata declares no image_resolution
DEFAULT_SYNTHETIC_CALLS = 8
DEFAULT_PROMPT = "pick up the cup and put it in the bowl"


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ardiff-client",
        description="Replay one episode (camera videos or synthetic frames) against an OpenPI/RoboArena/"
        "DreamZero websocket policy server and report action chunks and latency.",
        epilog="Joint state fed back (--feedback): 'end' (default) sends the last row of the previous chunk, "
        "a robot that executed the whole chunk; 'first' its first row, a robot that replans after one step; "
        "'hold' keeps the start pose. The gripper follows column 7 the same way. "
        "Exit status: 0 done, 1 server/connection error, 2 usage error or missing package, 130 interrupted.",
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="server host (default 127.0.0.1)")
    add("--port", type=int, default=8000, help="server port (default 8000)")
    add("--path", default="/", help="websocket path (default /; vLLM-Omni: /v1/realtime/robot/openpi)")
    add("--api-key", help="send 'Authorization: Api-Key <key>'")
    add("--calls", type=_positive_int, help=f"infer calls (default: until the videos end; {DEFAULT_SYNTHETIC_CALLS} with synthetic frames)")
    add(
        "--video-dir",
        type=Path,
        help="per-camera videos or frame folders, named as in DROID (exterior_image_1_left.mp4, ...); default: synthetic frames",
    )
    add("--frame-stride", type=_positive_int, default=1, help="use every N-th video frame (default 1)")
    add(
        "--frames-per-call",
        type=_positive_int,
        help="frames per camera on calls after the first, as a (T, H, W, 3) stack; 1 sends single frames like openpi clients "
        "(default: what the server's metadata advertises, frames_per_call; else 4, DreamZero's)",
    )
    add("--loop", action="store_true", help="start the videos over when they end (default: end the episode)")
    add("--prompt", default=DEFAULT_PROMPT, help=f"task instruction (default {DEFAULT_PROMPT!r})")
    add(
        "--camera-index",
        type=int,
        choices=(0, 1),
        default=0,
        help="exterior camera keys: 0 -> _0_left, _1_left (RoboArena server test, DreamZero); 1 -> _1_left, _2_left (RoboArena evaluator, openpi DROID) (default 0)",
    )
    add("--size", type=_parse_size, help="frame size HxW sent (default: the server's image_resolution)")
    add("--feedback", choices=("end", "first", "hold"), default="end", help="joint state fed back from each chunk (default end; see below)")
    add("--seed", type=int, default=0, help="synthetic frame pattern seed (default 0)")
    add("--timeout", type=float, help="seconds to wait for each reply (default: no limit)")
    add("--record", type=Path, metavar="OUT.npz", help="save actions (calls, N, 8), the states sent and per-call timings")
    add("--plot", type=Path, metavar="actions.png", help="plot joint and gripper trajectories, one subplot per dimension")
    add("--json", action="store_true", help="print one JSON object (summary and per-call records) instead of the table")
    add("--quiet", action="store_true", help="no progress output")
    add(
        "--async",
        dest="async_mode",
        action="store_true",
        help="run a robot loop at --control-hz that asks for the next chunk while executing this one (ardiff_client.async_runner) and report idle steps, latency, seam jumps",
    )
    add(
        "--mode",
        choices=("continuation", "async", "blocking"),
        default="continuation",
        help="with --async: send continuations (default), ask early without them, or block (the baseline)",
    )
    add("--control-hz", type=float, default=15.0, help="with --async: control rate (default 15, DROID)")
    add(
        "--asking",
        choices=ASKING,
        default="adaptive",
        help="with --async: when to ask for the next chunk: as late as the server's latency estimate allows (adaptive, the default) "
        "or when --overlap of the chunk is left (half)",
    )
    add(
        "--overlap",
        type=float,
        default=0.5,
        help="with --async --asking half (and adaptive before the server's first estimate): ask for the next chunk no later than "
        "when this fraction of the chunk is left (default 0.5; 0: only as the latency requires)",
    )
    add("--steps", type=_positive_int, default=120, help="with --async: control steps (default 120)")
    add("--version", action="version", version=f"ardiff-client {__version__}")
    args = parser.parse_args(argv)
    if not 0.0 <= args.overlap < 1.0:
        parser.error(f"--overlap must be in [0, 1), got {args.overlap}")
    if args.control_hz <= 0:
        parser.error(f"--control-hz must be > 0, got {args.control_hz}")
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _parse_size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX,]\s*(\d+)\s*", text)
    if not match or 0 in (int(match.group(1)), int(match.group(2))):
        raise argparse.ArgumentTypeError(f"expected HxW such as 180x320, got {text!r}")
    return int(match.group(1)), int(match.group(2))


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def _warn(message: str) -> None:
    print(f"ardiff-client: warning: {message}", file=sys.stderr, flush=True)


def _check_optional_packages(args: argparse.Namespace) -> None:
    """Fail before connecting when an output or input needs a package that is not installed."""
    if args.plot is not None:
        require_plotting()
    if args.video_dir is not None:
        require_video_reader(args.video_dir)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _check_optional_packages(args)
    except MissingDependency as exc:
        print(f"ardiff-client: {exc}", file=sys.stderr)
        return 2
    url = server_url(args.host, args.port, args.path)
    try:
        with open_client(url, args.api_key, args.timeout) as client:
            return _run(client, url, args)
    except (ReplayError, ConnectionClosed, TimeoutError) as exc:
        print(f"ardiff-client: error: {exc or 'no reply within --timeout'}", file=sys.stderr)
        return 1


def _run(client: PolicyClient, url: str, args: argparse.Namespace) -> int:
    size = args.size or _declared_size(client.metadata) or DEFAULT_SIZE
    keys = camera_keys(client.metadata, args.camera_index)
    try:
        cameras = open_cameras(keys, size, args, _warn)
    except ReplayError as exc:
        print(f"ardiff-client: error: {exc}", file=sys.stderr)
        return 2
    if args.calls is None and args.video_dir is None:
        args.calls = DEFAULT_SYNTHETIC_CALLS
    episode = Episode(url, client.metadata, f"replay-{uuid.uuid4()}", args.prompt, size, list(cameras))
    if args.async_mode:
        return _run_async(client, cameras, episode, args)
    try:
        run_episode(client, cameras, episode, args, Progress(args.calls, enabled=not args.quiet))
    except MissingDependency as exc:
        print(f"ardiff-client: {exc}", file=sys.stderr)
        return 2
    status = _write_outputs(episode, args)
    if episode.error:
        print(f"ardiff-client: error: {episode.error}", file=sys.stderr)
        return 1
    if episode.ended == "interrupted":
        return 130
    return status


def _async_mode(mode: str, metadata: dict[str, Any]) -> str:
    """``--mode continuation`` against a server whose metadata says it does not continue chunks (LingBot-VA) asks
    early without them: such a server refuses a ``continuation`` by name (docs/spec.md)."""
    if mode == "continuation" and metadata.get("continuations") is False:
        print("ardiff-client: this server does not continue chunks (metadata continuations: false): asking early without them", file=sys.stderr)
        return "async"
    return mode


def _run_async(client: PolicyClient, cameras: Mapping[str, Camera], episode: Episode, args: argparse.Namespace) -> int:
    """``--async``: a robot at ``--control-hz`` that follows the actions it executes (its state is the last action)."""
    schema = embodiment_schema(episode.metadata)
    robot = {"joints": READY_JOINTS.copy(), "gripper": np.zeros(1), "calls": 0}
    robot["state"] = None if schema is None else initial_embodiment_state(schema)

    def observe() -> dict[str, Any]:
        images = take_frames(cameras, frames_for_call(episode.metadata, robot["calls"] + 1, args.frames_per_call))
        if images is None:
            raise ReplayError("the videos ended (use --loop with --async)")
        robot["calls"] += 1
        if schema is None:  # the runner sets prompt, session_id and continuation
            return build_request(images, robot["joints"], robot["gripper"], args.prompt, episode.session_id)
        return build_embodiment_request(schema, images, robot["state"], args.prompt, episode.session_id)

    def act(action: np.ndarray) -> None:
        if schema is None:
            robot["joints"], robot["gripper"] = next_state(action[None], "end", robot["joints"], robot["gripper"])
        else:
            robot["state"] = next_embodiment_state(action[None], "end", robot["state"], episode.metadata)

    def progress(event: ChunkEvent) -> None:
        print(progress_line(event, args.steps, args.control_hz), file=sys.stderr, flush=True)

    runner = AsyncChunkRunner(
        lambda request: infer(client, request),
        control_hz=args.control_hz,
        prompt=args.prompt,
        mode=_async_mode(args.mode, episode.metadata),
        session_id=episode.session_id,
        asking=args.asking,
        overlap=args.overlap,
        joint_columns=joint_columns(episode.metadata),
        on_chunk=None if args.quiet else progress,
    )
    try:
        report = runner.run(observe, act, args.steps)
    except (ReplayError, ConnectionClosed, TimeoutError) as exc:  # ReplyError (a malformed reply) is a ReplayError
        reset_session(client, episode.session_id)  # nothing in flight after a reply or an observation failed
        print(f"ardiff-client: error: {exc or 'no reply within --timeout'}", file=sys.stderr)
        return 1
    episode.reset_reply = reset_session(client, episode.session_id)
    if args.json:
        print(json.dumps(jsonable(report.summary())))
    else:
        print("\n".join(summary_lines(report)))
    if report.chunks == 0:
        print(
            f"ardiff-client: error: no chunk arrived in {args.steps} control steps ({args.steps / args.control_hz:.1f} s at "
            f"{args.control_hz:g} Hz): the first reply took longer; raise --steps or check the server",
            file=sys.stderr,
        )
        return 1
    return 0


def _write_outputs(episode: Episode, args: argparse.Namespace) -> int:
    """Report, record and plot whatever completed (also after an error). Returns 0, or 2 when
    an output could not be written."""
    if args.json:
        print(json.dumps(jsonable(episode_json(episode)), allow_nan=False))
    else:
        print_report(episode)
    status = 0
    if args.record is not None:
        _info(args, f"recorded {save_record(args.record, episode)}")
    if args.plot is not None:
        if episode.records:
            _info(args, f"plotted {plot_episode(args.plot, episode)}")
        else:
            _warn(f"no calls completed: {args.plot} not written")
            status = 2
    return status


def _info(args: argparse.Namespace, message: str) -> None:
    """Side notes go to stderr under --json so stdout stays one JSON object."""
    print(message, file=sys.stderr if args.json else sys.stdout)


def _declared_size(metadata: Mapping[str, Any]) -> tuple[int, int] | None:
    value = metadata.get("image_resolution")
    schema = embodiment_schema(metadata)
    if schema is not None and schema["cameras"]:
        value = schema["cameras"][0].get("resolution", value)
    try:
        height, width = (int(v) for v in value)
    except (TypeError, ValueError):
        return None
    return (height, width) if height > 0 and width > 0 else None


if __name__ == "__main__":
    raise SystemExit(main())
