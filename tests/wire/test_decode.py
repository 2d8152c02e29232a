"""Request decoding: RoboArena / DROID wire dictionaries -> OpenPIRequest (``wire/openpi.py``, docs/spec.md §4)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openpi_client import msgpack_numpy as openpi

from ardiff_server.wire.decode import RequestError, decode_request
from ardiff_server.wire.fields import MAX_PROMPT_CHARS
from ardiff_server.wire.images import MAX_FRAMES, MAX_IMAGE_SIDE
from ardiff_server.wire.openpi import MAX_SESSION_ID_CHARS, OpenPIRequest
from ardiff_server.wire.protocol import ProtocolError, unpack

EXT = "observation/exterior_image_{}_left"
WRIST = "observation/wrist_image_left"
JOINTS = "observation/joint_position"
GRIPPER = "observation/gripper_position"
CARTESIAN = "observation/cartesian_position"
ARM = {JOINTS: np.zeros(7), GRIPPER: np.zeros(1)}  # the states a DROID inference request must carry


def image(height: int = 18, width: int = 32, frames: int | None = None, fill: int = 0) -> np.ndarray:
    shape = (height, width, 3) if frames is None else (frames, height, width, 3)
    return np.full(shape, fill, dtype=np.uint8)


def droid_request(first: int = 0, **overrides: Any) -> dict[str, Any]:
    """A complete request with exterior cameras indexed from ``first`` (0 or 1)."""
    request = {
        EXT.format(first): image(fill=10),
        EXT.format(first + 1): image(fill=20),
        WRIST: image(fill=30),
        JOINTS: np.arange(7, dtype=np.float64) / 10,
        GRIPPER: np.array([0.5], dtype=np.float32),
        CARTESIAN: np.zeros(6, dtype=np.float32),
        "prompt": "pick up the cup",
        "session_id": "c0ffee-A",
    }
    request.update(overrides)
    return request


def rejected(payload: Any) -> str:
    with pytest.raises(RequestError) as info:
        decode_request(payload)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300
    return message


# --- cameras ---------------------------------------------------------------------------------


@pytest.mark.parametrize("first", [0, 1])
def test_both_camera_index_conventions(first: int) -> None:
    observation = decode_request(droid_request(first)).observation
    assert observation is not None
    assert observation.exterior_left is not None and observation.exterior_left[0, 0, 0, 0] == 10
    assert observation.exterior_right is not None and observation.exterior_right[0, 0, 0, 0] == 20
    assert observation.wrist is not None and observation.wrist[0, 0, 0, 0] == 30


def test_lone_index_1_camera_is_the_first_exterior_camera() -> None:
    observation = decode_request({EXT.format(1): image(fill=7), **ARM}).observation
    assert observation is not None and observation.exterior_left is not None
    assert observation.exterior_left[0, 0, 0, 0] == 7 and observation.exterior_right is None


def test_zero_indexed_wins_and_its_unread_keys_are_ignored() -> None:
    # With _0_left present, _2_left is no camera of ours (and a bad value there is ignored).
    request = {EXT.format(0): image(fill=1), EXT.format(1): image(fill=2), EXT.format(2): "junk", **ARM}
    observation = decode_request(request).observation
    assert observation is not None and observation.exterior_right is not None
    assert observation.exterior_right[0, 0, 0, 0] == 2


def test_a_request_without_any_observation_is_refused() -> None:
    for payload in ({}, {"prompt": "hi"}, {"\x00" * 10: 0}, {"observation/joint_position": None}):
        with pytest.raises(RequestError, match="no observation in the request"):
            decode_request(payload)


def test_missing_cameras_and_state_are_none() -> None:
    request = decode_request({**ARM, GRIPPER: [0.5]})
    assert request == OpenPIRequest(endpoint="infer", session_id=None, observation=request.observation)
    observation = request.observation
    assert observation is not None
    assert observation.cameras == {"wrist": None, "exterior_left": None, "exterior_right": None}
    assert observation.cartesian_position is None and observation.joint_position.tolist() == [0.0] * 7
    assert observation.gripper_position.tolist() == [0.5]
    assert observation.prompt == ""


@pytest.mark.parametrize("gripper", ["absent", None])
def test_a_droid_request_without_the_gripper_position_is_a_bad_request_naming_the_key(gripper: Any) -> None:
    """The gripper is part of the model's state: read as 0 it said "open" whatever it was."""
    request = droid_request()
    if gripper == "absent":
        del request[GRIPPER]
    else:
        request[GRIPPER] = gripper
    assert rejected(request).startswith("observation/gripper_position: missing; expected 1 number")


@pytest.mark.parametrize("joints", ["absent", None])
def test_a_droid_request_without_joint_positions_is_a_bad_request_naming_the_key(joints: Any) -> None:
    """DROID actions are joint positions relative to the observed ones: read as zeros, a missing
    vector gave actions near 0. Every DROID client sends it."""
    request = droid_request()
    if joints == "absent":
        del request[JOINTS]
    else:
        request[JOINTS] = joints
    with pytest.raises(RequestError, match=r"^observation/joint_position: missing; expected 7 numbers"):
        decode_request(request)
    assert decode_request({"endpoint": "reset", "session_id": "a"}).endpoint == "reset"  # a reset carries no observation


def test_none_values_count_as_absent() -> None:
    # A nil _0_left does not select the 0-indexed convention.
    request = {
        EXT.format(0): None,
        EXT.format(1): image(fill=1),
        EXT.format(2): image(fill=2),
        CARTESIAN: None,
        **ARM,
        "prompt": None,
        "session_id": None,
    }
    decoded = decode_request(request)
    assert decoded.session_id is None and decoded.observation is not None
    assert decoded.observation.exterior_left[0, 0, 0, 0] == 1  # type: ignore[index]
    assert decoded.observation.exterior_right[0, 0, 0, 0] == 2  # type: ignore[index]
    assert decoded.observation.cartesian_position is None and decoded.observation.prompt == ""


def test_stereo_right_and_unknown_keys_are_ignored() -> None:
    request = droid_request(**{"observation/wrist_image_right": "not an image", "observation/exterior_image_0_right": 3, "extra": {"a": 1}})
    assert decode_request(request).observation is not None


def test_single_frames_and_stacks_become_t_h_w_3() -> None:
    observation = decode_request({EXT.format(0): image(5, 7), EXT.format(1): image(5, 7, frames=4), WRIST: image(5, 7, frames=1), **ARM}).observation
    assert observation is not None
    assert observation.exterior_left.shape == (1, 5, 7, 3)  # type: ignore[union-attr]
    assert observation.exterior_right.shape == (4, 5, 7, 3)  # type: ignore[union-attr]
    assert observation.wrist.shape == (1, 5, 7, 3)  # type: ignore[union-attr]


@pytest.mark.parametrize("height, width", [(1, 1), (180, 320), (288, 512), (3, MAX_IMAGE_SIDE)])
def test_any_image_size_is_accepted(height: int, width: int) -> None:
    observation = decode_request({WRIST: image(height, width), **ARM}).observation
    assert observation is not None and observation.wrist.shape == (1, height, width, 3)  # type: ignore[union-attr]


def test_images_are_c_contiguous_and_views_are_kept_when_they_already_are() -> None:
    """The engine client copies every array once (into shared memory); decoding copies only
    what is not C-contiguous, and read-only views of the frame stay views."""
    strided = np.zeros((4, 10, 3), np.uint8)[:, ::2]
    readonly = np.frombuffer(bytes(5 * 6 * 3), dtype=np.uint8).reshape(5, 6, 3)
    observation = decode_request({EXT.format(0): strided, EXT.format(1): readonly, **ARM}).observation
    assert observation is not None
    for frames in (observation.exterior_left, observation.exterior_right):
        assert frames is not None and frames.flags.c_contiguous
    assert not np.shares_memory(observation.exterior_left, strided)
    assert np.shares_memory(observation.exterior_right, readonly)


def test_decoded_wire_arrays_are_not_copied_twice() -> None:
    wire = unpack(openpi.packb({WRIST: image(4, 4, frames=2), **ARM}))
    observation = decode_request(wire).observation
    assert observation is not None and np.shares_memory(observation.wrist, wire[WRIST])


# --- state, prompt, session, endpoint ----------------------------------------------------------


def test_state_lists_and_arrays_become_float32() -> None:
    request = {JOINTS: [0, 1, 2, 3.5, 4, 5, 6], GRIPPER: np.array([1], dtype=np.int64), CARTESIAN: (0.5,) * 6}
    observation = decode_request(request).observation
    assert observation is not None
    for state, expected in (
        (observation.joint_position, [0, 1, 2, 3.5, 4, 5, 6]),
        (observation.gripper_position, [1.0]),
        (observation.cartesian_position, [0.5] * 6),
    ):
        assert state is not None and state.dtype == np.float32 and state.ndim == 1
        assert state.tolist() == expected


@pytest.mark.parametrize("gripper", [0.75, np.float32(0.75), np.float64(0.75), np.array(0.75), [0.75], np.array([0.75], dtype=np.float16)])
def test_gripper_accepts_a_scalar(gripper: Any) -> None:
    observation = decode_request({**ARM, GRIPPER: gripper}).observation
    assert observation is not None and observation.gripper_position is not None
    assert observation.gripper_position.shape == (1,) and observation.gripper_position[0] == np.float32(0.75)


def test_prompt_and_session_id() -> None:
    decoded = decode_request(droid_request(prompt="Wipe the table", session_id="  uuid-B  "))
    assert decoded.session_id == "uuid-B"
    assert decoded.observation is not None and decoded.observation.prompt == "Wipe the table"


def test_default_endpoint_is_infer() -> None:
    decoded = decode_request(droid_request())
    assert decoded.endpoint == "infer" and decoded.session_id == "c0ffee-A" and decoded.observation is not None
    assert decode_request(droid_request(endpoint="infer")).endpoint == "infer"


def test_reset_needs_no_images_and_ignores_reset_info() -> None:
    assert decode_request({"endpoint": "reset"}) == OpenPIRequest(endpoint="reset", session_id=None, observation=None)
    # RoboArena clients put arbitrary reset info next to the endpoint; it is no observation.
    decoded = decode_request({"endpoint": "reset", "session_id": "uuid-A", WRIST: "not an image", "success": 1.0})
    assert decoded == OpenPIRequest("reset", "uuid-A", None, reset_scope="named", session_ids=("uuid-A",))
    assert "session_id" in rejected({"endpoint": "reset", "session_id": 5.5})


def test_reset_forms() -> None:
    """session_id, session_ids: [...] (exactly those), session_ids: None (every session of the
    connection: IsaacLab-Arena), neither (the connection's current session: DreamZero's reset({}))."""
    named = decode_request({"endpoint": "reset", "session_ids": ["a", np.int64(7), "a", " b "]})
    assert (named.reset_scope, named.session_ids) == ("named", ("a", "7", "b"))
    both = decode_request({"endpoint": "reset", "session_id": "x", "session_ids": ["y"]})
    assert (both.reset_scope, both.session_ids) == ("named", ("x", "y"))
    everything = decode_request({"endpoint": "reset", "session_ids": None})
    assert (everything.reset_scope, everything.session_ids) == ("all", ())
    current = decode_request({"endpoint": "reset"})
    assert (current.reset_scope, current.session_ids) == ("current", ())
    assert "session_ids: expected a list" in rejected({"endpoint": "reset", "session_ids": "a"})
    assert "session_ids[1]: expected a non-empty string" in rejected({"endpoint": "reset", "session_ids": ["a", ""]})
    assert "session_ids: expected at most" in rejected({"endpoint": "reset", "session_ids": ["a"] * 1000})


@pytest.mark.parametrize(
    "value",
    [
        "17",
        17,
        np.int32(17),
        np.uint64(17),
        np.array([17]),
        np.array(17),
        np.array(["17"]),
        np.str_("17"),
        b"17",
        np.bytes_(b"17"),
        [17],
        [" 17 "],
        np.array([b"17"]),
    ],
)
def test_session_ids_of_every_type_clients_send_are_one_session(value: Any) -> None:
    assert decode_request({"session_id": value, GRIPPER: [0.0], **ARM}).session_id == "17"


def test_session_ids_in_string_arrays_survive_the_wire() -> None:
    """RoboArena's docs declare session_id: (1,); a client may send np.array(["<uuid>-A"])."""
    frame = openpi.packb({"session_id": np.array(["c0ffee-A"]), GRIPPER: [0.0], **ARM})
    assert decode_request(unpack(frame)).session_id == "c0ffee-A"
    scalar = openpi.packb({"session_id": np.str_("c0ffee-B"), GRIPPER: [0.0], **ARM})
    assert decode_request(unpack(scalar)).session_id == "c0ffee-B"


def test_a_full_openpi_round_trip() -> None:
    frame = openpi.packb(droid_request(first=1, endpoint="infer", **{JOINTS: list(range(7))}))
    decoded = decode_request(unpack(frame))
    observation = decoded.observation
    assert observation is not None and observation.exterior_right is not None and observation.joint_position is not None
    assert observation.exterior_right[0, 0, 0, 0] == 20
    assert observation.joint_position.tolist() == list(range(7))


# --- rejections ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, needle",
    [
        (np.zeros((4, 4, 3), np.float32), "got dtype float32"),
        (np.zeros((4, 4, 3), np.int64), "got dtype int64"),
        (np.zeros((4, 4, 3), bool), "got dtype bool"),
        (np.zeros((4, 4), np.uint8), "got shape (4, 4)"),
        (np.zeros((1, 1, 4, 4, 3), np.uint8), "got shape (1, 1, 4, 4, 3)"),
        (np.zeros((4, 4, 4), np.uint8), "3 color channels last (RGB), got shape (4, 4, 4)"),
        (np.zeros((4, 4, 1), np.uint8), "got shape (4, 4, 1)"),
        (np.zeros((3, 4, 4), np.uint8), "got shape (3, 4, 4)"),  # channels first
        (np.zeros((0, 4, 4, 3), np.uint8), f"1 to {MAX_FRAMES} frames"),
        (np.zeros((MAX_FRAMES + 1, 1, 1, 3), np.uint8), f"1 to {MAX_FRAMES} frames"),
        (np.zeros((0, 4, 3), np.uint8), f"1 to {MAX_IMAGE_SIDE} pixels"),
        (np.zeros((1, MAX_IMAGE_SIDE + 1, 3), np.uint8), f"1 to {MAX_IMAGE_SIDE} pixels"),
        ([[[0, 0, 0]]], "images must be numpy arrays, not lists"),
        ("jpeg bytes", "got str"),
        (b"\xff\xd8", "got bytes"),
    ],
)
@pytest.mark.parametrize("key", [EXT.format(0), WRIST])
def test_bad_images_are_rejected_naming_the_key(key: str, value: Any, needle: str) -> None:
    message = rejected({**droid_request(), key: value})
    assert message.startswith(f"{key}: expected ") and needle in message


def test_bad_image_under_the_one_indexed_convention_names_its_key() -> None:
    message = rejected(droid_request(first=1, **{EXT.format(2): np.zeros((4, 4), np.uint8)}))
    assert message.startswith(EXT.format(2))


@pytest.mark.parametrize(
    "key, value, needle",
    [
        (JOINTS, np.zeros(6), "expected 7 numbers (float array or list), got shape (6,)"),
        (JOINTS, np.zeros((2, 7)), "got shape (2, 7)"),  # a real batch; a batch of one is accepted (sim_evals)
        (JOINTS, [0.0] * 8, "got a list of 8"),
        (JOINTS, np.array(["1"] * 7), "got array of dtype <U1"),
        (JOINTS, np.ones(7, dtype=bool), "got array of dtype bool"),
        (JOINTS, np.ones(7, dtype=np.complex64), "got array of dtype complex64"),
        (JOINTS, [0.0] * 6 + ["1"], "got a list containing str"),
        (JOINTS, [0.0] * 6 + [True], "got a list containing bool"),
        (JOINTS, [0.0] * 6 + [None], "got a list containing NoneType"),
        (JOINTS, np.array([0, 0, 0, np.nan, 0, 0, 0]), "expected finite numbers"),
        (JOINTS, [0, 0, 0, float("inf"), 0, 0, 0], "expected finite numbers"),
        (JOINTS, [0, 0, 0, 1e300, 0, 0, 0], "expected finite numbers"),  # overflows float32
        (JOINTS, [0, 0, 0, 10**400, 0, 0, 0], "expected finite numbers"),  # overflows float64
        (JOINTS, 0.5, "got float"),
        (JOINTS, "0,0,0,0,0,0,0", "got str"),
        (GRIPPER, np.zeros(2), "expected 1 number (float, float array or list), got shape (2,)"),
        (GRIPPER, True, "got bool"),
        (GRIPPER, float("nan"), "expected finite numbers"),
        (GRIPPER, [], "got a list of 0"),
        (CARTESIAN, np.zeros(7, np.float32), "expected 6 numbers (float array or list), got shape (7,)"),
        (CARTESIAN, {"x": 1}, "got dict"),
    ],
)
def test_bad_state_is_rejected_naming_the_key(key: str, value: Any, needle: str) -> None:
    message = rejected({**droid_request(), key: value})
    assert message.startswith(f"{key}: expected ") and needle in message


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("prompt", 3, "prompt: expected a string, got int"),
        ("prompt", ["pick"], "prompt: expected a string, got a list of 1"),
        ("prompt", b"pick", "prompt: expected a string, got bytes"),
        ("prompt", "x" * (MAX_PROMPT_CHARS + 1), f"prompt: expected at most {MAX_PROMPT_CHARS} characters"),
        ("session_id", 4.5, "session_id: expected a string or integer (or a 1-element array of one), got float"),
        ("session_id", True, "session_id: expected a string or integer (or a 1-element array of one), got a bool"),
        ("session_id", ["a", "b"], "session_id: expected a string or integer (or a 1-element array of one), got a list of 2"),
        ("session_id", [["a"]], "session_id: expected a string or integer (or a 1-element array of one), got a nested list"),
        ("session_id", {"id": 1}, "session_id: expected a string or integer (or a 1-element array of one), got dict"),
        ("session_id", np.zeros((1, 1), np.int64), "got array of dtype int64 and shape (1, 1)"),
        ("session_id", np.array([1.5]), "got float64"),
        ("session_id", b"\xff\xfe", "session_id: bytes must be UTF-8"),
        ("session_id", "   ", "session_id: expected a non-empty string"),
        ("session_id", "", "session_id: expected a non-empty string"),
        (
            "session_id",
            "x" * (MAX_SESSION_ID_CHARS + 1),
            f"session_id: expected at most {MAX_SESSION_ID_CHARS} characters",
        ),
        ("session_id", "a\x00b", "session_id: expected printable characters"),
        ("endpoint", "step", "endpoint: expected 'infer' or 'reset', got 'step'"),
        ("endpoint", "Reset", "got 'Reset'"),
        ("endpoint", 1, "got 1"),
        ("endpoint", np.array(["reset"]), "endpoint: expected 'infer' or 'reset'"),
    ],
)
def test_bad_prompt_session_and_endpoint_are_rejected(key: str, value: Any, needle: str) -> None:
    assert needle in rejected({**droid_request(), key: value})


@pytest.mark.parametrize(
    "payload, needle",
    [
        ([1, 2], "request must be a map of observation keys, got a list of 2"),
        ("infer", "got str"),
        (None, "got NoneType"),
        (np.zeros(3), "got array of dtype float64 and shape (3,)"),
        ({b"prompt": "x"}, "request keys must be strings, got a key of type bytes: b'prompt'"),
        ({1: "x"}, "got a key of type int: 1"),
    ],
)
def test_non_map_payloads_are_rejected(payload: Any, needle: str) -> None:
    assert needle in rejected(payload)


def test_observation_error_is_a_protocol_error() -> None:
    # The server catches ProtocolError once for both codec and request errors.
    assert issubclass(RequestError, ProtocolError)


# --- property tests --------------------------------------------------------------------------

bad_images = st.one_of(
    st.tuples(
        st.sampled_from([np.float32, np.float64, np.int8, np.uint16, np.int64, bool]),
        st.sampled_from([(2, 2, 3), (1, 2, 2, 3)]),
    ).map(lambda t: np.zeros(t[1], t[0])),
    st.sampled_from([(2, 2), (2,), (), (1, 1, 2, 2, 3), (2, 2, 1), (2, 2, 4), (1, 2, 2, 2), (0, 2, 2, 3), (0, 2, 3), (2, 0, 3)]).map(
        lambda s: np.zeros(s, np.uint8)
    ),
    st.lists(st.integers(0, 255), max_size=3),
    st.text(max_size=3),
    st.integers(),
    st.floats(allow_nan=False),
    st.binary(max_size=3),
)


def bad_state(length: int) -> st.SearchStrategy[Any]:
    wrong_lengths = st.integers(0, 9).filter(lambda n: n != length)
    return st.one_of(
        wrong_lengths.map(lambda n: np.zeros(n, np.float32)),
        wrong_lengths.map(lambda n: [0.0] * n),
        st.sampled_from(["<U2", "bool", "complex128", "datetime64[s]"]).map(lambda dtype: np.zeros(length, dtype)),
        st.sampled_from([np.nan, np.inf, -np.inf, 1e39]).flatmap(
            lambda bad: st.integers(0, length - 1).map(lambda i: [bad if j == i else 0.0 for j in range(length)])
        ),
        st.sampled_from([np.nan, np.inf]).map(lambda bad: np.full(length, bad)),
        st.just(np.zeros((length, 1) if length > 1 else (2, 1))),  # a column; (1, 1) is a batch of one (accepted)
        st.text(max_size=3),
        st.just({"x": 0.0}),
        st.just([None] * length),
    )


@st.composite
def malformed_requests(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    first = draw(st.sampled_from([0, 1]))
    request = droid_request(first)
    key = draw(
        st.sampled_from(
            [
                EXT.format(first),
                EXT.format(first + 1),
                WRIST,
                JOINTS,
                GRIPPER,
                CARTESIAN,
                "prompt",
                "session_id",
                "endpoint",
            ]
        )
    )
    if key.startswith("observation/") and key.endswith("_left"):
        value = draw(bad_images)
    elif key in (JOINTS, GRIPPER, CARTESIAN):
        value = draw(bad_state({JOINTS: 7, GRIPPER: 1, CARTESIAN: 6}[key]))
    elif key == "endpoint":
        value = draw(
            st.one_of(
                st.text(max_size=8).filter(lambda s: s not in ("infer", "reset")),
                st.integers(),
                st.booleans(),
                st.floats(),
            )
        )
    elif key == "prompt":
        value = draw(
            st.one_of(
                st.integers(),
                st.floats(),
                st.binary(max_size=4),
                st.lists(st.text(max_size=2), max_size=2),
                st.just("p" * (MAX_PROMPT_CHARS + 1)),
            )
        )
    else:
        value = draw(
            st.one_of(
                st.floats(),
                st.booleans(),
                st.binary(max_size=4).filter(_not_utf8),
                st.just(""),
                st.just(" \t"),
                st.just("a\nb"),
                st.just("s" * (MAX_SESSION_ID_CHARS + 1)),
            )
        )
    request[key] = value
    return request, key


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@settings(max_examples=300, deadline=None)
@given(case=malformed_requests())
def test_malformed_requests_raise_an_error_naming_the_key(case: tuple[dict[str, Any], str]) -> None:
    request, key = case
    with pytest.raises(RequestError) as info:
        decode_request(request)
    assert str(info.value).startswith(f"{key}: ")


def state_values(length: int) -> st.SearchStrategy[Any]:
    numbers = st.floats(min_value=-10, max_value=10, allow_nan=False, width=32)
    return st.one_of(
        st.lists(numbers, min_size=length, max_size=length),
        st.lists(st.integers(-100, 100), min_size=length, max_size=length),
        st.tuples(
            st.sampled_from([np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8]),
            st.lists(st.integers(0, 100), min_size=length, max_size=length),
        ).map(lambda t: np.array(t[1], dtype=t[0])),
        *([numbers, numbers.map(np.float32), numbers.map(np.array)] if length == 1 else []),
    )


@st.composite
def valid_requests(draw: st.DrawFn) -> dict[str, Any]:
    first = draw(st.sampled_from([0, 1]))
    request: dict[str, Any] = {}
    height, width = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    for key, present in (
        (EXT.format(first), True),
        (EXT.format(first + 1), first == 0 or draw(st.booleans())),
        (WRIST, draw(st.booleans())),
    ):
        if present:
            frames = draw(st.sampled_from([None, 1, 2, 4]))
            request[key] = image(height, width, frames=frames, fill=draw(st.integers(0, 255)))
    for key, length in ((JOINTS, 7), (GRIPPER, 1), (CARTESIAN, 6)):
        if key in (JOINTS, GRIPPER) or draw(st.booleans()):  # joint and gripper positions: required
            request[key] = draw(state_values(length))
    if draw(st.booleans()):
        request["prompt"] = draw(st.text(max_size=40))
    if draw(st.booleans()):
        request["session_id"] = draw(st.text(st.characters(codec="ascii", categories=["L", "N", "Pd"]), min_size=1, max_size=40))
    if draw(st.booleans()):
        request["endpoint"] = "infer"
    request["extra/" + draw(st.text(max_size=5))] = draw(st.one_of(st.none(), st.integers(), st.text(max_size=3)))
    return request


def _expected_frames(value: np.ndarray | None) -> np.ndarray | None:
    return None if value is None else (value if value.ndim == 4 else value[np.newaxis])


@settings(max_examples=200, deadline=None)
@given(request=valid_requests())
def test_valid_random_requests_decode(request: dict[str, Any]) -> None:
    decoded = decode_request(request)
    observation = decoded.observation
    assert decoded.endpoint == "infer" and observation is not None
    assert decoded.session_id == request.get("session_id")
    assert observation.prompt == request.get("prompt", "")
    first = 0 if EXT.format(0) in request else 1
    for field, key in (
        ("exterior_left", EXT.format(first)),
        ("exterior_right", EXT.format(first + 1)),
        ("wrist", WRIST),
    ):
        actual, expected = getattr(observation, field), _expected_frames(request.get(key))
        if expected is None:
            assert actual is None
        else:
            assert actual.dtype == np.uint8 and actual.flags.c_contiguous and np.array_equal(actual, expected)
    for field, key, length in (
        ("joint_position", JOINTS, 7),
        ("gripper_position", GRIPPER, 1),
        ("cartesian_position", CARTESIAN, 6),
    ):
        actual = getattr(observation, field)
        if key not in request:
            assert actual is None
        else:
            assert actual.dtype == np.float32 and actual.shape == (length,)
            assert np.array_equal(actual, np.asarray(request[key], dtype=np.float32).reshape(length))
