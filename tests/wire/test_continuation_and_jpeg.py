"""The wire half of asynchronous chunks: the ``continuation`` field and JPEG-encoded images.

Requests go through the real codec (openpi's msgpack_numpy packs them, our unpack decodes them).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from openpi_client import msgpack_numpy as openpi
from PIL import Image

from ardiff_policies.continuation import Continuation
from ardiff_policies.embodiment import ObservationSchema, Part
from ardiff_server.wire.decode import RequestError, decode_request
from ardiff_server.wire.images import MAX_IMAGE_SIDE
from ardiff_server.wire.jpeg import encode_jpeg
from ardiff_server.wire.protocol import unpack

EXT = "observation/exterior_image_{}_left"
WRIST = "observation/wrist_image_left"


def droid_request(**overrides: Any) -> dict[str, Any]:
    image = np.full((18, 32, 3), 10, dtype=np.uint8)
    request = {
        EXT.format(0): image,
        EXT.format(1): image,
        WRIST: image,
        "observation/joint_position": np.zeros(7),
        "observation/gripper_position": np.array([0.5]),
        "prompt": "pick up the cup",
        "session_id": "c0ffee-A",
    }
    return {**request, **overrides}


def through_the_wire(request: dict[str, Any]):
    return decode_request(unpack(openpi.packb(request)))


def rejected(request: dict[str, Any]) -> str:
    with pytest.raises(RequestError) as info:
        through_the_wire(request)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300
    return message


# --- continuation ------------------------------------------------------------------------------


def test_continuation_decodes_and_travels_with_the_observation():
    request = through_the_wire(droid_request(continuation={"executed": 3, "delay": 5, "chunk_id": 12}))
    assert request.observation.continuation == Continuation(3, 5, 12)
    assert through_the_wire(droid_request(continuation={"executed": np.int64(0), "delay": 2})).observation.continuation == Continuation(0, 2)
    import pickle

    observation = request.observation
    copy = pickle.loads(pickle.dumps(observation))  # the engine's process boundary
    assert copy.continuation == Continuation(3, 5, 12) and np.array_equal(copy.wrist, observation.wrist)
    assert observation.with_arrays({}).continuation == Continuation(3, 5, 12)  # shared-memory views keep it


def test_absent_or_null_continuation_is_an_ordinary_request():
    plain = through_the_wire(droid_request())
    assert plain.observation.continuation is None
    nulled = through_the_wire(droid_request(continuation=None)).observation
    assert nulled.continuation is None and sorted(nulled.arrays()) == sorted(plain.observation.arrays())


@pytest.mark.parametrize(
    "value, message",
    [
        ([3, 5], "continuation: expected a map"),
        ({"executed": 3}, "continuation.delay: missing"),
        ({"delay": 3}, "continuation.executed: missing"),
        ({"executed": -1, "delay": 2}, "continuation.executed: expected an integer >= 0, got -1"),
        ({"executed": 1, "delay": 2.5}, "continuation.delay: expected an integer >= 0, got 2.5"),
        ({"executed": 1, "delay": True}, "continuation.delay: expected an integer >= 0, got True"),
        ({"executed": "1", "delay": 2}, "continuation.executed: expected an integer >= 0"),
        ({"executed": 1, "delay": 2, "chunk_id": -4}, "continuation.chunk_id: expected an integer >= 0, got -4"),
        # over the bound: the message states the bound, not ">= 0" (which the value is)
        (
            {"executed": 1, "delay": 2, "chunk_id": 2**64 - 1},
            f"continuation.chunk_id: expected an integer in [0, 2**63 - 1 = {2**63 - 1}], got {2**64 - 1}",
        ),
        ({"executed": 2**63, "delay": 2}, f"continuation.executed: expected an integer in [0, 2**63 - 1 = {2**63 - 1}], got {2**63}"),
        ({"executed": 1, "delay": 2, "late": 1}, "continuation: unknown field(s) ['late']"),
    ],
)
def test_bad_continuations_are_bad_requests_naming_the_field(value, message):
    assert rejected(droid_request(continuation=value)).startswith(message)


def test_a_server_that_takes_no_continuation_refuses_it_by_name():
    """``continuation_refused``: why this server serves no continuation (the policy does not continue chunks, or its
    reply format cannot say chunk_id/frozen); a request carrying one is refused naming the key, before its value is
    read, and a request without one is served as ever."""
    why = "policy noop does not continue chunks (its replies carry no chunk_id/frozen); leave it out"
    request = droid_request(continuation={"executed": 3, "delay": 5})
    with pytest.raises(RequestError) as info:
        decode_request(unpack(openpi.packb(request)), continuation_refused=why)
    assert str(info.value) == f"continuation: {why}"
    with pytest.raises(RequestError, match=r"^continuation: policy noop"):
        decode_request(unpack(openpi.packb(droid_request(continuation=[1, 2]))), continuation_refused=why)
    plain = decode_request(unpack(openpi.packb(droid_request(continuation=None))), continuation_refused=why)
    assert plain.observation.continuation is None


# --- JPEG ---------------------------------------------------------------------------------------


def smooth_image(height: int = 36, width: int = 64, seed: int = 0) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    phase = rng.uniform(0, 6, 3)
    return np.stack([(127 + 100 * np.sin(x / 9 + y / 13 + p)) for p in phase], axis=-1).astype(np.uint8)


def test_jpeg_images_round_trip_to_the_same_arrays_pillow_decodes():
    frames = [smooth_image(seed=s) for s in range(4)]
    encoded = [encode_jpeg(f, quality=95) for f in frames]
    request = through_the_wire(droid_request(**{EXT.format(0): encoded[0], WRIST: encoded}))
    single, stack = request.observation.exterior_left, request.observation.wrist
    assert single.shape == (1, 36, 64, 3) and stack.shape == (4, 36, 64, 3) and stack.dtype == np.uint8
    reference = np.stack([np.asarray(Image.open(io.BytesIO(e)).convert("RGB")) for e in encoded])  # Pillow directly
    assert np.array_equal(stack, reference) and np.array_equal(single[0], reference[0])
    assert np.abs(stack.astype(int) - np.stack(frames)).mean() < 3  # and close to what was encoded
    gray = io.BytesIO()
    Image.fromarray(frames[0][..., 0], mode="L").save(gray, format="JPEG")
    assert through_the_wire(droid_request(**{WRIST: gray.getvalue()})).observation.wrist.shape == (1, 36, 64, 3)


def test_jpeg_images_decode_for_an_embodiments_keys():
    schema = ObservationSchema("tiny_yam", ("top",), (Part("joints", 2),), ((36, 64),))
    payload = {"observation/top": encode_jpeg(smooth_image()), "observation/joints": [0.1, 0.2]}
    observation = decode_request(unpack(openpi.packb(payload)), schema).observation
    assert observation.cameras["top"].shape == (1, 36, 64, 3)


@pytest.mark.parametrize("key", [EXT.format(0), WRIST])
def test_a_corrupt_jpeg_is_a_bad_request_naming_the_key(key):
    good = encode_jpeg(smooth_image())
    truncated = good[: len(good) // 2]
    message = rejected(droid_request(**{key: truncated}))
    assert message.startswith(f"{key}: expected ") and "corrupt JPEG" in message
    garbage = b"\xff\xd8\xff" + bytes(200)
    assert rejected(droid_request(**{key: garbage})).startswith(f"{key}: expected ")
    assert "not a JPEG" in rejected(droid_request(**{key: b"\x89PNG\r\n\x1a\n" + bytes(40)}))
    in_stack = rejected(droid_request(**{key: [good, truncated]}))
    assert in_stack.startswith(f"{key}[1]: expected ") and "corrupt JPEG" in in_stack
    mixed = rejected(droid_request(**{key: [good, encode_jpeg(smooth_image(20, 20))]}))
    assert mixed.startswith(f"{key}[1]: frames of a stack must share one size")


def test_a_jpeg_declaring_a_huge_image_is_refused_from_its_header():
    big = io.BytesIO()
    Image.new("RGB", (MAX_IMAGE_SIDE + 8, 8)).save(big, format="JPEG", quality=10)
    message = rejected(droid_request(**{WRIST: big.getvalue()}))
    assert message.startswith(f"{WRIST}: expected ") and f"8x{MAX_IMAGE_SIDE + 8} pixels" in message


# --- continuation.actions_left_s: the request's deadline -----------------------------------------


def test_actions_left_is_the_requests_own_and_not_the_policys():
    asked = through_the_wire(droid_request(continuation={"executed": 3, "delay": 5, "chunk_id": 2, "actions_left_s": 0.75}))
    assert asked.actions_left_s == 0.75 and asked.observation.continuation == Continuation(3, 5, 2)
    assert through_the_wire(droid_request(continuation={"executed": 0, "delay": 0, "actions_left_s": 0})).actions_left_s == 0.0
    assert through_the_wire(droid_request(continuation={"executed": 0, "delay": 0, "actions_left_s": np.float32(1.5)})).actions_left_s == 1.5
    # without it (or without a continuation: a blocking client, a first call) the request is due now
    assert through_the_wire(droid_request(continuation={"executed": 1, "delay": 2})).actions_left_s is None
    assert through_the_wire(droid_request()).actions_left_s is None


@pytest.mark.parametrize(
    "value, message",
    [
        (-0.1, "continuation.actions_left_s: expected a finite number of seconds >= 0, got -0.1"),
        (float("nan"), "continuation.actions_left_s: expected a finite number of seconds >= 0, got nan"),
        (float("inf"), "continuation.actions_left_s: expected a finite number of seconds >= 0, got inf"),
        ("0.5", "continuation.actions_left_s: expected the seconds of actions left (a number >= 0), got '0.5'"),
        (True, "continuation.actions_left_s: expected the seconds of actions left (a number >= 0), got True"),
        ([0.5], "continuation.actions_left_s: expected the seconds of actions left (a number >= 0), got [0.5]"),
        (1500.0, "continuation.actions_left_s: expected at most 600 s of actions left, got 1500 (seconds, not milliseconds)"),
    ],
)
def test_a_bad_actions_left_is_a_bad_request_naming_the_field(value, message):
    assert rejected(droid_request(continuation={"executed": 1, "delay": 2, "actions_left_s": value})) == message
