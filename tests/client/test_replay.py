"""The replay client ``ardiff-client`` (``ardiff_client.replay`` and the modules it wires) and the frame helpers it uses
(``ardiff_client.video``, ``ardiff_server.media``).

Against the real server process (fake policy: ``actions[0, 0]`` = calls in the session,
``actions[0, 1]`` = the joint_position[0] it was sent), and against a small in-test server
that answers as DreamZero's own server does (a bare float32 (N, 8) array per infer, text to a
reset), written from the protocol description in docs/spec.md §3.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from websockets.sync.server import ServerConnection, serve

from ardiff_client import episode, infer_request, replay, report, video
from ardiff_client.records import CallRecord, ReplayError, ServerError
from ardiff_server import media
from ardiff_server.extras import pip_command
from ardiff_server.wire.protocol import pack, unpack
from tests.helpers.server_harness import ServerProcess, fake_config

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install matplotlib)")

IMAGE_KEYS_0 = tuple(f"observation/{name}" for name in ("exterior_image_0_left", "exterior_image_1_left", "wrist_image_left"))


def run_json(capsys, argv: list[str]) -> tuple[int, dict, str]:
    """main(argv + --json --quiet) -> (exit status, the JSON object, stderr)."""
    status = replay.main([*argv, "--json", "--quiet"])
    out, err = capsys.readouterr()
    return status, json.loads(out), err


# ---------------------------------------------------------------------------------------
# Against the real server
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(fake_config(), tmp_path_factory.mktemp("server")) as process:
        yield process


def test_replay_against_the_server_json_and_record(server, tmp_path, capsys):
    record = tmp_path / "episode.npz"
    argv = ["--port", str(server.port), "--calls", "4", "--size", "36x64", "--feedback", "first"]
    status, report, err = run_json(capsys, [*argv, "--record", str(record)])
    assert status == 0, err

    assert report["calls"] == 4 and report["ended"] == "calls" and report["error"] is None
    assert report["metadata"]["image_resolution"] == [180, 320]
    assert report["camera_keys"] == list(IMAGE_KEYS_0)
    records = report["records"]
    assert [r["call"] for r in records] == [1, 2, 3, 4]
    assert [r["frames"] for r in records] == [1, 4, 4, 4]  # DreamZero: one frame, then stacks of 4
    assert all(r["actions_shape"] == [4, 8] and r["reply_format"] == "dict" for r in records)
    assert [r["session"]["calls"] for r in records] == [1, 2, 3, 4]
    assert {r["session"]["id"] for r in records} == {report["session_id"]}
    assert records[0]["session"]["new"] is True and records[1]["session"]["new"] is False
    summary = report["summary"]
    columns = {"round_trip_ms", "server.infer_ms", "server.queue_ms", "server.prev_total_ms", "policy.compute"}
    assert columns <= set(summary)
    assert summary["round_trip_ms"]["n"] == 4 and summary["server.prev_total_ms"]["n"] == 3  # none before call 1
    assert summary["round_trip_ms"]["p50"] <= summary["round_trip_ms"]["p99"] <= summary["round_trip_ms"]["max"]
    sid = report["session_id"]
    assert report["reset_reply"] == {"status": "reset successful", "session_ids": [sid], "session_id": sid}

    with np.load(record) as data:
        actions = data["actions"]
        assert actions.shape == (4, 4, 8) and actions.dtype == np.float32
        assert actions[:, 0, 0].tolist() == [1, 2, 3, 4]
        assert data["joint_position"].shape == (4, 7) and data["gripper_position"].shape == (4, 1)
        # --feedback first: each call sends the previous chunk's first row (the fake echoes joint 0)
        assert data["joint_position"][:, 0].tolist() == [infer_request.READY_JOINTS[0], 1, 2, 3]
        np.testing.assert_allclose(actions[:, 0, 1], data["joint_position"][:, 0], atol=1e-6)
        assert data["rtt_ms"].shape == (4,) and np.all(data["rtt_ms"] > 0)
        assert data["server_infer_ms"].shape == (4,) and np.isnan(data["server_prev_total_ms"][0])
        assert data["frames"].tolist() == [1, 4, 4, 4]
        assert str(data["session_id"]) == report["session_id"]


def test_table_output_one_indexed_cameras_and_a_fresh_session_per_run(server, capsys):
    argv = ["--port", str(server.port), "--calls", "2", "--size", "24x32", "--camera-index", "1", "--quiet"]
    assert replay.main(argv) == 0
    first = capsys.readouterr().out
    assert "observation/exterior_image_1_left, observation/exterior_image_2_left" in first
    assert "2 calls (all done)" in first and "reset successful" in first
    for row in ("latency (ms)", "round_trip_ms", "server.infer_ms", "server.queue_ms", "policy.compute"):
        assert row in first
    assert replay.main(argv) == 0
    second = capsys.readouterr().out
    sessions = [out.splitlines()[0].split("session ")[1] for out in (first, second)]
    assert sessions[0].startswith("replay-") and sessions[0] != sessions[1]


@needs_matplotlib
def test_plot_writes_a_png(server, tmp_path, capsys):
    plot = tmp_path / "plots" / "actions.png"
    status, _, err = run_json(capsys, ["--port", str(server.port), "--calls", "3", "--size", "8x8", "--plot", str(plot)])
    assert status == 0, err
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert f"plotted {plot}" in err  # side notes go to stderr under --json


# ---------------------------------------------------------------------------------------
# Against a server that answers as DreamZero's own server does
# ---------------------------------------------------------------------------------------


class DreamZeroLikeServer:
    """Metadata map first; then a bare float32 (horizon, 8) array per infer request and the
    text "reset successful" to a reset. Call c's chunk is ``c + 0.01 * t`` in the joint
    columns and 0.5 in the gripper column, so the state fed back identifies the call."""

    def __init__(self, *, horizon: int = 6, size=(24, 32), text_error_on_call: int | None = None, api_key=None) -> None:
        self.horizon, self.size, self.text_error_on_call, self.api_key = horizon, size, text_error_on_call, api_key
        self.requests: list[dict] = []
        self.handshakes: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self._server = serve(self._handle, "127.0.0.1", 0, compression=None, max_size=None, process_request=self._check_key)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _check_key(self, connection, request):
        if self.api_key is not None and request.headers.get("Authorization") != f"Api-Key {self.api_key}":
            return connection.respond(401, "missing or invalid API key\n")
        return None

    def _handle(self, ws: ServerConnection) -> None:
        self.handshakes.append((ws.request.path, ws.request.headers.get("Authorization")))
        ws.send(
            pack(
                {
                    "image_resolution": list(self.size),
                    "needs_wrist_camera": True,
                    "n_external_cameras": 2,
                    "needs_stereo_camera": False,
                    "needs_session_id": True,
                    "action_space": "joint_position",
                }
            )
        )
        calls = 0
        for frame in ws:
            request = unpack(frame)
            self.requests.append(request)
            if request.get("endpoint") == "reset":
                ws.send("reset successful")
                continue
            calls += 1
            if calls == self.text_error_on_call:
                ws.send("bad request: simulated failure")
                continue
            actions = np.full((self.horizon, 8), 0.5, dtype=np.float32)
            actions[:, :7] = calls + 0.01 * np.arange(self.horizon, dtype=np.float32)[:, None]
            ws.send(pack(actions))

    @property
    def infers(self) -> list[dict]:
        return [r for r in self.requests if r.get("endpoint") != "reset"]

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(10)


@pytest.fixture
def dz_server():
    servers: list[DreamZeroLikeServer] = []

    def start(**kwargs) -> DreamZeroLikeServer:
        servers.append(DreamZeroLikeServer(**kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_bare_array_replies_path_api_key_and_request_contract(dz_server, capsys, tmp_path):
    server = dz_server(api_key="secret")
    path = "/v1/realtime/robot/openpi"
    argv = ["--port", str(server.port), "--path", path, "--api-key", "secret", "--calls", "3"]
    status, report, err = run_json(capsys, [*argv, "--record", str(tmp_path / "r.npz")])
    assert status == 0, err
    assert server.handshakes == [(path, "Api-Key secret")]

    assert [r["reply_format"] for r in report["records"]] == ["array"] * 3
    for r in report["records"]:
        assert r["actions_shape"] == [6, 8] and r["server_timing"] == {} and r["policy_timing"] == {}
    assert list(report["summary"]) == ["round_trip_ms"]  # no server timings in bare arrays
    assert report["reset_reply"] == "reset successful"  # a text reply to the reset is tolerated

    infers = server.infers
    assert len(infers) == 3 and server.requests[-1] == {"endpoint": "reset", "session_id": report["session_id"]}
    session_id = infers[0]["session_id"]
    assert session_id.startswith("replay-") and all(r["session_id"] == session_id for r in infers)
    for i, request in enumerate(infers):
        assert request["endpoint"] == "infer" and request["prompt"] == replay.DEFAULT_PROMPT
        shape = (24, 32, 3) if i == 0 else (4, 24, 32, 3)  # metadata image_resolution is the default size
        assert all(request[key].shape == shape and request[key].dtype == np.uint8 for key in IMAGE_KEYS_0)
        assert request["observation/joint_position"].shape == (7,)
        assert request["observation/gripper_position"].shape == (1,)
    # --feedback end (default): the state sent is the previous chunk's last row
    np.testing.assert_allclose(infers[0]["observation/joint_position"], infer_request.READY_JOINTS)
    np.testing.assert_allclose(infers[1]["observation/joint_position"], np.full(7, 1.05), rtol=1e-6)
    np.testing.assert_allclose(infers[2]["observation/joint_position"], np.full(7, 2.05), rtol=1e-6)
    assert infers[2]["observation/gripper_position"].tolist() == [0.5]
    with np.load(tmp_path / "r.npz") as data:
        assert data["actions"].shape == (3, 6, 8) and data["rtt_ms"].shape == (3,)
        assert not any(name.startswith("server_") for name in data.files)


def test_synthetic_frames_are_deterministic_by_seed_and_move(dz_server, capsys):
    server = dz_server()
    for seed in (7, 7, 8):
        assert run_json(capsys, ["--port", str(server.port), "--calls", "2", "--seed", str(seed)])[0] == 0
    runs = [server.infers[i : i + 2] for i in (0, 2, 4)]
    key = IMAGE_KEYS_0[0]
    assert np.array_equal(runs[0][1][key], runs[1][1][key])
    assert not np.array_equal(runs[0][1][key], runs[2][1][key])
    stack = runs[0][1][key].astype(np.int16)
    assert 0 < np.abs(np.diff(stack, axis=0)).mean() < 40  # frames change, smoothly
    assert not np.array_equal(runs[0][0][IMAGE_KEYS_0[0]], runs[0][0][IMAGE_KEYS_0[1]])  # cameras differ


def test_text_error_reply_stops_with_status_1_and_still_resets(dz_server, capsys):
    server = dz_server(text_error_on_call=2)
    status, report, err = run_json(capsys, ["--port", str(server.port), "--calls", "5"])
    assert status == 1
    assert "bad request: simulated failure" in err and "call 2" in err
    assert report["calls"] == 1 and report["ended"] == "error" and "simulated failure" in report["error"]
    assert len(server.infers) == 2 and server.requests[-1]["endpoint"] == "reset"


def test_single_frames_per_call_like_openpi_clients(dz_server, capsys):
    server = dz_server()
    argv = ["--port", str(server.port), "--calls", "3", "--frames-per-call", "1", "--size", "10x12"]
    assert run_json(capsys, argv)[0] == 0
    assert [r[IMAGE_KEYS_0[2]].shape for r in server.infers] == [(10, 12, 3)] * 3


def test_wrong_api_key_and_no_server_fail_with_one_line(dz_server, capsys):
    server = dz_server(api_key="secret")
    assert replay.main(["--port", str(server.port), "--api-key", "wrong", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "HTTP 401" in err and len(err.strip().splitlines()) == 1

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    assert replay.main(["--port", str(free_port), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "cannot connect" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------
# Video directories
# ---------------------------------------------------------------------------------------

VIDEO_SIZE = (32, 48)  # even sides: yuv420p


def grey_frames(count: int, offset: int) -> list[np.ndarray]:
    """Frame i is a flat grey of level offset + 20 i: identifiable after lossy coding."""
    return [np.full((*VIDEO_SIZE, 3), offset + 20 * i, dtype=np.uint8) for i in range(count)]


def write_video(path: Path, frames: list[np.ndarray]) -> None:
    """Write an MPEG-4 file with PyAV, else imageio-ffmpeg; skip when neither is installed."""
    if importlib.util.find_spec("av") is not None:
        import av

        with av.open(str(path), "w") as container:
            stream = container.add_stream("mpeg4", rate=15)
            stream.width, stream.height, stream.pix_fmt = VIDEO_SIZE[1], VIDEO_SIZE[0], "yuv420p"
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
    elif importlib.util.find_spec("imageio_ffmpeg") is not None:
        import imageio.v3 as iio

        iio.imwrite(path, np.stack(frames), plugin="FFMPEG", fps=15, codec="mpeg4", macro_block_size=16)
    else:
        pytest.skip("no video writer: pip install av (or imageio imageio-ffmpeg)")


def levels(image: np.ndarray) -> list[int]:
    """Mean grey level of each frame of an (H, W, 3) frame or (T, H, W, 3) stack."""
    image = image[None] if image.ndim == 3 else image
    return [round(float(f.mean())) for f in image]


@pytest.fixture
def video_dir(tmp_path) -> Path:
    for name, offset in (("exterior_image_1_left", 10), ("exterior_image_2_left", 15), ("wrist_image_left", 20)):
        write_video(tmp_path / f"{name}.mp4", grey_frames(10, offset))
    return tmp_path


def assert_levels(got: list[int], expected: list[int], tol: int = 4) -> None:
    assert len(got) == len(expected) and all(abs(g - e) <= tol for g, e in zip(got, expected)), (got, expected)


def test_video_dir_frames_in_order_until_the_shortest_camera_ends(dz_server, video_dir, capsys):
    server = dz_server()
    status, report, err = run_json(capsys, ["--port", str(server.port), "--video-dir", str(video_dir)])
    assert status == 0, err
    assert report["calls"] == 3 and report["ended"] == "video"  # frames 0 | 1-4 | 5-8; frame 9 is left over
    infers = server.infers
    assert [r[IMAGE_KEYS_0[0]].shape for r in infers] == [(24, 32, 3), (4, 24, 32, 3), (4, 24, 32, 3)]
    assert_levels([lvl for r in infers for lvl in levels(r[IMAGE_KEYS_0[0]])], [10 + 20 * i for i in range(9)])
    assert_levels(levels(infers[1][IMAGE_KEYS_0[1]]), [15 + 20 * i for i in range(1, 5)])  # DROID camera 2
    assert_levels(levels(infers[2]["observation/wrist_image_left"]), [20 + 20 * i for i in range(5, 9)])


def test_video_dir_stride_loop_and_a_missing_camera(dz_server, video_dir, capsys):
    server = dz_server()
    (video_dir / "exterior_image_2_left.mp4").unlink()
    argv = ["--port", str(server.port), "--video-dir", str(video_dir), "--frame-stride", "3", "--loop", "--calls", "3", "--camera-index", "1"]
    status, report, err = run_json(capsys, argv)
    assert status == 0 and report["calls"] == 3
    assert "exterior_image_2_left" in err and "not sent" in err  # warned, left out (the server renders it black)
    assert report["camera_keys"] == ["observation/exterior_image_1_left", "observation/wrist_image_left"]
    frames = [lvl for r in server.infers for lvl in levels(r["observation/exterior_image_1_left"])]
    used = [0, 3, 6, 9, 0, 3, 6, 9, 0]  # every 3rd frame, starting over at the end
    assert_levels(frames, [10 + 20 * i for i in used])


def test_frame_folders_and_stretching(dz_server, tmp_path, capsys):
    pil = pytest.importorskip("PIL.Image", reason="Pillow is not installed (pip install pillow)")
    for name, offset in (("exterior_image_1_left", 10), ("exterior_image_2_left", 15), ("wrist_image_left", 20)):
        (tmp_path / name).mkdir()
        for i, frame in enumerate(grey_frames(5, offset)):
            pil.fromarray(frame).save(tmp_path / name / f"{i:05d}.png")
    server = dz_server()
    argv = ["--port", str(server.port), "--video-dir", str(tmp_path), "--size", "16x20"]
    status, report, err = run_json(capsys, argv)
    assert status == 0, err
    assert report["calls"] == 2 and report["ended"] == "video"
    first, second = server.infers
    assert first[IMAGE_KEYS_0[1]].shape == (16, 20, 3) and second[IMAGE_KEYS_0[1]].shape == (4, 16, 20, 3)
    assert levels(second[IMAGE_KEYS_0[1]]) == [35, 55, 75, 95]  # lossless: exact


def test_imageio_backend_reads_the_same_frames_as_pyav(tmp_path):
    pytest.importorskip("av", reason="PyAV is not installed (pip install av)")
    pytest.importorskip("imageio_ffmpeg", reason="imageio-ffmpeg is not installed (pip install imageio imageio-ffmpeg)")
    write_video(tmp_path / "v.mp4", grey_frames(6, 10))
    with_av = [levels(f)[0] for f in video.iter_frames(tmp_path / "v.mp4", backend="av")]
    with_imageio = [levels(f)[0] for f in video.iter_frames(tmp_path / "v.mp4", backend="imageio")]
    assert len(with_av) == 6 and with_av == with_imageio


def test_missing_optional_packages_fail_with_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    assert replay.main(["--port", "1", "--plot", str(tmp_path / "a.png")]) == 2
    # this environment's own pip and the extra, never a bare pip that may be another Python's
    hint = f"{pip_command()} install -e '.[viz]' (bash scripts/serve.sh --record DIR installs it too)"
    assert capsys.readouterr().err.strip() == f"ardiff-client: plotting actions needs matplotlib (the viz extra): {hint}"

    (tmp_path / "exterior_image_1_left.mp4").write_bytes(b"")
    for module in ("av", "imageio", "imageio_ffmpeg"):
        monkeypatch.setitem(sys.modules, module, None)
    assert replay.main(["--port", "1", "--video-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"needs PyAV (the viz extra): {pip_command()} install -e '.[viz]'" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


@needs_matplotlib
def test_plot_actions_signature_and_validation(tmp_path):
    rng = np.random.default_rng(0)
    out = media.plot_actions(rng.normal(size=(3, 5, 8)), tmp_path / "a.png", state=rng.normal(size=(3, 8)), title="t")
    assert out == tmp_path / "a.png" and out.read_bytes()[:4] == b"\x89PNG"
    media.plot_actions(rng.normal(size=(10, 3)), tmp_path / "b.png")  # one (T, dim) trajectory
    with pytest.raises(ValueError, match="calls, horizon, dim"):
        media.plot_actions(np.zeros((2, 3, 4, 5)), tmp_path / "c.png")
    with pytest.raises(ValueError, match="state"):
        media.plot_actions(np.zeros((2, 3, 8)), tmp_path / "c.png", state=np.zeros((3, 8)))


def test_summary_statistics_and_reply_parsing():
    def record(i: int, rtt: float) -> CallRecord:
        return CallRecord(
            call=i + 1,
            frames=4,
            rtt_ms=rtt,
            actions=np.zeros((2, 8), np.float32),
            joint_position=np.zeros(7),
            gripper_position=np.zeros(1),
            reply_format="dict",
            server_timing={"infer_ms": 1.0} if i else {},
            policy_timing={"denoise": 2.0 * rtt},
        )

    records = [record(i, rtt) for i, rtt in enumerate([10.0, 20.0, 30.0, 40.0, 1000.0])]
    summary = report.summarize(records)
    assert summary["round_trip_ms"]["p50"] == 30 and summary["round_trip_ms"]["mean"] == 220
    assert 960 < summary["round_trip_ms"]["p99"] < 1000 and summary["round_trip_ms"]["max"] == 1000
    assert summary["server.infer_ms"]["n"] == 4 and summary["policy.denoise"]["p50"] == 60

    record = episode.parse_reply(pack({"actions": np.ones((24, 8)), "server_timing": {"infer_ms": 5, "x": "y"}}), 1)
    assert record.actions.dtype == np.float32 and record.server_timing == {"infer_ms": 5.0}
    with pytest.raises(ServerError, match="call 3: server error: boom"):
        episode.parse_reply("boom", 3)
    with pytest.raises(ReplayError, match="expected a map with 'actions'"):
        episode.parse_reply(pack({"status": "ok"}), 1)
    with pytest.raises(ReplayError, match=r"shape \(N, 8\)"):
        episode.parse_reply(pack(np.zeros(8, np.float32)), 1)
