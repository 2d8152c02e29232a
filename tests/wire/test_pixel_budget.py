"""The per-request pixel budget (``wire/budget.py``, ``wire/images.py``): a request's images are counted from
their JPEG headers and array shapes, after the frames the policy drops, and refused before any is decoded.

Requests go through the real codec (openpi's msgpack_numpy packs them, our unpack decodes them)."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from openpi_client import msgpack_numpy as openpi
from PIL import Image, ImageFile

from ardiff_policies.embodiment import ObservationSchema, Part
from ardiff_policies.info import PolicyInfo, droid_server_config
from ardiff_server.config import ConfigError, validate_config
from ardiff_server.wire.budget import AUTO_SIDE_SCALE, SETTING, PixelBudget, request_budget
from ardiff_server.wire.decode import RequestError, decode_request
from ardiff_server.wire.images import read_image
from ardiff_server.wire.jpeg import encode_jpeg
from ardiff_server.wire.lingbot_va import decode_lingbot_va
from ardiff_server.wire.protocol import pack, unpack
from tests.helpers.server_harness import REPO

EXT = "observation/exterior_image_{}_left"
WRIST = "observation/wrist_image_left"
STATES = {"observation/joint_position": np.zeros(7), "observation/gripper_position": np.array([0.5])}


def decoy_jpeg(side: int = 4096) -> bytes:
    """A ~690-byte JPEG whose header declares side x side: the scan is cut short and ended with EOI, and Pillow
    fills the pixels it lacks (a 4096x4096 decode, ~100 MiB and 0.2 s, from 690 bytes)."""
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 30)).save(buffer, format="JPEG", quality=10)
    return buffer.getvalue()[:688] + b"\xff\xd9"


def smooth_image(height: int = 36, width: int = 64, seed: int = 0) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    phase = np.random.default_rng(seed).uniform(0, 6, 3)
    return np.stack([(127 + 100 * np.sin(x / 9 + y / 13 + p)) for p in phase], axis=-1).astype(np.uint8)


def droid_request(**images: Any) -> dict[str, Any]:
    small = np.full((18, 32, 3), 10, np.uint8)
    return {EXT.format(0): small, EXT.format(1): small, WRIST: small, **STATES, "prompt": "go", **images}


def through_the_wire(request: dict[str, Any], budget: PixelBudget | None, schema: ObservationSchema | None = None):
    return decode_request(unpack(openpi.packb(request)), schema, budget=budget)


def refused(request: dict[str, Any], budget: PixelBudget) -> str:
    with pytest.raises(RequestError) as info:
        through_the_wire(request, budget)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300
    return message


@pytest.fixture
def loads(monkeypatch) -> list[tuple[int, int]]:
    """The (width, height) of every JPEG Pillow decodes (``ImageFile.load`` with tiles left: where pixels are made;
    a loaded image's later load() calls decode nothing)."""
    seen: list[tuple[int, int]] = []
    real = ImageFile.ImageFile.load

    def load(image):
        if image.tile:
            seen.append(image.size)
        return real(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return seen


def test_the_decoy_is_what_the_attack_sent():
    data = decoy_jpeg()
    assert len(data) == 690
    assert np.asarray(Image.open(io.BytesIO(data))).shape == (4096, 4096, 3)  # Pillow decodes it: the cost is real


def test_decoy_frames_over_the_budget_are_refused_from_their_headers_without_decoding(loads):
    budget = request_budget("auto", PolicyInfo(droid_server_config(), 24, 8, "m", max_frames_per_call=4, keeps_newest_frames=True))
    assert budget.max_pixels == 4 * 3 * (180 * AUTO_SIDE_SCALE) * (320 * AUTO_SIDE_SCALE) == 11_059_200
    message = refused(droid_request(**{WRIST: [decoy_jpeg()] * 4}), budget)
    assert message.startswith(f"{WRIST}: 4 frame(s) of 4096x4096 bring the request's images to ")
    assert f"over its budget of {budget.max_pixels} ({SETTING}: auto, 4 frame(s) x 3 camera(s) of up to 720x1280)" in message
    assert loads == []  # not one pixel decoded
    # 64 decoy frames on every camera: the same one line, still nothing decoded
    everything = {key: [decoy_jpeg()] * 64 for key in (EXT.format(0), EXT.format(1), WRIST)}
    assert refused(droid_request(**everything), budget).startswith(f"{EXT.format(0)}: 4 frame(s) of 4096x4096 ")
    assert loads == []


def test_the_key_named_is_the_one_that_brings_the_request_over():
    budget = PixelBudget(3 * 18 * 32 + 10)
    image = np.zeros((18, 32, 3), np.uint8)
    assert through_the_wire(droid_request(), budget).observation.wrist.shape == (1, 18, 32, 3)  # 3 images fit
    message = refused(droid_request(**{WRIST: np.zeros((2, 18, 32, 3), np.uint8), EXT.format(0): image}), budget)
    assert message.startswith(
        f"{WRIST}: 2 frame(s) of 18x32 bring the request's images to {4 * 18 * 32} pixels, over its budget of {budget.max_pixels} ({SETTING})"
    )


def test_a_request_within_the_budget_decodes_exactly_as_without_one(loads):
    frames = [smooth_image(seed=s) for s in range(4)]
    encoded = [encode_jpeg(f, quality=95) for f in frames]
    request = droid_request(**{EXT.format(0): encoded[0], WRIST: encoded, EXT.format(1): frames[1]})
    unbounded = through_the_wire(request, None).observation
    reference = np.stack([np.asarray(Image.open(io.BytesIO(e)).convert("RGB")) for e in encoded])  # Pillow directly
    loads.clear()
    exact = 36 * 64 * 5 + 36 * 64  # 1 + 4 JPEG frames, one raw image: exactly the budget
    bounded = through_the_wire(request, PixelBudget(exact, keep_frames=4)).observation
    assert np.array_equal(bounded.wrist, reference) and np.array_equal(bounded.exterior_left[0], reference[0])
    assert np.array_equal(bounded.exterior_right[0], frames[1])
    for name in ("exterior_left", "exterior_right", "wrist"):
        assert np.array_equal(getattr(bounded, name), getattr(unbounded, name)) and getattr(bounded, name).flags.c_contiguous
    assert len(loads) == 5  # each frame decoded once
    assert refused(request, PixelBudget(exact - 1, keep_frames=4)).startswith(f"{WRIST}: 4 frame(s) of 36x64 ")  # the last one counted


def test_raw_arrays_over_the_budget_are_refused_too():
    budget = request_budget("auto", PolicyInfo(droid_server_config((18, 32)), 24, 8, "m", max_frames_per_call=4, keeps_newest_frames=True))
    big = np.zeros((4, 18 * AUTO_SIDE_SCALE, 32 * AUTO_SIDE_SCALE, 3), np.uint8)  # 4 frames at 4x per side: the most per camera
    assert through_the_wire(droid_request(**{EXT.format(0): big, EXT.format(1): big, WRIST: big}), budget).observation.wrist.shape == big.shape
    larger = np.zeros((4, 18 * AUTO_SIDE_SCALE + 1, 32 * AUTO_SIDE_SCALE, 3), np.uint8)
    message = refused(droid_request(**{EXT.format(0): big, EXT.format(1): big, WRIST: larger}), budget)
    assert message.startswith(f"{WRIST}: 4 frame(s) of 73x128 ") and f"over its budget of {budget.max_pixels}" in message


def test_frames_past_what_the_policy_keeps_are_never_decoded(loads):
    """DreamZero reads the newest 4 frames per camera: the front end decodes those and drops the rest unread
    (older frames may even be garbage); a raw stack is cut to a view of its newest 4."""
    frames = [smooth_image(seed=s) for s in range(10)]
    encoded = [b"\xff\xd8\xff not even a JPEG"] * 6 + [encode_jpeg(f, quality=95) for f in frames[6:]]
    raw = np.stack(frames)
    budget = PixelBudget(3 * 4 * 36 * 64, keep_frames=4)
    observation = through_the_wire(droid_request(**{WRIST: encoded, EXT.format(0): raw, EXT.format(1): raw}), budget).observation
    reference = np.stack([np.asarray(Image.open(io.BytesIO(e))) for e in encoded[6:]])
    assert np.array_equal(observation.wrist, reference) and np.array_equal(observation.exterior_left, raw[6:])
    kept = read_image(WRIST, raw, budget).decode()
    assert np.shares_memory(kept, raw) and np.array_equal(kept, raw[6:])  # a view: nothing copied
    loads.clear()
    observation = through_the_wire(droid_request(**{WRIST: encoded}), budget).observation
    assert len(loads) == 4 and observation.wrist.shape == (4, 36, 64, 3)
    # the budget counts the kept frames only: 64 decoys of which 1 is kept fit a one-frame budget
    one = PixelBudget(4096 * 4096 + 2 * 18 * 32, keep_frames=1)
    loads.clear()
    assert through_the_wire(droid_request(**{WRIST: [decoy_jpeg()] * 64}), one).observation.wrist.shape == (1, 4096, 4096, 3)
    assert loads == [(4096, 4096)]
    # a policy that reads every frame (LingBot-VA: keep_frames None) gets them all, and all are counted
    assert through_the_wire(droid_request(**{WRIST: encoded[6:]}), PixelBudget(10**6)).observation.wrist.shape == (4, 36, 64, 3)


def test_an_embodiments_cameras_obey_the_budget(loads):
    schema = ObservationSchema("tiny_yam", ("top", "wrist"), (Part("joints", 2),), ((36, 64), (36, 64)))
    info = PolicyInfo({"embodiment": "tiny_yam"}, 24, 2, "m", observation_schema=schema, max_frames_per_call=2, keeps_newest_frames=True)
    budget = request_budget("auto", info)
    assert budget.max_pixels == 2 * 2 * 36 * 64 * AUTO_SIDE_SCALE**2 and budget.keep_frames == 2
    ok = {"observation/top": encode_jpeg(smooth_image()), "observation/wrist": encode_jpeg(smooth_image()), "observation/joints": [0.1, 0.2]}
    assert through_the_wire(ok, budget, schema).observation.cameras["top"].shape == (1, 36, 64, 3)
    loads.clear()
    with pytest.raises(RequestError, match=r"^observation/wrist: 2 frame\(s\) of 4096x4096 .* over its budget of 147456 "):
        through_the_wire({**ok, "observation/wrist": [decoy_jpeg()] * 3}, budget, schema)
    assert loads == []


def test_lingbot_va_messages_obey_the_budget():
    cameras = ("cam_high", "cam_left_wrist")

    def frame(side: int) -> dict:
        return {f"observation.images.{c}": np.zeros((side, side, 3), np.uint8) for c in cameras}

    budget = PixelBudget(16 * 2 * 32 * 32)
    state = np.zeros((2, 2, 4), np.float32)
    commit = decode_lingbot_va(unpack(pack({"obs": [frame(32)] * 16, "compute_kv_cache": True, "state": state})), cameras, budget)
    assert commit.observation.cameras["cam_high"].shape == (16, 32, 32, 3)
    with pytest.raises(RequestError) as info:
        decode_lingbot_va(unpack(pack({"obs": [frame(32)] * 16 + [frame(33)], "compute_kv_cache": True, "state": state})), cameras, budget)
    assert "differ in shape" in str(info.value)
    with pytest.raises(RequestError) as info:
        decode_lingbot_va(unpack(pack({"obs": [frame(33)] * 16, "compute_kv_cache": True, "state": state})), cameras, budget)
    assert str(info.value).startswith("observation.images.cam_left_wrist: 16 frame(s) of 33x33 ") and str(budget.max_pixels) in str(info.value)


def test_the_auto_budget_comes_from_what_each_policy_reads():
    """DreamZero: its newest 4 frames (and the front end drops older ones); LingBot-VA: every frame, up to a later
    chunk's key frames. Both advertise it in PolicyInfo, which the auto budget multiplies by the cameras' sizes."""
    droid = request_budget("auto", PolicyInfo(droid_server_config(), 24, 8, "m"))
    assert droid.max_pixels == 3 * 180 * 320 * 16 and droid.keep_frames is None  # a policy that says nothing: one frame each
    explicit = request_budget(123, PolicyInfo(droid_server_config(), 24, 8, "m", max_frames_per_call=4, keeps_newest_frames=True))
    assert explicit == PixelBudget(123, 4, SETTING)
    assert request_budget("auto", None) is None


@pytest.mark.parametrize("value", [0, -1, True, "lots", 1.5])
def test_a_bad_max_request_pixels_is_refused_at_start_up_by_name(value):
    with pytest.raises(ConfigError, match=r"server\.max_request_pixels: .*expected a number of pixels >= 1"):
        validate_config({"server": {"max_request_pixels": value}, "policy": {"name": "noop"}})
    assert validate_config({"server": {"max_request_pixels": 5}, "policy": {"name": "noop"}}).server.max_request_pixels == 5
    assert validate_config({"policy": {"name": "noop"}}).server.max_request_pixels == "auto"


def test_a_frame_decodes_into_its_stack_exactly_and_costs_one_pillow_buffer_on_top():
    """Rows are copied out of Pillow's buffer a strip at a time: ``np.asarray(image)`` added ~13 bytes a pixel at the
    peak on top of the stack (Pillow's RGBX buffer, ``tobytes``' chunks and their join), strips ~7.4 (Pillow's buffer, allocated in blocks). Measured in a
    fresh process: this one's allocator keeps freed memory for reuse."""
    from ardiff_server.wire.jpeg import STRIP_BYTES, read_jpeg

    height, width = 2048, 2000  # several strips, the last one partial
    assert height % (STRIP_BYTES // (4 * width)) != 0
    image = np.tile(smooth_image(256, 250), (8, 8, 1))
    data = encode_jpeg(image, quality=90)
    out = np.zeros((height, width, 3), np.uint8)
    read_jpeg(data, 4096).decode_into(out)
    assert np.array_equal(out, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    gray = io.BytesIO()
    Image.fromarray(image[..., 0], mode="L").save(gray, format="JPEG")
    read_jpeg(gray.getvalue(), 4096).decode_into(out)
    assert np.array_equal(out, np.asarray(Image.open(io.BytesIO(gray.getvalue())).convert("RGB")))
    code = (
        "import os, sys, numpy as np; from ardiff_server.wire.jpeg import read_jpeg; "
        "from tests.helpers.sockets import peak_rss_mib, reset_peak_rss, rss_mib; "
        f"data = sys.stdin.buffer.read(); out = np.zeros(({height}, {width}, 3), np.uint8); "
        "reset_peak_rss(os.getpid()); before = rss_mib(os.getpid()); read_jpeg(data, 4096).decode_into(out); "
        "print((peak_rss_mib(os.getpid()) - before) * 2**20 / out[..., 0].size)"
    )
    run = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr.decode()
    per_pixel = float(run.stdout)
    assert per_pixel < 9, f"{per_pixel:.1f} bytes a pixel on top of the stack"
