"""Batched requests (``wire/batch.py``, docs/spec.md §3): ``{"batch": [request, ...]}`` -> BatchRequest, every element
decoded alone (a bad one refused in its slot), the frame as a whole bounded and unambiguous."""

from __future__ import annotations

import numpy as np
import pytest
from openpi_client import msgpack_numpy as openpi

from ardiff_server.wire.batch import BatchRequest, RefusedElement
from ardiff_server.wire.budget import PixelBudget
from ardiff_server.wire.decode import RequestError, decode_request
from ardiff_server.wire.openpi import OpenPIRequest
from ardiff_server.wire.protocol import unpack

WRIST = "observation/wrist_image_left"
JOINTS = "observation/joint_position"
GRIPPER = "observation/gripper_position"


def image(height: int = 18, width: int = 32) -> np.ndarray:
    return np.zeros((height, width, 3), dtype=np.uint8)


def droid_request(session_id: str | None = None, **overrides) -> dict:
    """One DROID inference request (three 18x32 cameras, the arm's states)."""
    request = {
        "observation/exterior_image_0_left": image(),
        "observation/exterior_image_1_left": image(),
        WRIST: image(),
        JOINTS: np.arange(7, dtype=np.float64) / 10,
        GRIPPER: np.array([0.5]),
        "session_id": session_id,
    }
    return {**request, **overrides}


def decode(payload, max_elements: int = 8, budget: PixelBudget | None = None):
    return decode_request(unpack(openpi.packb(payload)), max_batch_elements=max_elements, budget=budget)


def test_each_element_is_decoded_alone_and_keeps_its_slot():
    good = droid_request(session_id="env-a", prompt="stack the cups")
    bad = droid_request(**{JOINTS: [0.0] * 6})  # six joints
    reset = {"endpoint": "reset", "session_id": "env-c"}
    request = decode({"batch": [good, bad, reset, droid_request(), 7]})
    assert isinstance(request, BatchRequest) and request.protocol == "openpi_batch"
    first, second, third, fourth, fifth = request.elements
    assert isinstance(first, OpenPIRequest) and first.session_id == "env-a" and first.observation.prompt == "stack the cups"
    np.testing.assert_array_equal(first.observation.joint_position, np.arange(7, dtype=np.float32) / 10)
    assert second == RefusedElement(f"{JOINTS}: expected 7 numbers (float array or list), got a list of 6")
    assert isinstance(third, RefusedElement) and third.message.startswith("endpoint: a batch element is an inference, got 'reset'")
    assert isinstance(fourth, OpenPIRequest) and fourth.session_id is None  # its session comes from its index (the front end)
    assert fifth == RefusedElement("request must be a map of observation keys, got int")


def test_a_session_named_twice_is_refused_in_the_later_slot():
    request = decode({"batch": [droid_request(session_id="x"), droid_request(session_id=b"x"), droid_request(session_id="y")]})
    assert [type(e) for e in request.elements] == [OpenPIRequest, RefusedElement, OpenPIRequest]
    assert request.elements[1].message == "session_id: 'x' is element 0's too; each element is its own session"


def test_the_pixel_budget_is_each_elements_own():
    budget = PixelBudget(3 * 18 * 32)  # one request's three 18x32 cameras, exactly
    elements = [droid_request(session_id=f"env-{i}") for i in range(3)]
    elements[2][WRIST] = image(36, 32)
    request = decode({"batch": elements}, budget=budget)
    assert [type(e) for e in request.elements] == [OpenPIRequest, OpenPIRequest, RefusedElement]
    assert request.elements[2].message.startswith(f"{WRIST}: 1 frame(s) of 36x32 bring the request's images to 2304 pixels, over its budget of 1728")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"batch": []}, "batch: expected at least one request, got an empty list"),
        ({"batch": {"a": 1}}, "batch: expected a list of requests, got dict"),
        ({"batch": [droid_request()] * 4}, "batch: expected at most 3 requests (server.max_batch_elements), got 4"),
        ({"batch": [droid_request()], "session_id": "s"}, "batch: a batched request carries only its 'batch' list, got also ['session_id']"),
        ({"batch": [droid_request()], GRIPPER: [0.1]}, f"batch: a batched request carries only its 'batch' list, got also ['{GRIPPER}']"),
        ({"batch": [droid_request()], "endpoint": "reset"}, "endpoint: a batched request is an inference, got 'reset'; send a reset on its own"),
    ],
)
def test_a_frame_that_is_no_clear_batch_is_refused_whole(payload, message):
    with pytest.raises(RequestError) as refused:
        decode(payload, max_elements=3)
    assert str(refused.value).startswith(message)


def test_endpoint_infer_beside_the_list_is_accepted():
    assert isinstance(decode({"batch": [droid_request()], "endpoint": "infer"}), BatchRequest)


def test_a_decoder_given_no_bound_takes_no_batch():
    with pytest.raises(RequestError, match="batch: batched requests are not taken here"):
        decode_request({"batch": [droid_request()]})
